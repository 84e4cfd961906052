"""JSON-lines request loop shared by ``engine_worker.py`` and ``sdk_worker.py``.

Stdlib only. Runs inside the lmcache venv; the worker scripts import it by its bare
name (they are run as scripts, so this directory is first on ``sys.path``).

Wire format (one JSON object per line, UTF-8):

* startup: the worker writes :func:`ready_line` (``{"ok": true, "ready": true,
  "pid": N, "worker": "<kind>", "lmcache_version": "...", "generation": "0.5.6" |
  "0.5.7"}``) once its imports succeeded, or ``{"ok": false, "ready": false,
  "error": "..."}`` and exits 1. The spawner (``harness/workers.py``) checks that the
  generation is the one it asked for.
* request: ``{"cmd": "<name>", "id": <any>, ...params}``.
* reply: ``{"ok": true, "id": <echo>, ...results}`` or ``{"ok": false,
  "id": <echo>, "error": "<Type>: <message>", "traceback": "..."}``.
  Exactly one reply per request line, in order. ``quit`` replies and exits;
  EOF on stdin exits too.

The protocol uses a private duplicate of the original stdout; file
descriptor 1 itself is pointed at stderr before anything else is imported,
so library noise (prints, logging, C-level writes) can never corrupt it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class WorkerExit(Exception):
    """Raised by a handler to end the loop after its reply."""

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__("exit")
        self.reply = reply


def installed_lmcache() -> tuple[str, str]:
    """``(version, generation)`` of the lmcache installed in this venv: the 0.5.6 wheel
    is the ``lmcache`` distribution, the 0.5.7rc3 build the ``lmcache-cli`` one."""
    for dist in ("lmcache", "lmcache-cli"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version, "0.5.6" if version == "0.5.6" else "0.5.7"
    raise RuntimeError("no lmcache distribution is installed in this venv")


def ready_line(worker: str) -> dict[str, Any]:
    """The startup line of a worker of kind ``worker`` (see the module docstring)."""
    version, generation = installed_lmcache()
    return {
        "ok": True,
        "ready": True,
        "pid": os.getpid(),
        "worker": worker,
        "lmcache_version": version,
        "generation": generation,
    }


def take_protocol_stdout() -> TextIO:
    """Detach the protocol channel from fd 1 and route fd 1 to stderr."""
    proto_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(proto_fd, "w", encoding="utf-8", buffering=1)


def send(out: TextIO, obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj, separators=(",", ":")) + "\n")
    out.flush()


def error_reply(exc: BaseException) -> dict[str, Any]:
    return {
        "ok": False,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(exc))[-6000:],
    }


def serve(
    out: TextIO,
    handlers: dict[str, Handler],
    *,
    on_exit: Callable[[], None] | None = None,
) -> int:
    """Read requests from stdin until ``quit``/EOF; returns the exit code."""
    try:
        for raw in sys.stdin:
            line = raw.strip()
            if not line:
                continue
            req_id: Any = None
            try:
                req = json.loads(line)
                if not isinstance(req, dict):
                    raise ValueError("request must be a JSON object")
                req_id = req.pop("id", None)
                cmd = req.pop("cmd", None)
                handler = handlers.get(cmd) if isinstance(cmd, str) else None
                if handler is None:
                    raise ValueError(f"unknown cmd {cmd!r}; known: {sorted(handlers)}")
                reply = handler(req)
                reply = {"ok": True, **reply}
            except WorkerExit as ex:
                send(out, {"ok": True, **ex.reply, "id": req_id})
                return 0
            except Exception as exc:  # report, never die on a bad request
                reply = error_reply(exc)
            reply["id"] = req_id
            send(out, reply)
        return 0
    finally:
        if on_exit is not None:
            try:
                on_exit()
            except Exception:
                traceback.print_exc(file=sys.stderr)
