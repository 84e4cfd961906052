"""AsyncClient vs the official SDK on the same real LMCache server, in the same run.

    .venv/bin/python benchmarks/bench_client.py [--iters 12] [--rounds 3] [--json] [--generation 0.5.7]

Starts a real LMCache server (0.5.6 from .lmcache-venv, or with ``--generation 0.5.7``
0.5.7rc3 from .lmcache-venv-057, whose own official SDK is then the comparison; SHM,
chunk 256), registers a
vLLM-style layout (32 layers x 8 KV heads x 128 head dim, bf16, block 16) with the fake
engine worker so that the official SDK can connect, and alternates rounds of the SDK
(in the lmcache venv, timed inside its own process) and of lmcache_async:

* ``retrieve16_out``: SHM retrieve of 16 chunks (512 MiB); ours into a reused ``out=``,
  the SDK's into fresh memory (it has no ``out=``); plus ``copy_`` of the same bytes
  into a warm buffer as the physical anchor;
* ``pair1``: store of fresh tokens + retrieve, 1 chunk (32 MiB): the fixed cost of a call
  with a realistic payload;
* ``pair1_tiny``: the same with a 1-layer, 1-head x 16 geometry (2 KiB per chunk): the
  pure fixed cost of the protocol exchange;
* ``store1``/``store4``/``store16`` and ``retrieve1``/``retrieve4``: for the tables.

Medians over ``--iters`` iterations per round; the reported figure is the median of the
round medians, with the range over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lmcache_async as lmc  # noqa: E402
from lmcache_async.wire import Op  # noqa: E402
from tests.support.real_server import RealLMCacheServer, lmcache_venv_python  # noqa: E402
from tests.support.workers import EngineWorker, _JsonLinesWorker  # noqa: E402

CS = 256
BIG = lmc.KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
TINY = lmc.KVGeometry(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16, block_size=16)


class SDKBench(_JsonLinesWorker):
    SCRIPT = "../../benchmarks/sdk_bench_worker.py"
    KIND = "sdk-bench"


def _kv(geom: lmc.KVGeometry, n: int) -> torch.Tensor:
    return torch.randn(geom.kv_shape(n), dtype=torch.float32).to(geom.dtype)


async def ours(client: lmc.AsyncClient, case: str, chunks: int, iters: int, base: int) -> list[float]:
    geom = client.geometry
    n = chunks * CS
    kv = _kv(geom, n)
    times: list[float] = []
    if case.startswith("retrieve"):
        tokens = list(range(base, base + n))
        await client.store(kv, tokens)
        out = torch.empty(geom.kv_shape(n), dtype=geom.dtype) if case.endswith("_out") else None
        got = await client.retrieve(tokens, out=out)
        assert got is not None and torch.equal(got, kv)
        for _ in range(iters):
            t0 = time.perf_counter()
            got = await client.retrieve(tokens, out=out)
            times.append(time.perf_counter() - t0)
            assert got is not None
            del got
        return times
    for i in range(iters):
        tokens = list(range(base + (i + 1) * n, base + (i + 2) * n))
        t0 = time.perf_counter()
        ok = await client.store(kv, tokens)
        if case.startswith("pair"):
            got = await client.retrieve(tokens)
            assert got is not None
        times.append(time.perf_counter() - t0)
        assert ok
    return times


def copy_anchor(chunks: int, iters: int) -> list[float]:
    src = _kv(BIG, chunks * CS)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


CASES = [
    # (name, geometry, sdk case, our case, chunks)
    ("retrieve16_out", "big", "retrieve", "retrieve_out", 16),
    ("pair1", "big", "pair", "pair", 1),
    ("pair1_tiny", "tiny", "pair", "pair", 1),
    ("store1", "big", "store", "store", 1),
    ("store4", "big", "store", "store", 4),
    ("store16", "big", "store", "store", 16),
    ("retrieve1", "big", "retrieve", "retrieve", 1),
    ("retrieve4", "big", "retrieve", "retrieve", 4),
]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    python = lmcache_venv_python(generation=args.generation)
    results: dict[str, dict[str, list[float]]] = {c[0]: {"sdk": [], "ours": []} for c in CASES}
    results["copy16"] = {"anchor": []}
    with RealLMCacheServer(
        "shm", venv_python=python, chunk_size=CS, l1_size_gb=args.l1_gb, generation=args.generation
    ) as srv:
        with (
            EngineWorker(srv.url, python=python) as eng_big,
            EngineWorker(srv.url, python=python) as eng_tiny,
        ):
            eng_big.register("bench-big", 32, 8, 128, block_size=16, num_blocks=32)
            eng_tiny.register("bench-tiny", 1, 1, 16, block_size=16, num_blocks=32)
            with SDKBench(python=python) as sdk_big, SDKBench(python=python) as sdk_tiny:
                sdk_big.request("connect", url=srv.url, http_url=srv.http_url, model_name="bench-big",
                                geometry=[32, 1024])  # fmt: skip
                sdk_tiny.request("connect", url=srv.url, http_url=srv.http_url, model_name="bench-tiny",
                                 geometry=[1, 16])  # fmt: skip
                sdks = {"big": sdk_big, "tiny": sdk_tiny}
                async with (
                    lmc.AsyncClient(srv.url, srv.http_url, "bench-big", timeout=120) as c_big,
                    lmc.AsyncClient(srv.url, srv.http_url, "bench-tiny", timeout=120) as c_tiny,
                ):
                    assert c_big.geometry == BIG and c_tiny.geometry == TINY, (
                        c_big.geometry,
                        c_tiny.geometry,
                    )
                    assert c_big.transfer == "shm"
                    assert c_big.wire_generation == args.generation, c_big.server_version
                    clients = {"big": c_big, "tiny": c_tiny}
                    base = 1000
                    for rnd in range(args.rounds + 1):  # round 0 warms the pool
                        for name, geom, sdk_case, our_case, chunks in CASES:
                            if args.only and name not in args.only:
                                continue
                            base += 100_000
                            order = ["sdk", "ours"] if rnd % 2 == 0 else ["ours", "sdk"]
                            for who in order:
                                if who == "sdk":
                                    reply = sdks[geom].request(
                                        "bench", deadline=600, case=sdk_case, chunks=chunks,
                                        iters=args.iters, base=base,
                                    )  # fmt: skip
                                    t = reply["times"]
                                else:
                                    t = await ours(clients[geom], our_case, chunks, args.iters, base + 50_000)
                                if rnd:
                                    results[name][who].append(statistics.median(t))
                                # keep the L1 from filling up (the server evicts lazily)
                                await c_big._conn.call(Op.CLEAR, (True,), timeout=60)
                            print(f"round {rnd} {name} done", file=sys.stderr)
                        if rnd:
                            results["copy16"]["anchor"].append(statistics.median(copy_anchor(16, args.iters)))
    return {k: v for k, v in results.items() if all(v.values())}


def summarize(results: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    anchor = statistics.median(results["copy16"]["anchor"]) if "copy16" in results else None
    for name, data in results.items():
        if name == "copy16":
            continue
        sdk, ours_ = statistics.median(data["sdk"]), statistics.median(data["ours"])
        row = {
            "case": name,
            "sdk_ms": round(sdk * 1e3, 2),
            "sdk_range_ms": [round(min(data["sdk"]) * 1e3, 2), round(max(data["sdk"]) * 1e3, 2)],
            "ours_ms": round(ours_ * 1e3, 2),
            "ours_range_ms": [round(min(data["ours"]) * 1e3, 2), round(max(data["ours"]) * 1e3, 2)],
            "speedup": round(sdk / ours_, 2),
        }
        if name == "retrieve16_out" and anchor:
            row["copy_ms"] = round(anchor * 1e3, 2)
            row["vs_copy"] = round(ours_ / anchor, 2)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--generation", choices=["0.5.6", "0.5.7"], default="0.5.6")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--l1-gb", type=int, default=8)
    parser.add_argument("--only", nargs="*", help="run only these cases")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = summarize(asyncio.run(run(args)))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'case':<16}{'SDK ms':>10}{'ours ms':>10}{'speedup':>9}  notes")
    for r in rows:
        note = f"copy_ {r['copy_ms']} ms, ours/copy {r['vs_copy']}" if "copy_ms" in r else ""
        print(f"{r['case']:<16}{r['sdk_ms']:>10}{r['ours_ms']:>10}{r['speedup']:>8}x  {note}")


if __name__ == "__main__":
    main()
