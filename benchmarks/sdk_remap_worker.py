"""The official SDK's side of benchmarks/suite/bench_remap_batch.py (run with the lmcache venv's python).

JSON lines over stdin/stdout (framing: harness/_worker_loop.py):

* ``connect`` {url, http_url, model_name} -> {chunk_size}
  ``lmcache.sdk.kvcache.connect``; the model must have a vLLM-style registration.
* ``remap`` {pairs: [[source_start, target_start], ...], num_tokens}
  -> {elapsed, hits, stored}
  For each pair, in a loop (what a user of the SDK writes): ``kv = ctx.retrieve(source)``
  then ``ctx.store(kv, target)``; tokens are ``range(start, start + num_tokens)``, built
  before the clock starts. ``elapsed`` is measured in this process.
"""

from __future__ import annotations

import sys
import time

# Run as a script with an lmcache venv's python: its own directory is sys.path[0]
# (sdk_worker_ready), and the spawner puts harness/ on PYTHONPATH (_worker_loop).
from _worker_loop import WorkerExit, error_reply, send, serve, take_protocol_stdout
from sdk_worker_ready import ready_line

PROTO = take_protocol_stdout()

try:
    from typing import Any

    from lmcache.sdk import kvcache
except Exception as _exc:  # pragma: no cover
    send(PROTO, {**error_reply(_exc), "ready": False})
    sys.exit(1)

state: dict[str, Any] = {}


def connect(req: dict[str, Any]) -> dict[str, Any]:
    ctx = kvcache.connect(req["url"], req["http_url"], req["model_name"], timeout=120.0)
    state["ctx"] = ctx
    return {"chunk_size": ctx.chunk_size}


def remap(req: dict[str, Any]) -> dict[str, Any]:
    ctx = state["ctx"]
    n = int(req["num_tokens"])
    pairs = [(list(range(s, s + n)), list(range(t, t + n))) for s, t in req["pairs"]]
    hits = stored = 0
    t0 = time.perf_counter()
    for source, target in pairs:
        kv = ctx.retrieve(source)
        if kv is None:
            continue
        hits += 1
        stored += bool(ctx.store(kv, target))
        del kv
    return {"elapsed": time.perf_counter() - t0, "hits": hits, "stored": stored}


def quit_(req: dict[str, Any]) -> dict[str, Any]:
    raise WorkerExit({})


def main() -> int:
    send(PROTO, ready_line("sdk-remap"))
    return serve(PROTO, {"connect": connect, "remap": remap, "quit": quit_})


if __name__ == "__main__":
    sys.exit(main())
