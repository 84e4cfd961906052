"""KV events, chunk hashes and the management calls against the REAL LMCache servers
(0.5.6 and 0.5.7rc3, each a server of its own: ``clear`` wipes every model).

* ``removed`` events after ``clear`` carry exactly the blake3 chunk hashes
  :meth:`AsyncClient.chunk_hashes` computes; client stores publish no ``stored`` event
  (the server counts them as ``unbound_stores``);
* the engine path (lmcache-driven, as vLLM) publishes one ``stored`` event per chunk
  with its hash, parent hash and tokens;
* ``max_events`` outside 1..1024 is refused before anything is sent;
* ``aclose``, leaving ``async with``, a cancelled wait and a dropped iterator leave no
  subscription on the server; the subscription is never under the registration id;
* credit: while the consumer does not ask, the server sends no second batch;
* a restarted server: the stream resumes and says ``Resync("restarted")``; a cursor
  that fell out of the server's log: ``Resync("lost")``; resuming from any cursor handed
  out (an event's ``seq``, a Resync's ``cursor``) skips nothing;
* closing the client (``aclose``, the blocking ``close`` from another thread) cancels
  every subscription on the server before it returns;
* a subscription nobody pings is reaped by the server (and the stream subscribes
  again); the pinged one stays;
* the blocking iterator adapter; ``experimental``, ``warm``, ``delete`` and ``clear``;
  ``warm`` with an L2 (the server's mock adapter) leaves the chunks in L1, a lookup's L2
  load does not.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import pytest

import lmcache_async as lmc
from lmcache_async import AsyncClient, management
from lmcache_async._transport.reply_stream import open_streams
from lmcache_async.errors import UnsupportedHashAlgorithmError
from lmcache_async.events import KVEventStream, RemovedEvent, Resync, StoredEvent
from lmcache_async.hashing import NONE_HASH, chunk_hashes
from lmcache_async.management import DeleteResult, WarmResult
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, peek, random_kv, unique_model

pytestmark = pytest.mark.anyio

CS = 16
GENERATIONS = pytest.mark.parametrize("generation", ["0.5.6", "0.5.7"])


def _subscribers(server: Any) -> int:
    return int(server.status()["kv_events"]["subscribers"])


async def _wait_subscribers(server: Any, n: int, deadline: float = 10.0) -> None:
    end = time.monotonic() + deadline
    while _subscribers(server) != n:
        if time.monotonic() > end:
            raise AssertionError(f"{_subscribers(server)} subscribers, expected {n}")
        await asyncio.sleep(0.05)


def _client(server: Any, model: str) -> AsyncClient:
    return lmc.AsyncClient(server.url, server.http_url, model, geometry=SMALL_GEOMETRY, timeout=30)


def _stream(c: AsyncClient, **kw: Any) -> KVEventStream:
    """The stream ``c.kv_events(**kw)`` iterates (its cursor and counters readable)."""
    return peek(c).event_stream(**kw)


@GENERATIONS
async def test_removed_events_carry_the_servers_chunk_hashes(fresh_real_server: Any, generation: str) -> None:
    srv = fresh_real_server("pickle", generation)
    model = unique_model("ev")
    tokens = fresh_tokens(4 * CS + 5)  # 4 whole chunks and a partial one
    async with _client(srv, model) as c:
        assert await c.store(random_kv(SMALL_GEOMETRY, len(tokens)), tokens) is True
        assert srv.status()["kv_events"]["unbound_stores"] == 4  # client stores publish nothing
        async with _stream(c) as events:
            first = asyncio.ensure_future(events.__anext__())
            await _wait_subscribers(srv, 1)
            await c.clear(force=False)
            ev = await asyncio.wait_for(first, 10)
            assert isinstance(ev, RemovedEvent)
            assert ev.model_name == model and ev.medium == "CPU" and ev.seq == 1
            assert ev.block_hashes == tuple(chunk_hashes(tokens, c))
            assert ev.block_hashes == tuple(chunk_hashes(tokens, CS))
            assert len(ev.block_hashes) == 4 and all(len(h) == 32 for h in ev.block_hashes)
            assert ev.incarnation == srv.status()["kv_events"]["incarnation"] == events.incarnation
            assert events.cursor == 1 and events.batches == 2 and events.subscriptions == 1
            assert events.subscriber_id != c.instance_id
        await _wait_subscribers(srv, 0)


@GENERATIONS
async def test_engine_path_stores_publish_stored_events(fresh_real_server: Any, generation: str) -> None:
    from harness.workers import EngineWorker

    srv = fresh_real_server("shm", generation)
    model = unique_model("engine")
    tokens = fresh_tokens(3 * CS)
    geometry = lmc.KVGeometry(2, 2, 8, SMALL_GEOMETRY.dtype, 4)
    with EngineWorker(srv) as eng:
        eng.register(model, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64)
        async with _client(srv, model) as c, _stream(c, max_events=2) as events:
            first = asyncio.ensure_future(events.__anext__())
            await _wait_subscribers(srv, 1)
            assert await asyncio.to_thread(eng.store, tokens, random_kv(geometry, len(tokens))) is True
            got = [await asyncio.wait_for(first, 20)]
            while len(got) < 3:
                got.append(await asyncio.wait_for(events.__anext__(), 20))
    hashes = chunk_hashes(tokens, CS)
    assert [type(e) for e in got] == [StoredEvent] * 3
    assert [e.block_hash for e in got] == hashes  # type: ignore[union-attr]
    assert [e.parent_hash for e in got] == [None, hashes[0], hashes[1]]  # type: ignore[union-attr]
    assert [e.token_ids for e in got] == [tuple(tokens[i * CS : (i + 1) * CS]) for i in range(3)]  # type: ignore[union-attr]
    assert [e.seq for e in got] == [1, 2, 3]  # type: ignore[union-attr]
    assert events.batches == 3  # the empty first batch, then 2 + 1 records (max_events=2)


@pytest.mark.parametrize("bad", [0, 1025, 5000, -1])
async def test_bad_max_events_is_refused_before_sending(real_server: Any, bad: int) -> None:
    async with _client(real_server, unique_model("ev")) as c:
        with pytest.raises(ValueError, match=rf"^max_events must be in 1\.\.1024, got {bad}$"):
            _stream(c, max_events=bad)
        with pytest.raises(ValueError, match=rf"^max_events must be in 1\.\.1024, got {bad}$"):
            await anext(c.kv_events(max_events=bad))  # at the first step, before anything is sent
        with pytest.raises(TypeError, match="^max_events must be an int, got bool$"):
            _stream(c, max_events=True)
        with pytest.raises(ValueError, match=r"^cursor must be in \[0, 2\*\*63\), got -1$"):
            await anext(c.kv_events(cursor=-1))
        assert open_streams(c._session.conn) == 0


@GENERATIONS
async def test_nothing_is_left_on_the_server(fresh_real_server: Any, generation: str) -> None:
    srv = fresh_real_server("pickle", generation)
    async with _client(srv, unique_model("ev")) as c:
        # aclose
        events = _stream(c)
        first = asyncio.ensure_future(events.__anext__())
        await _wait_subscribers(srv, 1)
        await events.aclose()
        await _wait_subscribers(srv, 0)
        with pytest.raises(StopAsyncIteration):
            await first
        # a cancelled wait (asyncio.timeout around the iteration)
        events = _stream(c)
        with pytest.raises(TimeoutError):  # noqa: PT012 - the timeout wraps the iteration
            async with asyncio.timeout(1.0):
                async for _ in events:
                    pass
        assert events.closed
        await _wait_subscribers(srv, 0)
        # the same through the public iterator
        with pytest.raises(TimeoutError):  # noqa: PT012 - the timeout wraps the iteration
            async with asyncio.timeout(1.0):
                async for _ in c.kv_events():
                    pass
        await _wait_subscribers(srv, 0)
        # a dropped iterator cancels itself: the stream, and the public iterator
        events = _stream(c)
        task = asyncio.ensure_future(events.__anext__())
        await _wait_subscribers(srv, 1)
        task.cancel()
        del events, task
        gc.collect()
        await _wait_subscribers(srv, 0)
        public = c.kv_events()
        task = asyncio.ensure_future(anext(public))
        await _wait_subscribers(srv, 1)
        task.cancel()
        del public, task
        gc.collect()
        await _wait_subscribers(srv, 0)
        # aclose of the public iterator mid-wait
        public = c.kv_events()
        task = asyncio.ensure_future(anext(public))
        await _wait_subscribers(srv, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await public.aclose()
        await _wait_subscribers(srv, 0)
        # the client's own connection is unaffected
        assert open_streams(c._session.conn) == 0
        assert await c.noop() > 0


@GENERATIONS
async def test_credit_one_batch_until_the_consumer_asks(fresh_real_server: Any, generation: str) -> None:
    srv = fresh_real_server("pickle", generation)
    models = [unique_model("ev") for _ in range(3)]
    clients = [_client(srv, m) for m in models]
    for c in clients:
        await c.open()
    try:
        for c in clients:
            toks = fresh_tokens(CS)
            assert await c.store(random_kv(SMALL_GEOMETRY, CS), toks) is True
        c0 = clients[0]
        # three clears: three removed records of models[0] (re-stored in between)
        async with _stream(c0, max_events=1) as events:
            first = asyncio.ensure_future(events.__anext__())
            await _wait_subscribers(srv, 1)
            toks = fresh_tokens(CS)
            for _ in range(3):
                assert await c0.store(random_kv(SMALL_GEOMETRY, CS), toks) is True
                await c0.clear(force=False)
            ev = await asyncio.wait_for(first, 10)
            assert isinstance(ev, RemovedEvent)
            await asyncio.sleep(1.0)  # the server could send more now, if it did not wait for credit
            assert events._stream is not None and len(events._stream._items) == 0
            assert events.batches == 2  # the first (empty) batch and the one consumed
            rest = [await asyncio.wait_for(events.__anext__(), 10) for _ in range(2)]
            assert [type(e) for e in rest] == [RemovedEvent, RemovedEvent]
            assert [e.seq for e in (ev, *rest)] == sorted(e.seq for e in (ev, *rest))  # type: ignore[union-attr]
            assert events.batches == 4
    finally:
        for c in clients:
            await c.aclose()


@GENERATIONS
async def test_a_restarted_server_resumes_with_a_resync(fresh_real_server: Any, generation: str) -> None:
    srv = fresh_real_server("pickle", generation)
    model = unique_model("ev")
    async with _client(srv, model) as c, _stream(c, reconnect_timeout=60) as events:
        first = asyncio.ensure_future(events.__anext__())
        await _wait_subscribers(srv, 1)
        old = srv.status()["kv_events"]["incarnation"]
        await asyncio.to_thread(srv.restart)
        new = srv.status()["kv_events"]["incarnation"]
        assert new != old
        ev = await asyncio.wait_for(first, 30)
        assert ev == Resync("restarted", new, old, 0)
        nxt = asyncio.ensure_future(events.__anext__())  # resubscribes from cursor 0
        await _wait_subscribers(srv, 1, deadline=30)
        tokens = fresh_tokens(2 * CS)
        end = time.monotonic() + 30
        while True:  # the client re-registers with the new server on its own
            try:
                assert await c.store(random_kv(SMALL_GEOMETRY, len(tokens)), tokens) is True
                break
            except lmc.LMCacheError:
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.2)
        await c.clear(force=False)
        ev = await asyncio.wait_for(nxt, 30)
        assert isinstance(ev, RemovedEvent) and ev.incarnation == new and ev.seq == 1
        assert ev.block_hashes == tuple(chunk_hashes(tokens, c))
        assert events.subscriptions >= 2


@GENERATIONS
async def test_a_cursor_out_of_the_log_gives_a_lost_resync(fresh_real_server: Any, generation: str) -> None:
    srv = fresh_real_server("pickle", generation, extra_args=["--kv-event-log-size", "2"])
    models = [unique_model("ev") for _ in range(3)]
    clients = [_client(srv, m) for m in models]
    for c in clients:
        await c.open()
    try:
        for c in clients:
            assert await c.store(random_kv(SMALL_GEOMETRY, CS), fresh_tokens(CS)) is True
        await clients[0].clear(force=False)  # three records (one per model); the log keeps 2
        incarnation = srv.status()["kv_events"]["incarnation"]
        await _wait_for(lambda: srv.status()["kv_events"]["next_seq"] == 4)
        # a consumer that had seen nothing of this incarnation (cursor 0) but knew it
        async with _stream(clients[2], cursor=0, incarnation=incarnation) as events:
            ev = await asyncio.wait_for(events.__anext__(), 10)
            assert ev == Resync("lost", incarnation, None, 2)  # just before the record that follows
            ev = await asyncio.wait_for(events.__anext__(), 10)
            assert isinstance(ev, RemovedEvent) and ev.seq == 3 and ev.model_name == models[2]
        # a fresh consumer (nothing derived yet) is not told
        async with _stream(clients[1]) as events:
            ev = await asyncio.wait_for(events.__anext__(), 10)
            assert isinstance(ev, RemovedEvent) and ev.seq == 2 and ev.model_name == models[1]
    finally:
        for c in clients:
            await c.aclose()


@GENERATIONS
async def test_resuming_skips_nothing_and_closing_leaves_no_subscription(
    fresh_real_server: Any, generation: str
) -> None:
    """One server (a log of 4 records, the reaper off) for both checks below."""
    args = ["--kv-event-log-size", "4", "--worker-reap-timeout-seconds", "0"]
    srv = fresh_real_server("pickle", generation, extra_args=args)
    await _resuming_from_any_cursor_handed_out_skips_nothing(srv)
    await _closing_the_client_cancels_its_subscriptions(srv)


async def _resuming_from_any_cursor_handed_out_skips_nothing(srv: Any) -> None:
    """With a log of 4 records and 10 written, a stream from cursor 1 says
    ``Resync("lost")`` and gets records 7..10; a stream resumed from the Resync's cursor
    or from any event's ``seq`` gets every record after it."""
    async with _client(srv, unique_model("ev")) as c:
        toks = fresh_tokens(CS)
        for _ in range(10):  # one removed record each
            assert await c.store(random_kv(SMALL_GEOMETRY, CS), toks) is True
            await c.clear(force=False)
        await _wait_for(lambda: srv.status()["kv_events"]["next_seq"] == 11)
        inc = srv.status()["kv_events"]["incarnation"]

        async def read(cursor: int, n: int) -> list[Any]:
            async with _stream(c, cursor=cursor, incarnation=inc, max_events=2) as events:
                return [await asyncio.wait_for(events.__anext__(), 10) for _ in range(n)]

        live = await read(1, 5)
        assert live[0] == Resync("lost", inc, None, 6)
        assert [e.seq for e in live[1:]] == [7, 8, 9, 10]
        for cursor in [6, 7, 8, 9]:  # the Resync's, then each event's but the last
            assert [e.seq for e in await read(cursor, 10 - cursor)] == list(range(cursor + 1, 11))


