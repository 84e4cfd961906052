"""Error messages that tell the user what went wrong and what to check: a port of the
embedded server that is in use, KV stored under one model name by clients of different
geometries, a store that finds nothing reservable (with the server's memory usage).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import pickle
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import pytest
import torch
import zmq

from lmcache_async import (
    AsyncClient,
    HTTPStatusError,
    KVGeometry,
    LMCacheTimeoutError,
    ProtocolError,
    TransferError,
)
from lmcache_async._base.zmq_context import process_context
from lmcache_async._engine import copies as copies
from lmcache_async._engine.ops import Operations, Registration
from lmcache_async._engine.ops.base import l1_memory
from lmcache_async._engine.runner import run_detached
from lmcache_async._protocol.wire import (
    GEN_0_5_6,
    CacheKey,
    Op,
    RegisterPayload,
    parse_prepare_store,
    parse_register_response,
)
from lmcache_async._transport.metadata import Metadata
from lmcache_async._transport.shm import ShmPool
from lmcache_async.errors import LayoutMismatchError
from lmcache_async.testing import EmbeddedServer, NoReply
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, random_kv, unique_model

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
    ZMQ's I/O threads) by id. The process-wide ZMQ context (``_zmq_context``), which every
    client and embedded server shares and which lives as long as the process, is made
    first, so that its threads are in every baseline (a test run alone would else count
    them as left by the server under test): libzmq starts them with its first socket."""
    process_context().socket(zmq.PAIR).close(linger=0)
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
    failure or never) free: libzmq closes a socket's file descriptor in its reaper thread,
    a moment after ``close()`` returns, so that is waited for (10 s at most)."""
    assert_no_new_thread(before)
    assert shm_segment is None or not os.path.exists(shm_segment)
    deadline = time.monotonic() + 10.0
    while True:
        try:
            with socket.create_server(("127.0.0.1", port)):
                return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
        time.sleep(0.01)


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
    ("envelope", "half-heads"): ("tensor envelope: tensor 0 shape", "[2, 2, 16, 16]", "[2, 2, 16, 8]"),
    ("envelope", "float16"): ("tensor envelope: tensor 0 dtype", "bfloat16", "float16"),
}
OTHERS = [pytest.param(HALF_HEADS, id="half-heads"), pytest.param(FLOAT16, id="float16")]


def check_other_geometry(
    err: LayoutMismatchError, model: str, mode: str, other: KVGeometry, protocol: str = "0.5.6"
) -> None:
    """``err`` names the model, the mismatch and what to check (and pickles whole)."""
    reply = "slot" if mode == "shm" else "tensor" if protocol == "0.5.6" else "envelope"
    what, got, expected = DETAILS[(reply, "float16" if other is FLOAT16 else "half-heads")]
    assert str(err) == (
        f"the KV stored under model {model!r} does not match this client's geometry ({what} {got} != "
        f"expected {expected}): it was stored with another geometry under the same model name; check "
        "geometry= (the KVGeometry given to this client)"
    )
    assert isinstance(err, ProtocolError)
    assert (err.what, err.got, err.expected, err.model_name) == (what, got, expected, model)
    copy = pickle.loads(pickle.dumps(err))
    assert (type(copy), str(copy), copy.model_name) == (LayoutMismatchError, str(err), model)


@pytest.mark.parametrize("other", OTHERS)
@pytest.mark.parametrize(
    ("protocol", "mode"),
    [("0.5.6", "shm"), ("0.5.6", "pickle"), ("0.5.7", "shm"), ("0.5.7", "pickle")],
    ids=["056-shm", "056-pickle", "057-shm", "057-pickle"],
)
async def test_kv_of_another_geometry_names_the_model_and_geometry(
    protocol: Literal["0.5.6", "0.5.7"], mode: Literal["shm", "pickle"], other: KVGeometry
) -> None:
    model = unique_model("geom")
    tokens = fresh_tokens(2 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    async with EmbeddedServer(chunk_size=CS, mode=mode, size_bytes=1 << 20, generation=protocol) as srv:
        async with AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=10) as writer:
            assert await writer.store(kv, tokens) is True
        async with AsyncClient(srv.url, srv.http_url, model, geometry=other, timeout=10) as reader:
            assert await reader.lookup(tokens) == 2 * CS
            with pytest.raises(LayoutMismatchError) as info:
                await reader.retrieve(tokens)
            check_other_geometry(info.value, model, mode, other, protocol)
            if mode == "shm":  # the in-pool remap reads the source's slots the same way
                with pytest.raises(LayoutMismatchError) as info:
                    await reader.remap(tokens, fresh_tokens(2 * CS))
                check_other_geometry(info.value, model, mode, other, protocol)
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
        with pytest.raises(LayoutMismatchError) as info:
            await reader.retrieve(tokens)
        check_other_geometry(info.value, model, real_server.mode, other)
    async with AsyncClient(url, http_url, model, geometry=SMALL_GEOMETRY, timeout=30) as again:
        got = await again.retrieve(tokens)
        assert got is not None and torch.equal(got, kv)


# --------------------------------------------------------------------------- nothing reservable

MODEL = "mem"
SLOT = 4096  # one chunk of SMALL_GEOMETRY (2048 bytes) in its aligned slot
L1_SLOTS = 8
StatusFetch = Callable[[float], Awaitable[Mapping[str, Any]]]


class EngineChannel:
    """The operations' channel over an embedded server's engine, on the test's loop."""

    def __init__(self, srv: EmbeddedServer) -> None:
        self.srv = srv

    @property
    def usable(self) -> bool:
        return True

    async def call(self, opcode: Op, args: Sequence[Any], timeout: float | None) -> Any:
        try:
            return await self.srv.handle(opcode, list(GEN_0_5_6.request_args(opcode, args)))
        except NoReply as exc:  # the real server would answer nothing
            raise LMCacheTimeoutError(opcode.name.lower(), 0.0) from exc


