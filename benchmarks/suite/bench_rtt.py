"""Client-side round-trip overhead: lmcache_async's asyncio DEALER vs a blocking pyzmq
DEALER, against the same real LMCache 0.5.6 server, for a SYNC handler (``noop``) and a
worker-pool handler (``end_session`` of an unknown id). The blocking DEALER is the floor:
the server's own cost per request plus the least a client can add.

    .venv/bin/python -m benchmarks.suite.bench_rtt [--n 300] [--rounds 3] [--json]

(``make bench`` runs this as the ``rtt`` section.) Each round times ``--n`` requests one
after another on each side (the order alternates between rounds) and keeps the median of
the last 80 %; the figure is the median over rounds, with its range. Our side sends the
same requests on the client's connection (``harness.raw_call``: ``end_session`` has no
method of its own), so that the two sides send the same thing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import lmcache_async as lmc
from benchmarks.harness import bare_dealer_rtt, raw_call, settle, spread
from harness.real_server import RealLMCacheServer, lmcache_venv_python
from lmcache_async._protocol.wire import Op

CASES: tuple[tuple[Op, tuple[Any, ...]], ...] = ((Op.NOOP, ()), (Op.END_SESSION, ("bench-rtt",)))


async def ours(url: str, http_url: str, op: Op, args: tuple[Any, ...], n: int) -> float:
    geometry = lmc.KVGeometry(1, 1, 16)
    async with lmc.AsyncClient(url, http_url, "bench-rtt", geometry=geometry, timeout=10) as client:
        await settle()  # the background SHM warm-up, if any, is over
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await raw_call(client, op, args, timeout=5)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[n // 5 :])


def section(url: str, http_url: str, *, n: int, rounds: int) -> dict[str, Any]:
    """Both request kinds on the running server at ``url``; every request has a 5 s deadline."""
    rows = []
    for op, op_args in CASES:
        bare: list[float] = []
        mine: list[float] = []
        for r in range(rounds):
            for side in ("bare", "ours") if r % 2 == 0 else ("ours", "bare"):
                if side == "bare":
                    bare.append(bare_dealer_rtt(url, op, op_args, n))
                else:
                    mine.append(asyncio.run(ours(url, http_url, op, op_args, n)))
        rows.append(
            {
                "request": op.name.lower(),
                "blocking_us": spread(bare, scale=1e6, digits=1),
                "ours_us": spread(mine, scale=1e6, digits=1),
                "ratio": spread([b / o for b, o in zip(bare, mine, strict=True)], digits=3),
            }
        )
    return {"n": n, "rounds": rounds, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with RealLMCacheServer("shm", venv_python=lmcache_venv_python(), chunk_size=256) as srv:
        result = section(srv.url, srv.http_url, n=args.n, rounds=args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'request':<14}{'blocking pyzmq µs':>20}{'lmcache_async µs':>20}")
    for r in result["rows"]:
        print(f"{r['request']:<14}{r['blocking_us']['median']:>20.0f}{r['ours_us']['median']:>20.0f}")


if __name__ == "__main__":
    main()