async def _closing_the_client_cancels_its_subscriptions(srv: Any) -> None:
    """``aclose()`` while consumers wait in ``kv_events()``, and the blocking ``close()``
    from another thread while a thread iterates: no subscription is left on the server
    (its reaper is off), right after the close."""
    c = _client(srv, unique_model("ev"))
    await c.open()
    consumers = [asyncio.ensure_future(anext(c.kv_events())) for _ in range(8)]
    await _wait_subscribers(srv, 8)
    start = time.monotonic()
    await c.aclose()
    assert time.monotonic() - start < 1.5
    assert _subscribers(srv) == 0  # the close waited for the server's end of each
    for task in consumers:
        with pytest.raises(lmc.ClientClosedError, match="^subscribe_kv_events: the connection was closed$"):
            await task

    def blocking() -> None:
        bc = lmc.Client(srv.url, srv.http_url, unique_model("ev"), geometry=SMALL_GEOMETRY, timeout=30)
        errors: list[BaseException] = []

        def iterate() -> None:
            try:
                for _ in bc.kv_events():
                    pass
            except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
                errors.append(exc)

        thread = threading.Thread(target=iterate)
        thread.start()
        _wait_subscribers_blocking(srv, 1)
        bc.close()
        assert _subscribers(srv) == 0
        thread.join(10)
        assert [type(e) for e in errors] == [lmc.ClientClosedError]

    await asyncio.to_thread(blocking)


