"""Fault detection and recovery times of one AsyncClient against the REAL LMCache server.

Each round, on one server (same ports throughout):

1. ``in-flight``: the server is frozen (SIGSTOP), a ``lookup`` is sent (deadline 30 s),
   then the server is SIGKILLed: time from the kill until that call fails, and how.
2. ``while-down``: a ``retrieve`` (deadline ``--op-timeout``) made after the death:
   time until it fails, and how.
3. ``restart``: the server is started again on the same ports (new instance, empty
   cache); from the moment its ``/healthcheck`` answers 200, the same client retries
   ``store`` + ``retrieve`` (deadline ``--op-timeout`` each) until both succeed: time to
   the first success and the failures on the way.

    .venv/bin/python -m benchmarks.probes.bench_recovery [--generation 0.5.6|0.5.7]
        [--mode shm|pickle] [--rounds 3] [--op-timeout 5] [--venv-python PATH]

Prints one line per round and the medians. Wall-clock times on a shared machine: read
them as orders of magnitude (0.1 s vs 5 s), not as precise figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import lmcache_async as lmc
from harness.real_server import RealLMCacheServer, lmcache_venv_python

CS = 16
GEOMETRY = lmc.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)


@dataclass
class Round:
    in_flight: float  # kill -> the in-flight call failed
    in_flight_outcome: str
    while_down: float  # a call made while down -> it failed
    while_down_outcome: str
    recovery: float  # healthy again -> first store + retrieve that worked
    failures: list[str]


def _outcome(exc: BaseException | None) -> str:
    return "ok" if exc is None else type(exc).__name__


async def one_round(c: lmc.AsyncClient, srv: RealLMCacheServer, op_timeout: float, seed: int) -> Round:
    tokens = list(range(seed * 1000, seed * 1000 + 2 * CS))
    kv = torch.randn(GEOMETRY.kv_shape(len(tokens)), generator=torch.Generator().manual_seed(seed)).to(
        GEOMETRY.dtype
    )
    assert await c.store(kv, tokens) is True
    pid = srv.pid
    assert pid is not None

    # 1. a call in flight when the server dies
    os.kill(pid, signal.SIGSTOP)
    task = asyncio.create_task(c.lookup(tokens, timeout=30))
    await asyncio.sleep(0.2)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    err: BaseException | None = None
    try:
        await task
    except Exception as exc:
        err = exc
    in_flight = (time.monotonic() - killed, _outcome(err))

    # 2. a call made while the server is down
    start = time.monotonic()
    err = None
    try:
        await c.retrieve(tokens, timeout=op_timeout)
    except Exception as exc:
        err = exc
    while_down = (time.monotonic() - start, _outcome(err))

    # 3. restart on the same ports: from healthy to the first store + retrieve that work
    await asyncio.to_thread(srv.stop)
    await asyncio.to_thread(srv.start)
    healthy = time.monotonic()
    failures: list[str] = []
    while True:
        try:
            # False is fine once an attempt timed out: its abandoned store may have
            # finished in the background.
            if await c.store(kv, tokens, timeout=op_timeout) is not True and not failures:
                raise AssertionError("the restarted server already had the prompt")
            got = await c.retrieve(tokens, timeout=op_timeout)
            if got is None or not torch.equal(got, kv):
                raise AssertionError("a wrong read after the restart")
            break
        except (lmc.LMCacheError, TimeoutError) as exc:
            failures.append(type(exc).__name__)
            if time.monotonic() - healthy > 120:
                raise
            await asyncio.sleep(0.05)
    recovered = time.monotonic() - healthy
    return Round(*in_flight, *while_down, recovered, failures)


async def bench(srv: RealLMCacheServer, rounds: int, op_timeout: float) -> None:
    async with lmc.AsyncClient(srv.url, srv.http_url, "bench-recovery", geometry=GEOMETRY, timeout=30) as c:
        results: list[Round] = []
        for r in range(rounds):
            res = await one_round(c, srv, op_timeout, r + 1)
            results.append(res)
            print(
                f"round {r + 1}: in-flight call failed after {res.in_flight:.3f} s ({res.in_flight_outcome}); "
                f"call while down failed after {res.while_down:.3f} s ({res.while_down_outcome}); "
                f"healthy -> first store+retrieve {res.recovery:.3f} s "
                f"(failures on the way: {res.failures or 'none'})"
            )
        med = statistics.median
        print(
            f"median over {rounds} rounds ({srv.generation}, {srv.mode}, op timeout {op_timeout} s): "
            f"in-flight {med(r.in_flight for r in results):.3f} s, "
            f"while down {med(r.while_down for r in results):.3f} s, "
            f"recovery {med(r.recovery for r in results):.3f} s"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generation", choices=["0.5.6", "0.5.7"], default="0.5.6")
    ap.add_argument("--mode", choices=["shm", "pickle"], default="shm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--op-timeout", type=float, default=5.0)
    ap.add_argument("--venv-python", help="the lmcache venv's python (default: built by the repo's recipe)")
    args = ap.parse_args()
    python = args.venv_python or lmcache_venv_python(generation=args.generation)
    with RealLMCacheServer(args.mode, venv_python=python, chunk_size=CS) as srv:
        asyncio.run(bench(srv, args.rounds, args.op_timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
