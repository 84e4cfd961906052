"""CUDA tensors in and out: our client vs the link, the SDK's path, a pinned vs an unpinned
pool. Needs a CUDA GPU.

    python -m benchmarks.probes.bench_cuda [--reps 7] [--json out.json]

Starts the embedded server in its own process (``lmcache-async serve``, SHM, chunk 256,
4 GB pool, prefaulted; and a pickle one), geometry 32 layers x 8 KV heads x 128 (1024
hidden), bf16: one chunk is 2 x 32 x 256 x 1024 x 2 B = 32 MiB; 1 and 16 chunks
(512 MiB). In each repetition, in turn (so drift hits every variant alike):

* ``raw_pinned_h2d/d2h`` and ``raw_pageable_h2d/d2h``: one ``copy_`` of the same bytes
  between a CUDA tensor and a pinned / pageable host tensor (the limits);
  ``raw_pool_h2d``: the same from the registered SHM pool itself;
* ``store`` / ``retrieve_out``: ``store(kv_cuda, fresh_tokens)`` and
  ``retrieve(tokens, out=kv_cuda)`` through a client whose pool is pinned
  (``cudaHostRegister``), and the same through a client whose pool is left unpinned;
* ``sdk_store`` / ``sdk_retrieve``: the official SDK's path, ``store(kv.cpu())`` and
  ``retrieve(tokens).cuda()``. The SDK itself cannot run on the GPU machine (no lmcache
  there), so it is emulated through OUR client, which is faster than the SDK on the CPU
  part (docs/benchmarks.md): an upper bound for the SDK;
* pickle transport: ``store`` / ``retrieve_out`` of CUDA tensors (pinned staging).

Each timed call ends with its data in place (our calls synchronise before returning; the
raw copies and the SDK path are synchronised). GB/s = bytes / median time (1 GB = 1e9 B).

Internals it reaches: the client's SHM pool (``client._session.pool``: pinned by hand,
marked unpinned, read raw), and the copy functions and stream count of
``lmcache_async._engine.cuda.copies`` (wrapped by timers, called alone).
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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

import lmcache_async as lmc
from lmcache_async._protocol.payload.pickle_tensors import encode_tensor_list
from lmcache_async._protocol.wire import GEN_0_5_6

ROOT = Path(__file__).resolve().parents[2]

CS = 256
GEOM = lmc.KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)


def start_server(mode: str, size: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    cmd = [sys.executable, "-m", "lmcache_async", "serve", "--port", "0", "--http-port", "0"]
    cmd += ["--chunk-size", str(CS), "--mode", mode, "--size", size, "--json"]
    if mode == "shm":
        cmd.append("--prefault")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError(f"the embedded server did not start: {cmd}")
    return proc, json.loads(line)


#: (start, end) of each CUDA copy during the current timed call (filled by the wrappers
#: installed by :func:`time_copies`): splits a call into copy and protocol.
COPY_SECONDS: list[tuple[float, float]] = []


def copy_time() -> float:
    """Seconds covered by the copies of the current call (overlapping ones counted once)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(COPY_SECONDS):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def time_copies() -> None:
    """Wrap the worker-thread copy functions of lmcache_async._engine.cuda.copies with timers."""
    from lmcache_async._engine.cuda import copies as cuda

    def timed_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                COPY_SECONDS.append((t0, time.perf_counter()))

        return wrapper

    def timed_async(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kw)
            finally:
                COPY_SECONDS.append((t0, time.perf_counter()))

        return wrapper

    # _copy: an SHM copy (enqueued on the loop, waited for in a thread); the other two
    # run in a worker thread. A grouped store's copies overlap: its copy part is their union.
    cuda._copy = timed_async(cuda._copy)  # type: ignore[assignment]
    for name in ("_staged_to_device", "_encode_staged"):
        setattr(cuda, name, timed_fn(getattr(cuda, name)))


def own_pinned_shm(nbytes: int) -> tuple[Any, str]:
    """A /dev/shm segment of our own, mapped and registered as the client maps and pins
    the server's pool: raw copies into it show the registered-tmpfs limit both ways."""
    from lmcache_async._engine.cuda import copies as cuda
    from lmcache_async._transport.shm import ShmPool

    name = f"lmca_bench_{os.getpid()}"
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    pool = ShmPool(name, nbytes)
    assert cuda.pin_pool(pool)
    return pool, path


