"""The fleet beyond one router (issue 43), on REAL LMCache servers: eight servers, added
and removed while the fleet routes (the memory index's bits reused); two routers (two
event loops, two threads) sharing one REAL ``redis-server`` route by what the other
learned (the engine path's ``stored`` events, a client's stores); Redis stopped mid-run
(every call still succeeds, by lookup fan-out) and restarted empty (the index refills
from stores and events)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

import pytest
import torch

import lmcache_async as lmc
from harness.redis_server import RedisServer
from lmcache_async.fleet import Fleet, MemoryIndex, RedisIndex
from tests.helpers import fresh_tokens, random_kv, unique_model

pytestmark = pytest.mark.anyio

T = TypeVar("T")
CS = 16
GEOMETRY = lmc.KVGeometry(2, 2, 8, torch.bfloat16, 4)


async def _until(pred: Any, deadline: float = 20.0) -> None:
    end = time.monotonic() + deadline
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


class _OtherLoop:
    """An event loop in a thread of its own: the second router."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def test_eight_servers_added_and_removed_while_routing(fresh_real_server: Any) -> None:
    servers = fresh_real_server.together(*({"mode": "pickle", "l1_size_gb": 0.25} for _ in range(8)))
    urls = [s.url for s in servers]
    model = unique_model("fleet8")
    prompts = [fresh_tokens(2 * CS) for _ in range(8)]
    kvs = [random_kv(GEOMETRY, 2 * CS) for _ in range(8)]
    async with Fleet(
        [(s.url, s.http_url) for s in servers[:6]], model, geometry=GEOMETRY, timeout=30
    ) as fleet:
        index = fleet.index
        assert isinstance(index, MemoryIndex)
        for i in range(6):
            assert (await fleet.store(kvs[i], prompts[i], server=urls[i])).value is True
        for i in range(6):
            route = await fleet.best(prompts[i], fanout="never")
            assert (route.server, route.cached_tokens, route.source) == (urls[i], 2 * CS, "index")
        freed = index.bit(urls[2])
        await fleet.remove_server(urls[2])
        assert fleet.servers == urls[:2] + urls[3:6] and urls[2] not in fleet.resyncs
        route = await fleet.best(prompts[2], fanout="never")
        assert route.server != urls[2] and route.cached_tokens == 0
        await fleet.add_server(urls[6], servers[6].http_url)
        await fleet.add_server(urls[7], servers[7].http_url)
        assert fleet.servers == [*urls[:2], *urls[3:8]]
        assert (await fleet.store(kvs[6], prompts[6], server=urls[6])).value is True
        assert index.bit(urls[6]) == freed and index.bit(urls[7]) == 6
        got = await fleet.retrieve(prompts[6])
        assert got.route.server == urls[6] and got.value is not None and torch.equal(got.value, kvs[6])
        got = await fleet.retrieve(prompts[0])
        assert got.route.server == urls[0] and got.value is not None and torch.equal(got.value, kvs[0])
        # urls[2] still holds prompts[2]; added back, a fan-out finds it there
        await fleet.add_server(urls[2], servers[2].http_url)
        route = await fleet.best(prompts[2])
        assert (route.server, route.cached_tokens, route.source) == (urls[2], 2 * CS, "lookup")
        with pytest.raises(ValueError, match=f"^server '{urls[0]}' is already in this fleet$"):
            await fleet.add_server(urls[0], servers[0].http_url)
        with pytest.raises(ValueError, match="^server 'tcp://127.0.0.1:1' is not in this fleet$"):
            await fleet.remove_server("tcp://127.0.0.1:1")
        with pytest.raises(lmc.LMCacheConnectionError, match=r"^fleet server \(tcp://127\.0\.0\.1:1, "):
            await fleet.add_server("tcp://127.0.0.1:1", "http://127.0.0.1:1")
        assert len(fleet.servers) == 8
        await _until(lambda: all(s.status()["kv_events"]["subscribers"] == 1 for s in servers))


