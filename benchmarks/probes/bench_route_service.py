"""The routing service under load (issue 43, item 3): two replicas of ``lmcache-async
route`` (two processes) sharing one REAL ``redis-server`` index over ``--servers`` REAL
LMCache servers, a load generator (aiohttp client) keeping ``--concurrency`` requests in
flight until ``--requests`` answered, and one replica restarted mid-run.

* Setup: the servers (pickle, chunk size 16), Redis, and ``--prompts`` prompts of 2 to 16
  chunks stored by a writer fleet sharing the replicas' index (round robin over the
  servers); each query is a stored prompt, a stored prompt's first chunks followed by
  chunks nobody holds, or a prompt nobody holds (one in four of each kind but the first,
  which is half). The expected answer of each query is ``lookup`` on every server, asked
  before the run and again after it (they must agree: nothing was evicted meanwhile).
* The run: each request goes to the replicas in turn; a connection error or a 5xx
  answer is retried at once on the other replica (clients fail over; they do not wait
  for the restart). When a third of the requests are answered, replica A is stopped
  (SIGTERM: requests in flight on it fail and are retried on B) and started again; it
  serves again once it printed its address.
* Checked: every answer's ``scores`` equal the servers' ``lookup``, its ``server`` holds
  the longest prefix (any server when none holds any); an answer that differs is counted
  wrong (it must be 0). Latency is from a request's first attempt to its answer
  (retries included); throughput is answers per second of the run.

    .venv/bin/python -m benchmarks.probes.bench_route_service [--servers 2] [--requests 20000]
        [--concurrency 1000] [--prompts 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch

import lmcache_async as lmc
from harness.real_server import RealLMCacheServer
from harness.redis_server import RedisServer
from lmcache_async.fleet import Fleet, RedisIndex

CS = 16
GEOMETRY = lmc.KVGeometry(2, 2, 8, torch.bfloat16, 16)
GEOMETRY_ARGS = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8", "--block-size", "16"]
MODEL = "bench-route"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Replica:
    """One ``lmcache-async route`` process (stopped by its own pid)."""

    def __init__(
        self, name: str, servers: list[RealLMCacheServer], redis_url: str, port: int, redis_deadline: float
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.argv = [sys.executable, "-m", "lmcache_async", "route", "--model-name", MODEL]
        for s in servers:
            self.argv += ["--server", f"{s.url},{s.http_url}"]
        self.argv += ["--redis", redis_url, "--namespace", MODEL, "--port", str(port), "--json"]
        self.argv += ["--deadline", "10", "--redis-deadline", str(redis_deadline), *GEOMETRY_ARGS]
        self.log_path = Path(f"/tmp/bench-route-{os.getpid()}-{name}.log")
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> float:
        """Start it; the seconds until it listens."""
        t = time.perf_counter()
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdout=asyncio.subprocess.PIPE, stderr=log
            )
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 120)
        json.loads(line)
        return time.perf_counter() - t

    async def stop(self) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            return await proc.wait()


def _queries(rng: random.Random, stored: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        kind = i % 4
        fresh = [rng.randrange(1 << 31) for _ in range(CS * rng.randint(1, 8))]
        p = stored[rng.randrange(len(stored))]
        if kind in (0, 1):
            out.append(p)
        elif kind == 2:
            out.append(p[: CS * rng.randint(1, len(p) // CS)] + fresh)
        else:
            out.append(fresh)
    return out


async def _truth(fleet: Fleet, queries: list[list[int]]) -> list[dict[str, int]]:
    sem = asyncio.Semaphore(32)

    async def one(q: list[int]) -> dict[str, int]:
        async with sem:
            got = await asyncio.gather(*(c.lookup(q) for c in fleet.clients))
            return dict(zip(fleet.servers, got, strict=True))

    return list(await asyncio.gather(*(one(q) for q in queries)))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _load(
    replicas: list[Replica],
    queries: list[list[int]],
    truth: list[dict[str, int]],
    requests: int,
    concurrency: int,
    restart_at: int,
) -> dict[str, Any]:
    bodies = [json.dumps({"tokens": q}).encode() for q in queries]
    lat: list[float] = []
    wrong: list[Any] = []
    retries = 0
    failed = 0
    sources: dict[str, int] = {}
    by_replica = dict.fromkeys((r.name for r in replicas), 0)
    next_i = 0
    done = 0
    restart: dict[str, Any] = {}
    restart_started = asyncio.Event()
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency * 2, limit_per_host=concurrency)
    timeout = aiohttp.ClientTimeout(total=30)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def ask(i: int) -> None:
            nonlocal retries, failed, done
            q = i % len(queries)
            first = i % len(replicas)
            t = time.perf_counter()
            for attempt in range(6):
                r = replicas[(first + attempt) % len(replicas)]
                if attempt:
                    retries += 1
                try:
                    async with http.post(r.url + "/score", data=bodies[q], headers=headers) as resp:
                        if resp.status >= 500:
                            continue
                        body = await resp.json()
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError):
                    continue
                lat.append(time.perf_counter() - t)
                by_replica[r.name] += 1
                exp = truth[q]
                top = max(exp.values())
                ok = (
                    status == 200
                    and body.get("scores") == exp
                    and (top == 0 or exp.get(body.get("server"), -1) == top)
                    and body.get("source") in ("index", "fanout")
                )
                if ok:
                    sources[body["source"]] = sources.get(body["source"], 0) + 1
                else:
                    wrong.append({"query": q, "got": body, "expected": exp})
                done += 1
                if done == restart_at:
                    restart_started.set()
                return
            failed += 1
            done += 1

        async def worker() -> None:
            nonlocal next_i
            while next_i < requests:
                i = next_i
                next_i += 1
                await ask(i)

        async def restarter() -> None:
            await restart_started.wait()
            t = time.perf_counter()
            restart["at_answered"] = done
            restart["stop_rc"] = await replicas[0].stop()
            restart["ready_after_s"] = round(await replicas[0].start() + (time.perf_counter() - t), 2)
            restart["answered_when_back"] = done

        t0 = time.perf_counter()
        side = asyncio.create_task(restarter())
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        if not side.done():
            side.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await side
    return {
        "requests": requests,
        "concurrency": concurrency,
        "answered": len(lat),
        "failed_after_retries": failed,
        "wrong": len(wrong),
        "wrong_examples": wrong[:5],
        "retries": retries,
        "sources": sources,
        "answered_by_replica": by_replica,
        "restart": restart,
        "wall_s": round(wall, 2),
        "throughput_rps": round(len(lat) / wall, 1),
        "latency_ms": {
            "p50": round(_pct(lat, 0.50) * 1e3, 1),
            "p90": round(_pct(lat, 0.90) * 1e3, 1),
            "p99": round(_pct(lat, 0.99) * 1e3, 1),
            "max": round(max(lat) * 1e3, 1),
            "mean": round(statistics.fmean(lat) * 1e3, 1),
        },
    }


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    servers = [RealLMCacheServer("pickle", chunk_size=CS, l1_size_gb=0.5) for _ in range(args.servers)]
    redis = RedisServer()
    replicas: list[Replica] = []
    try:
        for s in servers:
            s.start()
        redis.start()
        redis_url = f"redis://127.0.0.1:{redis.port}/0"
        replicas = [Replica(n, servers, redis_url, _free_port(), args.redis_deadline) for n in ("A", "B")]
        writer_index = RedisIndex(redis_url, MODEL, ttl=3600, speculative_ttl=3600)
        try:
            async with Fleet(
                [(s.url, s.http_url) for s in servers],
                MODEL,
                index=writer_index,
                events=False,
                geometry=GEOMETRY,
            ) as writer:
                stored = [
                    [rng.randrange(1 << 31) for _ in range(CS * rng.randint(2, 16))]
                    for _ in range(args.prompts)
                ]
                for i, p in enumerate(stored):
                    kv = torch.randn(GEOMETRY.kv_shape(len(p))).to(GEOMETRY.dtype)
                    assert (await writer.store(kv, p, server=writer.servers[i % len(servers)])).value is True
                queries = _queries(rng, stored, args.prompts * 4)
                truth = await _truth(writer, queries)
                starts = [round(await r.start(), 2) for r in replicas]
                res = await _load(
                    replicas, queries, truth, args.requests, args.concurrency, args.requests // 3
                )
                after = await _truth(writer, queries)
                res["truth_unchanged_after_run"] = after == truth
        finally:
            await writer_index.aclose()
        res["replica_start_s"] = starts
    finally:
        for r in replicas:
            await r.stop()
        redis.cleanup()
        for s in servers:
            s.stop()
    return {
        "probe": "bench_route_service",
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "servers": args.servers,
        "server_mode": "pickle, chunk size 16, LMCache 0.5.6",
        "replicas": 2,
        "replica_args": "--deadline 10 --redis-deadline " + str(args.redis_deadline),
        "prompts_stored": args.prompts,
        "queries": args.prompts * 4,
        "retry_policy": "on a connection error or 5xx, at once on the other replica (up to 6 attempts)",
        **res,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--redis-deadline", type=float, default=0.5, help="the replicas' --redis-deadline")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    res = asyncio.run(amain(args))
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if res["wrong"] == 0 and res["failed_after_retries"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
