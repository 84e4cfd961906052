"""Cross-server retrieve through a shared Redis L2, and the Redis share of it.

Starts a real ``redis-server`` (no persistence) and two real LMCache 0.5.6 servers A and
B, both SHM, both with ``--l2-adapter '{"type":"resp",...}'`` on that Redis, one
``AsyncClient`` on each. Per iteration (alternating, so both see the same machine load):

* store a fresh prompt through A and time how long until every chunk is in Redis
  (write-behind lag, polled with ``EXISTS`` every 0.5 ms);
* ``local``: retrieve it through A (an L1 hit);
* ``cross``: retrieve it through B (B's lookup loads it from Redis into a temporary L1
  object; the default prefetch policy keeps nothing, so every cross retrieve pays this);
* ``l2_prefetch``: B's own account of the Redis part of that cross retrieve -- the
  "Prefetch request completed (L1+L2): ... (0 L1, N L2) in X ms" line B logs for the
  retrieve's lookup (EXISTS + GET of every chunk into L1, server-side).

Prints medians (and p90) in ms, ``cross - local`` (what the L2 path adds) and
``l2_prefetch / cross`` (the Redis share). Figures depend on the machine and its load:
compare ratios.

    .venv/bin/python -m benchmarks.probes.bench_multi_host [--chunks 4] [--iters 12]
        [--layers 8 --heads 8 --head-dim 128 --chunk-size 256]  [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import statistics
import time
from typing import Any

import torch

import lmcache_async as lmc
from harness.real_server import RealLMCacheServer, lmcache_venv_python
from harness.redis_server import RedisServer, _encode, _Reader

_PREFETCH_LINE = re.compile(r"Prefetch request completed \(L1\+L2\): .*\(0 L1, (\d+) L2\) in ([0-9.]+) ms")


def _l2_prefetch_seconds(server: RealLMCacheServer, chunks: int) -> float:
    """The server-side time of the last all-L2 prefetch in ``server``'s log."""
    for line in reversed(server.log_tail(200).splitlines()):
        m = _PREFETCH_LINE.search(line)
        if m and "external_request_id=lmca-retrieve-" in line:
            if int(m.group(1)) != chunks:
                raise RuntimeError(f"the last L2 prefetch loaded {m.group(1)} chunks, not {chunks}")
            return float(m.group(2)) / 1e3
    raise RuntimeError("no L2 prefetch line in the server log")


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "median_ms": round(statistics.median(s) * 1e3, 3),
        "p90_ms": round(s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3, 3),
    }


class _Redis:
    """One persistent RESP connection (the test helper opens one per command)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.reader = _Reader(self.sock)

    def __call__(self, *args: Any) -> Any:
        self.sock.sendall(_encode(args))
        return self.reader.reply()

    def close(self) -> None:
        self.sock.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    python = lmcache_venv_python()
    geometry = lmc.KVGeometry(args.layers, args.heads, args.head_dim, torch.bfloat16, block_size=16)
    cs, n_tok = args.chunk_size, args.chunk_size * args.chunks
    model = f"bench-mh-{os.getpid()}"
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(RedisServer())
        l2 = ["--l2-adapter", redis.l2_adapter_arg()]
        a, b = (
            stack.enter_context(
                RealLMCacheServer(
                    "shm", chunk_size=cs, l1_size_gb=args.l1_gb, venv_python=python, extra_args=l2, name=name
                )
            )
            for name in ("bench_a", "bench_b")
        )
        r = _Redis(redis.port)
        stack.callback(r.close)
        async with (
            lmc.AsyncClient(a.url, a.http_url, model, geometry=geometry, timeout=60) as ca,
            lmc.AsyncClient(b.url, b.http_url, model, geometry=geometry, timeout=60) as cb,
        ):
            times: dict[str, list[float]] = {"write_behind": [], "local": [], "cross": [], "l2_prefetch": []}
            out = torch.empty(geometry.kv_shape(n_tok), dtype=geometry.dtype)
            base = 10_000_000
            for it in range(args.warmup + args.iters):
                tokens = list(range(base + it * n_tok, base + (it + 1) * n_tok))
                kv = torch.randn(geometry.kv_shape(n_tok)).to(geometry.dtype)
                before = set(redis.keys(f"{model}@*"))
                assert await ca.store(kv, tokens) is True
                t0 = time.perf_counter()
                while True:
                    keys = set(r("KEYS", f"{model}@*")) - {k.encode() for k in before}
                    if len(keys) == args.chunks:
                        break
                    if time.perf_counter() - t0 > 30:
                        raise RuntimeError("write-behind did not reach Redis in 30 s")
                    await asyncio.sleep(0.0005)
                lag = time.perf_counter() - t0
                order = ("local", "cross") if it % 2 else ("cross", "local")
                for what in order:
                    t0 = time.perf_counter()
                    got = await (ca if what == "local" else cb).retrieve(tokens, out=out)
                    dt = time.perf_counter() - t0
                    if got is None or not torch.equal(got, kv):
                        raise RuntimeError(f"{what} retrieve missed or differed")
                    if it >= args.warmup:
                        times[what].append(dt)
                        if what == "cross":
                            times["l2_prefetch"].append(_l2_prefetch_seconds(b, args.chunks))
                if it >= args.warmup:
                    times["write_behind"].append(lag)
    res: dict[str, Any] = {
        "geometry": f"{args.layers} layers x {args.heads} heads x {args.head_dim}, bf16, chunk {cs}",
        "payload_mib": round(geometry.bytes_per_token * n_tok / 2**20, 2),
        "chunks": args.chunks,
        "iters": args.iters,
    }
    for k, v in times.items():
        res[k] = _stats(v)
    local, cross, red = (statistics.median(times[k]) for k in ("local", "cross", "l2_prefetch"))
    res["cross_minus_local_ms"] = round((cross - local) * 1e3, 3)
    res["cross_over_local"] = round(cross / local, 2)
    res["redis_share_of_cross"] = round(red / cross, 2)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--l1-gb", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = asyncio.run(run(args))
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"{res['geometry']}; {res['chunks']} chunks = {res['payload_mib']} MiB; {res['iters']} iterations")
    for k in ("write_behind", "local", "cross", "l2_prefetch"):
        print(f"  {k:<13} median {res[k]['median_ms']:9.3f} ms   p90 {res[k]['p90_ms']:9.3f} ms")
    print(f"  cross - local {res['cross_minus_local_ms']:.3f} ms; cross / local {res['cross_over_local']}x")
    print(f"  Redis share of the cross retrieve (l2_prefetch / cross): {res['redis_share_of_cross']}")


if __name__ == "__main__":
    main()
