"""``AsyncClient.compose`` against a plain ``remap`` of the same size plus the rotation alone.

    .venv/bin/python -m benchmarks.suite.bench_compose [--embedded] [--transfer auto|shm|pickle]
        [--layers 32] [--iters 4] [--rounds 3] [--json]
    .venv/bin/python -m benchmarks.suite.bench_compose --cuda [--layers 32] [--iters 8] [--json]

(``make bench`` runs the CPU case as the ``compose`` section, on the suite's SHM server
and, when the run includes ``single_pickle``, on its inline server too.)

CPU case. Geometry ``--layers`` x 8 KV heads x 128, bf16, chunk 256 (``--layers 32``: 32
MiB a chunk). Two source prompts of 8 chunks each are stored (untimed). Each iteration,
in an order that alternates, times on fresh target tokens (so every store writes):

* ``remap``: ``client.remap(source, target)`` of a 16-chunk source (retrieve + store of
  16 chunks; on SHM a slot-to-slot copy inside the server's pool);
* ``rotation``: ``RopeSpec.rotate_keys`` of the 8 chunks compose rotates (the key plane of
  the shifted part, into a preallocated buffer): the work compose adds to a remap;
* ``compose``: ``client.compose(target, [KVPart(a), KVPart(b)], rope=...)`` with the
  second part shifted by 8 chunks: 16 chunks read, 8 rotated, 16 stored.

Figure: median of ``(remap + rotation) / compose`` per iteration; the issue's target is
>= 0.8 (compose at least 0.8x the speed of a remap plus the rotation).

CUDA case (``--cuda``; skipped with a message and exit 0 without CUDA): the rotation of a
16-chunk CUDA KV against a CUDA retrieve (``device="cuda"``) + store of the same bytes on
an embedded SHM server. Figure: median of rotation / (retrieve + store); target <= 0.10.
Run on a GPU machine: ``python -m benchmarks.suite.bench_compose --cuda --json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, Literal

import torch

import lmcache_async as lmc
from benchmarks.harness import clear_l1, spread

CS = 256
PART_CHUNKS = 8
MODEL = "bench-compose"


def geometry(layers: int) -> lmc.KVGeometry:
    return lmc.KVGeometry(
        num_layers=layers, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16
    )


def _tokens(n: int) -> list[int]:
    base = int.from_bytes(os.urandom(4), "little") % (2**30)
    return list(range(base, base + n))


async def measure_cpu(
    url: str,
    http_url: str,
    *,
    layers: int,
    iters: int,
    transfer: Literal["auto", "shm", "pickle"],
    clear: bool = True,
) -> dict[str, Any]:
    geom = geometry(layers)
    rope = lmc.RopeSpec(head_dim=128, theta=500000.0)
    n = PART_CHUNKS * CS
    rows: dict[str, list[float]] = {"remap": [], "rotation": [], "compose": []}
    if clear:  # LMCache evicts lazily: a round stores a few GiB, so it starts from an empty L1
        await asyncio.to_thread(clear_l1, http_url)
    async with lmc.AsyncClient(
        url, http_url, f"{MODEL}-{time.time_ns()}", geometry=geom, timeout=300, transfer=transfer
    ) as client:
        a, b, whole = _tokens(n), _tokens(n), _tokens(2 * n)
        gen = torch.Generator().manual_seed(0)
        for toks in (a, b, whole):
            kv = torch.randn(geom.kv_shape(len(toks)), generator=gen).to(geom.dtype)
            assert await client.store(kv, toks)
        del kv
        keys = torch.randn(geom.kv_shape(n), generator=gen).to(geom.dtype)[0]
        out = torch.empty_like(keys)

        async def t_remap() -> float:
            t0 = time.perf_counter()
            res = await client.remap(whole, _tokens(2 * n))
            assert res.stored_tokens == 2 * n and res.stored_new
            return time.perf_counter() - t0

        async def t_rotation() -> float:
            t0 = time.perf_counter()
            rope.rotate_keys(keys, n, out=out)
            return time.perf_counter() - t0

        async def t_compose() -> float:
            t0 = time.perf_counter()
            res = await client.compose(_tokens(2 * n), [lmc.KVPart(a), lmc.KVPart(b)], rope=rope)
            assert res.stored_tokens == 2 * n and res.stored_new and res.parts[1].shift == n
            return time.perf_counter() - t0

        cases = {"remap": t_remap, "rotation": t_rotation, "compose": t_compose}
        for name in cases:  # warm-up: first touch of buffers and pool pages, not counted
            await cases[name]()
        order = list(cases)
        for i in range(iters):
            for name in order[i % 3 :] + order[: i % 3]:
                rows[name].append(await cases[name]())
        used = client.transfer
    ratios = [(r + o) / c for r, o, c in zip(rows["remap"], rows["rotation"], rows["compose"], strict=True)]
    return {
        "case": "cpu",
        "transfer": used,
        "layers": layers,
        "target_chunks": 2 * PART_CHUNKS,
        "mib_per_target": geom.bytes_per_token * 2 * n >> 20,
        "iters": iters,
        "seconds": {k: spread(v) for k, v in rows.items()},
        "remap_plus_rotation_over_compose": spread(ratios, digits=3),
        "target": ">= 0.8",
        "met": statistics.median(ratios) >= 0.8,
    }


async def measure_cuda(*, layers: int, iters: int) -> dict[str, Any]:
    from lmcache_async.testing import EmbeddedServer

    geom = geometry(layers)
    rope = lmc.RopeSpec(head_dim=128, theta=500000.0)
    n = 2 * PART_CHUNKS * CS
    rows: dict[str, list[float]] = {"rotation": [], "retrieve_store": []}
    size = geom.bytes_per_token * n * (iters + 4) + (256 << 20)
    async with EmbeddedServer(chunk_size=CS, mode="shm", size_bytes=size) as srv:
        async with lmc.AsyncClient(srv.url, srv.http_url, MODEL, geometry=geom, timeout=300) as client:
            src = _tokens(n)
            kv = torch.randn(geom.kv_shape(n), generator=torch.Generator().manual_seed(0)).to(geom.dtype)
            assert await client.store(kv, src)
            gpu = kv.cuda()
            out = torch.empty_like(gpu)
            for i in range(iters + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                rope.shift(gpu, n, out=out)
                torch.cuda.synchronize()
                rot = time.perf_counter() - t0
                t0 = time.perf_counter()
                got = await client.retrieve(src, device="cuda")
                assert got is not None and got.shape[2] == n
                assert await client.store(got, _tokens(n))
                torch.cuda.synchronize()
                io = time.perf_counter() - t0
                if i:  # the first is a warm-up
                    rows["rotation"].append(rot)
                    rows["retrieve_store"].append(io)
    ratios = [r / io for r, io in zip(rows["rotation"], rows["retrieve_store"], strict=True)]
    return {
        "case": "cuda",
        "device": torch.cuda.get_device_name(),
        "layers": layers,
        "tokens": n,
        "mib": geom.bytes_per_token * n >> 20,
        "iters": iters,
        "seconds": {k: spread(v) for k, v in rows.items()},
        "rotation_over_retrieve_store": spread(ratios, digits=3),
        "target": "<= 0.10",
        "met": statistics.median(ratios) <= 0.10,
    }


def _transfer(name: str) -> Literal["shm", "pickle"]:
    if name not in ("shm", "pickle"):
        raise ValueError(f"transfer must be shm or pickle, got {name!r}")
    return "shm" if name == "shm" else "pickle"


def section(
    servers: dict[str, tuple[str, str]], *, layers: int, iters: int, rounds: int = 1
) -> dict[str, Any]:
    """The CPU case on running servers, ``{"shm": (url, http_url), "pickle": ...}`` (the
    suite's SHM server, and its inline one when that runs): ``rounds`` runs of ``iters``
    iterations each; per transfer the last run's figures and every run's median ratio."""
    result: dict[str, Any] = {"layers": layers, "iters": iters, "rounds": rounds, "target": ">= 0.8"}
    for transfer, (url, http_url) in servers.items():
        runs = [
            asyncio.run(measure_cpu(url, http_url, layers=layers, iters=iters, transfer=_transfer(transfer)))
            for _ in range(rounds)
        ]
        result[transfer] = runs[-1]
        result[transfer]["per_round_ratio"] = [r["remap_plus_rotation_over_compose"]["median"] for r in runs]
    return result


async def _embedded_cpu(args: argparse.Namespace) -> dict[str, Any]:
    from lmcache_async.testing import EmbeddedServer

    geom = geometry(args.layers)
    size = geom.bytes_per_token * CS * PART_CHUNKS * (4 + 4 * (args.iters + 1)) + (256 << 20)
    mode: Literal["shm", "pickle"] = "pickle" if args.transfer == "pickle" else "shm"
    async with EmbeddedServer(chunk_size=CS, mode=mode, size_bytes=size) as srv:
        return await measure_cpu(
            srv.url, srv.http_url, layers=args.layers, iters=args.iters, transfer=args.transfer, clear=False
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="tcp://127.0.0.1:5555")
    parser.add_argument("--http-url", default="http://127.0.0.1:8080")
    parser.add_argument(
        "--embedded", action="store_true", help="start an embedded server (no real one needed)"
    )
    parser.add_argument("--transfer", choices=("auto", "shm", "pickle"), default="auto")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--cuda", action="store_true", help="the CUDA case (rotation vs retrieve + store)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.cuda:
        if not torch.cuda.is_available():
            print("bench_compose --cuda: CUDA is not available here; nothing measured", file=sys.stderr)
            return 0
        result = asyncio.run(measure_cuda(layers=args.layers, iters=args.iters))
    elif args.embedded:
        result = asyncio.run(_embedded_cpu(args))
    else:
        result = asyncio.run(
            measure_cpu(args.url, args.http_url, layers=args.layers, iters=args.iters, transfer=args.transfer)
        )
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
