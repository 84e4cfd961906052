"""The process's one ZMQ context (lmcache_async._base.zmq_context): every socket of the package is
made on it, it is never terminated (so no garbage collection can block in ``term()``), and
a forked child gets a fresh one."""

from __future__ import annotations

import os

import pytest
import zmq

from lmcache_async._base import zmq_context as _zmq_context
from lmcache_async._transport.connection import Connection
from lmcache_async.testing import EmbeddedServer


def test_one_context_per_process_that_refuses_to_terminate() -> None:
    ctx = _zmq_context.process_context()
    assert _zmq_context.process_context() is ctx
    assert ctx.get(zmq.IO_THREADS) == _zmq_context.IO_THREADS
    with pytest.raises(
        RuntimeError, match="^the lmcache_async process-wide ZMQ context is never terminated$"
    ):
        ctx.term()
    with pytest.raises(
        RuntimeError, match="^the lmcache_async process-wide ZMQ context is never terminated$"
    ):
        ctx.destroy(linger=0)
    sock = ctx.socket(zmq.DEALER)
    ctx.__del__()  # what the collector would run: nothing (pyzmq's own destroys the context)
    assert not ctx.closed and not sock.closed
    sock.close(linger=0)


def test_monitor_addresses_are_unique() -> None:
    a, b = _zmq_context.monitor_address(), _zmq_context.monitor_address()
    assert a != b and a.startswith(f"inproc://lmcache-async-monitor-{os.getpid()}-")


@pytest.mark.anyio
async def test_clients_and_the_embedded_server_use_it_and_close_their_sockets() -> None:
    ctx = _zmq_context.process_context()
    async with EmbeddedServer() as srv:
        assert srv._ctx is not None and srv._ctx.underlying == ctx.underlying  # a shadow
        conn = Connection(srv.url)
        await conn.open(timeout=10)
        assert conn._ctx is ctx
        sock, monitor = conn._sock, conn._monitor
        assert sock is not None and monitor is not None
        await conn.close()
        assert sock.closed and monitor.closed and conn._ctx is None
    assert not ctx.closed


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_fresh_context_and_keeps_the_parents() -> None:
    parent = _zmq_context.process_context()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanups
        try:
            child = _zmq_context.process_context()
            ok = child is not parent and parent in _zmq_context._inherited and not child.closed
            os.write(write_fd, b"ok" if ok else b"bad")
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        assert os.read(read_fd, 16) == b"ok"
    finally:
        os.close(read_fd)
        assert os.waitpid(pid, 0)[1] == 0
    assert _zmq_context.process_context() is parent