async def _wait_for(pred: Any, deadline: float = 10.0) -> None:
    end = time.monotonic() + deadline
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


@pytest.mark.anyio
async def test_unsupported_hash_algorithm_is_refused(real_server: Any) -> None:
    async with _client(real_server, unique_model("ev")) as c:
        c._session.meta._cache["status"].value = {"hash_algorithm": "sha256_cbor"}
        assert c.hash_algorithm == "sha256_cbor"
        with pytest.raises(UnsupportedHashAlgorithmError, match="hashes chunks with 'sha256_cbor'"):
            chunk_hashes([1] * CS, c)
        with pytest.raises(UnsupportedHashAlgorithmError):
            await c.delete([1] * CS)


def test_chunk_hashes_recipe() -> None:
    import blake3

    tokens = list(range(40))
    h0 = blake3.blake3(NONE_HASH + b"".join(t.to_bytes(4, "big") for t in tokens[:16])).digest()
    h1 = blake3.blake3(h0 + b"".join(t.to_bytes(4, "big") for t in tokens[16:32])).digest()
    assert blake3.blake3((0).to_bytes(8, "big") + (0).to_bytes(4, "big")).digest() == NONE_HASH
    assert chunk_hashes(tokens, 16) == [h0, h1]
    assert chunk_hashes(tokens, 16, start=16) == [h1]
    assert chunk_hashes(tokens, 16, end=16) == [h0]
    assert chunk_hashes(tokens[:15], 16) == []
    with pytest.raises(
        ValueError, match="^start must be a non-negative multiple of the chunk size 16, got 3$"
    ):
        chunk_hashes(tokens, 16, start=3)
    with pytest.raises(ValueError, match=r"^end \(48\) is past the last whole chunk \(32 tokens\)$"):
        chunk_hashes(tokens, 16, end=48)


