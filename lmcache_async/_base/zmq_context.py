"""The process's one ZMQ context: created at first use, never terminated.

Invariant: every socket of the package is made on :func:`process_context`, whose
``__del__``, ``term()`` and ``destroy()`` do nothing or refuse, so no ``zmq_ctx_term()`` can
block a finalizer or the collector; sockets are made with linger 0 and closed by their
owners. A forked child gets a fresh context at its first use (docs/internals/design.md,
section "A client never closed").
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any, Final

import zmq

__all__ = ["IO_THREADS", "monitor_address", "process_context"]

#: The context's I/O threads: libzmq gives each new socket the least busy one, so several
#: clients of one process do not share one thread.
IO_THREADS: Final = max(1, min(4, os.cpu_count() or 1))


class ProcessContext(zmq.Context[zmq.Socket[Any]]):
    """The process-wide context: never terminated (see the module's docstring)."""

    def __del__(self) -> None:
        """Nothing: the context is never terminated (pyzmq's would ``destroy()`` it)."""

    def term(self) -> None:
        raise RuntimeError("the lmcache_async process-wide ZMQ context is never terminated")

    def destroy(self, linger: int | None = None) -> None:
        raise RuntimeError("the lmcache_async process-wide ZMQ context is never terminated")


_lock = threading.Lock()
_context: ProcessContext | None = None
_context_pid = 0
#: Contexts inherited across fork: kept referenced, so never collected in the child.
_inherited: list[ProcessContext] = []
_monitor_ids = itertools.count()


def process_context() -> ProcessContext:
    """The process's ZMQ context (made at the first call in this process)."""
    global _context, _context_pid
    ctx = _context
    if ctx is not None and _context_pid == os.getpid():
        return ctx
    with _lock:
        if _context is None or _context_pid != os.getpid():
            if _context is not None:
                _inherited.append(_context)
            _context = ProcessContext(io_threads=IO_THREADS)
            _context_pid = os.getpid()
        return _context


def monitor_address() -> str:
    """A fresh ``inproc://`` address for a socket monitor (unique in the context: the
    default, named after the socket's descriptor, could meet a closed socket's monitor
    still bound in the shared context)."""
    return f"inproc://lmcache-async-monitor-{os.getpid()}-{next(_monitor_ids)}"


def _after_fork_in_child() -> None:
    global _lock, _context
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork
    if _context is not None:
        _inherited.append(_context)
        _context = None


os.register_at_fork(after_in_child=_after_fork_in_child)
