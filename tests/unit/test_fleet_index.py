"""The fleet index's contract, one suite over both backends: the in-process
``MemoryIndex`` and the ``RedisIndex`` on a REAL ``redis-server``
(``harness/redis_server.py``). Then what only Redis has: expiry of speculative entries,
epochs (a resync forgets in O(1), seen by every router), namespaces, malformed entries
ignored, and Redis down (no call fails; logged once; ``prefix`` answers None)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from harness.redis_server import RedisServer
from lmcache_async.fleet import FleetIndex, MemoryIndex, RedisIndex
from lmcache_async.hashing import chunk_hashes

pytestmark = pytest.mark.anyio

A, B, C = "tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555", "tcp://10.0.0.3:5555"
SERVERS = (A, B, C)


def _h(n: int, seed: int = 0) -> list[bytes]:
    return chunk_hashes([seed] + list(range(n * 4 - 1)), 4)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    try:
        yield srv
    finally:
        srv.cleanup()


_seq = iter(range(1_000_000))


_opened: list[RedisIndex] = []


def _redis(srv: RedisServer, ns: str | None = None, **kw: Any) -> RedisIndex:
    idx = RedisIndex(f"redis://127.0.0.1:{srv.port}/0", ns or f"t{next(_seq)}", **kw)
    _opened.append(idx)
    return idx


@pytest.fixture
async def _close_redis_indexes() -> AsyncIterator[None]:
    """Every RedisIndex a test made is closed, even when the test failed."""
    yield
    while _opened:
        await _opened.pop().aclose()


@pytest.fixture(params=["memory", "redis"])
async def index(request: pytest.FixtureRequest, redis_server: RedisServer) -> AsyncIterator[FleetIndex]:
    idx: FleetIndex = MemoryIndex() if request.param == "memory" else _redis(redis_server)
    yield idx
    await idx.aclose()


async def test_longest_prefix_per_server(index: FleetIndex) -> None:
    hs = _h(5)
    await index.add(A, hs[:3])
    await index.add(B, hs)
    await index.add(C, hs[1:])  # no first chunk: no prefix
    assert await index.prefix(hs, SERVERS) == {A: 3, B: 5}
    assert await index.prefix(hs, [A]) == {A: 3}
    assert await index.prefix(hs[:2], SERVERS) == {A: 2, B: 2}
    assert await index.prefix(_h(5, seed=9), SERVERS) == {}
    assert await index.prefix(hs, ["tcp://never:1"]) == {}
    assert await index.prefix([], SERVERS) == {}


async def test_remove_forget_and_one_batch_in_order(index: FleetIndex) -> None:
    hs = _h(4)
    await index.apply([("add", A, hs), ("add", B, hs), ("remove", A, hs[2:3])])
    assert await index.prefix(hs, SERVERS) == {A: 2, B: 4}
    await index.forget(B)
    assert await index.prefix(hs, SERVERS) == {A: 2}
    await index.add(B, hs[:1])  # learned again after the resync
    assert await index.prefix(hs, SERVERS) == {A: 2, B: 1}
    await index.apply([("remove", A, hs), ("speculate", C, hs[:2]), ("forget", C, ())])
    assert await index.prefix(hs, SERVERS) == {B: 1}


async def test_release(index: FleetIndex) -> None:
    hs = _h(3)
    await index.add(A, hs)
    await index.add(B, hs)
    await index.release(A)
    if isinstance(index, MemoryIndex):  # A's entries gone, its bit given to the next server
        assert await index.prefix(hs, SERVERS) == {B: 3}
        assert index.bit(C) == 0 and index.bit(B) == 1
        assert await index.prefix(hs, SERVERS) == {B: 3}
    else:  # shared: other routers may still route to A
        assert await index.prefix(hs, SERVERS) == {A: 3, B: 3}


async def test_the_memory_index_has_no_server_ceiling() -> None:
    idx = MemoryIndex()
    hs = _h(3)
    urls = [f"tcp://h{i}:1" for i in range(1000)]
    for i, u in enumerate(urls):
        await idx.add(u, hs[: 1 + i % 3])
    got = await idx.prefix(hs, urls)
    assert got == {u: 1 + i % 3 for i, u in enumerate(urls)}
    await idx.release(urls[500])
    await idx.add("tcp://new:1", hs)
    assert idx.bit("tcp://new:1") == 500 and (await idx.prefix(hs, ["tcp://new:1", urls[500]])) == {
        "tcp://new:1": 3
    }


@pytest.mark.usefixtures("_close_redis_indexes")
async def test_speculative_entries_expire_unless_confirmed(redis_server: RedisServer) -> None:
    idx = _redis(redis_server, ttl=30, speculative_ttl=0.3)
    hs = _h(2)
    await idx.add(A, hs, confirmed=False)
    await idx.add(B, hs, confirmed=False)
    await idx.add(B, hs)  # an event confirms B's
    await idx.add(B, hs, confirmed=False)  # a later speculative write never shortens it
    assert await idx.prefix(hs, SERVERS) == {A: 2, B: 2}
    pttl = redis_server.command("PTTL", idx.key(hs[0]))
    assert 29_000 < pttl <= 30_000
    await asyncio.sleep(0.4)
    assert await idx.prefix(hs, SERVERS) == {B: 2}
    await idx.add(C, hs[:1])  # a write prunes the expired member
    assert redis_server.command("ZCARD", idx.key(hs[0])) == 2
    await idx.aclose()
    # an abandoned key vanishes with its longest-lived member
    short = _redis(redis_server, ttl=0.2, speculative_ttl=0.1)
    await short.add(A, hs)
    await asyncio.sleep(0.3)
    assert redis_server.command("EXISTS", short.key(hs[0])) == 0
    await short.aclose()


async def test_memory_keeps_speculative_entries() -> None:
    idx = MemoryIndex()
    await idx.add(A, _h(2), confirmed=False)
    assert await idx.prefix(_h(2), SERVERS) == {A: 2}


@pytest.mark.usefixtures("_close_redis_indexes")
async def test_epochs_forget_in_one_write_seen_by_every_router(redis_server: RedisServer) -> None:
    one = _redis(redis_server, "shared-epochs")
    two = _redis(redis_server, "shared-epochs")
    hs = _h(3)
    await one.add(A, hs)
    await one.add(B, hs)
    assert await two.prefix(hs, SERVERS) == {A: 3, B: 3}
    await two.forget(A)
    assert await one.epochs() == {A: 1}
    assert await one.prefix(hs, SERVERS) == {B: 3}
    await one.add(A, hs[:1])
    assert await two.prefix(hs, SERVERS) == {A: 1, B: 3}
    assert sorted(redis_server.command("ZRANGE", one.key(hs[0]), 0, -1)) == [
        f"0@{A}".encode(),
        f"0@{B}".encode(),
        f"1@{A}".encode(),
    ]
    await one.aclose()
    await two.aclose()


@pytest.mark.usefixtures("_close_redis_indexes")
async def test_namespaces_are_isolated(redis_server: RedisServer) -> None:
    x, y = _redis(redis_server, "fleet-x"), _redis(redis_server, "fleet-y")
    hs = _h(2)
    await x.add(A, hs)
    await y.forget(A)
    assert await x.prefix(hs, SERVERS) == {A: 2}
    assert await y.prefix(hs, SERVERS) == {}
    assert redis_server.keys("fleet-y:*") == ["fleet-y:epochs"]
    await x.aclose()
    await y.aclose()


@pytest.mark.usefixtures("_close_redis_indexes")
async def test_malformed_entries_are_ignored(redis_server: RedisServer) -> None:
    idx = _redis(redis_server, "junk")
    hs = _h(3)
    await idx.add(A, hs)
    k0, k1, k2 = (idx.key(h) for h in hs)
    far = 99_999_999_999_999
    for member in (
        b"x@" + B.encode(),
        b"@" + B.encode(),
        b"1" * 19 + b"@" + B.encode(),
        b"0" + B.encode(),
        b"0@\xff",
    ):
        redis_server.command("ZADD", k0, far, member)
    redis_server.command("ZADD", k0, far, b"0@tcp://10.0.0.9:1")  # not one of the servers asked
    redis_server.command("HSET", b"junk:epochs", C, b"-1")  # a bad epoch: read as absent (0)
    redis_server.command("ZADD", k0, far, f"0@{C}")
    redis_server.command("DEL", k1)
    redis_server.command("SET", k1, b"not a sorted set")  # WRONGTYPE: the chunk is held by nobody
    assert await idx.prefix(hs, SERVERS) == {A: 1, C: 1}
    redis_server.command("HSET", b"junk:epochs", A, b"12abc")
    assert await idx.prefix(hs[:1], SERVERS) == {A: 1, C: 1}
    del k2
    await idx.aclose()


async def test_redis_down_no_call_fails_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    idx = RedisIndex("redis://127.0.0.1:1/0", "down", deadline=0.2, retry_after=0.3)
    caplog.set_level(logging.WARNING, "lmcache_async.fleet.redis")
    hs = _h(2)
    assert await idx.prefix(hs, SERVERS) is None
    await idx.add(A, hs)
    assert await idx.prefix(hs, SERVERS) is None
    assert (idx.failures, idx.skipped) == (1, 2)
    await asyncio.sleep(0.35)
    assert await idx.prefix(hs, SERVERS) is None
    assert (idx.failures, idx.skipped) == (2, 2)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["fleet index: Redis lookup failed"]
    await idx.aclose()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"namespace": ""}, "namespace must be a non-empty str without whitespace, got ''"),
        ({"namespace": "a b"}, "namespace must be a non-empty str without whitespace, got 'a b'"),
        ({"namespace": "n", "ttl": 0}, "ttl must be a finite number of seconds > 0, got 0"),
        ({"namespace": "n", "deadline": True}, "deadline must be a finite number of seconds > 0, got True"),
        ({"namespace": "n", "ttl": 5, "speculative_ttl": 6}, "speculative_ttl (6) must not exceed ttl (5)"),
    ],
)
def test_bad_arguments(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{__import__('re').escape(message)}$"):
        RedisIndex("redis://127.0.0.1:1/0", **kw)
    with pytest.raises(ValueError, match="^give one of url or client$"):
        RedisIndex(None, "n")


@pytest.mark.usefixtures("_close_redis_indexes")
async def test_more_concurrent_calls_than_connections_wait_for_one(redis_server: RedisServer) -> None:
    """A routing service's burst (here 300 lookups at once, over the index's 64 pooled
    connections) waits for a connection within the deadline: nothing fails, every answer
    is exact (redis-py's own pool refuses the 101st call with MaxConnectionsError)."""
    idx = _redis(redis_server, deadline=2.0)
    hs = _h(4)
    await idx.add(A, hs[:3])
    got = await asyncio.gather(*(idx.prefix(hs, SERVERS) for _ in range(300)))
    assert got == [{A: 3}] * 300
    assert (idx.failures, idx.skipped) == (0, 0)
