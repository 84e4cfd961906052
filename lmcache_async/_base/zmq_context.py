"""The process's one ZMQ context: created at first use, never terminated.

Why: ``zmq_ctx_term()`` blocks until every socket of the context is closed. pyzmq calls it
from ``Context.__del__`` (through ``destroy()``, which closes the sockets it still tracks
first), and the garbage collector runs ``__del__`` on whichever thread collects: when the
sockets are garbage in the same collection, the context's weak references to them are
already cleared, ``destroy()`` closes nothing, and ``term()`` waits forever for sockets
nobody will close. A context per client (as before) made every unclosed client a
possible hang of the whole process.

So every socket of the package (the clients' DEALERs and their monitors, the embedded
test server's ROUTER, through a shadow) is made on :func:`process_context`, whose
``__del__``, ``term()`` and ``destroy()`` do nothing or refuse: no ``term()`` can ever
run, from a finalizer, the collector or anywhere else. Sockets are made with linger 0 and
closed by their owners (a client's ``aclose()``, or its finalizer, which needs no event
loop); closing a socket never blocks. A socket collected unclosed is closed by pyzmq's own
``Socket.__del__``, which does not block either. At interpreter exit the context is left
as it is: the process's end takes its I/O threads with it.

Fork: a child gets a fresh context at its first use; the parent's (unusable in the child)
is kept referenced and untouched (pyzmq's close and term are no-ops in another pid).
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any, Final

import zmq

__all__ = ["IO_THREADS", "monitor_address", "process_context"]

#: The context's I/O threads: libzmq gives each new socket the least busy one, so several
#: clients of one process do not share one thread (a context per client had one each).
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