def test_the_blocking_client(fresh_real_server: Any) -> None:
    """``Client.kv_events`` is a blocking iterator (each step a call on the loop thread;
    leaving it early cancels the subscription); the management calls and the hash
    algorithm are there too."""
    srv = fresh_real_server("pickle")
    tokens = fresh_tokens(2 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    with lmc.Client(srv.url, srv.http_url, unique_model("ev"), geometry=SMALL_GEOMETRY, timeout=30) as c:
        assert c.hash_algorithm == "blake3"
        assert chunk_hashes(tokens, c) == chunk_hashes(tokens, CS)
        assert c.experimental() == frozenset({"kv_event_stream"})
        with pytest.raises(ValueError, match=r"^max_events must be in 1\.\.1024, got 0$"):
            next(c.kv_events(max_events=0))
        assert c.store(kv, tokens) is True
        events = c.kv_events()
        timer = threading.Timer(0.5, c.clear, kwargs={"force": False})
        timer.start()
        ev = next(events)
        timer.join()
        assert isinstance(ev, RemovedEvent) and ev.block_hashes == tuple(chunk_hashes(tokens, CS))
        assert _subscribers(srv) == 1
        del events  # left early (the iterator dropped): cancelled on the server
        _wait_subscribers_blocking(srv, 0)
        assert c.store(kv, tokens) is True
        assert c.warm(tokens) == WarmResult(2, 2, 2)  # no L2: "found" counts what L1 holds
        for ev in c.kv_events():  # the earlier clear is still in the server's log: read at once
            assert isinstance(ev, RemovedEvent)
            break
        assert c.delete(tokens) == DeleteResult(2, 0)
        _wait_subscribers_blocking(srv, 0)
        assert c.lookup(tokens) == 0


def _wait_subscribers_blocking(server: Any, n: int, deadline: float = 10.0) -> None:
    end = time.monotonic() + deadline
    while _subscribers(server) != n:
        if time.monotonic() > end:
            raise AssertionError(f"{_subscribers(server)} subscribers, expected {n}")
        time.sleep(0.05)


@GENERATIONS
async def test_management_calls(fresh_real_server: Any, generation: str) -> None:
    srv = fresh_real_server("pickle", generation)
    model = unique_model("mgmt")
    tokens = fresh_tokens(3 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    async with _client(srv, model) as c:
        assert await c.experimental() == (
            frozenset({"kv_event_stream"}) if generation == "0.5.6" else frozenset()
        )
        blocks = [management.BlockAllocation("req-1", [7, 8], tokens[:2])]
        await c.report_block_allocation(blocks)  # answered (None), not refused or timed out
        with pytest.raises(TypeError, match=r"^records must hold BlockAllocation, got tuple$"):
            await c.report_block_allocation([("req-1", [7], [1])])  # type: ignore[list-item]
        assert await c.store(kv, tokens) is True
        # warm: no L2 here; "found" counts the chunks already in L1
        assert await c.warm(tokens) == WarmResult(3, 3, 3)
        assert await c.warm(tokens[: CS - 1]) == WarmResult(0, 0, 0)
        # delete from the second chunk on: the first stays
        assert await c.delete(tokens, start=CS) == DeleteResult(2, 0)
        assert await c.lookup(tokens) == CS
        # keys not resident are neither deleted nor skipped (skipped: locked ones)
        assert await c.delete(tokens, start=CS) == DeleteResult(0, 0)
        # another salt's chunks are other keys
        assert await c.delete(tokens, "other") == DeleteResult(0, 0)
        assert await c.lookup(tokens) == CS
        with pytest.raises(TypeError, match="^force must be a bool, got NoneType$"):
            await c.clear(force=None)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await c.clear()  # type: ignore[call-arg]
        await c.clear(force=True)
        assert await c.lookup(tokens) == 0
        assert await c.warm(tokens) == WarmResult(3, 0, 3)


async def test_a_subscription_nobody_pings_is_reaped_and_resumed(fresh_real_server: Any) -> None:
    """The server closes a subscription whose id nobody pinged for
    ``--worker-reap-timeout-seconds`` (30 s, the least it allows); the stream's own pings
    keep another alive, and the reaped stream subscribes again from its cursor. Both
    generations at once (the test is mostly waiting for the reap)."""
    servers = [
        fresh_real_server("pickle", generation, extra_args=["--worker-reap-timeout-seconds", "30"])
        for generation in ("0.5.6", "0.5.7")
    ]
    await asyncio.gather(*(_reaped_and_resumed(srv) for srv in servers))


async def _reaped_and_resumed(srv: Any) -> None:
    async with _client(srv, unique_model("ev")) as c:
        pinged, silent = _stream(c, ping_interval=5), _stream(c, ping_interval=30)
        waits = [asyncio.ensure_future(s.__anext__()) for s in (pinged, silent)]
        await _wait_subscribers(srv, 2)
        t0 = time.monotonic()
        assert silent._ping_task is not None
        silent._ping_task.cancel()  # its pinger gone: the server hears nothing from this id
        await _wait_for(lambda: silent.subscriptions == 2, deadline=90)
        assert time.monotonic() - t0 > 25  # not before the reap timeout (30 s after the subscribe)
        assert (pinged.subscriptions, pinged.closed, silent.closed) == (1, False, False)
        await _wait_subscribers(srv, 2)  # the reaped one is back, the pinged one never left
        assert pinged.subscriptions == 1
        for w in waits:
            w.cancel()
        await pinged.aclose()
        await silent.aclose()
        await _wait_subscribers(srv, 0)


def _l2_objects(server: Any) -> int:
    return int(server.status()["storage_manager"]["l2_adapters"][0]["stored_object_count"])


@GENERATIONS
async def test_warm_loads_from_l2_and_leaves_the_chunks_in_l1(
    fresh_real_server: Any, generation: str
) -> None:
    """With an L2 (the server's mock adapter): a lookup's L2 load leaves nothing in L1,
    ``warm`` does; what ``delete`` finds resident in L1 tells them apart."""
    adapter = '{"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 10}'
    srv = fresh_real_server("pickle", generation, extra_args=["--l2-adapter", adapter])
    tokens = fresh_tokens(3 * CS)
    async with _client(srv, unique_model("warm")) as c:
        assert await c.store(random_kv(SMALL_GEOMETRY, len(tokens)), tokens) is True
        await _wait_for(lambda: _l2_objects(srv) == 3)  # written through to L2
        assert await c.delete(tokens, tier="l1") == DeleteResult(3, 0)
        assert await c.lookup(tokens) == 3 * CS  # found in L2, loaded for the lookup only
        assert await c.delete(tokens, tier="l1") == DeleteResult(0, 0)  # ... and freed again
        assert await c.warm(tokens) == WarmResult(3, 3, 3)
        assert await c.delete(tokens, tier="l1") == DeleteResult(3, 0)  # warm left them in L1
        assert await c.warm(tokens[CS:]) == WarmResult(2, 0, 2)  # another prefix: other chunks
        assert await c.warm(tokens) == WarmResult(3, 3, 3)
        assert await c.delete(tokens, tier="all") == DeleteResult(6, 0)  # L1 and L2
        assert _l2_objects(srv) == 0
        assert await c.warm(tokens) == WarmResult(3, 0, 3)
