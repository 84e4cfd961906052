"""The official SDK's side of benchmarks/bench_client.py (run with the lmcache venv's python).

JSON lines over stdin/stdout (framing: tests/support/_worker_loop.py):

* ``connect`` {url, http_url, model_name} -> {chunk_size}
* ``bench`` {case: "store" | "retrieve" | "pair", chunks, iters, base} -> {times: [s, ...]}
  ``store``: each iteration stores fresh tokens; ``retrieve``: stores once, then times
  retrieves of the same tokens; ``pair``: fresh tokens, store then retrieve.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from _worker_loop import WorkerExit, error_reply, installed_lmcache, send, serve, take_protocol_stdout

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
    layers, hidden = state["geom"]
    return torch.randn(2, layers, n_tokens, hidden, dtype=torch.float32).to(torch.bfloat16)


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
    return {"times": times}


def quit_(req: dict[str, Any]) -> dict[str, Any]:
    raise WorkerExit({})


_version, _generation = installed_lmcache()  # the ready line says which lmcache this is
send(
    PROTO,
    {"ok": True, "ready": True, "worker": "sdk-bench", "lmcache_version": _version, "generation": _generation},
)
sys.exit(serve(PROTO, {"connect": connect, "bench": bench, "quit": quit_}))
