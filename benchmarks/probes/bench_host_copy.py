"""Host copies: ``Tensor.copy_`` (torch's intra-op pool) vs ``lmcache_async._base.host_copy.copy_into``.

    .venv/bin/python -m benchmarks.probes.bench_host_copy [--json]

One chunk of a ``[2, L, 256, D]`` bf16 KV copied into the chunk-sized slice of a
``[2, L, 1024, D]`` tensor (what a retrieve does per chunk), warm buffers, alternating the
two copies; wall time and process CPU time per copy (CPU includes torch's pool threads).
Run it twice: as is, and while another process loads the machine (e.g. a server), where
the pool's threads wait for each other. The bytes copied are compared after each run.

Then a retrieve into a new tensor: allocate a ``[2, 32, 256 x chunks, 1024]`` bf16 tensor
(1, 4, 16 chunks) and copy one warm source into it (``Tensor.copy_``), with ``torch.empty``
(4 KiB pages) and with ``lmcache_async._base.host_copy.empty_host`` (transparent huge pages where
the kernel offers them); every allocation is fresh, so its first touch is timed. Each is
run twice: freed after each copy (the allocator hands the same memory back next time), and
kept three at a time (each allocation is memory the process has not touched before).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import torch

from lmcache_async._base.host_copy import copy_into, empty_host

CASES = [(2, 128, "256 KiB"), (8, 512, "4 MiB"), (32, 1024, "32 MiB")]


def _time(fn: Callable[[], object], seconds: float) -> tuple[float, float]:
    fn()
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for layers, hidden, label in CASES:
        src = torch.randn(2, layers, 256, hidden).to(torch.bfloat16)
        big = torch.zeros(2, layers, 1024, hidden, dtype=torch.bfloat16)
        dst = big.narrow(2, 256, 256)
        figs: dict[str, list[tuple[float, float]]] = {"torch copy_": [], "copy_into": []}
        for _ in range(args.rounds):
            figs["torch copy_"].append(_time(functools.partial(torch.Tensor.copy_, dst, src), args.seconds))
            big.zero_()
            figs["copy_into"].append(_time(functools.partial(copy_into, dst, src), args.seconds))
            assert torch.equal(dst, src)
        for who, vals in figs.items():
            wall = sorted(v[0] for v in vals)[len(vals) // 2]
            cpu = sorted(v[1] for v in vals)[len(vals) // 2]
            rows.append({"payload": label, "copy": who, "wall_us": round(wall, 1), "cpu_us": round(cpu, 1)})
    fresh: list[dict[str, object]] = []
    for chunks in (1, 4, 16):
        shape = (2, 32, 256 * chunks, 1024)
        src = torch.randn(shape).to(torch.bfloat16)
        allocs: dict[str, Callable[..., torch.Tensor]] = {
            "torch.empty": torch.empty,
            "empty_host": empty_host,
        }
        for kept in (False, True):
            # kept: the tensors of a round stay alive (as a caller keeping its results
            # does), so every allocation takes memory the process has not used before.
            times: dict[str, list[float]] = {k: [] for k in allocs}
            for _ in range(args.rounds * (2 if chunks == 16 else 5)):
                for who, alloc in allocs.items():
                    held = []
                    for _ in range(3 if kept else 1):
                        t0 = time.perf_counter()
                        dst = alloc(shape, dtype=torch.bfloat16)
                        dst.copy_(src)
                        times[who].append((time.perf_counter() - t0) * 1e3)
                        assert torch.equal(dst, src)
                        held.append(dst)
                        del dst
                    del held
            for who, ms in times.items():
                ms.sort()
                fresh.append(
                    {
                        "chunks": chunks,
                        "alloc": who,
                        "kept": kept,
                        "ms": round(ms[len(ms) // 2], 2),
                        "max_ms": round(ms[-1], 2),
                    }
                )
    out = {"torch_threads": torch.get_num_threads(), "rows": rows, "fresh": fresh}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"torch intra-op threads: {out['torch_threads']}; medians of {args.rounds}")
    for r in rows:
        print(f"{r['payload']:>8}  {r['copy']:<12} {r['wall_us']:>10.1f} µs wall {r['cpu_us']:>10.1f} µs CPU")
    print("new tensor + copy_ (32 MiB a chunk), medians (max); kept = three at a time stay alive:")
    for r in fresh:
        life = "kept" if r["kept"] else "freed"
        print(f"{r['chunks']:>3} chunks  {life:<6} {r['alloc']:<12} {r['ms']:>8.2f} ms ({r['max_ms']:.2f})")


if __name__ == "__main__":
    main()
