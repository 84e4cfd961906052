"""A retrieve into a new tensor: why its time is bimodal, call by call.

    .venv/bin/python -m benchmarks.probes.bench_new_tensor [--chunks 4] [--reps 12] [--json]

A retrieve without ``out=`` allocates the ``[2, 32, 256 x chunks, 1024]`` bf16 tensor it
returns and copies the slots into it: the copy is the first touch of that memory. Each
repetition, in alternating order, allocates it with

* ``torch.empty`` (what the official SDK's ``torch.cat`` does: 4 KiB pages),
* ``empty_host`` (``lmcache_async._base.host_copy``: what the client allocates),
* ``huge``: ``torch.empty`` advised ``MADV_HUGEPAGE``, as ``empty_host`` did before,

and copies a warm source into it per chunk, as the client's retrieve does
(``lmcache_async._engine.copies.copy_chunks_out``). Per call: the time, the process's minor
faults, and the changes of the kernel's counters in ``/proc/vmstat`` over the call
(``thp_fault_alloc``: huge pages mapped on a fault; ``thp_fault_fallback``: a huge page was
wanted and none was free; ``compact_stall``: the fault waited for memory compaction). The
tensors are dropped after each call, as a caller that uses and frees them does.
"""

from __future__ import annotations

import argparse
import json
import mmap
import resource
import statistics
import time
from collections.abc import Callable

import torch

from lmcache_async._base.host_copy import HUGE_PAGE, empty_host, madvise
from lmcache_async._engine.copies import copy_chunks_out

COUNTERS = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "pgfault")


def _vmstat() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k in COUNTERS:
                out[k] = int(v)
    return out


def _huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    n = t.numel() * t.element_size()
    ptr = t.data_ptr()
    start = (ptr + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (ptr + n) & ~(HUGE_PAGE - 1)
    if madvise is not None and end > start:
        madvise(start, end - start, getattr(mmap, "MADV_HUGEPAGE", 14))
    return t


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n = args.chunks
    shape = (2, 32, 256 * n, 1024)
    chunks = [torch.randn(2, 32, 256, 1024).to(torch.bfloat16) for _ in range(n)]
    allocs: dict[str, Callable[[tuple[int, ...], torch.dtype], torch.Tensor]] = {
        "torch.empty": lambda s, d: torch.empty(s, dtype=d),
        "empty_host": empty_host,
        "huge": _huge,
    }
    calls: dict[str, list[dict[str, float]]] = {k: [] for k in allocs}
    for rep in range(args.reps):
        order = list(allocs) if rep % 2 == 0 else list(reversed(allocs))
        for name in order:
            v0, f0 = _vmstat(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            target = allocs[name](shape, torch.bfloat16)
            copy_chunks_out(target, chunks, 256, 2)
            dt = time.perf_counter() - t0
            v1, f1 = _vmstat(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            assert torch.equal(target[:, :, :256], chunks[0])
            del target
            calls[name].append({"ms": dt * 1e3, "faults": f1 - f0, **{k: v1[k] - v0[k] for k in COUNTERS}})
    if args.json:
        print(json.dumps({"chunks": n, "reps": args.reps, "calls": calls}, indent=1))
        return
    print(
        f"{n} chunk(s) ({n * 32} MiB) into a new tensor, {args.reps} calls each (ms / minor faults / thp alloc / fallback / compact stalls):"
    )
    for name, cs in calls.items():
        ms = [c["ms"] for c in cs]
        print(f"  {name:12} median {statistics.median(ms):7.2f} ms, range {min(ms):.2f}-{max(ms):.2f}")
        print(
            "    "
            + "  ".join(
                f"{c['ms']:.0f}/{c['faults']:.0f}/{c['thp_fault_alloc']:.0f}/{c['thp_fault_fallback']:.0f}/{c['compact_stall']:.0f}"
                for c in cs
            )
        )


if __name__ == "__main__":
    main()
