"""Client-side round-trip overhead: lmcache_async's asyncio DEALER vs a blocking pyzmq
DEALER, against the same real LMCache 0.5.6 server, for a SYNC handler (``noop``) and a
worker-pool handler (``end_session`` of an unknown id).

    .venv/bin/python benchmarks/bench_rtt.py [--n 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lmcache_async as lmc
from lmcache_async import wire
from lmcache_async.wire import Op
from tests.support.real_server import RealLMCacheServer, lmcache_venv_python


def blocking(url: str, op: Op, args: tuple[Any, ...], n: int) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(url)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        sock.send_multipart(wire.encode_request(i, op, args))
        sock.recv_multipart()
        times.append(time.perf_counter() - t0)
    sock.close(0)
    ctx.term()
    return statistics.median(times[n // 5 :])


async def ours(url: str, http_url: str, op: Op, args: tuple[Any, ...], n: int) -> float:
    geometry = lmc.KVGeometry(1, 1, 16)
    async with lmc.AsyncClient(url, http_url, "bench-rtt", geometry=geometry, timeout=10) as client:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await client._conn.call(op, args, timeout=5)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[n // 5 :])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    with RealLMCacheServer("shm", venv_python=lmcache_venv_python(), chunk_size=256) as srv:
        print(f"{'request':<14}{'blocking pyzmq µs':>20}{'lmcache_async µs':>20}")
        for op, op_args in ((Op.NOOP, ()), (Op.END_SESSION, ("bench-rtt",))):
            a = blocking(srv.url, op, op_args, args.n)
            b = asyncio.run(ours(srv.url, srv.http_url, op, op_args, args.n))
            print(f"{op.name.lower():<14}{a * 1e6:>20.0f}{b * 1e6:>20.0f}")


if __name__ == "__main__":
    main()
