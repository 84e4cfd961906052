"""The first copy through a fresh mapping of a tmpfs segment: map first, or fault?

    .venv/bin/python -m benchmarks.probes.bench_shm_pages [--mib 512] [--rounds 5] [--json]

A client maps the server's SHM pool; the first time its process touches a page of it,
the kernel maps that page (a fault). ``lmcache_async._transport.shm.ShmPool.populate`` can map the
pages of a range in one ``madvise(MADV_POPULATE_READ)`` before a copy instead. Which is
cheaper depends on the direction, and this measures it: a ``/dev/shm`` segment of
``--mib`` MiB (filled once, as a server's pool is), mapped afresh for every copy; the
copy runs in 32 MiB chunks with ``Tensor.copy_`` (what a client does for large copies),

* ``read``: from the segment into a warm private tensor (a retrieve reads its slots);
* ``write``: from a warm private tensor into the segment (a store fills its slots);

each as: ``warm`` (the mapping's pages touched before the timer: the floor), ``fault``
(no preparation), ``populate`` (``MADV_POPULATE_READ`` over the range, then the copy),
``populate_write`` (``MADV_POPULATE_WRITE``), and ``syscall``: no page of the mapping
touched at all, the same 32 MiB pieces moved by ``os.preadv`` / ``os.pwritev`` on the
segment's descriptor in two threads (the kernel copies from and to its page cache: no
fault, but a page-cache lookup per 4 KiB page). Medians of ``--rounds``; the cases
alternate within each round. Linux 5.14 or later (the populate advice).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from lmcache_async._base import host_copy as host_copy

MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
CHUNK = 32 << 20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    size = args.mib << 20
    if size % CHUNK:
        parser.error("--mib must be a multiple of 32")
    madvise = host_copy.madvise  # the client's own (ctypes, GIL released)
    if madvise is None:
        parser.error("needs Linux (madvise)")
    path = f"/dev/shm/lmca_bench_pages_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    threads = ThreadPoolExecutor(2)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as m:
            block = os.urandom(1 << 20)
            for i in range(args.mib):
                m[i << 20 : (i + 1) << 20] = block
        private = torch.full((size,), 1, dtype=torch.uint8)

        def copy(seg: torch.Tensor, direction: str) -> None:
            for lo in range(0, size, CHUNK):
                a, b = private[lo : lo + CHUNK], seg[lo : lo + CHUNK]
                if direction == "read":
                    a.copy_(b)
                else:
                    b.copy_(a)

        private_bytes = private.numpy().data
        pieces = range(0, size, CHUNK)

        def by_syscall(direction: str) -> None:
            def one(lo: int) -> None:
                buf = private_bytes[lo : lo + CHUNK]
                done = os.preadv(fd, [buf], lo) if direction == "read" else os.pwritev(fd, [buf], lo)
                if done != CHUNK:
                    raise OSError(f"short {direction}: {done} of {CHUNK} bytes")

            list(threads.map(one, pieces))

        def advise(seg: torch.Tensor, advice: int) -> None:
            if madvise(seg.data_ptr(), size, advice) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_*) failed (Linux >= 5.14?)")

        prepare: dict[str, Callable[[torch.Tensor, str], None]] = {
            "warm": lambda seg, d: copy(seg, d),
            "fault": lambda seg, d: None,
            "populate": lambda seg, d: None,
            "populate_write": lambda seg, d: None,
            "syscall": lambda seg, d: None,
        }
        before: dict[str, Callable[[torch.Tensor], None]] = {
            "populate": lambda seg: advise(seg, MADV_POPULATE_READ),
            "populate_write": lambda seg: advise(seg, MADV_POPULATE_WRITE),
        }
        out: dict[str, dict[str, float]] = {}
        for direction in ("read", "write"):
            times: dict[str, list[float]] = {k: [] for k in prepare}
            for _ in range(args.rounds):
                for case in prepare:
                    with mmap.mmap(fd, size) as m:
                        seg = torch.frombuffer(m, dtype=torch.uint8)
                        prepare[case](seg, direction)
                        t0 = time.perf_counter()
                        if case in before:
                            before[case](seg)
                        if case == "syscall":
                            by_syscall(direction)
                        else:
                            copy(seg, direction)
                        times[case].append(time.perf_counter() - t0)
                        del seg
            warm = statistics.median(times["warm"])
            out[direction] = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
            out[direction + "_vs_warm"] = {k: round(statistics.median(v) / warm, 2) for k, v in times.items()}
    finally:
        threads.shutdown()
        os.close(fd)
        os.unlink(path)
    if args.json:
        print(json.dumps({"mib": args.mib, "rounds": args.rounds, **out}, indent=1))
        return
    print(
        f"{args.mib} MiB through a fresh mapping, Tensor.copy_ in 32 MiB chunks (medians of {args.rounds}):"
    )
    for direction in ("read", "write"):
        cells = [f"{k} {out[direction][k]:.1f} ms ({out[direction + '_vs_warm'][k]:.2f}x)" for k in prepare]
        print(f"  {direction:5}  " + "   ".join(cells))


if __name__ == "__main__":
    main()
