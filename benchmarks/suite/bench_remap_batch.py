"""remap_many vs the official SDK doing the same remaps in a loop, on one real server.

    .venv/bin/python -m benchmarks.suite.bench_remap_batch [--rounds 5] [--pairs 64] [--l1-gb 10] [--json]

(``make bench`` runs this as the ``remap`` section.)

Starts a real LMCache 0.5.6 server (SHM, chunk 256, L1 ``--l1-gb`` GiB, from
.lmcache-venv), registers a vLLM-style layout (32 layers x 8 KV heads x 128 head dim =
1024 hidden, bf16, block 16) with the fake engine worker so that the official SDK can
connect, and stores 8 source prompts of 4 chunks (1024 tokens, 128 MiB of KV each).

A *run* remaps ``--pairs`` pairs (default 64): pair i retrieves source ``i % 8`` and stores it under a target
prompt of its own (fresh tokens every run, so every store really writes 128 MiB). Each
round runs, in an order that rotates from round to round:

* the official SDK (``lmcache.sdk.kvcache`` in the lmcache venv, timed in its own
  process): ``kv = ctx.retrieve(src); ctx.store(kv, dst)`` for each pair;
* ``AsyncClient.remap_many`` at concurrency 1, 4 and 16 (budget: concurrency x 128 MiB).

Before every run the L1 is cleared and the sources stored again (untimed), so each run
starts from the same state; after every run the last four targets are read back and
compared bitwise with their sources, and every run must have 64 hits and 64 new stores.
Round 0 warms the pool (first touch of the L1 pages and of the client's buffers) and is
not counted. Throughput = 64 pairs / elapsed; GB/s counts the bytes retrieved plus the
bytes stored (2 x 8 GiB per run). The reported figures are medians over the rounds, the
ratios medians of the per-round ratios ours / SDK.

Memory: a run writes 8 GiB of targets, and the server's LRU eviction runs once a second
(20 % of the L1 each time, above an 80 % watermark): it cannot keep up with stores at a
few GB/s, and a store that finds no free L1 fails (the official SDK's store then returns
False). So the L1 (default 10 GiB, watermark raised to 95 %) holds the 1 GiB of sources
plus a whole run, and is cleared between runs; 8 distinct sources keep it at that size.
The benchmark needs about 14 GiB of RAM (10 GiB of /dev/shm) while it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

import lmcache_async as lmc
from benchmarks.harness import settle, workers
from harness.real_server import RealLMCacheServer, lmcache_venv_python
from harness.workers import EngineWorker, SDKWorker

CS = 256
GEOMETRY = lmc.KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
MODEL = "bench-remap"
PAIRS = 64  # the default; --pairs
SOURCES = 8
TOKENS = 4 * CS  # 4 chunks per prompt
CONCURRENCY = (1, 4, 16)
ITEM_BYTES = TOKENS * GEOMETRY.bytes_per_token  # 128 MiB


def source_start(k: int) -> int:
    return 1_000_000 + k * 100_000


class Bench:
    def __init__(
        self, srv: RealLMCacheServer, client: lmc.AsyncClient, sdk: SDKWorker, pairs: int = PAIRS
    ) -> None:
        self.pairs = pairs
        self.srv = srv
        self.client = client
        self.sdk = sdk
        gen = torch.Generator().manual_seed(0)
        self.kvs = [
            torch.randn(GEOMETRY.kv_shape(TOKENS), generator=gen, dtype=torch.float32).to(GEOMETRY.dtype)
            for _ in range(SOURCES)
        ]
        self.sources = [list(range(source_start(k), source_start(k) + TOKENS)) for k in range(SOURCES)]
        self.run_id = 0

    def _targets(self) -> list[int]:
        self.run_id += 1
        base = 100_000_000 + self.run_id * 1_000_000
        return [base + i * 10_000 for i in range(self.pairs)]

    async def reset(self) -> None:
        """Clear the L1 and store the sources again (untimed)."""
        req = urllib.request.Request(
            f"{self.srv.http_url}/cache/clear",
            data=json.dumps({"tier": "l1", "force": True}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=60).read())
        result = await self.client.store_many(list(zip(self.kvs, self.sources, strict=True)), concurrency=2)
        assert result.summary.failures == 0 and result.summary.stored_new == SOURCES, result.summary

    async def verify(self, targets: list[int]) -> None:
        """The last four targets hold their sources' KV, bitwise."""
        tail = list(range(self.pairs - 4, self.pairs))
        got = await self.client.retrieve_many([list(range(targets[i], targets[i] + TOKENS)) for i in tail])
        for i, r in zip(tail, got, strict=True):
            assert r.kv is not None and torch.equal(r.kv, self.kvs[i % SOURCES]), f"target {i} differs"

    async def sdk_run(self) -> float:
        await self.reset()
        targets = self._targets()
        pairs = [[source_start(i % SOURCES), targets[i]] for i in range(self.pairs)]
        try:
            reply = await asyncio.to_thread(
                self.sdk.request, "remap", deadline=900, pairs=pairs, num_tokens=TOKENS
            )
        except asyncio.CancelledError:  # Ctrl-C: end the thread's wait now, not at the deadline
            self.sdk._kill()
            raise
        assert (reply["hits"], reply["stored"]) == (self.pairs, self.pairs), reply
        await self.verify(targets)
        return float(reply["elapsed"])

    async def our_run(self, concurrency: int) -> float:
        await self.reset()
        targets = self._targets()
        pairs = [(self.sources[i % SOURCES], list(range(t, t + TOKENS))) for i, t in enumerate(targets)]
        t0 = time.perf_counter()
        result = await self.client.remap_many(
            pairs, concurrency=concurrency, max_bytes_in_flight=concurrency * ITEM_BYTES
        )
        elapsed = time.perf_counter() - t0
        s = result.summary
        assert (s.hits, s.stored_new, s.failures) == (self.pairs, self.pairs, 0), (s, result.failed[:3])
        assert s.bytes_moved == 2 * self.pairs * ITEM_BYTES
        await self.verify(targets)
        return elapsed


