"""Where one operation's time goes against the real LMCache server: requests and copies.

    .venv/bin/python -m benchmarks.probes.bench_phases [--mode shm|pickle] [--op store|retrieve]
        [--chunks 1] [--n 30] [--generation 0.5.6|0.5.7] [--json]

Starts a real LMCache server (``--mode shm``: SHM pool; ``pickle``: inline transport),
geometry 32 layers x 8 KV heads x 128 bf16 (one 256-token chunk = 32 MiB), and times ``--n``
calls of one operation from one ``AsyncClient``, one at a time:

* ``store``: fresh tokens each call; the L1 is cleared (forced) after each call, so the
  server hands out the same, already mapped, slots again (the steady state of the
  single-operation section, without its page mapping);
* ``retrieve``: one stored prompt into a fresh tensor.

Reported: the median whole call and, per phase, the median time of each request the
operation waits for (``Operations.call``, or ``Operations.pipeline`` for requests sent back to
back: from handing it to the connection to its reply)
and of the copy steps (``_fill_reserved``: the store's copy including the hand-over to a
worker thread; ``decode_inline``: the inline payload's decoder; ``_copy_chunks``: copying
chunks into the result). The first 5 calls are a warm-up. Nothing in the library's files is
changed: those functions of ``lmcache_async._engine.ops`` are wrapped by timers for the run, and
a store's L1 is cleared through the client's connection (``client._session.conn``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import lmcache_async as lmc
from benchmarks.harness import server_python
from harness.real_server import RealLMCacheServer
from lmcache_async._engine.ops import Operations, inline
from lmcache_async._protocol.wire import Op

CS = 256
GEOM = lmc.KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
WARMUP = 5


def _instrument(phases: dict[str, list[float]]) -> Callable[[], None]:
    """Wrap the timed functions; returns the function that restores them."""
    ops = Operations
    saved: list[tuple[Any, str, Any]] = []

    def wrap_async(owner: Any, attr: str, label: Callable[..., str]) -> None:
        orig = getattr(owner, attr)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await orig(*args, **kwargs)
            finally:
                phases.setdefault(label(*args), []).append(time.perf_counter() - t0)

        saved.append((owner, attr, orig))
        setattr(owner, attr, timed)

    def wrap_sync(owner: Any, attr: str) -> None:
        orig = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                phases.setdefault(attr, []).append(time.perf_counter() - t0)

        saved.append((owner, attr, orig))
        setattr(owner, attr, timed)

    wrap_async(ops, "call", lambda _self, _op, opcode, *_a: opcode.name.lower())  # opcode: an Op
    wrap_async(ops, "pipeline", lambda _self, _op, *calls: " + ".join(c[0].name.lower() for c in calls))
    wrap_async(ops, "_fill_reserved", lambda *_a: "_fill_reserved")
    wrap_async(ops, "_copy_chunks", lambda *_a: "_copy_chunks")
    wrap_sync(inline, "decode_inline")

    def restore() -> None:
        for owner, attr, orig in reversed(saved):
            setattr(owner, attr, orig)

    return restore


async def _measure(srv: RealLMCacheServer, op: str, chunks: int, n: int) -> dict[str, Any]:
    phases: dict[str, list[float]] = {}
    calls: list[float] = []
    kv = torch.randn(GEOM.kv_shape(chunks * CS), dtype=torch.float32).to(GEOM.dtype)
    async with lmc.AsyncClient(srv.url, srv.http_url, "bench-phases", geometry=GEOM, timeout=120) as c:
        transfer, server_version = c.transfer, c.server_version
        restore = _instrument(phases)
        try:
            base = 10_000_000
            if op == "retrieve":
                tokens = list(range(base, base + chunks * CS))
                assert await c.store(kv, tokens)
            for i in range(n + WARMUP):
                if i == WARMUP:
                    phases.clear()
                if op == "store":
                    tokens = list(range(base + (i + 1) * chunks * CS, base + (i + 2) * chunks * CS))
                    t0 = time.perf_counter()
                    assert await c.store(kv, tokens)
                    elapsed = time.perf_counter() - t0
                    await c.drain(timeout=30)
                    await c._session.conn.call(Op.CLEAR, (True,), timeout=30)  # the same slots next time
                else:
                    t0 = time.perf_counter()
                    got = await c.retrieve(tokens)
                    elapsed = time.perf_counter() - t0
                    assert got is not None and torch.equal(got, kv)
                    del got
                if i >= WARMUP:
                    calls.append(elapsed)
        finally:
            restore()
    return {
        "op": op,
        "chunks": chunks,
        "transfer": transfer,
        "server_version": server_version,
        "n": n,
        "call_ms": round(statistics.median(calls) * 1e3, 3),
        "phases_ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in phases.items()},
        "phase_counts": {k: len(v) for k, v in phases.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["shm", "pickle"], default="shm")
    parser.add_argument("--op", choices=["store", "retrieve"], default="store")
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--generation", choices=["0.5.6", "0.5.7"], default="0.5.6")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    srv = RealLMCacheServer(
        args.mode, venv_python=server_python(args.generation), chunk_size=CS, l1_size_gb=2
    )
    with srv:
        out = asyncio.run(_measure(srv, args.op, args.chunks, args.n))
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{args.op}, {args.chunks} chunk(s), {out['transfer']}, server {out['server_version']}: "
          f"whole call {out['call_ms']:.2f} ms (median of {args.n})")  # fmt: skip
    for name, ms in out["phases_ms"].items():
        print(f"  {name:<36} {ms:>9.3f} ms  x{out['phase_counts'][name] // args.n}")


if __name__ == "__main__":
    main()