# One generation: the events, lookups and stores the routers share behave alike in both
# (tests/system/test_fleet.py routes on each); Redis is the part under test here.
@pytest.mark.parametrize("generation", ["0.5.7"])
async def test_two_routers_share_one_redis_index(fresh_real_server: Any, generation: str) -> None:
    from harness.workers import EngineWorker

    a, b = fresh_real_server.together(
        {"mode": "shm", "generation": generation, "l1_size_gb": 0.25},
        {"mode": "pickle", "generation": generation, "l1_size_gb": 0.25},
    )
    model = unique_model("fleet-redis")
    pairs = [(a.url, a.http_url), (b.url, b.http_url)]
    p, q, r, s = (fresh_tokens(3 * CS) for _ in range(4))
    kv_p, kv_q, kv_r, kv_s = (random_kv(GEOMETRY, 3 * CS) for _ in range(4))
    redis = RedisServer().start()
    other = _OtherLoop()
    url = f"redis://127.0.0.1:{redis.port}/0"

    async def open_second() -> Fleet:
        second = Fleet(
            pairs,
            model,
            index=RedisIndex(url, model, deadline=0.5, retry_after=0.2),
            events=False,
            geometry=GEOMETRY,
            timeout=30,
        )
        await second.open()
        return second

    def on_second(fn: Any) -> Awaitable[Any]:
        async def call() -> Any:
            return await fn(second)

        return other.run(call())

    first_index = RedisIndex(url, model, deadline=0.5, retry_after=0.2)
    second: Fleet | None = None
    try:
        with EngineWorker(a) as eng:
            eng.register(model, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64)
            async with Fleet(pairs, model, index=first_index, geometry=GEOMETRY, timeout=30) as first:
                second = await other.run(open_second())
                await _until(lambda: a.status()["kv_events"]["subscribers"] == 1)
                # the first router applies A's `stored` events: the second routes by them
                assert await asyncio.to_thread(eng.store, p, kv_p) is True
                await first.wait_applied(a.url, 3, 20)
                route = await on_second(lambda f: f.best(p, fanout="never"))
                assert (route.server, route.cached_tokens, route.source) == (a.url, 3 * CS, "index")
                assert await on_second(lambda f: f.score(p[: 2 * CS] + [7] * CS, fanout="never")) == (
                    {a.url: 2 * CS},
                    "index",
                )
                # the second router's store: the first routes by it
                done = await on_second(lambda f: f.store(kv_q, q, server=b.url))
                assert done.value is True
                route = await first.best(q, fanout="never")
                assert (route.server, route.cached_tokens, route.source) == (b.url, 3 * CS, "index")
                # Redis stopped: every call still succeeds, by lookup fan-out
                assert redis.stop() == 0
                route = await first.best(p)
                assert (route.server, route.cached_tokens, route.source) == (a.url, 3 * CS, "lookup")
                got = await first.retrieve(q)
                assert got.route.server == b.url and got.route.source == "lookup"
                assert got.value is not None and torch.equal(got.value, kv_q)
                done = await on_second(lambda f: f.store(kv_r, r, server=a.url))
                assert done.value is True and (await first.best(r, fanout="never")).cached_tokens == 0
                assert first_index.failures >= 1
                # Redis back, empty: the index refills from lookups, stores and events
                redis.start()
                await asyncio.sleep(0.25)  # past retry_after
                route = await on_second(lambda f: f.best(r))
                assert (route.server, route.cached_tokens, route.source) == (a.url, 3 * CS, "lookup")
                route = await first.best(r, fanout="never")
                assert (route.server, route.cached_tokens, route.source) == (a.url, 3 * CS, "index")
                before = first.events_applied[a.url]
                assert await asyncio.to_thread(eng.store, s, kv_s) is True
                await first.wait_applied(a.url, before + 3, 20)
                route = await on_second(lambda f: f.best(s, fanout="never"))
                assert (route.server, route.cached_tokens, route.source) == (a.url, 3 * CS, "index")
                # a resync (the first router forgets A) is seen by the second at once
                await first_index.forget(a.url)
                assert (await on_second(lambda f: f.best(s, fanout="never"))).cached_tokens == 0
                await on_second(lambda f: f.aclose())
                await on_second(lambda f: f.index.aclose())
    finally:
        await first_index.aclose()
        other.close()
        redis.cleanup()
    assert redis.pid is None
