"""The fleet on two REAL LMCache servers (per generation): the engine path's ``stored``
events route a prompt to the server that holds it, a client's store (which publishes
nothing) is found by lookup fan-out, ties go to the less loaded server, retrieve and
remap_many go to the chosen server (bitwise), ``removed`` events withdraw a server, and
a server killed and restarted mid-stream is excluded while down and resynced (its
entries forgotten) when it comes back. Prompts nobody holds spread over the servers."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

import pytest
import torch

import lmcache_async as lmc
from lmcache_async.fleet import Fleet
from lmcache_async.hashing import chunk_hashes
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, random_kv, unique_model

pytestmark = pytest.mark.anyio

CS = 16
GEOMETRY = lmc.KVGeometry(2, 2, 8, torch.bfloat16, 4)


async def _until(pred: Any, deadline: float = 30.0) -> None:
    end = time.monotonic() + deadline
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("generation", ["0.5.6", "0.5.7"])
async def test_fleet_routes_by_cached_prefix(fresh_real_server: Any, generation: str) -> None:
    from harness.workers import EngineWorker

    a, b = fresh_real_server.together(
        {"mode": "shm", "generation": generation}, {"mode": "shm", "generation": generation}
    )
    model = unique_model("fleet")
    ab = [a.url, b.url]
    p, q, r = fresh_tokens(3 * CS), fresh_tokens(3 * CS), fresh_tokens(2 * CS)
    kv_p, kv_q, kv_r = (random_kv(GEOMETRY, len(t)) for t in (p, q, r))
    with EngineWorker(a) as eng:
        eng.register(model, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64)
        async with Fleet(
            [(a.url, a.http_url), (b.url, b.http_url)], model, geometry=GEOMETRY, timeout=30
        ) as fleet:
            await _until(
                lambda: a.status()["kv_events"]["subscribers"] == 1 == b.status()["kv_events"]["subscribers"]
            )
            # the engine path on A publishes `stored`: the index learns A holds p
            assert await asyncio.to_thread(eng.store, p, kv_p) is True
            await fleet.wait_applied(a.url, 3, 20)
            route = await fleet.best(p, fanout="never")
            assert (route.server, route.cached_tokens, route.source) == (a.url, 3 * CS, "index")
            assert (await fleet.best(p[: 2 * CS] + [7] * CS, fanout="never")).cached_tokens == 2 * CS
            # a client's store on B publishes nothing: found by the lookup fan-out
            async with lmc.AsyncClient(b.url, b.http_url, model, geometry=GEOMETRY, timeout=30) as cb:
                assert await cb.store(kv_q, q) is True
                assert (await fleet.best(q, fanout="never")).cached_tokens == 0
                route = await fleet.best(q)
                assert (route.server, route.cached_tokens, route.source) == (b.url, 3 * CS, "lookup")
                assert (await fleet.best(q, fanout="never")).server == b.url  # recorded
                # routed retrieves, bitwise
                got = await fleet.retrieve(p)
                assert got.route.server == a.url and got.value is not None and torch.equal(got.value, kv_p)
                got = await fleet.retrieve(q)
                assert got.route.server == b.url and got.value is not None and torch.equal(got.value, kv_q)
                # both hold r: the tie goes to the less loaded
                assert (await fleet.store(kv_r, r, server=a.url)).value is True
                assert (await fleet.store(kv_r, r, server=b.url)).value is True
                assert await fleet.index.prefix(chunk_hashes(r, CS), ab) == {a.url: 2, b.url: 2}
                await fleet.clients[1].drain()
                fleet._routed[b.url] += 1
                assert (await fleet.best(r, fanout="never")).server == a.url
                fleet._routed[a.url] += 2
                assert (await fleet.best(r, fanout="never")).server == b.url
                fleet._routed[a.url] -= 2
                fleet._routed[b.url] -= 1
                # remap_many goes to the server holding each source
                target = [5, 6] + p[2:]
                done = await fleet.remap_many([(p, target), (q, [9] + q[1:])])
                assert [d.route.server for d in done] == [a.url, b.url]
                assert [len(d.value) for d in done] == [1, 1]
                assert all(d.value[0].error is None for d in done)
                got = await fleet.retrieve(target)
                assert got.route.server == a.url and got.value is not None and torch.equal(got.value, kv_p)
                # `removed` events withdraw B (a clear of B, every model)
                before = fleet.events_applied[b.url]
                await cb.clear(force=False)
                await fleet.wait_applied(b.url, before + 1, 20)
                assert (await fleet.best(q, fanout="never")).cached_tokens == 0
                assert await fleet.index.prefix(chunk_hashes(r, CS), [b.url]) == {}
            # A killed mid-stream: never chosen while down; resynced when it comes back
            await asyncio.to_thread(a.stop)
            await _until(lambda: not fleet.clients[0]._session.conn.connected)
            route = await fleet.best(p, fanout="never")
            assert route.server == b.url and route.cached_tokens == 0
            resyncs = fleet.resyncs[a.url]
            await asyncio.to_thread(a.start)
            await _until(lambda: fleet.resyncs[a.url] > resyncs)
            assert await fleet.index.prefix(chunk_hashes(p, CS), ab) == {}
            await _until(lambda: a.status()["kv_events"]["subscribers"] == 1)


async def test_sequential_new_prompts_spread_over_the_servers(real_server_shm: Any) -> None:
    """QA-5 m4: one store at a time (the load 0 everywhere) of 300 prompts nobody holds,
    over 3 servers: each gets 70 to 130 of them (an even share is 100; random prompts
    would fall outside with a probability of about 3e-4), and the same
    prompt is routed to the same server again. The three clients of this fleet share one
    real server: the routing only sees three servers."""
    srv = real_server_shm
    rng = random.Random(0)  # fixed prompts (the ranks also hash the URLs, whose port varies by run)
    prompts = [[rng.randrange(2**31) for _ in range(CS)] for _ in range(300)]
    kv = random_kv(SMALL_GEOMETRY, CS)
    port = srv.url.rsplit(":", 1)[1]
    urls = [srv.url, f"tcp://localhost:{port}", f"tcp://127.1:{port}"]  # three ids, one server
    async with Fleet(
        [(u, srv.http_url) for u in urls],
        unique_model("spread"),
        geometry=SMALL_GEOMETRY,
        events=False,
        timeout=30,
    ) as fleet:
        chosen = []
        for tokens in prompts:
            done = await fleet.store(kv, tokens)
            assert done.value is True and done.route.load == 0 and done.route.cached_tokens == 0
            chosen.append(done.route.server)
        shares = Counter(chosen)
        assert sorted(shares) == sorted(urls) and all(70 <= n <= 130 for n in shares.values()), shares
        fresh = Fleet([(u, srv.http_url) for u in urls], "m", geometry=SMALL_GEOMETRY, events=False)
        fresh._cs = CS
        fresh._up = lambda: urls  # type: ignore[method-assign]
        assert [(await fresh.best(t, fanout="never")).server for t in prompts] == chosen
