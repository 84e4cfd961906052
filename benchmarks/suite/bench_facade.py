"""The sync facade's added latency per call: ``Client.x()`` vs ``await AsyncClient.x()``.

    .venv/bin/python -m benchmarks.suite.bench_facade [--iters 2000] [--rounds 5] [--json]
    .venv/bin/python -m benchmarks.suite.bench_facade --url tcp://h:p --http-url http://h:p
    .venv/bin/python -m benchmarks.suite.bench_facade --trace 3000   # the phases of one noop

(``make bench`` runs this as the ``facade`` section, on the suite's SHM server: chunk 256.)

Without ``--url`` it starts a real LMCache 0.5.6 server itself (``--mode shm`` or
``pickle``, chunk size 16, from ``.lmcache-venv``). One blocking :class:`Client` and one
:class:`AsyncClient` are open on the same server at once, with the same small geometry
(2 layers x 2 heads x 8, bf16: 1 KiB per 16-token chunk, so the payload costs nothing and
the fixed cost of a call is what is measured). Rounds alternate the two (async first in
even rounds, sync first in odd ones); each round times ``--iters`` calls one by one with
``perf_counter``. The figure is the median of the round medians, with the range over
rounds; overhead = sync - async.

Cases:

* ``noop``: one server round trip (the thinnest call);
* ``lookup``: a 1-chunk hit (lookup, prefetch status, free locks, end session);
* ``retrieve``: a 1-chunk hit, copied out;
* ``handover``: the facade alone, no server: an empty coroutine submitted to the loop
  thread and waited for (``async`` column: the same coroutine awaited directly);
* ``two-thread ping-pong (the floor)``: no facade at all, two plain threads handing the
  turn to each other and back with two locks (two thread wake-ups, what any hand-over to
  another thread costs at least on the machine);
* ``noop x8``: throughput, 8 threads calling ``Client.noop()`` vs 8 tasks awaiting
  ``AsyncClient.noop()``, ``--iters`` calls each; reported in calls per second.

``--trace CALLS`` times instead where one ``Client.noop()`` spends its time (the phases
of :data:`TRACE_PHASES`), through the library's trace hook
(:func:`lmcache_async.observe.set_trace_hook`).

The async calls run in the main thread's own event loop (``asyncio.run``); the blocking
calls are made from that same thread (so the facade's loop thread does their work while
the main loop waits), which is the Jupyter situation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

import lmcache_async as lmc
from benchmarks.harness import facade_loop, settle
from lmcache_async.observe import set_trace_hook
from lmcache_async.sync_client import Client

GEOM = lmc.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)
MODEL = "bench-facade"


def _time_sync(fn: Callable[[], object], iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


async def _time_async(fn: Callable[[], Awaitable[object]], iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return times


def _sync_throughput(client: Client, threads: int, iters: int) -> float:
    barrier = threading.Barrier(threads + 1)

    def work() -> None:
        barrier.wait()
        for _ in range(iters):
            client.noop()

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    return threads * iters / (time.perf_counter() - t0)


async def _async_throughput(client: lmc.AsyncClient, tasks: int, iters: int) -> float:
    async def work() -> None:
        for _ in range(iters):
            await client.noop()

    t0 = time.perf_counter()
    await asyncio.gather(*(work() for _ in range(tasks)))
    return tasks * iters / (time.perf_counter() - t0)


async def _empty() -> None:
    return None


class _PingPong:
    """Two plain threads handing the turn over with two locks, no event loop: one
    ``once()`` is two thread wake-ups, the floor under any hand-over to another thread."""

    def __init__(self) -> None:
        self._go, self._back = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._back.acquire()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pingpong", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            if self._stop:
                return
            self._back.release()

    def once(self) -> None:
        self._go.release()
        self._back.acquire()

    def close(self) -> None:
        self._stop = True
        self._go.release()
        self._thread.join(5)


async def run(args: argparse.Namespace, url: str, http_url: str) -> dict[str, Any]:
    sync = Client(url, http_url, MODEL, geometry=GEOM)
    pingpong = _PingPong()
    try:
        async with lmc.AsyncClient(url, http_url, MODEL, geometry=GEOM) as aclient:
            cs = aclient.chunk_size
            tokens = list(range(10_000, 10_000 + cs))
            await aclient.store(torch.randn(GEOM.kv_shape(cs)).to(GEOM.dtype), tokens)
            await settle()  # both clients' background SHM warm-up, if any, is over
            lt = facade_loop(sync)

            sync_cases: dict[str, Callable[[], object]] = {
                "noop": sync.noop,
                "lookup": lambda: sync.lookup(tokens),
                "retrieve": lambda: sync.retrieve(tokens),
                "handover": lambda: lt.submit(_empty).wait("handover", 10.0, 1.0),
                "two-thread ping-pong (the floor)": pingpong.once,
            }
            async_cases: dict[str, Callable[[], Awaitable[object]]] = {
                "noop": aclient.noop,
                "lookup": lambda: aclient.lookup(tokens),
                "retrieve": lambda: aclient.retrieve(tokens),
                "handover": _empty,
                "two-thread ping-pong (the floor)": _empty,
            }
            rounds: dict[str, dict[str, list[float]]] = {c: {"async": [], "sync": []} for c in sync_cases}
            for case in sync_cases:  # warm up both paths
                _time_sync(sync_cases[case], 50)
                await _time_async(async_cases[case], 50)
            for r in range(args.rounds):
                for case in sync_cases:
                    order = ("async", "sync") if r % 2 == 0 else ("sync", "async")
                    for side in order:
                        if side == "sync":
                            times = _time_sync(sync_cases[case], args.iters)
                        else:
                            times = await _time_async(async_cases[case], args.iters)
                        rounds[case][side].append(statistics.median(times))
            tput: dict[str, list[float]] = {"async": [], "sync": []}
            n = max(args.iters // 8, 10)
            for _ in range(args.rounds):
                tput["async"].append(await _async_throughput(aclient, 8, n))
                tput["sync"].append(_sync_throughput(sync, 8, n))
            transfer = aclient.transfer
    finally:
        pingpong.close()
        sync.close()

    def summary(values: list[float], scale: float) -> dict[str, float]:
        return {
            "median": statistics.median(values) * scale,
            "min": min(values) * scale,
            "max": max(values) * scale,
        }

    cases: dict[str, Any] = {}
    for case, sides in rounds.items():
        a, s = summary(sides["async"], 1e6), summary(sides["sync"], 1e6)
        over = [x - y for x, y in zip(sides["sync"], sides["async"], strict=True)]
        cases[case] = {"async_us": a, "sync_us": s, "overhead_us": summary(over, 1e6)}
    cases["noop x8"] = {
        "async_calls_per_s": summary(tput["async"], 1),
        "sync_calls_per_s": summary(tput["sync"], 1),
    }
    return {
        "url": url,
        "transfer": transfer,
        "iters": args.iters,
        "rounds": args.rounds,
        "python": sys.version.split()[0],
        "cases": cases,
    }


#: The phases of one ``Client.noop()`` that :func:`trace_noop` times (name, from, to): the
#: points of the trace hook, the first of each in a call ("call" and "back": the caller's
#: own clock around the call).
TRACE_PHASES = (
    ("caller -> loop thread running the call", "submit", "start"),
    ("loop: task started -> request handed to libzmq", "start", "send"),
    ("libzmq send (queued; its I/O thread signalled)", "send", "sent"),
    ("request queued -> call finished on the loop (the round trip)", "sent", "finish"),
    ("call finished -> caller's flag set (before the loop blocks)", "finish", "wake"),
    ("flag set -> caller running again", "wake", "back"),
    ("whole Client.noop()", "call", "back"),
)


def trace_noop(url: str, http_url: str, calls: int) -> dict[str, dict[str, float]]:
    """Where one ``Client.noop()`` spends its time: the time of the first pass of each point
    of the library's trace hook in each call; medians, 10th and 90th percentiles over
    ``calls`` calls, in µs. The hook is turned off again afterwards; it adds ~1 µs per
    point.

    Raises:
        RuntimeError: a call passed none of a phase's points (the hook's points changed).
    """
    ns = time.perf_counter_ns
    marks: dict[str, int] = {}

    def hook(point: str) -> None:
        marks.setdefault(point, ns())

    rows: list[dict[str, int]] = []
    set_trace_hook(hook)
    try:
        client = Client(url, http_url, MODEL, geometry=GEOM)
        try:
            for _ in range(max(calls // 10, 50)):  # warm up
                client.noop()
            for _ in range(calls):
                marks.clear()
                marks["call"] = ns()
                client.noop()
                marks["back"] = ns()
                rows.append(dict(marks))
        finally:
            client.close()
    finally:
        set_trace_hook(None)
    missing = {p for _, a, b in TRACE_PHASES for p in (a, b) for r in rows if p not in r}
    if missing:
        raise RuntimeError(f"the trace hook never passed {sorted(missing)} in some calls")
    out: dict[str, dict[str, float]] = {}
    for label, a, b in TRACE_PHASES:
        values = sorted(r[b] - r[a] for r in rows)
        n = len(values)
        out[label] = {
            "median_us": values[n // 2] / 1e3,
            "p10_us": values[n // 10] / 1e3,
            "p90_us": values[(9 * n) // 10] / 1e3,
        }
    return out


def _print_trace(result: dict[str, dict[str, float]], calls: int) -> None:
    print(f"one Client.noop(), phases over {calls} calls: median [p10-p90] µs")
    for label, v in result.items():
        print(f"  {label:<64} {v['median_us']:7.1f} [{v['p10_us']:.1f}-{v['p90_us']:.1f}]")


def section(url: str, http_url: str, *, iters: int, rounds: int) -> dict[str, Any]:
    """Every facade case against the running server at ``url``; blocks until done (each
    call has the client's default 60 s deadline)."""
    return asyncio.run(run(argparse.Namespace(iters=iters, rounds=rounds), url, http_url))


def _print_table(result: dict[str, Any]) -> None:
    print(
        f"facade overhead per call -- server {result['url']} ({result['transfer']}), "
        f"{result['rounds']} rounds x {result['iters']} calls, median of round medians [range]"
    )
    print(f"{'case':<10} {'async µs':>20} {'sync µs':>20} {'overhead µs':>20}")

    def cell(d: dict[str, float], digits: int = 0) -> str:
        return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}-{d['max']:.{digits}f}]"

    for case, v in result["cases"].items():
        if case == "noop x8":
            continue
        print(f"{case:<10} {cell(v['async_us']):>20} {cell(v['sync_us']):>20} {cell(v['overhead_us']):>20}")
    t = result["cases"]["noop x8"]
    print(
        f"noop x8    throughput: async {cell(t['async_calls_per_s'])} calls/s, "
        f"sync (8 threads) {cell(t['sync_calls_per_s'])} calls/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="ZMQ endpoint of a running server (default: start one)")
    parser.add_argument("--http-url", help="HTTP endpoint of that server")
    parser.add_argument("--mode", choices=["shm", "pickle"], default="shm", help="for a started server")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--trace",
        type=int,
        metavar="CALLS",
        default=0,
        help="instead: time the phases of CALLS Client.noop() calls (where the hand-over goes)",
    )
    args = parser.parse_args()
    if (args.url is None) != (args.http_url is None):
        parser.error("--url and --http-url go together")

    def measure(url: str, http_url: str) -> Any:
        if args.trace:
            return trace_noop(url, http_url, args.trace)
        return asyncio.run(run(args, url, http_url))

    if args.url is not None:
        result = measure(args.url, args.http_url)
    else:
        from harness.real_server import RealLMCacheServer, lmcache_venv_python

        with RealLMCacheServer(args.mode, venv_python=lmcache_venv_python(), chunk_size=16) as srv:
            result = measure(srv.url, srv.http_url)
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.trace:
        _print_trace(result, args.trace)
    else:
        _print_table(result)


if __name__ == "__main__":
    main()
