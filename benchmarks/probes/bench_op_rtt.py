"""Where a call's time goes: round trips and copies, one operation at a time.

    python -m benchmarks.probes.bench_op_rtt [--n 300] [--reps 7] [--json out.json]

Run from the repository root with ``lmcache_async`` importable (installed, or
``PYTHONPATH=.``). Starts the embedded server in its own process (``lmcache-async serve``,
SHM, chunk 256, 4 GB pool, prefaulted), geometry 32 layers x 1024 hidden bf16 (one chunk
= 32 MiB), and measures:

* ``noop``: ``AsyncClient.noop()`` and the connection's bare ``call`` vs a blocking pyzmq
  DEALER on the same server (the floor: the server's cost plus the least a client adds),
  rounds alternating; ``end_session`` of an unknown id likewise (a worker-pool handler);
* 1 chunk: ``lookup`` (a hit), ``store`` (fresh tokens) and ``retrieve(out=)`` of a CPU
  tensor and, with CUDA, of a CUDA tensor (whole call, median);
* the phases of a 16-chunk ``store`` and ``retrieve(out=)`` (CPU, and CUDA when there
  is a GPU): every request the operation sends (from the moment it is handed to the
  connection to its reply; ``*``: answered in the background), every copy function and
  the whole call, as offsets from the call's start in ms, median over ``--reps`` calls;
  on CUDA also with each of the grouped store, the background commit of a retrieve and
  the copies enqueued on the loop switched off in turn, and all three (``_before``).

Nothing in the library's files is changed; for the run, the client's channel
(``client._session.channel``) is wrapped by a tracing one, the copy functions of
``lmcache_async._engine.cuda.copies`` / ``lmcache_async._engine.copies`` by timers, and the variants
replace ``lmcache_async._engine.ops.shm.store_groups``, a retrieve's background commit and the
pool's pinned flag.
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
from benchmarks.harness import bare_dealer_rtt, raw_call
from benchmarks.probes.bench_cuda import Tokens
from lmcache_async._protocol.wire import Op

ROOT = Path(__file__).resolve().parents[2]
CS = 256
GEOM = lmc.KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
#: Copy functions timed when they exist (the CUDA module's and the CPU path's).
CUDA_COPY_FUNCS = ("_copy", "_launch", "_wait_copies", "_run_copies", "_staged_to_device", "_encode_staged")
CPU_COPY_FUNCS = ("fill_slots", "copy_chunks_out")


def start_server(pool: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    cmd = [sys.executable, "-m", "lmcache_async", "serve", "--port", "0", "--http-port", "0"]
    cmd += ["--chunk-size", str(CS), "--mode", "shm", "--size", pool, "--prefault", "--json"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError(f"the embedded server did not start: {cmd}")
    return proc, json.loads(line)


# ------------------------------------------------------------------ tracing

#: (name, start, end) in perf_counter seconds, for the call being traced.
EVENTS: list[tuple[str, float, float]] = []


class TracingChannel:
    """Wraps the client's channel: records every request from hand-over to reply."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def usable(self) -> bool:
        return bool(self.inner.usable)

    async def call(self, opcode: Op, args: Sequence[Any], timeout: float | None) -> Any:
        t0 = time.perf_counter()
        try:
            return await self.inner.call(opcode, args, timeout)
        finally:
            EVENTS.append((opcode.name.lower(), t0, time.perf_counter()))

    def post(self, opcode: Op, args: Sequence[Any], timeout: float | None) -> asyncio.Future[Any] | None:
        t0 = time.perf_counter()
        fut: asyncio.Future[Any] | None = self.inner.post(opcode, args, timeout)
        if fut is not None:
            name = opcode.name.lower() + "*"
            fut.add_done_callback(lambda _f: EVENTS.append((name, t0, time.perf_counter())))
        return fut


def trace_client(client: lmc.AsyncClient) -> None:
    """Its later operations send through a :class:`TracingChannel` (a new channel: the
    session builds its operations again)."""
    session = client._session
    session.channel = TracingChannel(session.channel)  # type: ignore[assignment]


