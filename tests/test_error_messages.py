"""Error messages that tell the user what went wrong and what to check: a port of the
embedded server that is in use, KV stored under one model name by clients of different
geometries, a store that finds nothing reservable (with the server's memory usage).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import pytest
import torch

from lmcache_async import AsyncClient, KVGeometry, ProtocolError
from lmcache_async.testing import EmbeddedServer
from lmcache_async.wire import LayoutMismatch
from tests.conftest import SMALL_GEOMETRY, fresh_tokens, random_kv, unique_model

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


# --------------------------------------------------------------------------- geometries

#: Other geometries under the same model name than SMALL_GEOMETRY's (chunk [2, 2, 16, 16]
#: bfloat16): half the KV heads, or another dtype.
HALF_HEADS = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16, block_size=16)
FLOAT16 = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=16)
#: What the message shows, per transport ("slot": SHM, "tensor": inline) and geometry.
DETAILS = {
    ("slot", "half-heads"): ("slot shape", "[2, 2, 16, 16]", "[2, 2, 16, 8]"),
    ("slot", "float16"): ("slot dtype", "'bfloat16'", "'float16'"),
    ("tensor", "half-heads"): ("tensor shape", "[2, 2, 16, 16]", "[2, 2, 16, 8]"),
    ("tensor", "float16"): ("tensor dtype", "torch.bfloat16", "torch.float16"),
}
OTHERS = [pytest.param(HALF_HEADS, id="half-heads"), pytest.param(FLOAT16, id="float16")]


def check_other_geometry(err: LayoutMismatch, model: str, mode: str, other: KVGeometry) -> None:
    """``err`` names the model, the mismatch and what to check (and pickles whole)."""
    what, got, expected = DETAILS[
        ("slot" if mode == "shm" else "tensor", "float16" if other is FLOAT16 else "half-heads")
    ]
    assert str(err) == (
        f"the KV stored under model {model!r} does not match this client's geometry ({what} {got} != "
        f"expected {expected}): it was stored with another geometry under the same model name; check "
        "geometry= (the KVGeometry given to this client)"
    )
    assert isinstance(err, ProtocolError)
    assert (err.what, err.got, err.expected, err.model_name) == (what, got, expected, model)
    copy = pickle.loads(pickle.dumps(err))
    assert (type(copy), str(copy), copy.model_name) == (LayoutMismatch, str(err), model)


@pytest.mark.parametrize("other", OTHERS)
@pytest.mark.parametrize(
    ("protocol", "mode"),
    [("0.5.6", "shm"), ("0.5.6", "pickle"), ("0.5.7", "shm")],
    ids=["056-shm", "056-pickle", "057-shm"],
)
async def test_kv_of_another_geometry_names_the_model_and_geometry(
    protocol: Literal["0.5.6", "0.5.7"], mode: Literal["shm", "pickle"], other: KVGeometry
) -> None:
    model = unique_model("geom")
    tokens = fresh_tokens(2 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    async with EmbeddedServer(chunk_size=CS, mode=mode, size_bytes=1 << 20, protocol=protocol) as srv:
        async with AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=10) as writer:
            assert await writer.store(kv, tokens) is True
        async with AsyncClient(srv.url, srv.http_url, model, geometry=other, timeout=10) as reader:
            assert await reader.lookup(tokens) == 2 * CS
            with pytest.raises(LayoutMismatch) as info:
                await reader.retrieve(tokens)
            check_other_geometry(info.value, model, mode, other)
            if mode == "shm":  # the in-pool remap reads the source's slots the same way
                with pytest.raises(LayoutMismatch) as info:
                    await reader.remap(tokens, fresh_tokens(2 * CS))
                check_other_geometry(info.value, model, mode, other)
        # Nothing is left pending: every lock, read and session was released.
        assert srv.leftovers().is_clean(), srv.leftovers()
        async with AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=10) as again:
            got = await again.retrieve(tokens)
            assert got is not None and torch.equal(got, kv)


@pytest.mark.parametrize("other", OTHERS)
async def test_kv_of_another_geometry_on_the_real_server(real_server: Any, other: KVGeometry) -> None:
    model = unique_model("geom")
    tokens = fresh_tokens(2 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    url, http_url = real_server.url, real_server.http_url
    async with AsyncClient(url, http_url, model, geometry=SMALL_GEOMETRY, timeout=30) as writer:
        assert await writer.store(kv, tokens) is True
    async with AsyncClient(url, http_url, model, geometry=other, timeout=30) as reader:
        with pytest.raises(LayoutMismatch) as info:
            await reader.retrieve(tokens)
        check_other_geometry(info.value, model, real_server.mode, other)
    async with AsyncClient(url, http_url, model, geometry=SMALL_GEOMETRY, timeout=30) as again:
        got = await again.retrieve(tokens)
        assert got is not None and torch.equal(got, kv)
