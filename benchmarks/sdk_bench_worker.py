"""The official SDK's side of benchmarks/suite/bench_client.py (run with the lmcache venv's python).

JSON lines over stdin/stdout (framing: harness/_worker_loop.py):

* ``connect`` {url, http_url, model_name} -> {chunk_size}
* ``bench`` {case: "store" | "retrieve" | "pair", chunks, iters, base} -> {times: [s, ...], cpu}
  ``store``: each iteration stores fresh tokens; ``retrieve``: stores once, then times
  retrieves of the same tokens; ``pair``: fresh tokens, store then retrieve. ``cpu``: this
  process's CPU seconds (``time.process_time``) over the timed iterations.
* ``concurrent`` {op: "store" | "retrieve", starts, tokens, threads} -> {elapsed, cpu, done}
  one operation per start (``range(start, start + tokens)``), spread over ``threads``
  threads sharing the one context (a ``ThreadPoolExecutor``); ``retrieve`` expects the
  prompts to be stored already, ``store`` stores one random KV under each.
* ``fresh`` {url, http_url, model_name, start, tokens} -> {connect_s, first_s, second_s}
  a new context (``kvcache.connect``), two timed retrieves of stored tokens, closed again.
* ``untouched`` {url, http_url, model_name, op: "store" | "retrieve", starts, tokens}
  -> {times: [s, ...], faults: [n, ...]} a new context (a fresh mapping of the pool), one
  timed operation per start (``store``: a random KV under fresh tokens; ``retrieve``:
  tokens stored before, into the new tensor the SDK returns, dropped before the next),
  with this process's minor page faults during each; closed again.
"""

from __future__ import annotations

import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# Run as a script with an lmcache venv's python: its own directory is sys.path[0]
# (sdk_worker_ready), and the spawner puts harness/ on PYTHONPATH (_worker_loop).
from _worker_loop import WorkerExit, error_reply, send, serve, take_protocol_stdout
from sdk_worker_ready import ready_line

PROTO = take_protocol_stdout()

try:
    from typing import Any

    import torch
    from lmcache.sdk import kvcache
except Exception as _exc:  # pragma: no cover
    send(PROTO, {**error_reply(_exc), "ready": False})
    sys.exit(1)

state: dict[str, Any] = {}


def connect(req: dict[str, Any]) -> dict[str, Any]:
    ctx = kvcache.connect(req["url"], req["http_url"], req["model_name"], timeout=60.0)
    state["ctx"] = ctx
    state["geom"] = req["geometry"]  # [L, D]
    return {"chunk_size": ctx.chunk_size}


def _kv(n_tokens: int) -> torch.Tensor:
    """A random KV of ``n_tokens`` (made once per size: 512 MiB of randn costs seconds)."""
    cache = state.setdefault("kv", {})
    if n_tokens not in cache:
        layers, hidden = state["geom"]
        cache[n_tokens] = torch.randn(2, layers, n_tokens, hidden, dtype=torch.float32).to(torch.bfloat16)
    return cache[n_tokens]


def bench(req: dict[str, Any]) -> dict[str, Any]:
    ctx = state["ctx"]
    cs = ctx.chunk_size
    n = req["chunks"] * cs
    kv = _kv(n)
    base = int(req["base"])
    times: list[float] = []
    if req["case"] == "retrieve":
        tokens = list(range(base, base + n))
        ctx.store(kv, tokens)
        assert ctx.retrieve(tokens) is not None
    cpu0 = time.process_time()
    for i in range(req["iters"]):
        if req["case"] == "retrieve":
            t0 = time.perf_counter()
            got = ctx.retrieve(tokens)
            times.append(time.perf_counter() - t0)
            assert got is not None and got.shape[2] == n
            del got
            continue
        tokens = list(range(base + (i + 1) * n, base + (i + 2) * n))
        t0 = time.perf_counter()
        ok = ctx.store(kv, tokens)
        if req["case"] == "pair":
            got = ctx.retrieve(tokens)
            assert got is not None
        times.append(time.perf_counter() - t0)
        assert ok
    return {"times": times, "cpu": time.process_time() - cpu0}


def concurrent(req: dict[str, Any]) -> dict[str, Any]:
    ctx = state["ctx"]
    n = int(req["tokens"])
    prompts = [list(range(s, s + n)) for s in req["starts"]]
    kv = _kv(n)
    if req["op"] == "retrieve":

        def one(tokens: list[int]) -> bool:
            got = ctx.retrieve(tokens)
            return got is not None and got.shape[2] == n

    else:

        def one(tokens: list[int]) -> bool:
            return bool(ctx.store(kv, tokens))

    with ThreadPoolExecutor(int(req["threads"])) as pool:
        t0, cpu0 = time.perf_counter(), time.process_time()
        done = sum(pool.map(one, prompts))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"elapsed": elapsed, "cpu": cpu, "done": done}


def fresh(req: dict[str, Any]) -> dict[str, Any]:
    n = int(req["tokens"])
    tokens = list(range(int(req["start"]), int(req["start"]) + n))
    t0 = time.perf_counter()
    ctx = kvcache.connect(req["url"], req["http_url"], req["model_name"], timeout=60.0)
    t1 = time.perf_counter()
    try:
        got = ctx.retrieve(tokens)
        t2 = time.perf_counter()
        assert got is not None and got.shape[2] == n
        del got
        t3 = time.perf_counter()
        got = ctx.retrieve(tokens)
        t4 = time.perf_counter()
        assert got is not None
    finally:
        ctx.close()
    return {"connect_s": t1 - t0, "first_s": t2 - t1, "second_s": t4 - t3}


def untouched(req: dict[str, Any]) -> dict[str, Any]:
    n = int(req["tokens"])
    kv = _kv(n) if req["op"] == "store" else None
    ctx = kvcache.connect(req["url"], req["http_url"], req["model_name"], timeout=60.0)
    times: list[float] = []
    faults: list[int] = []
    try:
        for start in req["starts"]:
            tokens = list(range(int(start), int(start) + n))
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            if kv is not None:
                ok = ctx.store(kv, tokens)
            else:
                got = ctx.retrieve(tokens)
                ok = got is not None and got.shape[2] == n
            times.append(time.perf_counter() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            assert ok
            got = None
    finally:
        ctx.close()
    return {"times": times, "faults": faults}


def quit_(req: dict[str, Any]) -> dict[str, Any]:
    raise WorkerExit({})


send(PROTO, ready_line("sdk-bench"))
sys.exit(
    serve(
        PROTO,
        {
            "connect": connect,
            "bench": bench,
            "concurrent": concurrent,
            "fresh": fresh,
            "untouched": untouched,
            "quit": quit_,
        },
    )
)
