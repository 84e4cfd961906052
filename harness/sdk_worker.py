"""The OFFICIAL LMCache SDK (``lmcache.sdk.kvcache``) behind JSON lines.

Run with an LMCACHE venv's python: the 0.5.6 SDK (``.lmcache-venv``) or the
0.5.7rc3 one (``.lmcache-venv-057``, which speaks that generation's wire: packed
token keys, the msgpack tensor envelope on the inline transport); both have the
same public API. Driven by ``harness/workers.py::SDKWorker`` (framing:
``_worker_loop.py``). lmcache's log output goes to stderr. The ready line
carries ``lmcache_version`` and ``generation`` (``"0.5.6"`` or ``"0.5.7"``).

Commands (request -> reply, besides ``ok``/``id``):

* ``connect`` {url, http_url, model_name, timeout=30}
  -> {instance_id, chunk_size, shm_name, transfer}
  ``lmcache.sdk.kvcache.connect(url, http_url, model_name, timeout)``; it reads
  ``/config`` and ``/status`` (a vLLM-style ``cache_context_meta`` entry for
  ``model_name`` must exist, e.g. from ``engine_worker.py``) and registers an
  engine-driven context. ``transfer`` is the SDK's transfer class name
  (``...Shm``, or ``...Pickle`` on 0.5.6 / ``...Inline`` on 0.5.7).
* ``store`` {tokens, kv_file, cache_salt="", request_configs=null} -> {result: bool}
  ``ctx.store(kv, tokens, cache_salt, request_configs)``; ``kv_file`` is a
  ``torch.save`` of ``[2, L, T, D]``.
* ``retrieve`` {tokens, out_file, cache_salt="", request_configs=null} -> {hit_tokens: n}
  ``ctx.retrieve(tokens, cache_salt, request_configs)``; when n > 0 the tensor
  ``[2, L, n, D]`` is written to ``out_file``; a miss gives n = 0.
* ``close`` -> {} (``ctx.close()``; the SDK never unregisters).
* ``quit`` -> {} (closes first).
"""

from __future__ import annotations

import sys

# Run as a script (``python path/to/this.py``), so its own directory is sys.path[0]:
# the sibling _worker_loop imports by its bare name, with no sys.path edit.
from _worker_loop import WorkerExit, error_reply, installed_lmcache, send, serve, take_protocol_stdout

PROTO = take_protocol_stdout()

try:
    import os
    from typing import Any

    import torch
    from lmcache.sdk import kvcache
except Exception as _exc:  # pragma: no cover - reported to the parent
    send(PROTO, {**error_reply(_exc), "ready": False})
    sys.exit(1)


def _transfer_name(ctx: Any) -> str:
    """Best-effort name of the engine-driven transfer strategy the SDK picked."""
    wrapper = getattr(ctx, "transfer_ctx", None)
    for attr in ("_ctx", "ctx", "_engine_driven_context", "engine_driven_context", "_context"):
        inner = getattr(wrapper, attr, None)
        if inner is not None:
            return type(inner).__name__
    return type(wrapper).__name__


class SDK:
    def __init__(self) -> None:
        self.ctx: Any = None

    def _require(self) -> Any:
        if self.ctx is None:
            raise RuntimeError("not connected; send 'connect' first")
        return self.ctx

    def connect(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.ctx is not None:
            raise RuntimeError("already connected; send 'close' first")
        ctx = kvcache.connect(
            url=str(req["url"]),
            http_url=str(req["http_url"]),
            model_name=str(req["model_name"]),
            timeout=float(req.get("timeout", 30.0)),
        )
        self.ctx = ctx
        return {
            "instance_id": int(ctx.instance_id),
            "chunk_size": int(ctx.chunk_size),
            "shm_name": str(getattr(ctx, "shm_name", "")),
            "transfer": _transfer_name(ctx),
        }

    def store(self, req: dict[str, Any]) -> dict[str, Any]:
        ctx = self._require()
        kv = torch.load(req["kv_file"], weights_only=True)
        tokens = [int(t) for t in req["tokens"]]
        result = ctx.store(
            kv,
            tokens,
            cache_salt=str(req.get("cache_salt", "")),
            request_configs=req.get("request_configs"),
        )
        return {"result": bool(result)}

    def retrieve(self, req: dict[str, Any]) -> dict[str, Any]:
        ctx = self._require()
        tokens = [int(t) for t in req["tokens"]]
        out = ctx.retrieve(
            tokens,
            cache_salt=str(req.get("cache_salt", "")),
            request_configs=req.get("request_configs"),
        )
        if out is None:
            return {"hit_tokens": 0}
        # Token axis of the SDK's result is ndim - 2 ([2, L, n, D]).
        n = int(out.shape[-2])
        torch.save(out.contiguous(), str(req["out_file"]))
        return {"hit_tokens": n, "shape": list(out.shape), "dtype": str(out.dtype)}

    def close(self, _req: dict[str, Any]) -> dict[str, Any]:
        ctx, self.ctx = self.ctx, None
        if ctx is not None:
            ctx.close()
        return {}

    def quit(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            self.close(req)
        except Exception as exc:
            print(f"close on quit failed: {exc!r}", file=sys.stderr)
        raise WorkerExit({})

    def shutdown(self) -> None:
        if self.ctx is not None:
            self.close({})


def main() -> int:
    sdk = SDK()
    version, generation = installed_lmcache()
    send(
        PROTO,
        {
            "ok": True,
            "ready": True,
            "pid": os.getpid(),
            "worker": "sdk",
            "lmcache_version": version,
            "generation": generation,
        },
    )
    handlers = {
        "connect": sdk.connect,
        "store": sdk.store,
        "retrieve": sdk.retrieve,
        "close": sdk.close,
        "quit": sdk.quit,
    }
    return serve(PROTO, handlers, on_exit=sdk.shutdown)


if __name__ == "__main__":
    sys.exit(main())
