"""Many small operations at once: throughput and client CPU per operation vs concurrency.

    .venv/bin/python -m benchmarks.suite.bench_concurrent [--prompts 256] [--rounds 3]
        [--concurrency 1 8 64] [--threads 1 8] [--ops retrieve store] [--json]

(``make bench`` runs this as the ``concurrent`` section.)

Starts a real LMCache 0.5.6 server (SHM, chunk 256), registers a small vLLM-style layout
(2 layers x 1 KV head x 128, bf16: one 256-token chunk = 256 KiB) with the fake engine
worker, and runs ``--prompts`` one-chunk operations:

* lmcache_async: ONE ``AsyncClient``, ``c`` tasks taking prompts from a shared list and
  awaiting ``retrieve``/``store`` one after another (concurrency ``c`` in ``--concurrency``);
* the official SDK: ONE context in its own process, ``t`` threads (a ``ThreadPoolExecutor``
  over the prompts, ``t`` in ``--threads``).

``retrieve`` reads prompts stored once before the rounds (the same ones on both sides);
``store`` writes fresh prompts each run. Throughput = prompts / elapsed. Client CPU per
operation = ``time.process_time()`` of the client's process over the run / prompts (the
whole process: the event loop and any worker thread it uses, not the server). The order of
the runs rotates from round to round; round 0 warms up and is not counted; the client's
background SHM warm-up (if any) has finished before the first round (harness.settle). Per round:
ours / the SDK's best thread count (throughput), ours / the SDK at that thread count (CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import lmcache_async as lmc
from benchmarks.harness import clear_l1, sdk_call, server_python, settle, spread, workers
from harness.real_server import RealLMCacheServer
from harness.workers import EngineWorker, SDKWorker

CS = 256
GEOM = lmc.KVGeometry(num_layers=2, num_kv_heads=1, head_dim=128, dtype=torch.bfloat16, block_size=16)
MODEL = "bench-concurrent"


async def ours(
    client: lmc.AsyncClient, op: str, starts: list[int], kv: torch.Tensor, concurrency: int
) -> tuple[float, float]:
    """One run: (elapsed seconds, CPU seconds of this process)."""
    todo = iter(starts)
    done = 0

    async def worker() -> None:
        nonlocal done
        for s in todo:
            tokens = list(range(s, s + CS))
            if op == "retrieve":
                got = await client.retrieve(tokens)
                assert got is not None
            else:
                assert await client.store(kv, tokens)
            done += 1

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert done == len(starts), (done, len(starts))
    return elapsed, cpu


async def _measure(
    srv: RealLMCacheServer,
    python: Path,
    prompts: int,
    rounds: int,
    conc: list[int],
    threads: list[int],
    ops: list[str],
) -> dict[str, Any]:
    runs = [f"ours_c{c}" for c in conc] + [f"sdk_t{t}" for t in threads]
    raw: dict[str, dict[str, list[tuple[float, float]]]] = {op: {r: [] for r in runs} for op in ops}
    kv = torch.randn(GEOM.kv_shape(CS), dtype=torch.float32).to(GEOM.dtype)
    stored = [10_000_000 + i * 1000 for i in range(prompts)]
    with workers(EngineWorker(srv.url, python=python), SDKWorker(python=python, request_timeout=600)) as (
        eng,
        sdk,
    ):
        eng.register(MODEL, 2, 1, 128, block_size=16, num_blocks=32)
        sdk.connect(srv.url, srv.http_url, MODEL, 60.0, geometry=[2, 128])
        async with lmc.AsyncClient(srv.url, srv.http_url, MODEL, timeout=300) as client:
            assert client.geometry == GEOM, client.geometry
            assert client.transfer == srv.mode, client.transfer
            settled = await settle()
            base = 100_000_000
            for rnd in range(rounds + 1):
                await asyncio.to_thread(clear_l1, srv.http_url)
                # (re)store the retrieve prompts: untimed, 8 at a time
                await ours(client, "store", stored, kv, 8)
                order = runs[rnd % len(runs) :] + runs[: rnd % len(runs)]
                for op in ops:
                    for run in order:
                        if op == "retrieve":
                            starts = stored
                        else:
                            base += prompts * 1000
                            starts = [base + i * 1000 for i in range(prompts)]
                        if run.startswith("ours"):
                            fig = await ours(client, op, starts, kv, int(run.removeprefix("ours_c")))
                        else:
                            reply = await sdk_call(
                                sdk, "concurrent", server=srv, op=op, starts=starts, tokens=CS,
                                threads=int(run.removeprefix("sdk_t")), deadline=600,
                            )  # fmt: skip
                            assert reply["done"] == prompts, reply
                            fig = (reply["elapsed"], reply["cpu"])
                        if rnd:
                            raw[op][run].append(fig)
                print(f"  concurrent: round {rnd}{' (warm-up)' if rnd == 0 else ''} done", file=sys.stderr)
            server_version = srv.get_json("/lmc_version")
    rows = []
    for op in ops:
        data = raw[op]
        for run in runs:
            who, n = run.split("_")
            rows.append(
                {
                    "op": op,
                    "who": "sdk" if who == "sdk" else "ours",
                    "concurrency": int(n[1:]),
                    "ops_per_s": spread([prompts / e for e, _ in data[run]], digits=1),
                    "cpu_us_per_op": spread([c / prompts for _, c in data[run]], scale=1e6, digits=1),
                }
            )
        # per round: ours vs the SDK's best thread count of that round
        for c in conc:
            tput, cpu = [], []
            for r in range(rounds):
                sdk_best = max((f"sdk_t{t}" for t in threads), key=functools.partial(_inverse_time, data, r))
                tput.append(data[sdk_best][r][0] / data[f"ours_c{c}"][r][0])
                cpu.append(data[f"ours_c{c}"][r][1] / data[sdk_best][r][1])
            rows.append({"op": op, "who": "ratio", "concurrency": c,
                         "tput_vs_sdk_best": spread(tput, digits=3), "cpu_vs_sdk_best": spread(cpu, digits=3)})  # fmt: skip
    return {
        "transfer": srv.mode,
        "server_version": server_version,
        "prompts": prompts,
        "chunk_bytes": CS * GEOM.bytes_per_token,
        "geometry": "2 layers x 1 KV head x 128, bf16, block 16; chunk 256 tokens = 256 KiB",
        "rounds": rounds,
        "prefault_wait_s": settled,
        "rows": rows,
    }


def _inverse_time(data: dict[str, list[tuple[float, float]]], r: int, k: str) -> float:
    """1 / the elapsed seconds of run ``k`` in round ``r``."""
    return 1 / data[k][r][0]


def section(
    srv: RealLMCacheServer, *, python: Path, prompts: int, rounds: int, concurrency: list[int], threads: list[int],
    ops: list[str],
) -> dict[str, Any]:  # fmt: skip
    """Run the concurrent case on ``srv``; blocks until done (server calls: 300 s deadline,
    SDK requests: 600 s)."""
    return asyncio.run(_measure(srv, python, prompts, rounds, concurrency, threads, ops))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ops", nargs="+", choices=["retrieve", "store"], default=["retrieve", "store"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    python = server_python("0.5.6")
    with RealLMCacheServer("shm", venv_python=python, chunk_size=CS, l1_size_gb=2) as srv:
        result = section(srv, python=python, prompts=args.prompts, rounds=args.rounds,
                         concurrency=args.concurrency, threads=args.threads, ops=args.ops)  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['prompts']} one-chunk prompts (256 KiB), {result['rounds']} rounds, medians")
    for r in result["rows"]:
        if r["who"] == "ratio":
            print(f"  {r['op']:<9} ours c{r['concurrency']}: throughput {r['tput_vs_sdk_best']['median']}x "
                  f"the SDK's best, CPU/op {r['cpu_vs_sdk_best']['median']}x")  # fmt: skip
        else:
            print(f"{r['op']:<9} {r['who']:<5} {r['concurrency']:>3}: {r['ops_per_s']['median']:>8} ops/s "
                  f"{r['cpu_us_per_op']['median']:>8} µs CPU/op")  # fmt: skip


if __name__ == "__main__":
    main()
