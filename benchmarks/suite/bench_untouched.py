"""Pool pages nobody has used yet: stores into them, and retrieves of KV another process stored.

    .venv/bin/python -m benchmarks.suite.bench_untouched [--chunks 1 4 16] [--iters 3]
        [--rounds 3] [--l1-gb 4] [--json]

(``make bench`` runs this as the ``untouched`` section.)

The ``single_shm`` section reuses its slots: round 0 is an untimed warm-up and its L1 is
cleared between cases, so the server hands out the same slots again, already mapped by
the client. A service that keeps storing new prompts on a large pool lands on slots it
has never touched instead. This section measures that case on a real LMCache 0.5.6 server
(SHM, chunk 256, the vLLM-style layout of ``single_shm``: 32 MiB a chunk):

* ``store``: each side opens a NEW client (ours: an ``AsyncClient``; the SDK: a new
  context, in its own process), so its mapping of the pool is fresh, and stores
  ``--iters`` fresh prompts of ``--chunks`` chunks. The pool's pages under those slots
  were never written by anyone: after every side the L1 is cleared and the pages of the
  segment are given back to the kernel (``fallocate(PUNCH_HOLE)`` on the segment; the L1
  is empty then, so no slot's content is lost), which also keeps the memory this section
  holds at one side's stores (``--iters`` x 16 chunks at most: 1.5 GiB by default).
* ``retrieve``: ``--iters`` prompts stored by ANOTHER process (the SDK's worker, a context
  of its own: the engine's case, KV written by someone else), then each side, again with
  a fresh mapping, retrieves each prompt once into a new tensor (ours: ``retrieve()``
  without ``out=``; the SDK's ``retrieve``).

The sides alternate (the order rotates each round); each side's figure per round is its
median over ``--iters`` operations, with the minor page faults of its process per
operation (``getrusage``). Reported: the median of the round figures with their range, and
the SDK/ours ratio per round (> 1: lmcache_async is faster) with its range.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import lmcache_async as lmc
from benchmarks.harness import clear_l1, sdk_call, server_python, spread, workers
from harness.real_server import RealLMCacheServer
from harness.workers import EngineWorker, SDKWorker

CS = 256
GEOM = lmc.KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
MODEL = "bench-untouched"
OPS = ("store", "retrieve")

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def punch_pool(segment: str) -> None:
    """Give every page of the (empty) pool segment back to the kernel: the next store on
    any slot writes pages nobody has used yet, as on a new server's pool."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fd = os.open(segment, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size) != 0:
            raise OSError(ctypes.get_errno(), f"fallocate(PUNCH_HOLE) on {segment} failed")
    finally:
        os.close(fd)


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


async def ours(
    srv: RealLMCacheServer, op: str, starts: list[int], n: int, kv: torch.Tensor
) -> dict[str, Any]:
    """A new client; one timed ``op`` per start. Returns ``{times, faults}``."""
    times: list[float] = []
    faults: list[int] = []
    async with lmc.AsyncClient(srv.url, srv.http_url, MODEL, timeout=300) as client:
        for start in starts:
            tokens = list(range(start, start + n))
            f0 = _minflt()
            t0 = time.perf_counter()
            if op == "store":
                ok = await client.store(kv, tokens)
            else:
                got = await client.retrieve(tokens)
                ok = got is not None and got.shape == kv.shape
            times.append(time.perf_counter() - t0)
            faults.append(_minflt() - f0)
            assert ok, (op, start)
            got = None
    return {"times": times, "faults": faults}