class Tokens:
    def __init__(self, base: int) -> None:
        self.next = base

    def fresh(self, n: int) -> list[int]:
        t = list(range(self.next, self.next + n))
        self.next += n
        return t


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    await fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def timed_sync(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


async def run(reps: int) -> dict[str, Any]:
    shm_proc, shm_ep = start_server("shm", "4GB")
    pk_proc, pk_ep = start_server("pickle", "3GB")
    results: dict[str, Any] = {"geometry": "32 layers x 1024 hidden bf16, chunk 256", "reps": reps}
    try:

        def client(ep: dict[str, Any], name: str) -> lmc.AsyncClient:
            return lmc.AsyncClient(ep["url"], ep["http_url"], name, geometry=GEOM, timeout=120)

        async with (
            client(shm_ep, "pinned") as pinned,
            client(shm_ep, "unpinned") as unpinned,
            client(pk_ep, "pickle") as pickled,
        ):
            from lmcache_async._engine.cuda import copies as cuda

            time_copies()
            pinned_pool, unpinned_pool = pinned._session.pool, unpinned._session.pool
            assert pinned_pool is not None and unpinned_pool is not None
            cuda._pin(unpinned_pool).pinned = False  # as if cudaHostRegister had failed
            toks = Tokens(1000)
            # Warm up: CUDA context, streams, pool registration (timed), allocator.
            warm = torch.randn(GEOM.kv_shape(CS), device="cuda").to(GEOM.dtype)

            t0 = time.perf_counter()
            await asyncio.to_thread(cuda.pin_pool, pinned_pool)
            results["pin_pool_s"] = time.perf_counter() - t0
            results["pool_bytes"] = pinned_pool.pool_size
            for c in (pinned, unpinned, pickled):
                t = toks.fresh(CS)
                await c.store(warm, t)
                await c.retrieve(t, out=warm)
                await c.store(warm.cpu(), toks.fresh(CS))
            for chunks in (1, 16):
                results[f"chunks{chunks}"] = await bench_chunks(chunks, reps, pinned, unpinned, pickled, toks)
                torch.cuda.empty_cache()
    finally:
        for p in (shm_proc, pk_proc):
            p.terminate()
            p.wait(timeout=30)
    return results


async def bench_chunks(
    chunks: int,
    reps: int,
    pinned: lmc.AsyncClient,
    unpinned: lmc.AsyncClient,
    pickled: lmc.AsyncClient,
    toks: Tokens,
) -> dict[str, Any]:
    """One size: every variant once per repetition, in turn."""
    n = chunks * CS
    kv = torch.randn(GEOM.kv_shape(n), device="cuda").to(GEOM.dtype)
    nbytes = kv.numel() * kv.element_size()
    out = torch.empty_like(kv)
    dev = torch.empty_like(kv)  # the raw copies' device side (kv stays what was stored)
    host_pinned = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
    host_page = torch.empty(kv.shape, dtype=kv.dtype)
    host_page.fill_(1)  # touch the pages
    pool = pinned._session.pool
    assert pool is not None and pool._base is not None
    pool_bytes = pool._base[:nbytes]
    dev_bytes = dev.view(-1).view(torch.uint8)
    times: dict[str, list[float]] = {}
    clients = {"pinned": pinned, "unpinned": unpinned, "pickle": pickled}
    stored: dict[str, list[int]] = {}
    for key, c in clients.items():
        stored[key] = toks.fresh(n)
        await c.store(kv, stored[key])
    sdk_t = toks.fresh(n)
    await pinned.store(kv.cpu(), sdk_t)

    def add(name: str, t: float) -> None:
        times.setdefault(name, []).append(t)

    async def sdk_retrieve() -> None:
        got = await pinned.retrieve(sdk_t)
        assert got is not None
        got.cuda()

    async def sdk_store() -> None:
        await pinned.store(kv.cpu(), toks.fresh(n))

    shm_pool, shm_path = own_pinned_shm(nbytes)
    assert shm_pool._base is not None
    reg_shm = shm_pool._base[:nbytes]
    kv_bytes = kv.view(-1).view(torch.uint8)

    async def ours(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        COPY_SECONDS.clear()
        add(name, await timed(fn))
        add(f"{name}__copy_part", copy_time())

    from lmcache_async._engine.cuda import copies as cuda

    slot_shape = GEOM.kv_shape(CS)
    slot_bytes = kv_bytes.numel() // chunks
    slots = [
        reg_shm[i * slot_bytes : (i + 1) * slot_bytes].view(GEOM.dtype).view(slot_shape)
        for i in range(chunks)
    ]
    kv_chunks = [kv.narrow(GEOM.token_axis, i * CS, CS) for i in range(chunks)]
    out_chunks = [out.narrow(GEOM.token_axis, i * CS, CS) for i in range(chunks)]

    def direct(streams: int, d2h: bool) -> float:
        """cuda._run_copies alone (the client's copy, no protocol), with 1 or 2 streams."""
        if streams != cuda._STREAMS_PER_DEVICE:
            cuda._STREAMS_PER_DEVICE = streams  # type: ignore[misc]
            cuda._STATES.clear()
        mark = cuda.caller_mark(kv.device)
        pairs = list(zip(slots, kv_chunks, strict=True)) if d2h else list(zip(out_chunks, slots, strict=True))
        return timed_sync(lambda: cuda._run_copies(pairs, mark, []))

    mark0 = cuda.caller_mark(kv.device)

    def encode_direct() -> None:  # without staging: pageable D2H straight into the frame
        encode_tensor_list(kv_chunks)

    def encode_staged() -> None:  # now: through the reused pinned staging buffers
        cuda._encode_staged(GEN_0_5_6, kv_chunks, mark0)

    # SHM and the limits first, every variant once per repetition; the pickle transport
    # (slow on the embedded server) in a loop of its own afterwards, so that its load does
    # not inflate the SHM round trips.
    for _ in range(reps):
        for streams in (1, 2):
            add(f"direct_d2h_streams{streams}", direct(streams, True))
            add(f"direct_h2d_streams{streams}", direct(streams, False))
        add("raw_regshm_d2h", timed_sync(lambda: reg_shm.copy_(kv_bytes, non_blocking=True)))
        add("raw_regshm_h2d", timed_sync(lambda: dev_bytes.copy_(reg_shm, non_blocking=True)))
        add("raw_pinned_h2d", timed_sync(lambda: dev.copy_(host_pinned, non_blocking=True)))
        add("raw_pinned_d2h", timed_sync(lambda: host_pinned.copy_(kv, non_blocking=True)))
        add("raw_pageable_h2d", timed_sync(lambda: dev.copy_(host_page)))
        add("raw_pageable_d2h", timed_sync(lambda: host_page.copy_(kv)))
        # Reading the registered pool itself (a read: the server's objects stay intact).
        add("raw_pool_h2d", timed_sync(lambda: dev_bytes.copy_(pool_bytes, non_blocking=True)))
        for key in ("pinned", "unpinned"):
            c = clients[key]
            add("noop_rtt", await pinned.noop())
            await ours(f"shm_{key}_store", lambda c=c: c.store(kv, toks.fresh(n)))  # type: ignore[misc]
            add("noop_rtt", await pinned.noop())
            await ours(f"shm_{key}_retrieve_out", lambda c=c, key=key: c.retrieve(stored[key], out=out))  # type: ignore[misc]
        add("sdk_store", await timed(sdk_store))
        add("sdk_retrieve", await timed(sdk_retrieve))
    for _ in range(max(2, reps // 2)):
        add("pickle_encode_direct", timed_sync(encode_direct))
        add("pickle_encode_staged", timed_sync(encode_staged))
        await ours("pickle_store", lambda: pickled.store(kv, toks.fresh(n)))
        await ours("pickle_retrieve_out", lambda: pickled.retrieve(stored["pickle"], out=out))
    shm_pool.close()
    os.unlink(shm_path)
    for key, c in clients.items():  # bitwise check of each kind
        got = await c.retrieve(stored[key], out=out)
        assert got is not None and torch.equal(out, kv), key
    row: dict[str, Any] = {"bytes": nbytes}
    for name, ts in times.items():
        med = statistics.median(ts)
        gbps = nbytes / med / 1e9 if med > 0 and name != "noop_rtt" else None
        row[name] = {"median_s": med, "gbps": gbps, "min_s": min(ts), "max_s": max(ts)}
    return row


def summary(res: dict[str, Any]) -> str:
    lines = [f"pool pin (cudaHostRegister of {res['pool_bytes'] / 2**30:.1f} GiB): {res['pin_pool_s']:.3f} s"]
    for chunks in (1, 16):
        row = res[f"chunks{chunks}"]
        mib = row["bytes"] / 2**20
        lines.append(f"\n{chunks} chunk(s), {mib:.0f} MiB          GB/s   median ms")
        for name, v in row.items():
            if name == "bytes":
                continue
            gbps = "    -  " if v["gbps"] is None else f"{v['gbps']:7.1f}"
            lines.append(f"  {name:<34}{gbps}  {v['median_s'] * 1e3:9.2f}")
        g = {k: v["gbps"] for k, v in row.items() if k != "bytes" and v["gbps"]}
        lines.append(
            f"  retrieve_out / pinned H2D = {g['shm_pinned_retrieve_out'] / g['raw_pinned_h2d']:.2f}; "
            f"store / pinned D2H = {g['shm_pinned_store'] / g['raw_pinned_d2h']:.2f}; "
            f"vs SDK path: retrieve x{g['shm_pinned_retrieve_out'] / g['sdk_retrieve']:.1f}, "
            f"store x{g['shm_pinned_store'] / g['sdk_store']:.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None, help="write the full results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda.py needs a CUDA GPU")
    res = asyncio.run(run(args.reps))
    res["device"] = torch.cuda.get_device_name(0)
    res["torch"] = torch.__version__
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2))
    print(summary(res))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
