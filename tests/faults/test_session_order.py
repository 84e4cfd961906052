"""A session's ``end_session`` goes out only after the late reply of the affinity-pool
request it follows: a timed-out request still queued on the server must not recreate the
session after it was ended.

The real server runs ``prepare_store``, ``commit_store``, ``prepare_retrieve`` and
``commit_retrieve`` on its per-connection FIFO "affinity" worker, and ``end_session`` on
the "normal" pool; the two pools are not ordered relative to each other. When such a
request timed out client-side while still queued, the client used to send
``end_session`` at once: the server ran it first (an unknown session), then the queued
request created the session again, which lived until the server's TTL (600 s).

The affinity worker is kept busy on demand: a ``commit_store`` whose pickle payload
sleeps when the 0.5.6 server unpickles it (the server unpickles unrestricted, pitfall 14
of the protocol notes), sent on the client's own connection, so the operation's requests
queue behind it on the same FIFO worker. Each path's sleep lies between the moment its
last affinity request times out (the caller's timeout, then one ``cleanup_grace`` per
chained wait) and the end of the wait for its late reply (one ``cleanup_grace`` more).
"""

from __future__ import annotations

import asyncio
import pickle
import time
import uuid
from typing import Any

import pytest

import lmcache_async as lmc
from lmcache_async._protocol.wire import CacheKey, Op
from tests.helpers import SESSION_CHUNK_SIZE, SMALL_GEOMETRY, fresh_tokens, peek, random_kv, unique_model

pytestmark = pytest.mark.anyio

CS = SESSION_CHUNK_SIZE
TIMEOUT = 0.2
GRACE = 2.0


