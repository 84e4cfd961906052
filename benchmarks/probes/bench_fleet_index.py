"""The fleet index at scale (issue 43): a 4k-token prompt's lookup at a large index, in
memory and on Redis; ``Fleet.best`` at 1,000 servers; events per second one router
applies into Redis; Redis memory per chunk.

* ``memory``: a :class:`~lmcache_async.fleet.MemoryIndex` filled with ``--memory-chunks``
  random chunk hashes over 8 servers; then the lookup (``prefix``) of a 4096-token prompt
  (256 chunks of 16 tokens) held whole by one server, and of one nobody holds; the
  chunk hashing of the prompt (blake3) timed apart.
* ``servers_1000``: a ``Fleet`` of 1,000 servers (clients never opened: ``best`` with
  ``fanout="never"`` does no I/O) whose ``MemoryIndex`` holds ``--best-chunks`` chunks
  spread over all of them, the prompt held by 10 servers to different depths: ``best``.
* ``redis``: a REAL ``redis-server`` (``harness/redis_server.py``), a ``RedisIndex``
  filled with ``--redis-chunks`` chunks over 8 servers in batches of 4,096 (one Lua
  call each, the shape the router writes one server's ``stored`` events in); then the
  same two lookups (one pipeline each); events per second applied in batches of 4,096
  single-chunk events, from 8 servers interleaved (one Lua call per event) and from one
  server (merged into one call); memory per chunk (``INFO memory`` before and after the
  fill, and ``MEMORY USAGE`` of 1,000 chunk keys).

    .venv/bin/python -m benchmarks.probes.bench_fleet_index [--memory-chunks 10000000]
        [--redis-chunks 1000000] [--best-chunks 1000000] [--json PATH]

Timings are medians (with the 10th and 90th percentiles) on a shared 2-core machine:
read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import lmcache_async as lmc
from harness.redis_server import RedisServer
from lmcache_async.fleet import Fleet, MemoryIndex, RedisIndex
from lmcache_async.hashing import chunk_hashes

CS = 16
PROMPT = 4096
SERVERS = [f"tcp://10.0.{i // 250}.{i % 250}:5555" for i in range(1000)]
BATCH = 4096


def _spread(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10) if len(xs) > 1 else [xs[0]] * 9
    return {
        "median": round(statistics.median(xs), 2),
        "p10": round(q[0], 2),
        "p90": round(q[-1], 2),
        "n": len(xs),
    }


async def _timed_us(fn: Callable[[], Awaitable[Any]], n: int) -> dict[str, float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1e6)
    return _spread(out)


def _hashes(n: int, rng: random.Random) -> list[bytes]:
    return [rng.randbytes(32) for _ in range(n)]


async def _memory_part(chunks: int, rng: random.Random, lookups: int) -> dict[str, Any]:
    idx = MemoryIndex(max_chunks=chunks + 1024)
    t = time.perf_counter()
    left = chunks
    s = 0
    while left:
        n = min(left, 1 << 20)
        await idx.add(SERVERS[s % 8], _hashes(n, rng))
        left -= n
        s += 1
    fill = time.perf_counter() - t
    toks = [rng.randrange(1 << 31) for _ in range(PROMPT)]
    hs = chunk_hashes(toks, CS)
    await idx.add(SERVERS[3], hs)
    miss = chunk_hashes([t + 1 for t in toks], CS)
    up = SERVERS[:8]
    assert await idx.prefix(hs, up) == {SERVERS[3]: len(hs)}
    assert await idx.prefix(miss, up) == {}
    hash_us = []
    for _ in range(lookups):
        t = time.perf_counter()
        chunk_hashes(toks, CS)
        hash_us.append((time.perf_counter() - t) * 1e6)
    return {
        "chunks": len(idx),
        "fill_s": round(fill, 2),
        "prompt_tokens": PROMPT,
        "prompt_chunks": len(hs),
        "hash_us": _spread(hash_us),
        "lookup_hit_us": await _timed_us(lambda: idx.prefix(hs, up), lookups),
        "lookup_miss_us": await _timed_us(lambda: idx.prefix(miss, up), lookups),
    }


async def _best_part(chunks: int, rng: random.Random, lookups: int) -> dict[str, Any]:
    fleet = Fleet([(u, "http://127.0.0.1:1") for u in SERVERS], "m", geometry=lmc.KVGeometry(2, 2, 8))
    fleet._cs = CS
    fleet._up = lambda: SERVERS  # type: ignore[method-assign]
    idx = fleet.index
    assert isinstance(idx, MemoryIndex)
    per = max(1, chunks // len(SERVERS))
    for u in SERVERS:
        await idx.add(u, _hashes(per, rng))
    toks = [rng.randrange(1 << 31) for _ in range(PROMPT)]
    hs = chunk_hashes(toks, CS)
    for k in range(10):
        await idx.add(SERVERS[k * 97], hs[: 20 * (k + 1)])
    route = await fleet.best(toks, fanout="never")
    assert (route.server, route.cached_tokens) == (SERVERS[9 * 97], 200 * CS), route
    res = {
        "servers": len(SERVERS),
        "chunks": len(idx),
        "best_us": await _timed_us(lambda: fleet.best(toks, fanout="never"), lookups),
        "prefix_us": await _timed_us(lambda: idx.prefix(hs, SERVERS), lookups),
    }
    await fleet.aclose()
    return res


def _used(redis: RedisServer) -> int:
    info = redis.command("INFO", "memory")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return int(next(line.split(":")[1] for line in text.splitlines() if line.startswith("used_memory:")))


async def _redis_part(chunks: int, rng: random.Random, lookups: int) -> dict[str, Any]:
    with RedisServer() as redis:
        idx = RedisIndex(f"redis://127.0.0.1:{redis.port}/0", "bench", deadline=30)
        base = _used(redis)
        t = time.perf_counter()
        left, s = chunks, 0
        sample: list[bytes] = []
        while left:
            n = min(left, BATCH)
            hs = _hashes(n, rng)
            if len(sample) < 1000:
                sample.append(hs[0])
            await idx.apply([("add", SERVERS[s % 8], hs)])
            left -= n
            s += 1
        fill = time.perf_counter() - t
        assert idx.failures == 0
        used = _used(redis) - base
        usage = [int(redis.command("MEMORY", "USAGE", idx.key(h))) for h in sample]
        toks = [rng.randrange(1 << 31) for _ in range(PROMPT)]
        hs = chunk_hashes(toks, CS)
        await idx.add(SERVERS[3], hs)
        miss = chunk_hashes([t + 1 for t in toks], CS)
        up = SERVERS[:8]
        assert await idx.prefix(hs, up) == {SERVERS[3]: len(hs)}
        assert await idx.prefix(miss, up) == {}
        res: dict[str, Any] = {
            "chunks": int(redis.command("DBSIZE")) - 1,  # less the epochs hash
            "redis_version": redis.command("INFO", "server").decode().split("redis_version:")[1].split()[0],
            "fill_s": round(fill, 2),
            "fill_chunks_per_s": round(chunks / fill),
            "used_memory_bytes_per_chunk": round(used / chunks, 1),
            "memory_usage_bytes_per_key": _spread([float(u) for u in usage]),
            "lookup_hit_us": await _timed_us(lambda: idx.prefix(hs, up), lookups),
            "lookup_miss_us": await _timed_us(lambda: idx.prefix(miss, up), lookups),
        }
        events = 16 * BATCH
        for shape, ops in (
            (
                "8_servers_interleaved",
                [("add", SERVERS[i % 8], [h]) for i, h in enumerate(_hashes(events, rng))],
            ),
            ("one_server_merged", None),
        ):
            t = time.perf_counter()
            if ops is not None:
                for k in range(0, events, BATCH):
                    await idx.apply(ops[k : k + BATCH])  # type: ignore[arg-type]
            else:
                for _ in range(0, events, BATCH):
                    await idx.apply([("add", SERVERS[0], _hashes(BATCH, rng))])
            res[f"events_per_s_{shape}"] = round(events / (time.perf_counter() - t))
        assert idx.failures == 0
        await idx.aclose()
        return res


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    out: dict[str, Any] = {
        "probe": "bench_fleet_index",
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.redis_chunks:
        out["redis"] = await _redis_part(args.redis_chunks, rng, args.lookups)
        print("redis:", out["redis"], file=sys.stderr)
    if args.best_chunks:
        out["servers_1000"] = await _best_part(args.best_chunks, rng, args.lookups)
        print("servers_1000:", out["servers_1000"], file=sys.stderr)
        gc.collect()
    if args.memory_chunks:
        out["memory"] = await _memory_part(args.memory_chunks, rng, args.lookups)
        print("memory:", out["memory"], file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--memory-chunks", type=int, default=10_000_000)
    ap.add_argument("--redis-chunks", type=int, default=1_000_000)
    ap.add_argument("--best-chunks", type=int, default=1_000_000)
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    res = asyncio.run(amain(args))
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
