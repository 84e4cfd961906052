"""The DEALER transport against a scripted ROUTER: routing by uid, deadlines, drops."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from lmcache_async._protocol import wire as wire
from lmcache_async._protocol.wire import Op, Reply
from lmcache_async._transport.connection import Connection
from lmcache_async._transport.pending import PendingTable
from lmcache_async.errors import ClientClosedError, LMCacheConnectionError, LMCacheTimeoutError
from tests.fakes import server_wire
from tests.fakes.fake_router import Action, FakeRouter
from tests.plugins.hypothesis_budget import examples

pytestmark = pytest.mark.anyio


async def test_concurrent_calls_are_routed_by_uid_not_by_order() -> None:
    # Replies come back in reverse order of arrival; each caller must get its own.
    def handler(req: server_wire.Request) -> list[tuple[object, ...]]:
        rid = wire.unpackb(req.args[0])
        return [("sleep", 0.2 - rid * 0.003), ("reply", f"done-{rid}")]

    async with FakeRouter(handler) as router:
        conn = Connection(router.url)
        await conn.open()
        try:
            replies = await asyncio.gather(*(conn.call(Op.END_SESSION, (i,), timeout=5) for i in range(50)))
            assert [r.value() for r in replies] == [f"done-{i}" for i in range(50)]
            assert conn.in_flight == 0
            assert conn.dropped == (0, 0)
        finally:
            await conn.close()


async def test_timeout_is_a_builtin_timeout_naming_the_operation() -> None:
    async with FakeRouter(lambda req: []) as router:
        conn = Connection(router.url)
        await conn.open()
        try:
            with pytest.raises(TimeoutError) as info:
                await conn.call(Op.LOOKUP, ({}, 1), timeout=0.2)
            err = info.value
            assert isinstance(err, LMCacheTimeoutError)
            assert err.operation == "lookup"
            assert err.request_id == 0
            assert err.elapsed >= 0.2
            assert "lookup (request 0): no reply" in str(err)
            assert conn.in_flight == 0
        finally:
            await conn.close()


async def test_late_duplicate_and_mismatched_replies_are_dropped_and_counted() -> None:
    def handler(req: server_wire.Request) -> list[tuple[object, ...]]:
        tag = wire.unpackb(req.args[0])
        if tag == "late":
            return [("sleep", 0.3), ("reply", "late")]
        if tag == "twice":
            return [("reply", "first"), ("reply", "second")]
        if tag == "wrong-op":
            return [("raw", [req.uid_frame, wire.packb(int(Op.PING)), wire.packb(True)])]
        return [("reply", tag)]

    async with FakeRouter(handler) as router:
        conn = Connection(router.url)
        await conn.open()
        try:
            with pytest.raises(LMCacheTimeoutError):
                await conn.call(Op.END_SESSION, ("late",), timeout=0.1)
            assert (await conn.call(Op.END_SESSION, ("twice",), timeout=2)).value() == "first"
            with pytest.raises(LMCacheTimeoutError):
                await conn.call(Op.END_SESSION, ("wrong-op",), timeout=0.3)
            await asyncio.sleep(0.3)  # the late reply arrives meanwhile
            assert (await conn.call(Op.END_SESSION, ("after",), timeout=2)).value() == "after"
            assert conn.dropped == (2, 1)  # late + duplicate unknown; one op mismatch
            assert conn.in_flight == 0
        finally:
            await conn.close()


async def test_malformed_replies_are_dropped() -> None:
    def handler(req: server_wire.Request) -> list[tuple[object, ...]]:
        return [("raw", [b"\xc1"]), ("raw", [req.uid_frame, req.op_frame, b"x", b"y"]), ("reply", "OK")]

    async with FakeRouter(handler) as router:
        conn = Connection(router.url)
        await conn.open()
        try:
            assert (await conn.call(Op.NOOP, (), timeout=2)).value() == "OK"
            assert conn.dropped == (2, 0)
        finally:
            await conn.close()


async def test_cancellation_removes_the_entry() -> None:
    async with FakeRouter(lambda req: []) as router:
        conn = Connection(router.url)
        await conn.open()
        try:
            task = asyncio.create_task(conn.call(Op.NOOP, (), timeout=None))
            await asyncio.sleep(0.1)
            assert conn.in_flight == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert conn.in_flight == 0
        finally:
            await conn.close()


async def test_connection_loss_fails_in_flight_calls_promptly() -> None:
    async with FakeRouter(lambda req: [("sleep", 0.1), ("drop",)]) as router:
        conn = Connection(router.url)
        await conn.open()
        try:
            start = time.monotonic()
            with pytest.raises(LMCacheConnectionError, match="end_session: connection to .* lost"):
                await conn.call(Op.END_SESSION, ("x",), timeout=30)
            assert time.monotonic() - start < 10  # far from the 30 s deadline
            assert conn.in_flight == 0
        finally:
            await conn.close()


async def test_reconnect_bumps_the_generation() -> None:
    async with FakeRouter() as router:
        conn = Connection(router.url)
        await conn.open()
        try:
            assert (await conn.call(Op.NOOP, (), timeout=5)).value() == "OK"
            assert conn.generation == 0
            await router.restart()
            deadline = time.monotonic() + 10
            while conn.generation == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert conn.generation == 1
            assert (await conn.call(Op.NOOP, (), timeout=5)).value() == "OK"
        finally:
            await conn.close()


async def test_close_fails_pending_calls_and_refuses_new_ones() -> None:
    async with FakeRouter(lambda req: []) as router:
        conn = Connection(router.url)
        await conn.open()
        task = asyncio.create_task(conn.call(Op.NOOP, (), timeout=None))
        await asyncio.sleep(0.05)
        await conn.close()
        with pytest.raises(ClientClosedError, match="noop: the connection was closed"):
            await task
        with pytest.raises(ClientClosedError):
            await conn.call(Op.NOOP, (), timeout=1)
        await conn.close()  # idempotent


# ------------------------------------------------------------------ the table, property-tested

events = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.sampled_from([Op.NOOP, Op.PING, Op.LOOKUP])),
        st.tuples(st.just("reply"), st.integers(0, 30)),
        st.tuples(st.just("wrong_op"), st.integers(0, 30)),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("fail_all"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=examples(200), deadline=None)
@given(events)
def test_table_never_leaks_or_misroutes(script: list[tuple[str, object]]) -> None:
    loop = asyncio.new_event_loop()
    try:
        table = PendingTable()
        futures: dict[int, tuple[Op, asyncio.Future[Reply]]] = {}
        expected_unknown = 0
        expected_mismatch = 0
        for kind, arg in script:
            if kind == "send":
                assert isinstance(arg, Op)
                uid, fut = table.register(arg, loop)
                assert uid not in futures  # never reused
                futures[uid] = (arg, fut)
            elif kind in ("reply", "wrong_op"):
                assert isinstance(arg, int)
                entry = futures.get(arg)
                live = entry is not None and not entry[1].done()
                op = (entry[0] if entry else Op.NOOP) if kind == "reply" else Op.CLEAR
                routed = table.resolve(Reply(arg, int(op), wire.packb(arg)))
                if not live:
                    expected_unknown += 1
                    assert not routed
                elif kind == "wrong_op":
                    expected_mismatch += 1
                    assert not routed
                else:
                    assert routed
                    assert entry is not None
                    assert wire.unpackb(entry[1].result().payload or b"") == arg  # its own reply
            elif kind == "cancel":  # the caller stops waiting: it discards its entry
                assert isinstance(arg, int)
                if arg in futures:
                    futures[arg][1].cancel()
                    table.discard(arg)
            else:
                table.fail_all(lambda op: LMCacheConnectionError("lost"))
        assert len(table) == sum(1 for _, f in futures.values() if not f.done())
        assert (table.dropped_unknown, table.dropped_mismatch) == (expected_unknown, expected_mismatch)
        for _, fut in futures.values():
            if fut.done() and not fut.cancelled():
                fut.exception()
    finally:
        loop.close()


async def test_send_nowait_delivers_times_out_and_gives_its_place_back() -> None:
    def handler(req: server_wire.Request) -> list[tuple[object, ...]]:
        tag = wire.unpackb(req.args[0])
        return [] if tag == "silent" else [("reply", tag)]

    async with FakeRouter(handler) as router:
        conn = Connection(router.url, max_in_flight=2)
        await conn.open()
        try:
            # send_nowait sends nothing until the DEALER's handshake is done (ZMQ_IMMEDIATE),
            # which open() does not wait for: on a loaded machine it may not be done yet.
            # A call waits for it (request 0).
            assert (await conn.call(Op.END_SESSION, ("ready",), timeout=5)).value() == "ready"
            fut = conn.send_nowait(Op.END_SESSION, ("a",), timeout=5)
            assert fut is not None
            assert (await fut).value() == "a"
            await asyncio.sleep(0)  # its done-callbacks
            assert (conn.in_flight, conn._busy) == (0, 0)

            silent = conn.send_nowait(Op.END_SESSION, ("silent",), timeout=0.2)
            assert silent is not None
            with pytest.raises(LMCacheTimeoutError, match=r"end_session \(request 2\): no reply") as info:
                await silent
            assert info.value.request_id == 2
            await asyncio.sleep(0)
            assert (conn.in_flight, conn._busy) == (0, 0)

            # No place free: nothing is sent, the caller is told to wait with call().
            held = [asyncio.create_task(conn.call(Op.END_SESSION, ("silent",), timeout=5)) for _ in range(2)]
            await asyncio.sleep(0.05)
            assert conn._busy == 2
            assert conn.send_nowait(Op.END_SESSION, ("b",), timeout=5) is None
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            assert (conn.in_flight, conn._busy) == (0, 0)
            assert conn.send_nowait(Op.END_SESSION, ("c",), timeout=5) is not None
        finally:
            await conn.close()
        assert conn.send_nowait(Op.END_SESSION, ("closed",), timeout=5) is None


async def test_a_waiter_handed_a_place_and_cancelled_passes_it_on() -> None:
    """Backpressure hand-over: a place given to a waiter that is cancelled at that very
    moment goes to the next waiter; none is lost or counted twice."""
    async with FakeRouter(lambda req: [("sleep", 0.1), ("reply", "OK")]) as router:
        conn = Connection(router.url, max_in_flight=1)
        await conn.open()
        try:
            first = asyncio.create_task(conn.call(Op.NOOP, (), timeout=5))
            await asyncio.sleep(0.01)
            second = asyncio.create_task(conn.call(Op.NOOP, (), timeout=5))
            third = asyncio.create_task(conn.call(Op.NOOP, (), timeout=5))
            await asyncio.sleep(0.01)
            assert len(conn._place_waiters) == 2
            await first  # its place goes to `second` ...
            second.cancel()  # ... which leaves before it runs
            with pytest.raises(asyncio.CancelledError):
                await second
            assert (await third).value() == "OK"
            assert (conn.in_flight, conn._busy, len(conn._place_waiters)) == (0, 0, 0)
        finally:
            await conn.close()


async def test_an_urgent_call_is_sent_at_once_past_the_bound() -> None:
    """A cleanup (``urgent``) never waits for a place: with every place taken and ordinary
    calls queued, it is on the wire at once (QA-4 N1: cleanups that waited behind a backlog
    ran past their deadline unsent, and were dropped). It holds a place past the bound: the
    queued calls go out, in arrival order, only once the in-flight count is back under it."""
    async with FakeRouter(lambda req: [("sleep", 0.05), ("reply", msgpack.unpackb(req.args[0]))]) as router:
        conn = Connection(router.url, max_in_flight=1)
        await conn.open()
        try:
            first = asyncio.create_task(conn.call(Op.END_SESSION, ("first",), timeout=5))
            await asyncio.sleep(0.01)
            queued = [asyncio.create_task(conn.call(Op.END_SESSION, (f"q{i}",), timeout=5)) for i in range(3)]
            await asyncio.sleep(0.01)
            cleanup = asyncio.create_task(conn.call(Op.END_SESSION, ("cleanup",), timeout=5, urgent=True))
            await asyncio.sleep(0.01)
            # Sent without waiting: two in flight with a bound of one, three still queued.
            assert (conn.in_flight, conn._busy, len(conn._place_waiters)) == (2, 2, 3)
            assert conn.send_nowait(Op.END_SESSION, ("posted",), timeout=5) is None
            got = [(await t).value() for t in (first, cleanup, *queued)]
            assert got == ["first", "cleanup", "q0", "q1", "q2"]
            assert [msgpack.unpackb(r.args[0]) for r in router.requests] == [
                "first",
                "cleanup",
                "q0",
                "q1",
                "q2",
            ]
            assert (conn.in_flight, conn._busy, len(conn._place_waiters)) == (0, 0, 0)
        finally:
            await conn.close()


async def test_urgent_calls_past_the_bound_give_their_places_back_to_the_pool() -> None:
    """Places released while urgent calls hold more than ``max_in_flight`` go back to the
    pool, not to a waiter: an ordinary call is sent only once fewer than the bound are in
    flight, and a cleanup sent while every place is taken is answered, not timed out."""

    def answer(req: server_wire.Request) -> list[Action]:
        return [("sleep", 0.5 if req.op == Op.END_SESSION else 0.1), ("reply", "OK")]

    async with FakeRouter(answer) as router:
        conn = Connection(router.url, max_in_flight=1)
        await conn.open()
        try:
            first = asyncio.create_task(conn.call(Op.NOOP, (), timeout=5))
            await asyncio.sleep(0.01)
            cleanups = [
                asyncio.create_task(conn.call(Op.END_SESSION, (f"c{i}",), timeout=5, urgent=True))
                for i in range(2)
            ]
            await asyncio.sleep(0.01)
            late = asyncio.create_task(conn.call(Op.NOOP, (), timeout=5))
            await asyncio.sleep(0.01)
            assert (conn.in_flight, conn._busy, len(conn._place_waiters)) == (3, 3, 1)
            await first
            await asyncio.sleep(0.05)
            # One place back: still two urgent calls in flight, over the bound of one.
            assert (conn.in_flight, len(conn._place_waiters)) == (2, 1)
            for c in cleanups:
                assert (await c).value() == "OK"
            assert (await late).value() == "OK"
            assert [r.op for r in router.requests] == [Op.NOOP, Op.END_SESSION, Op.END_SESSION, Op.NOOP]
            assert (conn.in_flight, conn._busy, len(conn._place_waiters)) == (0, 0, 0)
        finally:
            await conn.close()


async def test_a_late_reply_is_told_to_on_late_after_a_timeout_or_cancellation() -> None:
    # "slow" replies after 0.3 s, "never" never does. The caller stops waiting first
    # (a timeout of call() or of a posted request, or a cancellation); the future given
    # to on_late is done when the late reply arrives (which is still dropped and counted).
    def handler(req: server_wire.Request) -> list[Action]:
        tag = wire.unpackb(req.args[0])
        if tag == "never":
            return []
        return [("sleep", 0.3), ("reply", tag)] if tag.startswith("slow") else [("reply", tag)]

    async with FakeRouter(handler) as router:
        conn = Connection(router.url)
        await conn.open()
        late: list[asyncio.Future[None]] = []
        try:
            assert (
                await conn.call(Op.END_SESSION, ("ready",), timeout=5, on_late=late.append)
            ).value() == "ready"
            assert late == []  # answered in time: nothing is late
            with pytest.raises(LMCacheTimeoutError):
                await conn.call(Op.END_SESSION, ("slow-1",), timeout=0.05, on_late=late.append)
            task = asyncio.create_task(conn.call(Op.END_SESSION, ("slow-2",), timeout=5, on_late=late.append))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            posted = conn.send_nowait(Op.END_SESSION, ("slow-3",), timeout=0.05, on_late=late.append)
            assert posted is not None
            with pytest.raises(LMCacheTimeoutError):
                await posted
            await asyncio.sleep(0)  # the posted request's done-callbacks
            assert len(late) == 3 and not any(f.done() for f in late)
            assert (conn.in_flight, conn.late) == (0, (0, 3))
            assert (await asyncio.wait_for(asyncio.gather(*late), 5)) == [None, None, None]
            assert conn.late == (3, 0)
            assert conn.dropped == (3, 0)  # the late replies themselves are dropped

            # One never answered: its waiter gives up by cancelling it (forgotten at once).
            with pytest.raises(LMCacheTimeoutError):
                await conn.call(Op.END_SESSION, ("never",), timeout=0.05, on_late=late.append)
            assert conn.late == (3, 1)
            late[-1].cancel()
            await asyncio.sleep(0)
            assert conn.late == (3, 0)

            # One still to come when the connection closes fails as the calls do.
            with pytest.raises(LMCacheTimeoutError):
                await conn.call(Op.END_SESSION, ("never",), timeout=0.05, on_late=late.append)
        finally:
            await conn.close()
        with pytest.raises(ClientClosedError, match="end_session: the connection was closed"):
            await late[-1]
        assert conn.late == (3, 0)


async def test_a_call_failed_by_a_lost_connection_has_no_late_reply() -> None:
    # The server drops the connection: the call fails at once, and no reply can come.
    async with FakeRouter(lambda req: [("drop",)]) as router:
        conn = Connection(router.url)
        await conn.open()
        late: list[asyncio.Future[None]] = []
        try:
            with pytest.raises(LMCacheConnectionError):
                await conn.call(Op.END_SESSION, ("x",), timeout=5, on_late=late.append)
            assert late == []
            assert conn.late == (0, 0)
        finally:
            await conn.close()
