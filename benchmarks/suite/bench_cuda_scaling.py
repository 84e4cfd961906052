"""CUDA stores and retrieves against the link: single calls and concurrency. Needs a GPU.

    python -m benchmarks.suite.bench_cuda_scaling [--reps 5] [--json out.json] [--plot out.png]
        [--phases] [--quick]

Starts the embedded server in its own process (``lmcache-async serve``, SHM, chunk 256,
prefaulted pool), geometry 40 layers x 8 KV heads x 128, fp16: one chunk is
2 x 40 x 256 x 1024 x 2 B = 40 MiB. One ``AsyncClient`` (its pool pinned). In each
repetition, every case in turn (so drift hits them alike):

* ``single``: one ``store(kv_cuda, fresh_tokens)`` and one ``retrieve(tokens, out=kv_cuda)``
  of 1, 4, 16 and 32 chunks (32: 1.25 GiB); the pinned ``copy_`` of the same bytes (D2H, H2D: the link);
  the official SDK's path, ``store(kv.cpu())`` and ``retrieve(tokens).cuda()``, emulated
  through this client (the SDK cannot run on the GPU machine: an upper bound for it);
* ``scaling``: 16 calls of 4 chunks (2.5 GiB), at most 1, 2, 4 or 8 in flight: ``store``
  and ``retrieve(out=)`` from tasks under a semaphore, ``store_many(concurrency=c)`` and
  ``retrieve_many(concurrency=c, device="cuda")``; against 16 pinned copies of the same
  bytes one after the other.

Every timed call ends with its data in place. GB/s = bytes / median time (1 GB = 1e9 B);
``pct`` = GB/s over the pinned copy of the same direction measured in the same repetition
set. After the timed rounds every stored target is read back and compared bitwise.

``--phases``: one extra instrumented pass per concurrency (not part of the figures): the
client's own phases per store and retrieve (its requests, copy enqueue, copy wait), the
loop thread's and the server's CPU time per call, and the GPU time of the copies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import lmcache_async as lmc
from benchmarks.probes.bench_cuda import Tokens, start_server

ROOT = Path(__file__).resolve().parents[2]

CS = 256
GEOM = lmc.KVGeometry(num_layers=40, num_kv_heads=8, head_dim=128, dtype=torch.float16, block_size=16)
SINGLE_CHUNKS = (1, 4, 16, 32)  # 32 chunks: 1.25 GiB, one call of at least 1 GiB
CONCURRENCY = (1, 2, 4, 8)
CALLS = 16
CALL_CHUNKS = 4


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def timed(device: torch.device, fn: Callable[[], Awaitable[Any]]) -> float:
    sync(device)
    t0 = time.perf_counter()
    await fn()
    sync(device)
    return time.perf_counter() - t0


def timed_sync(device: torch.device, fn: Callable[[], Any]) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def random_kv(n_tokens: int, device: torch.device) -> torch.Tensor:
    return torch.randn(GEOM.kv_shape(n_tokens), device=device).to(GEOM.dtype)


async def bounded(limit: int, fns: Sequence[Callable[[], Awaitable[Any]]]) -> list[Any]:
    sem = asyncio.Semaphore(limit)

    async def one(fn: Callable[[], Awaitable[Any]]) -> Any:
        async with sem:
            return await fn()

    return await asyncio.gather(*(one(f) for f in fns))


# ----------------------------------------------------------------------------- phases


class Phases:
    """Wrappers around the client's request and copy functions that record, per call
    task, the time spent in each (for ``--phases``); installed once, active only while
    ``self.on``."""

    def __init__(self) -> None:
        self.on = False
        self.spans: list[tuple[int, str, float, float]] = []
        self.gpu: list[tuple[torch.cuda.Event, list[torch.cuda.Event], int]] = []

    def install(self) -> None:
        from lmcache_async._engine.cuda import copies as cuda
        from lmcache_async._engine.ops.base import OperationsBase

        phases = self
        call = OperationsBase.call

        async def timed_call(self_: Any, op: Any, name: Any, *args: Any, **kw: Any) -> Any:
            if not phases.on:
                return await call(self_, op, name, *args, **kw)
            t0 = time.perf_counter()
            try:
                return await call(self_, op, name, *args, **kw)
            finally:
                phases.record(f"rpc:{getattr(name, 'name', name)}", t0)

        OperationsBase.call = timed_call  # type: ignore[method-assign, assignment]
        launch, wait, copy = cuda._launch, cuda._wait_copies, cuda._copy

        def timed_launch(pairs: Any, mark: Any, keep_alive: Any) -> Any:
            if not phases.on:
                return launch(pairs, mark, keep_alive)
            t0 = time.perf_counter()
            st = cuda._state(mark.device)
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(st.streams[0])
            done = launch(pairs, mark, keep_alive)
            ends = []
            for s in st.streams:
                e = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                e.record(s)
                ends.append(e)
            nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)
            phases.gpu.append((start, ends, nbytes))
            phases.record("copy_enqueue(loop)", t0)
            return done

        def timed_wait(done: Any) -> None:
            t0 = time.perf_counter()
            try:
                wait(done)
            finally:
                if phases.on:
                    phases.spans.append((-1, "copy_wait(thread)", t0, time.perf_counter()))

        async def timed_copy(*args: Any, **kw: Any) -> None:
            if not phases.on:
                return await copy(*args, **kw)
            t0 = time.perf_counter()
            try:
                await copy(*args, **kw)
            finally:
                phases.record("copy(total, awaited)", t0)

        cuda._launch = timed_launch
        cuda._wait_copies = timed_wait
        cuda._copy = timed_copy

    def record(self, name: str, t0: float) -> None:
        task = asyncio.current_task()
        self.spans.append((id(task) if task else 0, name, t0, time.perf_counter()))

    def summary(self, calls: int, wall: float) -> dict[str, Any]:
        per: dict[str, list[float]] = {}
        for _, name, a, b in self.spans:
            per.setdefault(name, []).append(b - a)
        torch.cuda.synchronize()
        gpu_ms = [max(s.elapsed_time(e) for e in ends) for s, ends, _ in self.gpu]
        out: dict[str, Any] = {
            name: {"count": len(v), "total_ms": sum(v) * 1e3, "median_ms": statistics.median(v) * 1e3}
            for name, v in sorted(per.items())
        }
        out["gpu_copy_per_launch_ms"] = statistics.median(gpu_ms) if gpu_ms else None
        out["calls"] = calls
        out["wall_ms"] = wall * 1e3
        return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- the run


async def verify(
    c: lmc.AsyncClient, device: torch.device, pairs: Sequence[tuple[list[int], torch.Tensor]]
) -> int:
    """Read every ``(tokens, kv)`` back (untimed) and compare bitwise; the count checked."""
    for tk, kv in pairs:
        got = await c.retrieve(tk, device=device)
        assert got is not None, "a stored target is not in the cache"
        assert torch.equal(got, kv), "a stored target reads back wrong"
    return len(pairs)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    calls = CALLS
    scaling_bytes = calls * CALL_CHUNKS * GEOM.bytes_per_token * CS
    proc, ep = start_server("shm", args.pool)
    res: dict[str, Any] = {
        "geometry": "40 layers x 8 KV heads x 128, fp16, chunk 256 (40 MiB a chunk)",
        "reps": args.reps,
        "single": {},
        "scaling": {},
    }
    phases = Phases()
    if args.phases:
        phases.install()
    try:
        async with lmc.AsyncClient(ep["url"], ep["http_url"], "bench", geometry=GEOM, timeout=120) as c:
            toks = Tokens(1000)
            warm = random_kv(CS, device)
            t = toks.fresh(CS)
            await c.store(warm, t)
            await c.retrieve(t, out=warm)
            checked = [0]
            sections = args.sections.split(",")
            if "single" in sections:
                res["single"] = await single(c, device, toks, args.reps, checked)
            if "scaling" in sections:
                res["scaling"] = await scaling(c, device, toks, args.reps, checked, calls)
            res["scaling_bytes"] = scaling_bytes
            if args.phases:
                res["phases"] = await phase_pass(c, device, toks, calls, phases, proc.pid)
            res["bitwise_checked"] = checked[0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return res


def gbps(nbytes: int, ts: list[float]) -> dict[str, float]:
    med = statistics.median(ts)
    return {"median_s": med, "min_s": min(ts), "max_s": max(ts), "gbps": nbytes / med / 1e9}


async def single(
    c: lmc.AsyncClient,
    device: torch.device,
    toks: Tokens,
    reps: int,
    checked: list[int],
) -> dict[str, Any]:
    return {f"chunks{k}": await single_size(c, device, toks, reps, checked, k) for k in SINGLE_CHUNKS}


async def single_size(
    c: lmc.AsyncClient, device: torch.device, toks: Tokens, reps: int, checked: list[int], chunks: int
) -> dict[str, Any]:
    n = chunks * CS
    kv = random_kv(n, device)
    nbytes = kv.numel() * kv.element_size()
    dst = torch.empty_like(kv)
    stored = toks.fresh(n)
    await c.store(kv, stored)
    pinned = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=device.type == "cuda")
    times: dict[str, list[float]] = {}

    def add(name: str, t: float) -> None:
        times.setdefault(name, []).append(t)

    async def sdk_retrieve() -> None:
        got = await c.retrieve(stored)
        assert got is not None
        got.to(device)

    last: list[list[int]] = []

    async def store_fresh() -> None:
        t = toks.fresh(n)
        last.append(t)
        assert await c.store(kv, t)

    for _ in range(reps):
        add("pinned_d2h", timed_sync(device, lambda: pinned.copy_(kv, non_blocking=True)))
        add("pinned_h2d", timed_sync(device, lambda: dst.copy_(pinned, non_blocking=True)))
        add("store", await timed(device, store_fresh))
        add("retrieve_out", await timed(device, lambda: c.retrieve(stored, out=dst)))
        add("sdk_store", await timed(device, lambda: c.store(kv.cpu(), toks.fresh(n))))
        add("sdk_retrieve", await timed(device, sdk_retrieve))
    checked[0] += await verify(c, device, [(last[-1], kv), (stored, kv)])
    assert torch.equal(dst, kv)
    row: dict[str, Any] = {name: gbps(nbytes, ts) for name, ts in times.items()}
    row["bytes"] = nbytes
    for name in ("store", "sdk_store"):
        row[name]["pct"] = row[name]["gbps"] / row["pinned_d2h"]["gbps"]
    for name in ("retrieve_out", "sdk_retrieve"):
        row[name]["pct"] = row[name]["gbps"] / row["pinned_h2d"]["gbps"]
    return row


async def scaling(
    c: lmc.AsyncClient,
    device: torch.device,
    toks: Tokens,
    reps: int,
    checked: list[int],
    calls: int,
) -> dict[str, Any]:
    n = CALL_CHUNKS * CS
    kvs = [random_kv(n, device) for _ in range(calls)]
    outs = [torch.empty_like(kv) for kv in kvs]
    nbytes = calls * kvs[0].numel() * kvs[0].element_size()
    stored = [toks.fresh(n) for _ in range(calls)]
    for kv, tk in zip(kvs, stored, strict=True):
        await c.store(kv, tk)
    pinned = [torch.empty(kv.shape, dtype=kv.dtype, pin_memory=device.type == "cuda") for kv in kvs]
    times: dict[str, list[float]] = {}

    def add(name: str, t: float) -> None:
        times.setdefault(name, []).append(t)

    def d2h() -> None:
        for p, kv in zip(pinned, kvs, strict=True):
            p.copy_(kv, non_blocking=True)

    def h2d() -> None:
        for o, p in zip(outs, pinned, strict=True):
            o.copy_(p, non_blocking=True)

    for rep in range(reps):
        check = rep == reps - 1  # the last repetition's stores are read back (untimed)
        add("pinned_d2h", timed_sync(device, d2h))
        add("pinned_h2d", timed_sync(device, h2d))
        for conc in CONCURRENCY:
            fresh = [toks.fresh(n) for _ in range(calls)]

            async def stores(fresh: list[list[int]] = fresh, conc: int = conc) -> None:
                done = await bounded(
                    conc,
                    [lambda kv=kv, t=t: c.store(kv, t) for kv, t in zip(kvs, fresh, strict=True)],  # type: ignore[misc]
                )
                assert all(done)

            add(f"store_c{conc}", await timed(device, stores))
            if check:
                checked[0] += await verify(c, device, list(zip(fresh, kvs, strict=True)))

            async def retrieves(conc: int = conc) -> None:
                got = await bounded(
                    conc,
                    [lambda t=t, o=o: c.retrieve(t, out=o) for t, o in zip(stored, outs, strict=True)],  # type: ignore[misc]
                )
                assert all(g is not None for g in got)

            add(f"retrieve_out_c{conc}", await timed(device, retrieves))

            fresh_many = [toks.fresh(n) for _ in range(calls)]

            async def store_many(fresh: list[list[int]] = fresh_many, conc: int = conc) -> None:
                r = await c.store_many(list(zip(kvs, fresh, strict=True)), concurrency=conc)
                assert r.summary.failures == 0 and r.summary.stored_new == calls, r.summary

            add(f"store_many_c{conc}", await timed(device, store_many))
            if check:
                checked[0] += await verify(c, device, list(zip(fresh_many, kvs, strict=True)))

            async def retrieve_many(conc: int = conc) -> None:
                r = await c.retrieve_many(stored, concurrency=conc, device=device)
                assert r.summary.failures == 0 and r.summary.hits == calls, r.summary

            add(f"retrieve_many_c{conc}", await timed(device, retrieve_many))
    for o, kv in zip(outs, kvs, strict=True):
        assert torch.equal(o, kv)
    row: dict[str, Any] = {name: gbps(nbytes, ts) for name, ts in times.items()}
    for name, v in row.items():
        if name.startswith("store"):
            v["pct"] = v["gbps"] / row["pinned_d2h"]["gbps"]
        elif name.startswith("retrieve"):
            v["pct"] = v["gbps"] / row["pinned_h2d"]["gbps"]
    row["bytes"] = nbytes
    return row


async def phase_pass(
    c: lmc.AsyncClient, device: torch.device, toks: Tokens, calls: int, phases: Phases, server_pid: int
) -> dict[str, Any]:
    """One instrumented pass per concurrency, stores then retrieves."""
    n = CALL_CHUNKS * CS
    kvs = [random_kv(n, device) for _ in range(calls)]
    outs = [torch.empty_like(kv) for kv in kvs]
    stored = [toks.fresh(n) for _ in range(calls)]
    for kv, tk in zip(kvs, stored, strict=True):
        await c.store(kv, tk)
    big = random_kv(16 * CS, device)
    big_out = torch.empty_like(big)
    big_stored = toks.fresh(16 * CS)
    await c.store(big, big_stored)
    out: dict[str, Any] = {}
    for conc in (0, *CONCURRENCY):  # 0: one 16-chunk call, alone (four times in a row)
        for kind in ("store", "retrieve_out"):
            fresh = [toks.fresh(n) for _ in range(calls)]
            fns: list[Callable[[], Awaitable[Any]]]
            if conc == 0 and kind == "store":
                fns = [lambda: c.store(big, toks.fresh(16 * CS)) for _ in range(4)]
            elif conc == 0:
                fns = [lambda: c.retrieve(big_stored, out=big_out) for _ in range(4)]
            elif kind == "store":
                fns = [lambda kv=kv, t=t: c.store(kv, t) for kv, t in zip(kvs, fresh, strict=True)]  # type: ignore[misc]
            else:
                fns = [lambda t=t, o=o: c.retrieve(t, out=o) for t, o in zip(stored, outs, strict=True)]  # type: ignore[misc]
            phases.spans.clear()
            phases.gpu.clear()
            sync(device)
            s0, l0 = cpu_seconds(server_pid), time.thread_time()
            p0 = time.process_time()
            phases.on = True
            t0 = time.perf_counter()
            await bounded(max(conc, 1), fns)
            sync(device)
            wall = time.perf_counter() - t0
            phases.on = False
            summary = phases.summary(len(fns), wall)
            summary["loop_thread_cpu_ms_per_call"] = (time.thread_time() - l0) * 1e3 / len(fns)
            summary["process_cpu_ms_per_call"] = (time.process_time() - p0) * 1e3 / len(fns)
            summary["server_cpu_ms_per_call"] = (cpu_seconds(server_pid) - s0) * 1e3 / len(fns)
            out[f"{kind}_16chunks_alone" if conc == 0 else f"{kind}_c{conc}"] = summary
    return out


# ----------------------------------------------------------------------------- output


def table(res: dict[str, Any]) -> str:
    lines = []
    for key, row in res.get("single", {}).items():
        lines.append(f"\nsingle call, {key} ({row['bytes'] / 2**20:.0f} MiB)      GB/s   % link   median ms")
        for name, v in row.items():
            if name == "bytes":
                continue
            pct = f"{v['pct'] * 100:6.0f}%" if "pct" in v else "       "
            lines.append(f"  {name:<28}{v['gbps']:7.1f}  {pct}  {v['median_s'] * 1e3:9.2f}")
    row = res.get("scaling") or {"bytes": 0}
    lines.append(f"\n{CALLS} calls of {CALL_CHUNKS} chunks ({row['bytes'] / 2**30:.2f} GiB)   GB/s   % link")
    for name, v in row.items():
        if name == "bytes":
            continue
        pct = f"{v['pct'] * 100:6.0f}%" if "pct" in v else "       "
        lines.append(f"  {name:<28}{v['gbps']:7.1f}  {pct}")
    if "phases" in res:
        lines.append("\nphases (one instrumented pass; ms)")
        for key, s in res["phases"].items():
            lines.append(
                f"  {key}: wall {s['wall_ms']:.1f} ({s['wall_ms'] / s['calls']:.2f}/call), loop CPU "
                f"{s['loop_thread_cpu_ms_per_call']:.2f}/call, process CPU {s['process_cpu_ms_per_call']:.2f}/call, "
                f"server CPU {s['server_cpu_ms_per_call']:.2f}/call, GPU copy/launch {s['gpu_copy_per_launch_ms']}"
            )
            for name, v in s.items():
                if isinstance(v, dict):
                    lines.append(
                        f"      {name:<26} n={v['count']:<4} median {v['median_ms']:7.3f}  total {v['total_ms']:8.2f}"
                    )
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row = res["scaling"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in (
        ("store", "o-"),
        ("store_many", "s--"),
        ("retrieve_out", "^-"),
        ("retrieve_many", "v--"),
    ):
        ys = [row[f"{name}_c{c}"]["gbps"] for c in CONCURRENCY]
        ax.plot(CONCURRENCY, ys, style, label=name)
    ax.axhline(row["pinned_d2h"]["gbps"], color="gray", lw=1, ls=":", label="pinned copy D2H")
    ax.axhline(row["pinned_h2d"]["gbps"], color="black", lw=1, ls=":", label="pinned copy H2D")
    ax.set_xscale("log", base=2)
    ax.set_xticks(CONCURRENCY, [str(c) for c in CONCURRENCY])
    ax.set_xlabel("calls in flight (16 calls of 4 chunks, 40 MiB a chunk)")
    ax.set_ylabel("GB/s")
    ax.set_ylim(0, None)
    ax.set_title(f"CUDA tensors on {res.get('device', '?')}, one AsyncClient, embedded server")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="write the full results here")
    ap.add_argument("--plot", type=Path, default=None, help="GB/s against concurrency (needs matplotlib)")
    ap.add_argument("--phases", action="store_true", help="add one instrumented pass per concurrency")
    ap.add_argument("--pool", default="24GB", help="the embedded server's pool size")
    ap.add_argument(
        "--from-json", type=Path, default=None, help="print (and plot) an earlier run's JSON; run nothing"
    )
    ap.add_argument("--sections", default="single,scaling", help="comma-separated: single, scaling")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: dry run of the script
    args = ap.parse_args()
    if args.from_json is not None:
        res = json.loads(args.from_json.read_text())
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            sys.exit("bench_cuda_scaling needs a CUDA GPU")
        res = asyncio.run(run(args))
        if torch.cuda.is_available():
            res["device"] = torch.cuda.get_device_name(0)
        res["torch"] = torch.__version__
        res["measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        res["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2))
    print(table(res))
    if args.plot is not None:
        plot(res, args.plot)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
