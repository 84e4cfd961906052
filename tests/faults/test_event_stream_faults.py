"""A hostile server behind ``kv_events()`` (tests/fakes/fake_router.py answers
``subscribe_kv_events``): batches that are not what was asked are a ``ProtocolError``
with an exact message and the subscription cancelled; a server that ignores the ``ack``
credit and floods is refused at its first item without credit, nothing of the flood is
buffered, and the client's other calls are still answered; closing the client while a
consumer waits names the operation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import lmcache_async as lmc
from lmcache_async._protocol.wire import Op, packb
from lmcache_async._transport.reply_stream import open_streams
from tests.fakes import server_wire
from tests.fakes.fake_router import FakeRouter, json_http_server
from tests.helpers import SMALL_GEOMETRY

pytestmark = pytest.mark.anyio

CS = 16
MODEL = "m"
H = bytes(range(32))  # a 32-byte chunk hash


@pytest.fixture
async def http_stub() -> AsyncIterator[str]:
    """The HTTP API of a 0.5.6 server (chunk size 16)."""
    mp = {"chunk_size": CS, "supported_transfer_mode": "auto", "instance_id": "x", "max_cpu_workers": 1}
    routes = {"/config": {"mp": mp}, "/status": {"cache_context_meta": {}, "active_sessions": 0}}
    async with json_http_server(routes) as url:
        yield url


def serving(on_subscribe: Callable[[server_wire.Request], list[tuple[Any, ...]]]) -> Any:
    """A fake server that registers clients and answers ``subscribe_kv_events`` with
    ``on_subscribe(request)``'s actions."""

    def handler(req: server_wire.Request) -> list[tuple[Any, ...]]:
        if req.op is Op.NOOP:
            return [("reply", "OK")]
        if req.op is Op.GET_CHUNK_SIZE:
            return [("reply", CS)]
        if req.op is Op.REGISTER_ENGINE_DRIVEN:
            return [("reply", {"shm_name": "", "pool_size": 0})]
        if req.op in (Op.UNREGISTER_ENGINE_DRIVEN, Op.PING):
            return [("reply", None)]
        if req.op is Op.SUBSCRIBE_KV_EVENTS:
            return on_subscribe(req)
        return []

    return handler


def batch(events: list[dict[str, Any]], next_cursor: int | None = None, **fields: Any) -> dict[str, Any]:
    last = events[-1]["seq"] if events and isinstance(events[-1].get("seq"), int) else 0
    return {
        "enabled": True,
        "incarnation": 7,
        "next_cursor": last if next_cursor is None else next_cursor,
        "lost": False,
        "events": events,
        **fields,
    }


def removed(seq: int, *hashes: bytes, model: str = MODEL) -> dict[str, Any]:
    return {
        "seq": seq, "kind": "removed", "medium": "CPU", "model_name": model,
        "block_hashes": list(hashes or (H,)), "parent_block_hash": None, "token_ids": [],
    }  # fmt: skip


def stored(seq: int, tokens: list[int], model: str = MODEL) -> dict[str, Any]:
    return {
        "seq": seq, "kind": "stored", "medium": "CPU", "model_name": model,
        "block_hashes": [H], "parent_block_hash": None, "token_ids": tokens,
    }  # fmt: skip


def client(router: FakeRouter, http: str) -> lmc.AsyncClient:
    return lmc.AsyncClient(router.url, http, MODEL, geometry=SMALL_GEOMETRY, timeout=5, cleanup_grace=0.5)


BAD_BATCHES = [
    pytest.param(
        batch([removed(i) for i in range(1, 6)]),
        "KV event batch: Expected `array` of length <= 4 - at `$.events`",
        id="more-records-than-max_events",
    ),
    pytest.param(
        batch([stored(1, list(range(CS - 1)))]),
        "KV event 1: a stored record carries 16 token ids (the chunk size), got 15",
        id="stored-too-few-tokens",
    ),
    pytest.param(
        batch([stored(1, list(range(CS + 1)))]),
        "KV event batch: Expected `array` of length <= 16 - at `$.events[0].token_ids`",
        id="stored-too-many-tokens",
    ),
    pytest.param(
        batch([stored(1, list(range(10_000_000)))]),
        f"KV event batch of {len(packb(batch([stored(1, list(range(10_000_000)))])))} bytes: more than "
        "the 35653444 a batch of at most 4 records can take",
        id="stored-10M-tokens",
    ),
    pytest.param(
        batch([dict(stored(1, list(range(CS))), block_hashes=[H, H])]),
        "KV event 1: a stored record carries one hash, got 2",
        id="stored-two-hashes",
    ),
    pytest.param(
        batch([removed(1, H[:31])]),
        "KV event batch: Expected `bytes` of length >= 32 - at `$.events[0].block_hashes[0]`",
        id="hash-31-bytes",
    ),
    pytest.param(
        batch([removed(1, b"")]),
        "KV event batch: Expected `bytes` of length >= 32 - at `$.events[0].block_hashes[0]`",
        id="empty-hash",
    ),
    pytest.param(
        batch([dict(stored(1, list(range(CS))), parent_block_hash=b"x" * 33)]),
        "KV event batch: Expected `bytes` of length <= 32 - at `$.events[0].parent_block_hash`",
        id="parent-hash-33-bytes",
    ),
    pytest.param(
        batch([], next_cursor=-5),
        "KV event batch: Expected `int` >= 0 - at `$.next_cursor`",
        id="next_cursor-negative",
    ),
    pytest.param(
        batch([], next_cursor=2**64 - 1),
        "KV event batch: Expected `int` <= 9223372036854775807 - at `$.next_cursor`",
        id="next_cursor-2**64-1",
    ),
    pytest.param(
        batch([removed(-(2**63))], next_cursor=3),
        "KV event batch: Expected `int` >= 1 - at `$.events[0].seq`",
        id="seq-negative",
    ),
    pytest.param(
        batch([removed(5)], next_cursor=3),
        "KV event: seq 5 is out of order (after 0, next_cursor 3)",
        id="seq-past-next_cursor",
    ),
    pytest.param(
        batch([removed(2), removed(2)]),
        "KV event: seq 2 is out of order (after 2, next_cursor 2)",
        id="seq-repeated",
    ),
    pytest.param(
        batch([removed(1, model="other")]),
        "KV event 1: a record of model 'other', not 'm'",
        id="another-model",
    ),
    pytest.param(
        batch([removed(1, b"\0" * (50 << 20))]),
        f"KV event batch of {len(packb(batch([removed(1, bytes(50 << 20))])))} bytes: more than the "
        "35653444 a batch of at most 4 records can take",
        id="50MB-hash",
    ),
]