async def measure(srv: RealLMCacheServer, python: Path, rounds: int, pairs: int = PAIRS) -> dict[str, Any]:
    """Every round on the running server ``srv`` (SHM, L1 >= 1 GiB + pairs x 128 MiB)."""
    times: dict[str, list[float]] = {"sdk": [], **{f"ours_c{c}": [] for c in CONCURRENCY}}
    ratios: dict[str, list[float]] = {f"ours_c{c}": [] for c in CONCURRENCY}
    with workers(EngineWorker(srv.url, python=python), SDKWorker(python=python, request_timeout=900)) as (
        eng,
        sdk,
    ):
        eng.register(MODEL, 32, 8, 128, block_size=16, num_blocks=32)
        sdk.connect(srv.url, srv.http_url, MODEL, 120.0)
        async with lmc.AsyncClient(srv.url, srv.http_url, MODEL, timeout=300) as client:
            assert client.geometry == GEOMETRY, client.geometry  # from /status
            assert client.transfer == "shm"
            await settle()  # the background SHM warm-up, if any, is over
            bench = Bench(srv, client, sdk, pairs)
            names = ["sdk", *(f"ours_c{c}" for c in CONCURRENCY)]
            for rnd in range(rounds + 1):  # round 0 warms up
                order = names[rnd % len(names) :] + names[: rnd % len(names)]
                got: dict[str, float] = {}
                for name in order:
                    if name == "sdk":
                        got[name] = await bench.sdk_run()
                    else:
                        got[name] = await bench.our_run(int(name.removeprefix("ours_c")))
                line = "  ".join(f"{n} {got[n]:.3f}s" for n in names)
                print(f"  remap: round {rnd}{' (warm-up)' if rnd == 0 else ''}: {line}", file=sys.stderr)
                if rnd:
                    for n in names:
                        times[n].append(got[n])
                    for n in ratios:
                        ratios[n].append(got["sdk"] / got[n])
    return {"times": times, "ratios": ratios}


def server(python: Path, l1_gb: float) -> RealLMCacheServer:
    """The server this benchmark needs (not started): SHM, chunk 256, eviction watermark 0.95."""
    return RealLMCacheServer(
        "shm",
        venv_python=python,
        chunk_size=CS,
        l1_size_gb=l1_gb,
        extra_args=["--eviction-trigger-watermark", "0.95"],
    )


def section(srv: RealLMCacheServer, *, python: Path, rounds: int, pairs: int, l1_gb: float) -> dict[str, Any]:
    """The remap batch on ``srv``; blocks until done (server calls: 300 s deadline, the SDK's
    loop: 900 s)."""
    args = argparse.Namespace(rounds=rounds, pairs=pairs, l1_gb=l1_gb)
    result = summarize(asyncio.run(measure(srv, python, rounds, pairs)), args)
    result["server_version"] = srv.get_json("/lmc_version")
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    python = lmcache_venv_python()
    with server(python, args.l1_gb) as srv:
        return await measure(srv, python, args.rounds, args.pairs)


def summarize(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    run_bytes = 2 * args.pairs * ITEM_BYTES  # retrieved + stored
    for name, ts in data["times"].items():
        med = statistics.median(ts)
        row: dict[str, Any] = {
            "who": name,
            "median_s": round(med, 3),
            "range_s": [round(min(ts), 3), round(max(ts), 3)],
            "pairs_per_s": round(args.pairs / med, 2),
            "gb_per_s": round(run_bytes / med / 1e9, 2),
        }
        if name in data["ratios"]:
            rs = data["ratios"][name]
            row["vs_sdk"] = round(statistics.median(rs), 2)
            row["vs_sdk_range"] = [round(min(rs), 2), round(max(rs), 2)]
        rows.append(row)
    return {
        "pairs": args.pairs,
        "sources": SOURCES,
        "tokens_per_prompt": TOKENS,
        "mib_per_prompt": ITEM_BYTES >> 20,
        "rounds": args.rounds,
        "l1_gb": args.l1_gb,
        "cpus": os.cpu_count(),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (after one warm-up round)")
    parser.add_argument("--pairs", type=int, default=PAIRS, help="remaps per run (>= 4)")
    parser.add_argument("--l1-gb", type=int, default=10, help="server L1 size in GiB (>= 1 + pairs/8)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    result = summarize(asyncio.run(run(args)), args)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{args.pairs} remaps of {TOKENS}-token prompts ({ITEM_BYTES >> 20} MiB of KV each), "
        f"{args.rounds} rounds, medians (range)"
    )
    print(f"{'who':<10}{'run s':>8}{'range s':>16}{'pairs/s':>9}{'GB/s':>7}{'vs SDK':>8}{'range':>14}")
    for r in result["rows"]:
        vs = f"{r['vs_sdk']}x" if "vs_sdk" in r else ""
        vr = f"{r['vs_sdk_range'][0]}-{r['vs_sdk_range'][1]}x" if "vs_sdk_range" in r else ""
        rng = f"{r['range_s'][0]}-{r['range_s'][1]}"
        print(
            f"{r['who']:<10}{r['median_s']:>8}{rng:>16}{r['pairs_per_s']:>9}{r['gb_per_s']:>7}{vs:>8}{vr:>14}"
        )


if __name__ == "__main__":
    main()