def timed_fn(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if asyncio.iscoroutinefunction(fn):

        async def awrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kw)
            finally:
                EVENTS.append((label, t0, time.perf_counter()))

        return awrapper

    def wrapper(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            EVENTS.append((label, t0, time.perf_counter()))

    return wrapper


def time_copies() -> None:
    from lmcache_async._engine import copies as copies

    for name in CPU_COPY_FUNCS:
        setattr(copies, name, timed_fn(f"copy:{name}", getattr(copies, name)))
    if torch.cuda.is_available():
        from lmcache_async._engine.cuda import copies as cuda

        for name in CUDA_COPY_FUNCS:
            if hasattr(cuda, name):
                setattr(cuda, name, timed_fn(f"copy:{name}", getattr(cuda, name)))


async def traced(fn: Callable[[], Awaitable[Any]]) -> tuple[float, list[tuple[str, float, float]]]:
    """Run one call; its length and its events (offsets from its start, seconds). Waits
    for the background replies (``end_session``) before returning, outside the timing."""
    EVENTS.clear()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    await fn()
    t1 = time.perf_counter()
    await asyncio.sleep(0.02)  # the background end_session reply
    events = [(name, a - t0, b - t0) for name, a, b in EVENTS]
    return t1 - t0, events


def phase_table(runs: list[tuple[float, list[tuple[str, float, float]]]]) -> dict[str, Any]:
    """Median whole-call time and, per event (by order of appearance), median start/end."""
    whole = statistics.median(r[0] for r in runs)
    shapes = [tuple(name for name, _, _ in ev) for _, ev in runs]
    common = max(set(shapes), key=shapes.count)
    same = [ev for (_, ev), s in zip(runs, shapes, strict=True) if s == common]
    phases = []
    for i, name in enumerate(common):
        starts = [ev[i][1] for ev in same]
        ends = [ev[i][2] for ev in same]
        phases.append(
            {
                "what": name,
                "start_ms": round(statistics.median(starts) * 1e3, 3),
                "end_ms": round(statistics.median(ends) * 1e3, 3),
                "ms": round(statistics.median(e - s for s, e in zip(starts, ends, strict=True)) * 1e3, 3),
            }
        )
    return {"whole_ms": round(whole * 1e3, 3), "calls": len(runs), "same_shape": len(same), "phases": phases}


# ------------------------------------------------------------------ round trips


async def ours_rtt(
    client: lmc.AsyncClient, op: Op, args: tuple[Any, ...], n: int, *, via_noop: bool
) -> float:
    times = []
    for _ in range(n):
        if via_noop:
            times.append(await client.noop())
        else:
            t0 = time.perf_counter()
            await raw_call(client, op, args, timeout=5)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[n // 5 :])


async def round_trips(client: lmc.AsyncClient, url: str, n: int, rounds: int) -> dict[str, Any]:
    res: dict[str, list[float]] = {}
    for r in range(rounds):
        for side in ("bare", "ours") if r % 2 == 0 else ("ours", "bare"):
            for op, args in ((Op.NOOP, ()), (Op.END_SESSION, ("bench-op-rtt",))):
                name = op.name.lower()
                if side == "bare":
                    t = await asyncio.to_thread(bare_dealer_rtt, url, op, args, n)
                    res.setdefault(f"{name}_bare_dealer_us", []).append(t * 1e6)
                else:
                    t = await ours_rtt(client, op, args, n, via_noop=False)
                    res.setdefault(f"{name}_conn_call_us", []).append(t * 1e6)
                    if op is Op.NOOP:
                        t = await ours_rtt(client, op, args, n, via_noop=True)
                        res.setdefault("noop_client_noop_us", []).append(t * 1e6)
    return {
        k: {"median": round(statistics.median(v), 1), "rounds": [round(x, 1) for x in v]}
        for k, v in res.items()
    }


# ------------------------------------------------------------------ operations


def make_kv(n: int, device: str) -> torch.Tensor:
    return torch.randn(GEOM.kv_shape(n), device=device).to(GEOM.dtype)


async def single_chunk(client: lmc.AsyncClient, toks: Tokens, device: str, reps: int) -> dict[str, Any]:
    kv = make_kv(CS, device)
    out = torch.empty_like(kv)
    stored = toks.fresh(CS)
    await client.store(kv, stored)
    runs: dict[str, list[tuple[float, list[tuple[str, float, float]]]]] = {}
    for _ in range(reps):
        runs.setdefault("lookup", []).append(await traced(lambda: client.lookup(stored)))
        runs.setdefault("store", []).append(await traced(lambda: client.store(kv, toks.fresh(CS))))
        runs.setdefault("retrieve_out", []).append(await traced(lambda: client.retrieve(stored, out=out)))
    got = await client.retrieve(stored, out=out)
    assert got is not None and torch.equal(out, kv)
    return {name: phase_table(r) for name, r in runs.items()}


async def sixteen_chunks(client: lmc.AsyncClient, toks: Tokens, device: str, reps: int) -> dict[str, Any]:
    n = 16 * CS
    kv = make_kv(n, device)
    out = torch.empty_like(kv)
    stored = toks.fresh(n)
    await client.store(kv, stored)
    runs: dict[str, list[tuple[float, list[tuple[str, float, float]]]]] = {}
    for _ in range(reps):
        runs.setdefault("store", []).append(await traced(lambda: client.store(kv, toks.fresh(n))))
        runs.setdefault("retrieve_out", []).append(await traced(lambda: client.retrieve(stored, out=out)))
    out.zero_()
    got = await client.retrieve(stored, out=out)
    assert got is not None and torch.equal(out, kv)
    res: dict[str, Any] = {name: phase_table(r) for name, r in runs.items()}
    res["bytes"] = kv.numel() * kv.element_size()
    return res


def _patch(obj: Any, name: str, value: Any) -> Callable[[], None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    return lambda: setattr(obj, name, old)


def _ungrouped(client: lmc.AsyncClient) -> Callable[[], None]:
    """A CUDA store in one group (one prepare_store, one commit_store)."""
    from lmcache_async._engine.ops import shm

    return _patch(shm, "store_groups", lambda n: [(0, n)])


def _commit_awaited(client: lmc.AsyncClient) -> Callable[[], None]:
    """A CUDA retrieve waits for its commit_retrieve's answer."""
    from lmcache_async._engine.ops import Operations

    return _patch(Operations, "_commit_retrieve_later", lambda self, *a: False)


def _thread_launch(client: lmc.AsyncClient) -> Callable[[], None]:
    """Copies enqueued in a worker thread (the pool is still registered: only the path
    that a pool left unpinned takes is chosen)."""
    from lmcache_async._engine.cuda import copies as cuda

    pool = client._session.pool
    if pool is None or not cuda.pinned(pool):
        return lambda: None
    return _patch(cuda._pin(pool), "pinned", False)


def _all_off(client: lmc.AsyncClient) -> Callable[[], None]:
    undo = [f(client) for f in (_ungrouped, _commit_awaited, _thread_launch)]

    def restore() -> None:
        for u in reversed(undo):
            u()

    return restore


def _plan(sizes: Sequence[int]) -> Callable[[lmc.AsyncClient], Callable[[], None]]:
    """Another split of a CUDA store (group sizes in chunks; for 16 chunks)."""

    def switch(client: lmc.AsyncClient) -> Callable[[], None]:
        from lmcache_async._engine.ops import shm

        bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
        plan = [(bounds[k], bounds[k + 1]) for k in range(len(sizes))]
        return _patch(shm, "store_groups", lambda n: plan if n == bounds[-1] else [(0, n)])

    return switch


#: 16-chunk CUDA variants: each switches one of the changes that overlap round trips with
#: the copy off (``_before``: all three), so their effect is measured in the same run; ``_plan_*``:
#: other splits of the grouped store (the default for 16 chunks: 2, 6, 6, 2).
VARIANTS: dict[str, Callable[[lmc.AsyncClient], Callable[[], None]]] = {
    "": lambda client: lambda: None,
    "_ungrouped": _ungrouped,
    "_commit_awaited": _commit_awaited,
    "_thread_launch": _thread_launch,
    "_before": _all_off,
    "_plan_1_7_7_1": _plan([1, 7, 7, 1]),
    "_plan_1_3_6_6": _plan([1, 3, 6, 6]),
    "_plan_2_14": _plan([2, 14]),
    "_plan_2_4_4_4_2": _plan([2, 4, 4, 4, 2]),
}


async def run(n: int, reps: int, pool: str) -> dict[str, Any]:
    proc, ep = start_server(pool)
    geometry = f"{GEOM.num_layers} layers x 1024 hidden bf16, chunk 256"
    results: dict[str, Any] = {"geometry": geometry, "reps": reps, "n": n, "pool": pool}
    try:
        async with lmc.AsyncClient(
            ep["url"], ep["http_url"], "bench-op-rtt", geometry=GEOM, timeout=120
        ) as client:
            results["round_trips"] = await round_trips(client, ep["url"], n, rounds=4)
            trace_client(client)
            time_copies()
            toks = Tokens(10_000)
            devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
            for device in devices:  # warm up each path (pool pinning, streams, allocator)
                warm = make_kv(CS, device)
                t = toks.fresh(CS)
                await client.store(warm, t)
                await client.retrieve(t, out=warm)
            for device in devices:
                results[f"chunks1_{device}"] = await single_chunk(client, toks, device, reps)
            results["chunks16_cpu"] = await sixteen_chunks(client, toks, "cpu", max(3, reps // 2))
            if torch.cuda.is_available():
                for name, switch in VARIANTS.items():
                    undo = switch(client)
                    try:
                        results[f"chunks16_cuda{name}"] = await sixteen_chunks(client, toks, "cuda", reps)
                    finally:
                        undo()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return results


def summary(res: dict[str, Any]) -> str:
    lines = ["round trips (µs, median of rounds):"]
    for k, v in res["round_trips"].items():
        lines.append(f"  {k:<28}{v['median']:9.1f}")
    for key, block in res.items():
        if not key.startswith("chunks"):
            continue
        for op, table in block.items():
            if op == "bytes":
                continue
            extra = ""
            if "bytes" in block:
                extra = f"  {block['bytes'] / (table['whole_ms'] / 1e3) / 1e9:.1f} GB/s"
            lines.append(f"\n{key} {op}: whole call {table['whole_ms']:.2f} ms{extra}")
            for p in table["phases"]:
                lines.append(
                    f"  {p['what']:<28}{p['start_ms']:8.2f} -> {p['end_ms']:8.2f}  ({p['ms']:.2f} ms)"
                )
    variants = [k for k in res if k.startswith("chunks16_cuda")]
    if variants:
        lines.append("\n16 chunks, CUDA: whole call (ms, GB/s)      store            retrieve_out")
        for k in variants:
            st, rt, nbytes = res[k]["store"]["whole_ms"], res[k]["retrieve_out"]["whole_ms"], res[k]["bytes"]
            lines.append(
                f"  {k[len('chunks16_cuda') :] or '(as shipped)':<36}{st:7.2f} {nbytes / st / 1e6:5.1f}"
                f"     {rt:7.2f} {nbytes / rt / 1e6:5.1f}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300, help="requests per round-trip round")
    ap.add_argument("--reps", type=int, default=7, help="calls per traced operation")
    ap.add_argument("--json", type=Path, default=None, help="write the full results here")
    ap.add_argument(
        "--layers", type=int, default=32, help="layers of the geometry (fewer: a smaller trial run)"
    )
    ap.add_argument("--pool", default="4GB", help="the server's SHM pool size")
    args = ap.parse_args()
    global GEOM
    GEOM = lmc.KVGeometry(
        num_layers=args.layers, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16
    )
    res = asyncio.run(run(args.n, args.reps, args.pool))
    res["torch"] = torch.__version__
    if torch.cuda.is_available():
        res["device"] = torch.cuda.get_device_name(0)
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2))
    print(summary(res))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