@pytest.mark.parametrize(("value", "message"), BAD_BATCHES)
async def test_a_batch_that_is_not_what_was_asked_is_refused(
    http_stub: str, value: Any, message: str
) -> None:
    payload = packb(value)
    async with FakeRouter(serving(lambda req: [("raw", [req.uid_frame, req.op_frame, payload])])) as router:
        async with client(router, http_stub) as c:
            events = c.kv_events(max_events=4)
            start = time.monotonic()
            with pytest.raises(lmc.ProtocolError) as info:
                await asyncio.wait_for(anext(events), 10)
            assert str(info.value) == message
            assert time.monotonic() - start < 2.0
            await asyncio.sleep(0.1)  # the cancel reaches the fake
            subscribes = [r for r in router.requests if r.op is Op.SUBSCRIBE_KV_EVENTS]
            assert len(subscribes) == 1  # refused: no resubscribe from a bad cursor
            assert router.controls == [(subscribes[0].uid_frame, b"cancel")]
            assert open_streams(c._session.conn) == 0
            assert await c.noop() > 0  # the client is still usable


async def test_a_server_that_ignores_the_credit_is_refused_and_the_client_stays_responsive(
    http_stub: str,
) -> None:
    """The fake answers one subscribe with 3000 batches at once, acks or not, and goes on
    sending them after the cancel: the client refuses the first item without credit,
    buffers none of the flood, and answers a noop made meanwhile."""
    frames: list[tuple[Any, ...]] = []

    def flood(req: server_wire.Request) -> list[tuple[Any, ...]]:
        for seq in range(1, 3001):
            frames.append(("raw", [req.uid_frame, req.op_frame, packb(batch([removed(seq)]))]))
            if seq % 50 == 0:
                frames.append(("sleep", 0))  # the fake's own loop gets a turn
        return frames

    async with FakeRouter(serving(flood)) as router:
        async with client(router, http_stub) as c:
            got: list[Any] = []
            with pytest.raises(lmc.ProtocolError) as info:  # noqa: PT012 - the iteration raises
                async with asyncio.timeout(10):
                    async for ev in c.kv_events():
                        got.append(ev)
            assert str(info.value) == (
                "subscribe_kv_events: the server sent a stream item without credit "
                "(it must wait for an ack after each item); the stream is cancelled"
            )
            assert 1 <= len(got) <= 2  # the first item, and one more if its ack went out first
            assert open_streams(c._session.conn) == 0
            start = time.monotonic()
            assert await c.noop(timeout=2) > 0  # answered while the flood still comes in
            assert time.monotonic() - start < 2
            await asyncio.sleep(0.2)
            assert [action for _, action in router.controls] in ([b"cancel"], [b"ack", b"cancel"])
            assert c._session.conn.dropped[0] > 100  # the flood was dropped, not buffered


async def test_closing_the_client_names_the_subscription_and_cancels_it(http_stub: str) -> None:
    """A consumer waiting when the client closes gets a ClientClosedError that names
    ``subscribe_kv_events``; the close sends the subscription's cancel (a fake that never
    answers it: the close waits at most a second for the end)."""
    first = packb(batch([]))
    async with FakeRouter(serving(lambda req: [("raw", [req.uid_frame, req.op_frame, first])])) as router:
        c = client(router, http_stub)
        await c.open()
        waiting = asyncio.ensure_future(anext(c.kv_events()))
        await asyncio.sleep(0.3)
        start = time.monotonic()
        await c.aclose()
        assert time.monotonic() - start < 1.5
        with pytest.raises(lmc.ClientClosedError, match=r"^subscribe_kv_events: the connection was closed$"):
            await waiting
        await asyncio.sleep(0.1)
        (sub,) = [r for r in router.requests if r.op is Op.SUBSCRIBE_KV_EVENTS]
        assert router.controls == [(sub.uid_frame, b"ack"), (sub.uid_frame, b"cancel")]
