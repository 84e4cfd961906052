"""Single operations: AsyncClient vs the official SDK on the same real LMCache server, same run.

    .venv/bin/python -m benchmarks.suite.bench_client [--mode shm|pickle] [--chunks 1 4 16]
        [--iters 8] [--rounds 3] [--generation 0.5.6|0.5.7] [--json]

(``make bench`` runs this as the ``single_shm`` and ``single_pickle`` sections.)

Starts a real LMCache server (``--mode shm``: the L1 is a POSIX SHM segment and both
clients copy through it; ``pickle``: no SHM, the KV travels inline in the ZMQ frames),
registers a vLLM-style layout (32 layers x 8 KV heads x 128 head dim, bf16, block 16;
chunk 256 tokens = 32 MiB) with the fake engine worker so that the official SDK can
connect, and for each payload of ``--chunks`` chunks alternates (the order rotates from
round to round; the client's background SHM warm-up, if any, has finished first) the SDK (in the lmcache venv, timed inside its own process) and
lmcache_async (timed in this process):

* ``store``: each iteration stores fresh tokens;
* ``retrieve``: one stored prompt retrieved into a fresh tensor, ``--iters`` times;
* ``retrieve_out``: ours into a reused ``out=`` buffer; the SDK has no ``out=``, its
  figure is its ``retrieve`` of the same round; plus ``copy_`` of the same bytes into a
  warm buffer (the physical floor of a copy on this machine);
* ``pair_tiny``: store of fresh tokens + retrieve of a 1-layer, 1-head x 16 geometry
  (16 KiB per 256-token chunk): the fixed cost of the protocol exchange.

Each side's figure per round is the median over ``--iters`` iterations; reported: the
median of the round figures with their range, the SDK/ours ratio per round (its median and
range; > 1 means lmcache_async is faster), and the client CPU per operation
(``time.process_time`` of the measuring process over the timed iterations). Round 0 warms
the pool and is not counted. The L1 is cleared between cases.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import lmcache_async as lmc
from benchmarks.harness import (
    clear_l1,
    require_generation,
    sdk_call,
    server_python,
    settle,
    spread,
    workers,
)
from harness.real_server import RealLMCacheServer
from harness.workers import EngineWorker, SDKWorker

CS = 256
BIG = lmc.KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
TINY = lmc.KVGeometry(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16, block_size=16)
OPS = ("store", "retrieve", "retrieve_out")

_KV: dict[tuple[int, int], torch.Tensor] = {}


def _kv(geom: lmc.KVGeometry, n: int) -> torch.Tensor:
    key = (geom.bytes_per_token, n)
    if key not in _KV:  # 512 MiB of randn costs seconds: make each size once
        _KV[key] = torch.randn(geom.kv_shape(n), dtype=torch.float32).to(geom.dtype)
    return _KV[key]


async def ours(
    client: lmc.AsyncClient, case: str, chunks: int, iters: int, base: int
) -> tuple[list[float], float]:
    """Time ``iters`` calls of ``case``; returns (seconds per call, CPU seconds per call)."""
    geom = client.geometry
    n = chunks * CS
    kv = _kv(geom, n)
    times: list[float] = []
    if case.startswith("retrieve"):
        tokens = list(range(base, base + n))
        await client.store(kv, tokens)
        out = torch.empty(geom.kv_shape(n), dtype=geom.dtype) if case == "retrieve_out" else None
        got = await client.retrieve(tokens, out=out)
        assert got is not None and torch.equal(got, kv)
        cpu0 = time.process_time()
        for _ in range(iters):
            t0 = time.perf_counter()
            got = await client.retrieve(tokens, out=out)
            times.append(time.perf_counter() - t0)
            assert got is not None
            del got
        return times, (time.process_time() - cpu0) / iters
    cpu0 = time.process_time()
    for i in range(iters):
        tokens = list(range(base + (i + 1) * n, base + (i + 2) * n))
        t0 = time.perf_counter()
        ok = await client.store(kv, tokens)
        if case == "pair":
            got = await client.retrieve(tokens)
            assert got is not None
        times.append(time.perf_counter() - t0)
        assert ok
    return times, (time.process_time() - cpu0) / iters


def copy_anchor(chunks: int, iters: int) -> list[float]:
    """``dst.copy_(src)`` of ``chunks`` chunks into a warm buffer, ``iters`` times."""
    src = _kv(BIG, chunks * CS)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


async def _measure(
    srv: RealLMCacheServer, python: Path, chunk_list: list[int], iters: int, rounds: int, generation: str
) -> dict[str, Any]:
    mode = srv.mode
    # raw[(op, chunks)][who] -> per-round (median seconds, cpu seconds per op)
    keys = [(op, c) for c in chunk_list for op in OPS] + [("pair_tiny", 1)]
    raw: dict[tuple[str, int], dict[str, list[tuple[float, float]]]] = {
        k: {"sdk": [], "ours": []} for k in keys
    }
    anchors: dict[int, list[float]] = {c: [] for c in chunk_list}
    big_model, tiny_model = f"bench-big-{mode}", f"bench-tiny-{mode}"
    with workers(
        EngineWorker(srv.url, python=python),
        EngineWorker(srv.url, python=python),
        SDKWorker(python=python, request_timeout=600),
        SDKWorker(python=python, request_timeout=600),
    ) as (eng_big, eng_tiny, sdk_big, sdk_tiny):
        eng_big.register(big_model, 32, 8, 128, block_size=16, num_blocks=32)
        eng_tiny.register(tiny_model, 1, 1, 16, block_size=16, num_blocks=32)
        sdk_big.connect(srv.url, srv.http_url, big_model, 60.0, geometry=[32, 1024])
        sdk_tiny.connect(srv.url, srv.http_url, tiny_model, 60.0, geometry=[1, 16])
        async with (
            lmc.AsyncClient(srv.url, srv.http_url, big_model, timeout=300) as c_big,
            lmc.AsyncClient(srv.url, srv.http_url, tiny_model, timeout=300) as c_tiny,
        ):
            assert c_big.geometry == BIG and c_tiny.geometry == TINY, (c_big.geometry, c_tiny.geometry)
            if c_big.transfer != mode:
                raise SystemExit(f"asked for {mode}, but the client chose {c_big.transfer}")
            await require_generation(c_big, generation)
            settled = await settle()
            base = 1_000_000
            for rnd in range(rounds + 1):  # round 0 warms the pool and the buffers
                for c in chunk_list:
                    base += 1_000_000
                    # the SDK's retrieve serves both "retrieve" and "retrieve_out"
                    sides = ["sdk", "retrieve", "retrieve_out", "store-sdk", "store"]
                    sides = sides[rnd % len(sides) :] + sides[: rnd % len(sides)]
                    sdk_retrieve: tuple[float, float] | None = None
                    for side in sides:
                        base += 100_000
                        if side == "sdk":
                            reply = await sdk_call(
                                sdk_big,
                                "bench",
                                server=srv,
                                case="retrieve",
                                chunks=c,
                                iters=iters,
                                base=base,
                            )
                            sdk_retrieve = (statistics.median(reply["times"]), reply["cpu"] / iters)
                        elif side == "store-sdk":
                            reply = await sdk_call(
                                sdk_big, "bench", server=srv, case="store", chunks=c, iters=iters, base=base
                            )
                            if rnd:
                                raw[("store", c)]["sdk"].append(
                                    (statistics.median(reply["times"]), reply["cpu"] / iters)
                                )
                        else:
                            t, cpu = await ours(c_big, side, c, iters, base)
                            if rnd:
                                raw[(side, c)]["ours"].append((statistics.median(t), cpu))
                        await asyncio.to_thread(clear_l1, srv.http_url)
                    assert sdk_retrieve is not None
                    if rnd:
                        raw[("retrieve", c)]["sdk"].append(sdk_retrieve)
                        raw[("retrieve_out", c)]["sdk"].append(sdk_retrieve)
                        anchors[c].append(statistics.median(copy_anchor(c, iters)))
                # the fixed cost: a 16 KiB store + retrieve
                order = ["sdk", "ours"] if rnd % 2 == 0 else ["ours", "sdk"]
                for who in order:
                    base += 100_000
                    if who == "sdk":
                        reply = await sdk_call(
                            sdk_tiny, "bench", server=srv, case="pair", chunks=1, iters=iters * 4, base=base
                        )
                        fig = (statistics.median(reply["times"]), reply["cpu"] / (iters * 4))
                    else:
                        t, cpu = await ours(c_tiny, "pair", 1, iters * 4, base)
                        fig = (statistics.median(t), cpu)
                    if rnd:
                        raw[("pair_tiny", 1)][who].append(fig)
                await asyncio.to_thread(clear_l1, srv.http_url)
                print(
                    f"  single {mode}: round {rnd}{' (warm-up)' if rnd == 0 else ''} done",
                    file=sys.stderr,
                )
            server_version = srv.get_json("/lmc_version")
    rows = []
    for (op, c), data in raw.items():
        geom = TINY if op == "pair_tiny" else BIG
        sdk_t = [x[0] for x in data["sdk"]]
        our_t = [x[0] for x in data["ours"]]
        row: dict[str, Any] = {
            "op": op,
            "chunks": c,
            "bytes": c * CS * geom.bytes_per_token,
            "sdk_s": spread(sdk_t, digits=6),
            "ours_s": spread(our_t, digits=6),
            "sdk_cpu_s": spread([x[1] for x in data["sdk"]], digits=6),
            "ours_cpu_s": spread([x[1] for x in data["ours"]], digits=6),
            "ratio": spread([s / o for s, o in zip(sdk_t, our_t, strict=True)], digits=3),
        }
        if op == "retrieve_out":
            row["copy_s"] = spread(anchors[c], digits=6)
            row["vs_copy"] = spread([o / a for o, a in zip(our_t, anchors[c], strict=True)], digits=3)
        rows.append(row)
    return {
        "transfer": mode,
        "server_version": server_version,
        "geometry": "32 layers x 8 KV heads x 128, bf16, block 16; chunk 256 tokens = 32 MiB",
        "iters": iters,
        "rounds": rounds,
        "prefault_wait_s": settled,
        "rows": rows,
    }


def section(
    srv: RealLMCacheServer,
    *,
    python: Path,
    chunks: list[int],
    iters: int,
    rounds: int,
    generation: str = "0.5.6",
) -> dict[str, Any]:
    """Measure every single-operation case on the running server ``srv`` (its mode decides
    SHM or inline). Blocks until done; every server call has a 300 s deadline and every
    SDK request a 600 s one."""
    return asyncio.run(_measure(srv, python, chunks, iters, rounds, generation))


def print_table(result: dict[str, Any]) -> None:
    print(f"single operations, {result['transfer']}, server {result['server_version']}")
    print(f"{'op':<14}{'chunks':>7}{'SDK ms':>10}{'ours ms':>10}{'SDK/ours':>10}  notes")
    for r in result["rows"]:
        note = ""
        if "copy_s" in r:
            note = f"copy_ {r['copy_s']['median'] * 1e3:.2f} ms, ours/copy {r['vs_copy']['median']}"
        print(
            f"{r['op']:<14}{r['chunks']:>7}{r['sdk_s']['median'] * 1e3:>10.2f}"
            f"{r['ours_s']['median'] * 1e3:>10.2f}{r['ratio']['median']:>9}x  {note}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["shm", "pickle"], default="shm")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--l1-gb", type=int, default=8)
    parser.add_argument("--generation", choices=["0.5.6", "0.5.7"], default="0.5.6")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    python = server_python(args.generation)
    with RealLMCacheServer(args.mode, venv_python=python, chunk_size=CS, l1_size_gb=args.l1_gb) as srv:
        result = section(
            srv,
            python=python,
            chunks=args.chunks,
            iters=args.iters,
            rounds=args.rounds,
            generation=args.generation,
        )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