@contextlib.asynccontextmanager
async def l1_server() -> AsyncIterator[EmbeddedServer]:
    """An embedded SHM server whose L1 holds exactly ``L1_SLOTS`` chunks."""
    async with EmbeddedServer(chunk_size=CS, size_bytes=L1_SLOTS * SLOT) as srv:
        yield srv


@contextlib.asynccontextmanager
async def store_ops(srv: EmbeddedServer, fetch: StatusFetch | None) -> AsyncIterator[Operations]:
    """The operations of a registration of its own, given ``fetch`` for ``/status``."""
    instance_id = 7000 + len(srv.engine.status()["registrations"])
    payload = RegisterPayload(
        instance_id=instance_id,
        model_name=MODEL,
        world_size=1,
        block_size=SMALL_GEOMETRY.block_size,
        num_layers=SMALL_GEOMETRY.num_layers,
        hidden_dim_size=SMALL_GEOMETRY.hidden_dim,
        dtype_str="bfloat16",
        use_mla=False,
        num_physical_slots=CS,
    )
    shm_name, pool_size = parse_register_response(
        await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [payload.to_wire()])
    )
    pool = ShmPool(shm_name, pool_size)
    reg = Registration(
        model_name=MODEL,
        geometry=SMALL_GEOMETRY,
        chunk_size=CS,
        wire=GEN_0_5_6,
        instance_id=instance_id,
        pool=pool,
        server_has_shm=True,
        write_ttl=srv.write_ttl,
    )
    try:
        yield Operations(EngineChannel(srv), reg, cleanup_grace=2.0, server_status=fetch)
    finally:
        pool.close()


async def reserve(srv: EmbeddedServer, tokens: list[int]) -> None:
    """Another writer (a registration of its own) reserves ``tokens`` and never commits."""
    async with store_ops(srv, None) as other:
        key = CacheKey(MODEL, 1, 0, tokens, 0, len(tokens), "other-writer").to_wire(GEN_0_5_6)
        slots, _ = parse_prepare_store(await srv.handle(Op.PREPARE_STORE, [key, other.reg.instance_id]))
        assert len(slots) == len(tokens) // CS


async def failed_store(ops: Operations, tokens: list[int], timeout: float = 1.0) -> str:
    """Store ``tokens`` (timeout 1 s): the TransferError's message."""
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    with pytest.raises(TransferError) as info:
        await run_detached("store", timeout, 2.0, lambda op: ops.store(op, kv, tokens, len(tokens), ""))
    return str(info.value)


def not_reservable(chunks: int) -> str:
    return (
        f"the server could not reserve memory for {chunks} chunks that are not cached: they are reserved "
        "by another writer (until it commits, or until its reservation expires after the server's write "
        "TTL of 600 s), or L1 is out of memory"
    )


@contextlib.asynccontextmanager
async def http_status(srv: EmbeddedServer) -> AsyncIterator[StatusFetch]:
    """The client's ``/status`` fetch (over HTTP, never cached) of ``srv``."""
    meta = Metadata(srv.http_url)
    try:
        yield lambda timeout: meta.status(max_age=0, timeout=timeout)
    finally:
        await meta.close()


