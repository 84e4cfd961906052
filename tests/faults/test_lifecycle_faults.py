"""The client's lifecycle under faults: a closer's cancellation propagates and
still closes everything, a forked child never touches the parent's socket, every method
refuses another event loop, a stopped reader fails pending calls at once, the number of
requests in flight is bounded, and bad arguments are refused before anything is sent.

Scripted with tests/fakes/fake_router.py and a stub HTTP API (faults the real server does not
produce on demand: silence, a stubborn task); the real server is in test_recovery.py and
test_store_faults.py.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import tracemalloc
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, cast

import numpy as np
import pytest
import torch

import lmcache_async as lmc
from lmcache_async._protocol.wire import Op
from tests.fakes import server_wire
from tests.fakes.fake_router import FakeRouter, json_http_server
from tests.helpers import SMALL_GEOMETRY, peek

pytestmark = pytest.mark.anyio

CS = 16


@pytest.fixture
async def http_stub() -> AsyncIterator[str]:
    async with json_http_server(
        {
            "/config": {"mp": {"chunk_size": CS, "supported_transfer_mode": "auto", "instance_id": "x"}},
            "/status": {"cache_context_meta": {}, "active_sessions": 0},
        }
    ) as url:
        yield url


class Switch:
    """A router handler that answers the connect sequence, then goes silent on demand."""

    def __init__(self) -> None:
        self.silent = False

    def __call__(self, req: server_wire.Request) -> list[tuple[Any, ...]]:
        if req.op is Op.NOOP and not self.silent:
            return [("reply", "OK")]
        if req.op is Op.GET_CHUNK_SIZE and not self.silent:  # asked of a 0.5.6 server at connect
            return [("reply", CS)]
        if req.op is Op.REGISTER_ENGINE_DRIVEN and not self.silent:
            return [("reply", {"shm_name": "", "pool_size": 0})]
        if req.op in (Op.UNREGISTER_ENGINE_DRIVEN,) and not self.silent:
            return [("reply", None)]
        return []


def _assert_closed(c: lmc.AsyncClient) -> None:
    assert c.closed
    assert peek(c).conn.closed and peek(c).zmq_socket is None and peek(c).zmq_context is None
    assert peek(c).http_session is None
    keepalive = peek(c).keepalive_task
    assert keepalive is None or keepalive.done()


# ------------------------------------------------------------------ closing, cancelled


async def test_cancelling_aclose_mid_drain_propagates_and_closes(http_stub: str) -> None:
    """aclose() cancelled while it waits for operations in flight."""
    switch = Switch()
    async with FakeRouter(switch) as router:
        c = await lmc.connect(
            router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5, cleanup_grace=30
        )
        switch.silent = True
        op = asyncio.create_task(c.noop(timeout=None))
        await asyncio.sleep(0.1)
        closer = asyncio.create_task(c.aclose())
        await asyncio.sleep(0.2)  # aclose() is waiting for the noop (up to 30 s)
        assert not closer.done()
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        _assert_closed(c)
        with pytest.raises(lmc.ClientClosedError):
            await op
        await c.aclose()  # idempotent, returns at once
        with pytest.raises(lmc.ClientClosedError, match="the client is closed"):
            await c.noop()


async def test_cancelling_aclose_mid_keepalive_propagates_and_closes(http_stub: str) -> None:
    """The keep-alive ignores its first cancellation for a while: the closer waiting for it
    is cancelled, and its CancelledError is no longer swallowed."""
    async with FakeRouter(Switch()) as router:
        c = await lmc.connect(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5)
        release = asyncio.Event()

        async def stubborn() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await release.wait()

        keepalive = peek(c).keepalive_task
        assert keepalive is not None
        keepalive.cancel()
        peek(c).replace_keepalive(asyncio.create_task(stubborn()))
        await asyncio.sleep(0)
        closer = asyncio.create_task(c.aclose())
        await asyncio.sleep(0.2)
        assert not closer.done()
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        assert c.closed
        assert peek(c).zmq_socket is None and peek(c).http_session is None
        release.set()


# ------------------------------------------------------------------ fork


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
async def test_aclose_in_a_forked_child_leaves_the_parent_working(http_stub: str) -> None:
    """The child's aclose() must not unregister the parent's descriptors."""
    async with FakeRouter(Switch()) as router:
        c = await lmc.connect(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5)
        await c.status(max_age=0)  # an HTTP connection in the session's pool
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery, report through the pipe
            code = 0
            try:
                asyncio.run(c.aclose())
                assert c.closed
            except BaseException:
                code = 1
            os.write(w, bytes([code]))
            os._exit(0)
        os.close(w)
        report = await asyncio.to_thread(os.read, r, 1)
        os.close(r)
        await asyncio.to_thread(os.waitpid, pid, 0)
        assert report == b"\x00"
        assert await c.noop(timeout=5) >= 0  # the parent's socket still works
        assert (await c.status(max_age=0))["active_sessions"] == 0
        await c.aclose()
        _assert_closed(c)


# ------------------------------------------------------------------ one event loop


async def test_every_method_refuses_another_event_loop(http_stub: str) -> None:
    """Every method but aclose() refuses a call from another event loop; aclose() closes
    the client on its own loop."""
    async with FakeRouter(Switch()) as router:
        c = await lmc.connect(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5)
        calls: dict[str, Callable[[], Coroutine[Any, Any, object]]] = {
            "noop": lambda: c.noop(),
            "status": lambda: c.status(),
            "config": lambda: c.config(),
            "drain": lambda: c.drain(),
            "lookup": lambda: c.lookup([1] * CS),
            "remap_many": lambda: c.remap_many([([1] * CS, [2] * CS)]),
            "store_many": lambda: c.store_many([]),
            "retrieve_many": lambda: c.retrieve_many([[1] * CS]),
        }
        errors: dict[str, BaseException | None] = {}

        def other_loop() -> None:
            for name, make in calls.items():
                try:
                    asyncio.run(make())
                    errors[name] = None
                except BaseException as exc:  # noqa: BLE001 - recorded and checked
                    errors[name] = exc

        thread = threading.Thread(target=other_loop)
        thread.start()
        await asyncio.to_thread(thread.join)
        for name in calls:
            exc = errors[name]
            assert isinstance(exc, lmc.LMCacheError), (name, exc)
            assert "event loop other than the one that opened it" in str(exc), name
        # The client still works on its own loop.
        assert await c.noop() >= 0
        # aclose() alone is taken from another loop: the close runs on the client's own
        # loop (still running), and the other loop waits for it.
        closer = threading.Thread(target=lambda: asyncio.run(c.aclose()))
        closer.start()
        await asyncio.to_thread(closer.join)
        _assert_closed(c)


# ------------------------------------------------------------------ the reader stops


async def test_a_stopped_reader_fails_pending_calls_at_once(http_stub: str) -> None:
    """Nothing waits for a reply that nobody reads."""
    switch = Switch()
    async with FakeRouter(switch) as router:
        c = await lmc.connect(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5)
        switch.silent = True
        pending = asyncio.create_task(peek(c).conn.call(Op.NOOP, (), timeout=None))
        await asyncio.sleep(0.1)
        reader = peek(c).reader_task
        assert reader.get_name().startswith("lmcache-reader")
        reader.cancel()  # what the end of asyncio.run() does to it
        with pytest.raises(lmc.LMCacheConnectionError, match="noop: the connection's reader stopped"):
            await pending
        with pytest.raises(lmc.LMCacheConnectionError, match="reader stopped"):
            await c.noop(timeout=None)
        assert peek(c).conn.in_flight == 0
        await c.aclose()
        _assert_closed(c)


# ------------------------------------------------------------------ backpressure


async def test_requests_in_flight_are_bounded_and_memory_stays_flat(http_stub: str) -> None:
    """An unanswering server: calls beyond max_in_flight wait (and time out) instead of
    growing the pending table; memory after two rounds of 2,000 calls is flat."""
    switch = Switch()
    async with FakeRouter(switch) as router:
        c = await lmc.connect(
            router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5, max_in_flight=16
        )
        switch.silent = True
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, peek(c).conn.in_flight)
                await asyncio.sleep(0.001)

        async def round_of(n: int) -> int:
            """How many of ``n`` noops timed out (the results are dropped)."""
            results = await asyncio.gather(*(c.noop(timeout=0.3) for _ in range(n)), return_exceptions=True)
            return sum(isinstance(r, lmc.LMCacheTimeoutError) for r in results)

        watcher = asyncio.create_task(watch())
        tracemalloc.start()
        try:
            first = await round_of(2000)
            router.requests.clear()  # the router (in this process) records what it got
            gc.collect()
            after_first = tracemalloc.get_traced_memory()[0]
            second = await round_of(2000)
            router.requests.clear()
            gc.collect()
            after_second = tracemalloc.get_traced_memory()[0]
            assert (first, second) == (2000, 2000)
            assert peak == 16
            assert peek(c).conn.in_flight == 0
            growth = after_second - after_first
            print(f"\n[backpressure] peak in flight {peak}; memory growth over the second round {growth} B")
            # tracemalloc sees the whole process (other threads too); a pending entry kept
            # per call (future, callbacks, frames: well over 256 B) would grow by > 512 KiB.
            assert growth < 2000 * 256
        finally:
            tracemalloc.stop()
            watcher.cancel()
            await c.aclose()


# ------------------------------------------------------------------ validation


async def test_defect_11_inputs_are_refused_before_anything_is_sent(http_stub: str) -> None:
    async with FakeRouter(Switch()) as router:
        with pytest.raises(
            ValueError, match=r"cleanup_grace must be a finite non-negative number of seconds, got -1\b"
        ):
            lmc.AsyncClient(router.url, http_stub, "m", cleanup_grace=-1)
        with pytest.raises(
            ValueError, match="cleanup_grace must be a finite non-negative number of seconds, got inf"
        ):
            lmc.AsyncClient(router.url, http_stub, "m", cleanup_grace=float("inf"))
        with pytest.raises(ValueError, match="timeout must be a non-negative number"):
            lmc.AsyncClient(router.url, http_stub, "m", timeout=float("nan"))
        with pytest.raises(ValueError, match="max_in_flight must be an int >= 1, got 0"):
            lmc.AsyncClient(router.url, http_stub, "m", max_in_flight=0)
        c = await lmc.connect(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5)
        sent_before = peek(c).next_request_uid()
        kv_shape = SMALL_GEOMETRY.kv_shape(CS)
        toks = list(range(CS))
        cases: list[tuple[Any, type[Exception], str]] = [
            (c.lookup([True] * CS), TypeError, "tokens must contain ints, found bool"),
            (c.lookup(cast(Any, np.ones(CS, dtype=bool))), TypeError, "tokens must contain ints, found bool"),
            (c.lookup(memoryview(bytes(CS))), TypeError, "tokens must be a sequence of ints, got memoryview"),
            (
                c.lookup(cast(Any, np.array([-1] * CS))),
                ValueError,
                r"tokens: token id -1 is outside \[0, 2\*\*32\)",
            ),
            (c.lookup(toks, timeout=float("nan")), ValueError, "timeout must be a non-negative number"),
            (
                c.retrieve(
                    toks, out=torch.zeros(kv_shape[:-1] + (1,), dtype=torch.bfloat16).expand(kv_shape)
                ),
                ValueError,
                "out has stride 0 on dimension 3",
            ),
            (
                c.retrieve(toks, out=torch.empty(kv_shape, dtype=torch.bfloat16, device="meta")),
                ValueError,
                "out is a meta tensor",
            ),
            (c.remap_many(None), TypeError, "pairs must be an iterable of items, got NoneType"),  # type: ignore[arg-type]
            (c.store_many(5), TypeError, "items must be an iterable of items, got int"),  # type: ignore[arg-type]
        ]
        for coro, exc_type, message in cases:
            with pytest.raises(exc_type, match=message):
                await coro
        assert peek(c).next_request_uid() == sent_before + 1  # nothing was sent meanwhile
        await c.aclose()


async def test_too_many_tokens_are_refused_by_every_operation_before_anything_is_sent(http_stub: str) -> None:
    """QA-4 N2: no token list longer than ``MAX_TOKENS`` (2**22) reaches the wire, in any
    operation; ``range(2**40)`` is refused from its length at once (it used to be walked
    on the event loop for ever)."""

    def bound(name: str, n: int) -> str:
        return f"{name} has {n} tokens; at most 4194304 (2**22) are accepted"

    huge, over = range(2**40), range(4_194_305)
    kv = torch.zeros(SMALL_GEOMETRY.kv_shape(CS), dtype=torch.bfloat16)
    toks = list(range(CS))
    async with FakeRouter(Switch()) as router:
        c = await lmc.connect(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5)
        sent_before = peek(c).next_request_uid()
        loop_start = asyncio.get_running_loop().time()
        cases: list[tuple[Coroutine[Any, Any, Any], str]] = [
            (c.lookup(huge), bound("tokens", 2**40)),
            (c.lookup(over), bound("tokens", 4_194_305)),
            (c.retrieve(huge), bound("tokens", 2**40)),
            (c.store(kv, huge), bound("tokens", 2**40)),
            (c.remap(huge, toks), bound("source_tokens", 2**40)),
            (c.remap(toks, over), bound("target_tokens", 4_194_305)),
            (c.compose(huge, [lmc.KVPart(toks)]), bound("target_tokens", 2**40)),
        ]
        for coro, message in cases:
            with pytest.raises(ValueError, match=r"are accepted$") as info:
                await coro
            assert str(info.value) == message
        with pytest.raises(ValueError, match=r"are accepted$") as info:
            lmc.KVPart(huge)
        assert str(info.value) == bound("source_tokens", 2**40)
        batches = [
            await c.store_many([(kv, huge)]),
            await c.retrieve_many([huge]),
            await c.remap_many([(toks, huge)]),
        ]
        errors = [str(batch[0].error) for batch in batches]
        assert errors == [bound("tokens", 2**40), bound("tokens", 2**40), bound("target_tokens", 2**40)]
        assert asyncio.get_running_loop().time() - loop_start < 5  # nothing was walked
        assert peek(c).next_request_uid() == sent_before + 1  # nothing was sent meanwhile
        await c.aclose()