async def _measure(
    srv: RealLMCacheServer, python: Path, chunk_list: list[int], iters: int, rounds: int
) -> dict[str, Any]:
    segment = srv.shm_segment
    assert segment is not None
    raw: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = {
        (op, c): {"sdk": [], "ours": []} for c in chunk_list for op in OPS
    }
    with workers(
        EngineWorker(srv.url, python=python),
        SDKWorker(python=python, request_timeout=600),
        SDKWorker(python=python, request_timeout=600),
    ) as (eng, sdk_w, storer):
        eng.register(MODEL, 32, 8, 128, block_size=16, num_blocks=32)
        for w in (sdk_w, storer):
            w.connect(srv.url, srv.http_url, MODEL, 60.0, geometry=[32, 1024])
        server: dict[str, Any] = {
            "server": srv,
            "url": srv.url,
            "http_url": srv.http_url,
            "model_name": MODEL,
        }
        await asyncio.to_thread(clear_l1, srv.http_url)  # a server shared with other sections
        punch_pool(segment)
        base = 100_000_000  # token ids stay below 2**32 (the server hashes them as uint32)
        for rnd in range(rounds):
            for c in chunk_list:
                n = c * CS
                kv = torch.randn(GEOM.kv_shape(n), dtype=torch.float32).to(GEOM.dtype)
                for op in OPS:
                    starts = [base + i * 100_000 for i in range(iters)]
                    base += 20_000_000
                    if op == "retrieve":  # another process stores the prompts
                        await sdk_call(storer, "untouched", op="store", starts=starts, tokens=n, **server)
                    sides = ["sdk", "ours"] if (rnd + OPS.index(op)) % 2 == 0 else ["ours", "sdk"]
                    for who in sides:
                        if who == "ours":
                            fig = await ours(srv, op, starts, n, kv)
                        else:
                            fig = await sdk_call(sdk_w, "untouched", op=op, starts=starts, tokens=n, **server)
                        raw[(op, c)][who].append(fig)
                        if op == "store":
                            await asyncio.to_thread(clear_l1, srv.http_url)
                            punch_pool(segment)
                            starts = [s + 10_000_000 for s in starts]  # the other side: fresh tokens
                    if op == "retrieve":
                        await asyncio.to_thread(clear_l1, srv.http_url)
                        punch_pool(segment)
            print(f"  untouched: round {rnd} done", file=sys.stderr)
        server_version = srv.get_json("/lmc_version")
    rows = []
    for (op, c), data in raw.items():
        sdk_t = [statistics.median(f["times"]) for f in data["sdk"]]
        our_t = [statistics.median(f["times"]) for f in data["ours"]]
        rows.append(
            {
                "op": op,
                "chunks": c,
                "bytes": c * CS * GEOM.bytes_per_token,
                "sdk_s": spread(sdk_t, digits=6),
                "ours_s": spread(our_t, digits=6),
                "sdk_faults": spread([statistics.median(f["faults"]) for f in data["sdk"]], digits=0),
                "ours_faults": spread([statistics.median(f["faults"]) for f in data["ours"]], digits=0),
                "ratio": spread([s / o for s, o in zip(sdk_t, our_t, strict=True)], digits=3),
                "ratio_all": spread(
                    [
                        s / o
                        for fs, fo in zip(data["sdk"], data["ours"], strict=True)
                        for s, o in zip(fs["times"], fo["times"], strict=True)
                    ],
                    digits=3,
                ),
            }
        )
    return {
        "transfer": "shm",
        "server_version": server_version,
        "geometry": "32 layers x 8 KV heads x 128, bf16, block 16; chunk 256 tokens = 32 MiB",
        "iters": iters,
        "rounds": rounds,
        "rows": rows,
    }


def section(
    srv: RealLMCacheServer, *, python: Path, chunks: list[int], iters: int, rounds: int
) -> dict[str, Any]:
    """Measure the untouched-pages cases on the running SHM server ``srv``. Blocks until
    done; every server call has a 300 s deadline and every SDK request a 600 s one."""
    return asyncio.run(_measure(srv, python, chunks, iters, rounds))


def print_table(result: dict[str, Any]) -> None:
    print(
        f"untouched pool pages, server {result['server_version']}, {result['rounds']} rounds of {result['iters']}"
    )
    print(
        f"{'op':<10}{'chunks':>7}{'SDK ms':>10}{'ours ms':>10}{'SDK/ours':>10}{'range':>14}{'faults SDK/ours':>20}"
    )
    for r in result["rows"]:
        rng = f"{r['ratio']['min']}-{r['ratio']['max']}"
        flt = f"{r['sdk_faults']['median']:.0f}/{r['ours_faults']['median']:.0f}"
        print(
            f"{r['op']:<10}{r['chunks']:>7}{r['sdk_s']['median'] * 1e3:>10.2f}"
            f"{r['ours_s']['median'] * 1e3:>10.2f}{r['ratio']['median']:>9}x{rng:>14}{flt:>20}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--iters", type=int, choices=range(1, 51), default=3, metavar="1..50")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--l1-gb", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    python = server_python("0.5.6")
    with RealLMCacheServer("shm", venv_python=python, chunk_size=CS, l1_size_gb=args.l1_gb) as srv:
        result = section(srv, python=python, chunks=args.chunks, iters=args.iters, rounds=args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
