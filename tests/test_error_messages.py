"""Error messages that tell the user what went wrong and what to check: a port of the
embedded server that is in use, KV stored under one model name by clients of different
geometries, a store that finds nothing reservable (with the server's memory usage).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Literal

import pytest

from lmcache_async.testing import EmbeddedServer

pytestmark = pytest.mark.anyio

CS = 16


@contextlib.contextmanager
def listening_port() -> Iterator[int]:
    """A free loopback port, bound and listening on a socket of the test's own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def free_port() -> int:
    with listening_port() as port:
        return port


def threads() -> tuple[set[str], set[str]]:
    """Python threads by name, and every thread of the process (native ones too, e.g.
    ZMQ's I/O threads) by id."""
    return {t.name for t in threading.enumerate()}, set(os.listdir("/proc/self/task"))


def assert_no_new_thread(before: tuple[set[str], set[str]]) -> None:
    """No thread that was not there ``before`` (a joined thread may take a moment to
    leave ``/proc``: waited for, 10 s at most)."""
    deadline = time.monotonic() + 10.0
    while True:
        names, tids = threads()
        if (names <= before[0] and tids <= before[1]) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert names <= before[0], names - before[0]
    assert tids <= before[1], tids - before[1]


def assert_nothing_left(shm_segment: str | None, before: tuple[set[str], set[str]], port: int) -> None:
    """No new thread, no SHM segment, and ``port`` (the other one, bound before the
    failure or never) free."""
    assert_no_new_thread(before)
    assert shm_segment is None or not os.path.exists(shm_segment)
    with socket.create_server(("127.0.0.1", port)):
        pass


def in_use(what: str) -> str:
    """The message of a port in use; ``what`` names the endpoint."""
    return f"[Errno {errno.EADDRINUSE}] cannot {what}: the port is in use (choose another port, or 0 for a free one)"


# --------------------------------------------------------------------------- ports in use


@pytest.mark.parametrize("mode", ["shm", "pickle"])
async def test_a_zmq_port_in_use_is_named_and_nothing_is_left(mode: Literal["shm", "pickle"]) -> None:
    http_port = free_port()
    with listening_port() as port:
        srv = EmbeddedServer(chunk_size=CS, size_bytes=1 << 16, mode=mode, port=port, http_port=http_port)
        before = threads()
        with pytest.raises(OSError, match="the port is in use") as info:
            await srv.start()
    assert info.value.errno == errno.EADDRINUSE
    assert str(info.value) == in_use(f"bind the ZMQ endpoint tcp://127.0.0.1:{port}")
    assert not srv.running
    assert_nothing_left(srv.shm_segment, before, http_port)


async def test_an_http_port_in_use_is_named_and_the_zmq_port_is_released() -> None:
    zmq_port = free_port()
    with listening_port() as port:
        srv = EmbeddedServer(chunk_size=CS, size_bytes=1 << 16, port=zmq_port, http_port=port)
        before = threads()
        with pytest.raises(OSError, match="the port is in use") as info:
            await srv.start()
    assert info.value.errno == errno.EADDRINUSE
    assert str(info.value) == in_use(f"listen on the HTTP endpoint http://127.0.0.1:{port}")
    assert not srv.running
    assert_nothing_left(srv.shm_segment, before, zmq_port)


@pytest.mark.parametrize(
    ("which", "what"),
    [("port", "bind the ZMQ endpoint tcp"), ("http_port", "listen on the HTTP endpoint http")],
)
def test_a_port_in_use_fails_start_in_thread_and_leaves_nothing(which: str, what: str) -> None:
    shm_name = f"lmca_test_{os.getpid()}_{which}"
    other = free_port()
    before = threads()
    with listening_port() as port:
        zmq_port, http_port = (port, other) if which == "port" else (other, port)
        with pytest.raises(OSError, match="the port is in use") as info:
            EmbeddedServer.start_in_thread(
                chunk_size=CS, size_bytes=1 << 16, shm_name=shm_name, port=zmq_port, http_port=http_port
            )
    assert info.value.errno == errno.EADDRINUSE
    assert str(info.value) == in_use(f"{what}://127.0.0.1:{port}")
    assert_nothing_left(f"/dev/shm/lmcache_l1_pool_{shm_name}", before, other)