class _Sleep:
    """Unpickles as ``time.sleep(seconds)`` (then the server's commit fails: no reply)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> tuple[Any, tuple[float]]:
        return (time.sleep, (self.seconds,))


def _sessions(srv: Any) -> int:
    return int(srv.status()["active_sessions"])


def _block_affinity_worker(c: lmc.AsyncClient, seconds: float) -> tuple[str, asyncio.Future[Any] | None]:
    """Queue a ``commit_store`` that holds the server's affinity worker for ``seconds``
    (it creates a session of its own, and is never answered)."""
    view = peek(c)
    rid = f"blocker-{uuid.uuid4().hex}"
    key = CacheKey(
        model_name=c.model_name,
        world_size=1,
        worker_id=0,
        token_ids=list(range(CS)),
        start=0,
        end=CS,
        request_id=rid,
        cache_salt="",
        request_configs=None,
        num_kv_readers=1,
    ).to_wire(view.conn.wire)
    fut = view.conn.send_nowait(
        Op.COMMIT_STORE, (key, view.registered_id, pickle.dumps(_Sleep(seconds))), timeout=None
    )
    assert fut is not None
    return rid, fut


async def _wait_dropped(c: lmc.AsyncClient, at_least: int, deadline: float) -> int:
    end = time.monotonic() + deadline
    while peek(c).conn.dropped[0] < at_least and time.monotonic() < end:
        await asyncio.sleep(0.02)
    return peek(c).conn.dropped[0]


def _spy_end_sessions(c: lmc.AsyncClient) -> list[tuple[str, int]]:
    """Each ``end_session`` the client sends from now on: (request id, late replies the
    connection had heard of when it went out)."""
    conn = peek(c).conn
    sent: list[tuple[str, int]] = []
    call, send_nowait = conn.call, conn.send_nowait

    async def spy_call(op: Op, args: Any = (), **kw: Any) -> Any:
        if op is Op.END_SESSION:
            sent.append((args[0], conn.late[0]))
        return await call(op, args, **kw)

    def spy_send_nowait(op: Op, args: Any, **kw: Any) -> Any:
        fut = send_nowait(op, args, **kw)
        if op is Op.END_SESSION and fut is not None:
            sent.append((args[0], conn.late[0]))
        return fut

    conn.call = spy_call  # type: ignore[method-assign]
    conn.send_nowait = spy_send_nowait  # type: ignore[method-assign]
    return sent


async def _time_out(c: lmc.AsyncClient, what: str, kv: Any, tokens: list[int]) -> None:
    call = c.store(kv, tokens, timeout=TIMEOUT) if what == "store" else c.retrieve(tokens, timeout=TIMEOUT)
    with pytest.raises(lmc.LMCacheTimeoutError):
        await call


# (late affinity replies, chained waits before the end_session): the SHM retrieve's
# cleanup commit_retrieve is queued behind its prepare and times out too. On the code
# before the fix every case left exactly one session (of 0 before it) once every late
# reply had come and the client had drained.
CASES = {
    ("shm", "store"): (1, 1),
    ("shm", "retrieve"): (2, 2),
    ("pickle", "store"): (1, 1),
    ("pickle", "retrieve"): (1, 1),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["store", "retrieve"])
@pytest.mark.parametrize("mode", ["shm", "pickle"])
async def test_a_timed_out_affinity_request_does_not_recreate_its_session(
    fresh_real_server: Any, mode: str, what: str
) -> None:
    # A server of its own: it counts sessions, and the store case leaves a reservation
    # of a retired registration until the write TTL.
    srv = fresh_real_server(mode=mode, chunk_size=CS)
    late, chained = CASES[(mode, what)]
    sleep = TIMEOUT + GRACE * (chained + 0.5)
    async with lmc.AsyncClient(
        srv.url, srv.http_url, unique_model("order"), geometry=SMALL_GEOMETRY, timeout=30, cleanup_grace=GRACE
    ) as c:
        tokens = fresh_tokens(2 * CS)
        kv = random_kv(SMALL_GEOMETRY, len(tokens))
        if what == "retrieve":
            assert await c.store(kv, tokens) is True
            other = tokens
        else:
            other = fresh_tokens(2 * CS)
        assert await c.drain(10)
        assert _sessions(srv) == 0
        assert peek(c).conn.dropped == (0, 0)
        blocker, fut = _block_affinity_worker(c, sleep)
        sent = _spy_end_sessions(c)
        await _time_out(c, what, kv, other)
        # Every late reply comes once the worker wakes up, and every cleanup is done.
        assert await _wait_dropped(c, late, sleep + 10) == late
        assert await c.drain(10)
        assert fut is not None
        fut.cancel()
        # The operation's end_session went out once, after its late replies.
        assert [heard for _, heard in sent] == [late]
        ends = peek(c).late_ends
        assert (ends.deferred, ends.unordered, ends.unsent) == (1, 0, 0)
        assert peek(c).conn.late == (late, 0)
        await peek(c).conn.call(Op.END_SESSION, (blocker,), timeout=10)
        # No session is left: the operation's end_session ran after its late request.
        assert _sessions(srv) == 0
        assert peek(c).conn.dropped == (late, 0)


@pytest.mark.timeout(120)
async def test_a_late_reply_that_never_comes_holds_the_end_session_at_most_cleanup_grace(
    fresh_real_server: Any,
) -> None:
    # The worker sleeps far longer than the client waits: the end_session goes out
    # after cleanup_grace anyway (logged, counted as unordered), and drain() returns.
    srv = fresh_real_server(mode="shm", chunk_size=CS)
    grace = 0.5
    async with lmc.AsyncClient(
        srv.url, srv.http_url, unique_model("never"), geometry=SMALL_GEOMETRY, timeout=30, cleanup_grace=grace
    ) as c:
        tokens = fresh_tokens(2 * CS)
        kv = random_kv(SMALL_GEOMETRY, len(tokens))
        assert await c.store(kv, tokens) is True
        assert await c.drain(10)
        _blocker, fut = _block_affinity_worker(c, 60.0)
        sent = _spy_end_sessions(c)
        await _time_out(c, "retrieve", kv, tokens)
        assert await c.drain(TIMEOUT + 3 * grace + 10)
        assert [heard for _, heard in sent] == [0]
        ends = peek(c).late_ends
        assert (ends.deferred, ends.unordered, ends.unsent) == (1, 1, 0)
        # The late replies are no longer watched for: nothing is held.
        assert peek(c).conn.late == (0, 0)
        assert peek(c).conn.in_flight == 1  # the blocker
        assert fut is not None
        fut.cancel()


@pytest.mark.timeout(120)
async def test_aclose_does_not_wait_past_its_bound_for_a_late_reply(fresh_real_server: Any) -> None:
    # aclose() right after the caller's timeout waits cleanup_grace for the operation
    # (whose commit then times out) and its held end_session, then stops waiting: the
    # end_session is not sent (counted), and aclose() ends within its own bounds.
    srv = fresh_real_server(mode="pickle", chunk_size=CS)
    grace = 1.0
    c = lmc.AsyncClient(
        srv.url, srv.http_url, unique_model("close"), geometry=SMALL_GEOMETRY, timeout=30, cleanup_grace=grace
    )
    await c.__aenter__()
    try:
        tokens = fresh_tokens(2 * CS)
        kv = random_kv(SMALL_GEOMETRY, len(tokens))
        _blocker, _fut = _block_affinity_worker(c, 60.0)
        sent = _spy_end_sessions(c)
        await _time_out(c, "store", kv, tokens)
    finally:
        async with asyncio.timeout(grace + 10):  # aclose's own bounds: grace, then 2 s
            await c.aclose()
    ends = peek(c).late_ends
    for _ in range(100):  # a wait the close failed ends on the next loop turns
        if ends.unsent:
            break
        await asyncio.sleep(0.01)
    assert (ends.deferred, ends.unordered, ends.unsent) == (1, 0, 1)
    assert sent == []
    assert peek(c).conn.late == (0, 0)


# The embedded server models the two pools as two lanes, unordered relative to each
# other: there the operation's first affinity request itself is held on the transfer
# lane (and every request queued behind it waits), for both generations.
EMBEDDED_CASES = [
    ("0.5.6", "shm", "store"),
    ("0.5.6", "pickle", "retrieve"),
    ("0.5.7", "shm", "retrieve"),
    ("0.5.7", "pickle", "store"),
]


class _HeldLane:
    """Stands for the embedded server's transfer-lane queue: the next request put on it,
    and every one after it, reach the lane ``seconds`` later, in their order."""

    def __init__(self, lane: asyncio.Queue[Any], seconds: float) -> None:
        self.lane = lane
        self.seconds = seconds
        self.held: list[Any] | None = []  # None: released

    def put_nowait(self, item: Any) -> None:
        if self.held is None:
            self.lane.put_nowait(item)
            return
        if not self.held:  # on the server's loop (its request dispatch)
            asyncio.get_running_loop().call_later(self.seconds, self._release)
        self.held.append(item)

    def _release(self) -> None:
        held, self.held = self.held, None
        for item in held or ():
            self.lane.put_nowait(item)


def _hold_next_transfer(handle: Any, seconds: float) -> None:
    """The embedded server's next transfer-lane request (and those queued behind it) run
    ``seconds`` late; the other lanes go on."""
    lanes = handle.server._lanes
    lanes["transfer"] = _HeldLane(lanes["transfer"], seconds)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("generation", "mode", "what"), EMBEDDED_CASES)
async def test_on_the_embedded_server_too(generation: str, mode: str, what: str) -> None:
    from lmcache_async.testing import EmbeddedServer

    grace = 1.0
    late, chained = CASES[(mode, what)]
    handle = EmbeddedServer.start_in_thread(chunk_size=CS, mode=mode, generation=generation)  # type: ignore[arg-type]
    try:
        async with lmc.AsyncClient(
            handle.url, handle.http_url, unique_model("order"), geometry=SMALL_GEOMETRY, timeout=30,
            cleanup_grace=grace,
        ) as c:  # fmt: skip
            tokens = fresh_tokens(2 * CS)
            kv = random_kv(SMALL_GEOMETRY, len(tokens))
            if what == "retrieve":
                assert await c.store(kv, tokens) is True
            assert await c.drain(10)
            assert _sessions(handle) == 0
            sent = _spy_end_sessions(c)
            _hold_next_transfer(handle, TIMEOUT + grace * (chained + 0.5))
            await _time_out(c, what, kv, tokens if what == "retrieve" else fresh_tokens(2 * CS))
            assert await _wait_dropped(c, late, 10 + grace * 3) == late
            assert await c.drain(10)
            assert [heard for _, heard in sent] == [late]
            ends = peek(c).late_ends
            assert (ends.deferred, ends.unordered, ends.unsent) == (1, 0, 0)
            assert _sessions(handle) == 0
            assert peek(c).conn.dropped == (late, 0)
    finally:
        handle.stop()
