"""A fresh client: the 16-chunk retrieve into ``out=`` right after connect.

    .venv/bin/python -m benchmarks.suite.bench_fresh [--reps 5] [--settle 6] [--l1-gb 8] [--json]

(``make bench`` runs this as the ``fresh`` section.)

Starts a real LMCache 0.5.6 server (SHM, chunk 256, L1 ``--l1-gb`` GiB: the pool a new
client maps), registers the vLLM-style layout (32 layers x 8 KV heads x 128, bf16; 32 MiB
a chunk) and stores one 16-chunk prompt (512 MiB). Each repetition, in an order that
alternates:

* lmcache_async: a NEW ``AsyncClient`` (default options) is opened; the first
  ``retrieve(tokens, out=buf)`` is timed at once, then a second one, then (``--settle`` s
  later, when ``--settle`` > 0) a third; ``buf`` is a warm buffer made before connecting;
* the official SDK: a NEW context (``kvcache.connect``) in its own process; its first and
  second ``retrieve`` (fresh tensors: it has no ``out=``);
* ``dst.copy_(src)`` of the same 512 MiB into a warm buffer: the floor.

Figures: medians over the repetitions with ranges; per repetition the SDK/ours ratio and
ours/``copy_`` for the first call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import lmcache_async as lmc
from benchmarks.harness import sdk_call, server_python, spread, workers
from harness.real_server import RealLMCacheServer
from harness.workers import EngineWorker, SDKWorker

CS = 256
CHUNKS = 16
GEOM = lmc.KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
MODEL = "bench-fresh"
START = 50_000_000


def _copy(src: torch.Tensor, dst: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


async def _ours(
    srv: RealLMCacheServer, tokens: list[int], buf: torch.Tensor, settle: float
) -> dict[str, float]:
    t0 = time.perf_counter()
    async with lmc.AsyncClient(srv.url, srv.http_url, MODEL, timeout=300) as client:
        t1 = time.perf_counter()
        got = await client.retrieve(tokens, out=buf)
        t2 = time.perf_counter()
        assert got is not None
        got = await client.retrieve(tokens, out=buf)
        t3 = time.perf_counter()
        fig = {"connect_s": t1 - t0, "first_s": t2 - t1, "second_s": t3 - t2}
        if settle > 0:
            await asyncio.sleep(settle)
            t4 = time.perf_counter()
            await client.retrieve(tokens, out=buf)
            fig["settled_s"] = time.perf_counter() - t4
    return fig


async def _measure(
    srv: RealLMCacheServer, python: Path, reps: int, settle: float, l1_gb: float
) -> dict[str, Any]:
    n = CHUNKS * CS
    tokens = list(range(START, START + n))
    kv = torch.randn(GEOM.kv_shape(n), dtype=torch.float32).to(GEOM.dtype)
    buf = torch.empty_like(kv)
    warm = torch.empty_like(kv)
    buf.copy_(kv)
    warm.copy_(kv)
    ours: list[dict[str, float]] = []
    sdk: list[dict[str, float]] = []
    copies: list[float] = []
    with workers(EngineWorker(srv.url, python=python), SDKWorker(python=python, request_timeout=600)) as (
        eng,
        sdk_w,
    ):
        eng.register(MODEL, 32, 8, 128, block_size=16, num_blocks=32)
        async with lmc.AsyncClient(srv.url, srv.http_url, MODEL, timeout=300) as keeper:
            assert keeper.geometry == GEOM and keeper.transfer == "shm", (keeper.geometry, keeper.transfer)
            await keeper.store(kv, tokens)
        sdk_w.start()
        for rep in range(reps):
            order = ["ours", "sdk", "copy"] if rep % 2 == 0 else ["sdk", "copy", "ours"]
            for who in order:
                if who == "ours":
                    ours.append(await _ours(srv, tokens, buf, settle))
                elif who == "sdk":
                    reply = await sdk_call(
                        sdk_w, "fresh", server=srv, url=srv.url, http_url=srv.http_url, model_name=MODEL,
                        start=START, tokens=n, deadline=600,
                    )  # fmt: skip
                    sdk.append({k: reply[k] for k in ("connect_s", "first_s", "second_s")})
                else:
                    copies.append(_copy(kv, warm))
            assert torch.equal(buf, kv)
            print(f"  fresh: repetition {rep} done", file=sys.stderr)
        server_version = srv.get_json("/lmc_version")
    result: dict[str, Any] = {
        "transfer": "shm",
        "server_version": server_version,
        "l1_gb": l1_gb,
        "bytes": n * GEOM.bytes_per_token,
        "reps": reps,
        "settle_s": settle,
        "ours": {k: spread([f[k] for f in ours], digits=6) for k in ours[0]},
        "sdk": {k: spread([f[k] for f in sdk], digits=6) for k in sdk[0]},
        "copy_s": spread(copies, digits=6),
        "first_vs_sdk": spread(
            [s["first_s"] / o["first_s"] for s, o in zip(sdk, ours, strict=True)], digits=3
        ),
        "first_vs_copy": spread([o["first_s"] / c for o, c in zip(ours, copies, strict=True)], digits=3),
        "second_vs_copy": spread([o["second_s"] / c for o, c in zip(ours, copies, strict=True)], digits=3),
    }
    if settle > 0:
        result["settled_vs_copy"] = spread(
            [o["settled_s"] / c for o, c in zip(ours, copies, strict=True)], digits=3
        )
    return result


def section(
    srv: RealLMCacheServer, *, python: Path, reps: int, settle: float, l1_gb: float
) -> dict[str, Any]:
    """Run the fresh-client case on ``srv`` (SHM); blocks until done (server calls: 300 s
    deadline, SDK requests: 600 s)."""
    return asyncio.run(_measure(srv, python, reps, settle, l1_gb))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--settle", type=float, default=6.0, help="seconds before the third call (0: none)")
    parser.add_argument("--l1-gb", type=float, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    python = server_python("0.5.6")
    with RealLMCacheServer("shm", venv_python=python, chunk_size=CS, l1_size_gb=args.l1_gb) as srv:
        result = section(srv, python=python, reps=args.reps, settle=args.settle, l1_gb=args.l1_gb)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    o, s = result["ours"], result["sdk"]
    print(
        f"fresh client, 16-chunk retrieve (512 MiB), L1 {result['l1_gb']} GiB, {result['reps']} reps, medians"
    )
    print(f"  ours: connect {o['connect_s']['median'] * 1e3:.1f} ms, first {o['first_s']['median'] * 1e3:.1f} ms, "
          f"second {o['second_s']['median'] * 1e3:.1f} ms")  # fmt: skip
    print(
        f"  SDK:  first {s['first_s']['median'] * 1e3:.1f} ms; copy_ {result['copy_s']['median'] * 1e3:.1f} ms"
    )
    print(
        f"  first call: {result['first_vs_sdk']['median']}x the SDK, {result['first_vs_copy']['median']}x copy_"
    )


if __name__ == "__main__":
    main()