async def test_a_store_held_by_another_writer_shows_the_servers_memory_usage() -> None:
    tokens = fresh_tokens(2 * CS)
    async with l1_server() as srv, http_status(srv) as fetch, store_ops(srv, fetch) as ops:
        await reserve(srv, tokens)
        assert await failed_store(ops, tokens) == not_reservable(2) + (
            " (server L1 memory: 8192 of 32768 bytes used (25%); 2 write reservations pending, 8192 bytes staged)"
        )


async def test_a_store_into_a_full_l1_shows_the_servers_memory_usage() -> None:
    async with l1_server() as srv, http_status(srv) as fetch, store_ops(srv, fetch) as ops:
        await reserve(srv, fresh_tokens(L1_SLOTS * CS))  # every slot, never committed
        assert await failed_store(ops, fresh_tokens(CS)) == not_reservable(1) + (
            " (server L1 memory: 32768 of 32768 bytes used (100%); 8 write reservations pending, 32768 bytes staged)"
        )


async def _hangs(timeout: float) -> Mapping[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _refused(timeout: float) -> Mapping[str, Any]:
    raise HTTPStatusError(
        503, "http://127.0.0.1:9/status", "", "GET http://127.0.0.1:9/status failed with HTTP 503"
    )


async def _no_usage(timeout: float) -> Mapping[str, Any]:
    return {"is_healthy": True, "storage_manager": {"l1_usage": [1, 2]}}


@pytest.mark.parametrize(
    ("fetch", "why"),
    [
        (_hangs, "/status did not answer in time"),
        (_refused, "GET http://127.0.0.1:9/status failed with HTTP 503"),
        (_no_usage, "/status has no L1 memory usage (storage_manager.l1_usage and l1_managers)"),
    ],
)
async def test_a_status_that_fails_never_masks_the_store_error(fetch: StatusFetch, why: str) -> None:
    tokens = fresh_tokens(2 * CS)
    async with l1_server() as srv, store_ops(srv, fetch) as ops:
        await reserve(srv, tokens)
        message = await failed_store(ops, tokens)  # a TransferError before the caller's deadline
        assert message == not_reservable(2) + f" (server memory usage unavailable: {why})"


async def test_the_real_servers_status_gives_the_l1_memory_usage(
    real_server_shm: Any, real_server_057_shm: Any
) -> None:
    """The fields the message is made of, on the real 0.5.6 and 0.5.7 servers."""
    for srv in (real_server_shm, real_server_057_shm):
        meta = Metadata(srv.http_url)
        try:
            status = await meta.status(max_age=0, timeout=10)
        finally:
            await meta.close()
        l1 = status["storage_manager"]["l1_manager"]  # one L1: its own fields too
        used, total = status["storage_manager"]["l1_usage"]
        assert (used, total) == (l1["memory_used_bytes"], l1["memory_total_bytes"])
        assert total == 1 << 30  # the fixtures' --l1-size-gb 1
        assert l1_memory(status) == (
            f"{used} of {total} bytes used ({used / total:.0%}); {l1['write_locked_count']} write "
            f"reservations pending, {l1['staging_bytes']} bytes staged"
        )


async def test_a_store_held_by_another_writer_on_the_real_server(
    fresh_real_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real 0.5.6: while one client's store is copying into its reservation, another
    client's store of the same prompt fails (its deadline is short) and says that two write
    reservations are pending, with the server's L1 usage."""
    srv = fresh_real_server("shm")
    model = unique_model("held")
    tokens = fresh_tokens(2 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    copying, release = threading.Event(), threading.Event()
    fill = copies.fill_slots

    def held_fill(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], pool: Any = None) -> None:
        copying.set()
        release.wait(30)
        fill(pairs, pool)

    monkeypatch.setattr(copies, "THREAD_COPY_BYTES", 0)  # the copy runs in a thread
    monkeypatch.setattr(copies, "fill_slots", held_fill)
    async with (
        AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30) as a,
        AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30) as b,
    ):
        first = asyncio.create_task(a.store(kv, tokens))
        try:
            assert await asyncio.to_thread(copying.wait, 10)
            with pytest.raises(TransferError) as info:
                await b.store(random_kv(SMALL_GEOMETRY, len(tokens)), tokens, timeout=1.0)
            message = str(info.value)
        finally:
            release.set()
        assert await first is True
    usage = re.fullmatch(
        re.escape(not_reservable(2))
        + r" \(server L1 memory: (\d+) of 1073741824 bytes used \(0%\); 2 write reservations pending, "
        r"(\d+) bytes staged\)",
        message,
    )
    assert usage is not None, message
    assert int(usage[1]) >= int(usage[2]) >= 2 * 2048  # the two reserved chunks at least
