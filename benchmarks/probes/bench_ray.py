"""Ray Data remap (``lmcache_async.ray``) against one process's ``remap_many``, same pairs.

Starts one real LMCache 0.5.6 server (SHM) and a local Ray instance on loopback
(``harness.ray_local``: 2 CPUs, a 300 MB object store, no dashboard), stores ``--pairs`` one-chunk sources, then remaps them to
fresh targets three times, alternating nothing else on the machine:

* ``single``: one ``AsyncClient.remap_many`` in this process (``--concurrency``);
* ``ray_1`` / ``ray_2``: ``remap_dataset`` with 1 and 2 actors (``--batch-size`` pairs per
  ``remap_many`` call, the same concurrency per actor).

For the Ray runs it reports the job's wall time (actor start-up included) and its
*span*: from the first batch's start to the last batch's end, as the actors saw it (same
host, same clock), i.e. without the actors' start-up. ``overhead_us_per_pair`` is
``(span(ray_1) - time(single)) / pairs``: what Ray Data and the integration add per pair
(batching, Arrow rows, the blocking client's hand-over), on one actor like one process.
Pairs/s and GB/s (bytes moved: retrieved + stored) per run; ``ray_2 / single`` is the
issue's target ratio (>= 0.8 on a 2-core machine). Figures depend on the machine and its
load: run all three in one invocation and compare ratios.

    .venv/bin/python -m benchmarks.probes.bench_ray [--pairs 500] [--batch-size 50]
        [--layers 4 --heads 4 --head-dim 64 --chunk-size 256] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from typing import Any

import torch

import lmcache_async as lmc
from harness.ray_local import local_ray
from harness.real_server import RealLMCacheServer, lmcache_venv_python
from lmcache_async.ray import RemapBatches, remap_dataset


class TimedRemapBatches(RemapBatches):
    """:class:`RemapBatches` that adds each batch's start and end (``time.time()``)."""

    def __call__(self, batch: Any) -> Any:
        t0 = time.time()
        table = super().__call__(batch)
        t1 = time.time()
        n = table.num_rows
        return table.append_column("t0", [[t0] * n]).append_column("t1", [[t1] * n])


def _tokens(base: int, i: int, n: int) -> list[int]:
    return list(range(base + i * n, base + (i + 1) * n))


def _rate(pairs: int, moved: int, seconds: float) -> dict[str, float]:
    return {
        "seconds": round(seconds, 3),
        "pairs_per_s": round(pairs / seconds, 1),
        "gb_per_s": round(moved / seconds / 1e9, 3),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray.data

    geometry = lmc.KVGeometry(args.layers, args.heads, args.head_dim, torch.bfloat16, block_size=16)
    cs, n = args.chunk_size, args.pairs
    model = f"bench-ray-{os.getpid()}"
    sources = [_tokens(10_000_000, i, cs) for i in range(n)]
    moved_per_pair = 2 * cs * geometry.bytes_per_token
    res: dict[str, Any] = {
        "geometry": f"{args.layers} layers x {args.heads} heads x {args.head_dim}, bf16, chunk {cs}",
        "pairs": n,
        "mib_per_pair": round(cs * geometry.bytes_per_token / 2**20, 3),
        "batch_size": args.batch_size,
        "concurrency": args.concurrency,
    }
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(
            RealLMCacheServer("shm", chunk_size=cs, l1_size_gb=args.l1_gb, venv_python=lmcache_venv_python())
        )

        async def store_and_single() -> float:
            async with lmc.AsyncClient(srv.url, srv.http_url, model, geometry=geometry, timeout=60) as c:
                kvs = (torch.randn(geometry.kv_shape(cs)).to(geometry.dtype) for _ in range(n))
                r = await c.store_many(zip(kvs, sources, strict=True), concurrency=args.concurrency)
                assert r.summary.failures == 0
                pairs = [(s, _tokens(20_000_000, i, cs)) for i, s in enumerate(sources)]
                t0 = time.perf_counter()
                one = await c.remap_many(pairs, concurrency=args.concurrency)
                dt = time.perf_counter() - t0
                assert (one.summary.hits, one.summary.stored_new) == (n, n), one.summary
                return dt

        single = asyncio.run(store_and_single())
        res["single"] = _rate(n, n * moved_per_pair, single)

        node = stack.enter_context(local_ray())
        for actors, base in ((1, 30_000_000), (2, 40_000_000)):
            rows = [{"source": s, "target": _tokens(base, i, cs)} for i, s in enumerate(sources)]
            ds = ray.data.from_items(rows, override_num_blocks=max(2, n // args.batch_size))
            t0 = time.perf_counter()
            out = remap_dataset(
                ds, model, actors=actors, batch_size=args.batch_size, concurrency=args.concurrency,
                servers={node: (srv.url, srv.http_url)}, client_options={"geometry": geometry, "timeout": 60},
                batch_class=TimedRemapBatches,
            ).take_all()  # fmt: skip
            wall = time.perf_counter() - t0
            assert len(out) == n and all(r["status"] == "hit" and r["stored_new"] for r in out)
            span = max(r["t1"] for r in out) - min(r["t0"] for r in out)
            res[f"ray_{actors}"] = {
                "wall": _rate(n, n * moved_per_pair, wall),
                "span": _rate(n, n * moved_per_pair, span),
            }
    res["overhead_us_per_pair"] = round((res["ray_1"]["span"]["seconds"] - single) / n * 1e6, 1)
    res["ray_1_over_single"] = round(res["ray_1"]["span"]["pairs_per_s"] / res["single"]["pairs_per_s"], 3)
    res["ray_2_over_single"] = round(res["ray_2"]["span"]["pairs_per_s"] / res["single"]["pairs_per_s"], 3)
    res["ray_2_wall_over_single"] = round(
        res["ray_2"]["wall"]["pairs_per_s"] / res["single"]["pairs_per_s"], 3
    )
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--l1-gb", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    for key, value in res.items():
        print(f"{key:24} {value}")


if __name__ == "__main__":
    main()
