"""A store into pool pages nobody has written yet: where its time goes, by phase.

    .venv/bin/python -m benchmarks.probes.bench_shm_holes [--chunks 1] [--rounds 7] [--allocated] [--json]

A server started CPU-only creates its pool with ``ftruncate`` and never touches it: a slot
that no store has used yet is a hole of the tmpfs segment, and the first write to each of
its 4 KiB pages allocates and zeroes a page of the page cache and maps it (a fault). This
probe writes ``--chunks`` chunks of 32 MiB (the layout of the suite: ``[2, 32, T, 1024]``
bf16, chunk ``i`` the token slice ``[:, :, 256 i : 256 (i+1)]``) into such pages of a
fresh ``/dev/shm`` segment, mapped afresh, in each of these ways:

* ``warm``: the same copy into pages already allocated and mapped (the floor);
* ``sdk``: ``slot.copy_(chunk)`` with nothing before (the official SDK's store: write
  faults, shared by torch's intra-op threads);
* ``populate_read``: ``madvise(MADV_POPULATE_READ)`` over the slots, then ``copy_`` (the
  client before this probe);
* ``populate_write``: ``madvise(MADV_POPULATE_WRITE)``, then ``copy_``;
* ``fallocate``: ``fallocate`` on the segment's descriptor (allocates the pages in one
  call, maps nothing), then ``copy_``;
* ``split``: the slots' bytes cut in two, each half populated (``MADV_POPULATE_WRITE``)
  and copied by a thread of its own; ``split_read``: the same with ``MADV_POPULATE_READ``;
* ``pwritev``: no page mapped at all, the bytes written through the segment's descriptor
  (``os.pwritev``, one iovec per contiguous run of the source) by two threads;
* ``client``: the client's own store copy (``lmcache_async._engine.copies.fill_slots`` over an
  ``lmcache_async._transport.shm.ShmPool`` of the segment).

Each case reports its median time, the share of its phases (the preparation, the copy),
and the minor faults of the process during it (``getrusage``). The cases alternate within
each round. Linux 5.14 or later (the populate advice).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from lmcache_async._base import host_copy as host_copy
from lmcache_async._engine import copies as copies
from lmcache_async._transport.shm import ShmPool

MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
TOKENS = 256
SHAPE = (2, 32, TOKENS, 1024)
CHUNK = 2 * 32 * TOKENS * 1024 * 2  # bytes of a chunk (bf16)
CASES = (
    "warm",
    "sdk",
    "populate_read",
    "populate_write",
    "fallocate",
    "split",
    "split_read",
    "pwritev",
    "client",
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--allocated",
        action="store_true",
        help="the pages exist (written once through another mapping) but this mapping never touched them",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    madvise = host_copy.madvise
    if madvise is None:
        parser.error("needs Linux (madvise)")
    n = args.chunks
    size = n * CHUNK
    kv = torch.randn(2, 32, n * TOKENS, 1024).to(torch.bfloat16)
    sources = [kv[:, :, i * TOKENS : (i + 1) * TOKENS] for i in range(n)]
    threads = ThreadPoolExecutor(2)

    def copy(slots: list[torch.Tensor]) -> None:
        for slot, src in zip(slots, sources, strict=True):
            slot.copy_(src)

    def advise(seg: torch.Tensor, advice: int) -> None:
        if madvise(seg.data_ptr(), seg.numel(), advice) != 0:
            raise OSError(ctypes.get_errno(), "madvise failed")

    def split(seg: torch.Tensor, slots: list[torch.Tensor], advice: int) -> None:
        # Each chunk's [2, 32, 256, 1024] bytes in two halves along the layer axis.
        def half(k: int) -> None:
            for slot, src in zip(slots, sources, strict=True):
                lo, hi = slot[:, 16 * k : 16 * (k + 1)], src[:, 16 * k : 16 * (k + 1)]
                for part in (lo[0], lo[1]):
                    advise(part.reshape(-1).view(torch.uint8), advice)
                host_copy.copy_into(lo, hi)

        list(threads.map(half, (0, 1)))

    def pwritev(fd: int) -> None:
        # Each chunk is 64 contiguous runs of the source (one per K/V x layer): an iovec each.
        def half(k: int) -> None:
            for i, src in enumerate(sources):
                views = [
                    src[kv, layer].contiguous().view(torch.uint8).reshape(-1).numpy().data
                    for kv in (0, 1)
                    for layer in range(16 * k, 16 * (k + 1))
                ]
                run = views[0].nbytes
                for j, kv in enumerate((0, 1)):
                    off = i * CHUNK + kv * 32 * run + 16 * k * run
                    part = views[j * 16 : (j + 1) * 16]
                    if os.pwritev(fd, part, off) != 16 * run:
                        raise OSError("short write")

        list(threads.map(half, (0, 1)))

    times: dict[str, list[float]] = {c: [] for c in CASES}
    prep: dict[str, list[float]] = {c: [] for c in CASES}
    faults: dict[str, list[int]] = {c: [] for c in CASES}
    copy([torch.empty(SHAPE, dtype=torch.bfloat16) for _ in range(n)])  # start torch's threads
    for _ in range(args.rounds):
        for case in CASES:
            path = f"/dev/shm/lmca_bench_holes_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                if args.allocated:
                    with mmap.mmap(fd, size) as other:
                        other.write(b"\x01" * size)
                with mmap.mmap(fd, size) as m:
                    seg = torch.frombuffer(m, dtype=torch.uint8)
                    slots = [
                        seg[i * CHUNK : (i + 1) * CHUNK].view(torch.bfloat16).view(SHAPE) for i in range(n)
                    ]
                    if case == "warm":
                        copy(slots)
                    f0 = _minflt()
                    t0 = time.perf_counter()
                    if case == "populate_read":
                        advise(seg, MADV_POPULATE_READ)
                    elif case == "populate_write":
                        advise(seg, MADV_POPULATE_WRITE)
                    elif case == "fallocate" and _libc.fallocate(fd, 1, 0, size) != 0:  # KEEP_SIZE
                        raise OSError(ctypes.get_errno(), "fallocate failed")
                    t1 = time.perf_counter()
                    if case == "split":
                        split(seg, slots, MADV_POPULATE_WRITE)
                    elif case == "split_read":
                        split(seg, slots, MADV_POPULATE_READ)
                    elif case == "pwritev":
                        pwritev(fd)
                    elif case == "client":
                        pool = ShmPool(os.path.basename(path), size)
                        targets = [
                            pool._base[i * CHUNK : (i + 1) * CHUNK].view(torch.bfloat16).view(SHAPE)  # type: ignore[index]
                            for i in range(n)
                        ]
                        copies.fill_slots(list(zip(targets, sources, strict=True)), pool)
                        del targets
                        pool.close()
                    else:
                        copy(slots)
                    t2 = time.perf_counter()
                    faults[case].append(_minflt() - f0)
                    times[case].append(t2 - t0)
                    prep[case].append(t1 - t0)
                    del seg, slots
            finally:
                os.close(fd)
                os.unlink(path)
    threads.shutdown()
    warm = statistics.median(times["warm"])
    out: dict[str, dict[str, Any]] = {
        c: {
            "ms": round(statistics.median(times[c]) * 1e3, 2),
            "range_ms": [round(min(times[c]) * 1e3, 2), round(max(times[c]) * 1e3, 2)],
            "prepare_ms": round(statistics.median(prep[c]) * 1e3, 2),
            "vs_warm": round(statistics.median(times[c]) / warm, 2),
            "minor_faults": int(statistics.median(faults[c])),
        }
        for c in CASES
    }
    if args.json:
        print(json.dumps({"chunks": n, "rounds": args.rounds, "cases": out}, indent=1))
        return
    where = (
        "pages written before through another mapping" if args.allocated else "hole pages of a fresh segment"
    )
    print(f"{n} chunk(s) of 32 MiB into {where}, medians of {args.rounds}:")
    for c, o in out.items():
        print(
            f"  {c:15} {o['ms']:7.2f} ms  ({o['vs_warm']:.2f}x warm; range {o['range_ms'][0]}-{o['range_ms'][1]})"
            f"  prepare {o['prepare_ms']:6.2f} ms  faults {o['minor_faults']}"
        )


if __name__ == "__main__":
    main()
