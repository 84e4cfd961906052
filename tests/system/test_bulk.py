"""Bulk operations (lmcache_async.bulk): remap_many, store_many, retrieve_many.

The budget and buffer-pool primitives are tested on their own (no server); everything
else runs against the real LMCache 0.5.6 server over SHM and pickle (the ``client``
fixture of tests/plugins/clients.py: chunk size 16, the small explicit geometry, a model of
its own per test). No assertion depends on wall-clock speed; every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import itertools
import time
import weakref
from typing import Any

import pytest
import torch

from lmcache_async import AsyncClient, LMCacheTimeoutError, bulk
from lmcache_async._engine import batching as _batching
from lmcache_async.bulk import BatchProgress, ComposeItem, RemapPair, RetrieveItem, StoreItem
from lmcache_async.results import KVPart
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, random_kv

pytestmark = pytest.mark.anyio

CS = 16
BPT = SMALL_GEOMETRY.bytes_per_token  # 2 planes * 2 layers * 16 * 2 bytes = 128


# --------------------------------------------------------------------------- helpers


async def server_counts(client: AsyncClient) -> tuple[int, int, int, int]:
    """(active sessions, prefetch jobs, read-locked objects, write-locked objects)."""
    st = await client.status(max_age=0)
    l1 = st["storage_manager"]["l1_manager"]
    return (
        st["active_sessions"],
        st["active_prefetch_jobs"],
        l1["read_locked_count"],
        l1["write_locked_count"],
    )


async def wait_for_counts(
    client: AsyncClient, want: tuple[int, int, int, int], deadline: float = 30.0
) -> tuple[int, int, int, int]:
    """Poll /status until the counts equal ``want`` (cleanup runs in the background)."""
    end = time.monotonic() + deadline
    while True:
        got = await server_counts(client)
        if got == want or time.monotonic() > end:
            return got
        await asyncio.sleep(0.05)


async def quiet_baseline(client: AsyncClient) -> tuple[int, int, int, int]:
    """The counts once nothing is in flight (earlier tests' background cleanup may still
    be running on the shared server): stable across two reads 0.2 s apart."""
    end = time.monotonic() + 30.0
    last = await server_counts(client)
    while time.monotonic() < end:
        await asyncio.sleep(0.2)
        now = await server_counts(client)
        if now == last:
            return now
        last = now
    return last


async def wait_idle(client: AsyncClient, deadline: float = 30.0) -> str:
    """Wait until the client has no operation task left (abandoned ones finish their
    cleanup in the background); returns its repr."""
    end = time.monotonic() + deadline
    while "in_flight=0" not in repr(client) and time.monotonic() < end:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    return repr(client)


def chunked(n: int) -> int:
    return n // CS * CS


# --------------------------------------------------------------------------- primitives (no server)


async def test_byte_budget_is_fifo_and_runs_oversized_requests_alone() -> None:
    budget = _batching.ByteBudget(10)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await budget.acquire(n)
        order.append(name)

    await budget.acquire(6)
    a = asyncio.ensure_future(take("a", 6))
    b = asyncio.ensure_future(take("b", 2))  # would fit, but must not overtake a
    big = asyncio.ensure_future(take("big", 25))  # larger than the whole budget
    c = asyncio.ensure_future(take("c", 1))
    await asyncio.sleep(0)
    assert order == [] and budget.used == 6
    budget.release(6)
    await asyncio.sleep(0)
    assert order == ["a", "b"] and budget.used == 8
    budget.release(6)
    budget.release(2)
    await asyncio.sleep(0)
    assert order == ["a", "b", "big"] and budget.used == 25  # alone, over the budget
    budget.release(25)
    await asyncio.wait_for(asyncio.gather(a, b, big, c), 5)
    assert order == ["a", "b", "big", "c"] and budget.used == 1
    assert budget.peak == 25


async def test_byte_budget_cancelled_waiters_release_their_place_and_bytes() -> None:
    budget = _batching.ByteBudget(4)
    await budget.acquire(2)
    first = asyncio.ensure_future(budget.acquire(4))  # must wait
    second = asyncio.ensure_future(budget.acquire(1))  # queued behind first
    await asyncio.sleep(0)
    assert not first.done() and not second.done()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 5)
    assert budget.used == 3
    # Granted, then cancelled before it resumed: the bytes come back.
    late = asyncio.ensure_future(budget.acquire(2))
    await asyncio.sleep(0)
    budget.release(2)  # late is granted now (used 1 + 2)
    assert budget.used == 3
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late
    assert budget.used == 1
    budget.release(1)
    assert budget.used == 0


async def test_buffer_pool_hands_buffers_over_and_counts_idle_ones() -> None:
    per_chunk = CS * BPT
    pool = _batching.BufferPool(_batching.ByteBudget(2 * per_chunk), SMALL_GEOMETRY)
    one = await pool.acquire(CS)
    two = await pool.acquire(CS)
    assert pool.allocations == 2 and pool.budget.used == 2 * per_chunk
    waiter = asyncio.ensure_future(pool.acquire(CS))
    await asyncio.sleep(0)
    assert not waiter.done()
    tensor = one.tensor
    pool.release(one, reuse=True)  # goes straight to the waiter
    three = await asyncio.wait_for(waiter, 5)
    assert three.tensor is tensor and pool.allocations == 2
    pool.release(two, reuse=True)  # nobody waits: kept idle, still counted
    assert pool.budget.used == 2 * per_chunk
    again = await pool.acquire(CS)  # the idle one is reused
    assert again.tensor.shape == SMALL_GEOMETRY.kv_shape(CS) and pool.allocations == 2
    pool.release(again, reuse=False)  # a failed item's buffer is never reused
    assert pool.budget.used == per_chunk
    # A longer request evicts what it must; a shorter one may use a longer idle buffer.
    pool.release(three, reuse=True)
    big = await pool.acquire(2 * CS)
    assert pool.allocations == 3 and pool.budget.used == 2 * per_chunk
    pool.release(big, reuse=True)
    small = await pool.acquire(CS)
    assert small.tokens == 2 * CS and pool.allocations == 3
    pool.release(small, reuse=True)
    pool.clear()
    assert pool.budget.used == 0


# --------------------------------------------------------------------------- remap_many


async def test_remap_many_210_pairs_with_failures_and_misses(client: AsyncClient) -> None:
    """150 hits (some salted, target lengths 64/48/40/100), 30 uncached sources, 10
    targets shorter than a chunk, 20 invalid pairs: exact counts, every target bitwise."""
    pool = fresh_tokens(300 * 200)

    def span(k: int, offset: int, n: int) -> list[int]:
        return pool[k * 200 + offset : k * 200 + offset + n]

    target_lengths = [64, 48, 40, 100, 64]
    sources = [span(i, 0, 64) for i in range(150)]
    kvs = [random_kv(SMALL_GEOMETRY, 64, seed=i) for i in range(150)]
    salts = ["alpha" if i % 15 == 0 else "" for i in range(150)]
    stored = await client.store_many(
        [StoreItem(kvs[i], sources[i], salts[i]) for i in range(150)], concurrency=8
    )
    assert (stored.summary.items, stored.summary.failures, stored.summary.stored_new) == (150, 0, 150)
    assert (stored.summary.hits, stored.summary.misses, stored.summary.stored_tokens) == (0, 150, 150 * 64)

    pairs: list[Any] = []
    expect: list[
        tuple[str, Any]
    ] = []  # ("hit", (src index, target, n, salt)) / ("miss", target) / ("err", type)
    for i in range(150):
        dst = span(i, 100, target_lengths[i % 5])
        if salts[i]:
            pairs.append(RemapPair(sources[i], dst, "alpha", "beta"))
            expect.append(("hit", (i, dst, chunked(min(64, len(dst))), "beta")))
        else:
            pairs.append((sources[i], dst))
            expect.append(("hit", (i, dst, chunked(min(64, len(dst))), "")))
    for k in range(150, 180):  # sources never stored
        dst = span(k, 100, 64)
        pairs.append((span(k, 0, 64), dst))
        expect.append(("miss", dst))
    for k in range(180, 190):  # cached source, but a target shorter than one chunk
        pairs.append((sources[k - 180], span(k, 100, 8)))
        expect.append(("miss", None))
    bad: list[tuple[Any, type[Exception]]] = (
        [(([2**32, *sources[0]], span(190, 100, 64)), ValueError)] * 5
        + [((sources[0], "not tokens"), TypeError)] * 5
        + [((sources[0],), TypeError)] * 4
        + [((sources[0], span(191, 100, 64), "bad/salt"), ValueError)] * 3
        + [(12345, TypeError)] * 3
    )
    for value, exc_type in bad:
        pairs.append(value)
        expect.append(("err", exc_type))
    # Interleave so failures, misses and hits are mixed across the workers.
    order = sorted(range(len(pairs)), key=lambda j: (j * 7919) % len(pairs))
    pairs = [pairs[j] for j in order]
    expect = [expect[j] for j in order]
    assert len(pairs) == 210

    seen: list[BatchProgress] = []
    result = await client.remap_many(pairs, concurrency=8, progress=seen.append)

    s = result.summary
    assert (s.items, s.hits, s.misses, s.failures, s.stored_new) == (210, 150, 40, 20, 150)
    assert s.retrieved_tokens == s.stored_tokens == 30 * (64 + 48 + 32 + 64 + 64) == 8160
    assert s.bytes_moved == 2 * 8160 * BPT
    assert len(result) == 210 and [r.index for r in result] == list(range(210))
    for r, (kind, info) in zip(result, expect, strict=True):
        if kind == "hit":
            n = info[2]
            assert (r.error, r.retrieved_tokens, r.stored_tokens, r.stored_new) == (None, n, n, True)
        elif kind == "miss":
            assert (r.error, r.retrieved_tokens, r.stored_tokens, r.stored_new) == (None, 0, 0, False)
        else:
            assert type(r.error) is info, (r.index, r.error)
            assert (r.retrieved_tokens, r.stored_tokens, r.stored_new) == (0, 0, False)
    assert len(result.failed) == 20

    # The progress hook: once per item, in completion order, totals adding up.
    assert [p.done for p in seen] == list(range(1, 211))
    assert sorted(p.item.index for p in seen) == list(range(210))
    assert all(p.total == 210 for p in seen)
    last = seen[-1]
    assert (last.hits, last.misses, last.failures, last.tokens, last.bytes_moved) == (
        150,
        40,
        20,
        2 * 8160,
        s.bytes_moved,
    )
    assert all(a.bytes_moved <= b.bytes_moved for a, b in itertools.pairwise(seen))

    # Every target, bitwise: the source's KV prefix under the target's salt, nothing else.
    hit_targets = [info for kind, info in expect if kind == "hit"]
    got = await client.retrieve_many([RetrieveItem(dst, salt) for _i, dst, _n, salt in hit_targets])
    assert got.summary.failures == 0 and got.summary.hits == 150
    for r, (i, _dst, n, _salt) in zip(got, hit_targets, strict=True):
        assert r.kv is not None and r.retrieved_tokens == n
        assert torch.equal(r.kv, kvs[i][:, :, :n]), i
    salted = [(dst, n) for _i, dst, n, salt in hit_targets if salt]
    assert len(salted) == 10
    unsalted_view = await client.retrieve_many([dst for dst, _n in salted])
    assert unsalted_view.summary.hits == 0  # stored under "beta" only
    misses = [info for kind, info in expect if kind == "miss" and info is not None]
    looked = await client.retrieve_many(misses)
    assert (looked.summary.hits, looked.summary.misses) == (0, 30)


async def test_remap_stores_from_pooled_buffers_and_respects_the_budget(
    client: AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Live retrieve buffers (tracked by weak references, not by the module's own
    bookkeeping) never exceed the budget; an item larger than the budget runs alone."""
    live: dict[int, int] = {}
    allocs: list[tuple[int, int]] = []  # (bytes allocated, bytes live just before)
    keys = itertools.count()

    def tracking_allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        key = next(keys)
        allocs.append((t.numel() * t.element_size(), sum(live.values())))
        live[key] = t.numel() * t.element_size()
        weakref.finalize(t, live.pop, key, None)
        return t

    monkeypatch.setattr(_batching, "allocate", tracking_allocate)
    budget = 5 * CS * BPT  # five chunks
    chunk_counts = [1, 2, 3, 4, 2, 1, 3, 8, 2, 4, 1, 3, 2, 4, 1, 2] * 3  # 8 chunks > budget
    tokens = fresh_tokens(len(chunk_counts) * 400)
    sources = [tokens[k * 400 : k * 400 + c * CS] for k, c in enumerate(chunk_counts)]
    targets = [tokens[k * 400 + 200 : k * 400 + 200 + c * CS] for k, c in enumerate(chunk_counts)]
    kvs = [random_kv(SMALL_GEOMETRY, c * CS, seed=100 + k) for k, c in enumerate(chunk_counts)]
    assert (await client.store_many(list(zip(kvs, sources, strict=True)))).summary.stored_new == len(kvs)

    result = await client.remap_many(
        list(zip(sources, targets, strict=True)), concurrency=8, max_bytes_in_flight=budget
    )
    assert result.summary.failures == 0 and result.summary.hits == len(chunk_counts)
    oversize = 8 * CS * BPT
    assert result.summary.peak_bytes_in_flight == oversize
    if client.transfer == "shm":
        # SHM remaps copy slot to slot inside the server's pool: no buffer in this process.
        assert allocs == []
        got = await client.retrieve_many(targets)
        assert all(torch.equal(r.kv, kvs[r.index]) for r in got)  # type: ignore[arg-type]
        return
    for nbytes, before in allocs:
        if nbytes > budget:
            assert (nbytes, before) == (oversize, 0)  # waited until nothing else was live
        else:
            assert before + nbytes <= budget or before == 0
    assert any(n == oversize for n, _ in allocs)
    assert result.summary.peak_bytes_in_flight == oversize
    gc.collect()
    assert live == {}  # every buffer freed when the batch ended
    got = await client.retrieve_many(targets)
    assert all(torch.equal(r.kv, kvs[r.index]) for r in got)  # type: ignore[arg-type]

    # Uniform items: with room for three buffers, exactly three are ever allocated.
    allocs.clear()
    sources2 = [tokens[k * 400 : k * 400 + 64] for k in range(40)]
    targets2 = [tokens[k * 400 + 300 : k * 400 + 364] for k in range(40)]
    await client.store_many([(random_kv(SMALL_GEOMETRY, 64, seed=k), s) for k, s in enumerate(sources2)])
    again = await client.remap_many(
        list(zip(sources2, targets2, strict=True)), concurrency=8, max_bytes_in_flight=3 * 64 * BPT
    )
    assert again.summary.failures == 0 and again.summary.hits == 40
    assert [n for n, _ in allocs] == [64 * BPT] * 3
    assert again.summary.peak_bytes_in_flight == 3 * 64 * BPT


async def test_cancelled_batch_cancels_in_flight_items_and_leaves_nothing_behind(
    client: AsyncClient,
) -> None:
    n = 100
    tokens = fresh_tokens(n * 200)
    sources = [tokens[k * 200 : k * 200 + 64] for k in range(n)]
    targets = [tokens[k * 200 + 100 : k * 200 + 164] for k in range(n)]
    await client.store_many([(random_kv(SMALL_GEOMETRY, 64, seed=k), s) for k, s in enumerate(sources)])
    baseline = await quiet_baseline(client)

    done: list[int] = []
    batch: asyncio.Future[Any] | None = None

    def progress(p: BatchProgress) -> None:
        done.append(p.item.index)
        if p.done == 10:
            assert batch is not None
            batch.cancel()  # 7 other workers have an item in flight right now

    batch = asyncio.ensure_future(
        client.remap_many(list(zip(sources, targets, strict=True)), progress=progress)
    )
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(batch), 60)
    assert batch.cancelled()
    # Items already in flight may still finish before the cancellation reaches them: at
    # most the 10 done + the 7 in flight when it was requested.
    assert 10 <= len(done) <= 17 and max(done) < 17

    assert await wait_for_counts(client, baseline) == baseline
    assert "in_flight=0" in await wait_idle(client)
    hits = [await client.lookup(t) for t in targets]
    assert all(h in (0, 64) for h in hits)  # a store is all or nothing
    assert all(hits[i] == 64 for i in done)
    assert all(h == 0 for h in hits[17:])  # started after the cancellation: never stored
    # The client is still usable.
    after = await client.remap_many([(sources[-1], targets[-1])])
    assert (after.summary.hits, after[0].stored_new) == (1, True)


async def test_return_exceptions_false_raises_the_first_failure(client: AsyncClient) -> None:
    tokens = fresh_tokens(40 * 200)
    sources = [tokens[k * 200 : k * 200 + 32] for k in range(40)]
    await client.store_many([(random_kv(SMALL_GEOMETRY, 32, seed=k), s) for k, s in enumerate(sources)])
    baseline = await quiet_baseline(client)
    pairs: list[Any] = [(s, tokens[k * 200 + 100 : k * 200 + 132]) for k, s in enumerate(sources)]
    pairs[12] = (sources[12], [-5, 1, 2])
    with pytest.raises(ValueError, match=r"target_tokens: token id -5 is outside"):
        await client.remap_many(pairs, concurrency=4, return_exceptions=False)
    assert await wait_for_counts(client, baseline) == baseline
    assert "in_flight=0" in await wait_idle(client)
    assert await client.lookup(pairs[39][1]) == 0  # the batch stopped before the end


async def test_a_failing_progress_hook_aborts_the_batch(client: AsyncClient) -> None:
    tokens = fresh_tokens(20 * 100)
    pairs = [(tokens[k * 100 : k * 100 + 16], tokens[k * 100 + 50 : k * 100 + 66]) for k in range(20)]
    baseline = await quiet_baseline(client)

    def progress(p: BatchProgress) -> None:
        if p.done == 3:
            raise RuntimeError("progress bar broke")

    with pytest.raises(RuntimeError, match="progress bar broke"):
        await client.remap_many(pairs, concurrency=2, progress=progress)
    assert await wait_for_counts(client, baseline) == baseline


async def test_timed_out_items_fail_alone_and_clean_up(client: AsyncClient) -> None:
    tokens = fresh_tokens(12 * 200)
    sources = [tokens[k * 200 : k * 200 + 48] for k in range(12)]
    targets = [tokens[k * 200 + 100 : k * 200 + 148] for k in range(12)]
    await client.store_many([(random_kv(SMALL_GEOMETRY, 48, seed=k), s) for k, s in enumerate(sources)])
    baseline = await quiet_baseline(client)
    result = await client.remap_many(list(zip(sources, targets, strict=True)), timeout=0)
    assert result.summary.failures == 12
    assert all(isinstance(r.error, LMCacheTimeoutError) for r in result)
    assert all(isinstance(r.error, TimeoutError) for r in result)
    assert await wait_for_counts(client, baseline) == baseline
    assert "in_flight=0" in await wait_idle(client)
    assert [await client.lookup(t) for t in targets] == [0] * 12  # retrieves gave up: no stores
    # Same pairs with a real deadline: all hit.
    ok = await client.remap_many(list(zip(sources, targets, strict=True)), timeout=30)
    assert (ok.summary.hits, ok.summary.failures) == (12, 0)


# --------------------------------------------------------------------------- store_many / retrieve_many


async def test_store_many_and_retrieve_many(client: AsyncClient) -> None:
    tokens = fresh_tokens(30 * 100)
    lists = [tokens[k * 100 : k * 100 + 16 * (1 + k % 4)] for k in range(30)]
    kvs = [random_kv(SMALL_GEOMETRY, len(t), seed=k) for k, t in enumerate(lists)]
    items: list[Any] = [
        (kv, t, "s") if k % 3 == 0 else StoreItem(kv, t)
        for k, (kv, t) in enumerate(zip(kvs, lists, strict=True))
    ]
    items.append((kvs[0][:, :, :5], lists[0][:5]))  # no whole chunk
    items.append((kvs[1], lists[0]))  # wrong shape for its tokens
    seen: list[BatchProgress] = []
    first = await client.store_many(
        items, concurrency=5, max_bytes_in_flight=3 * 64 * BPT, progress=seen.append
    )
    s = first.summary
    total = sum(len(t) for t in lists)
    assert (s.items, s.failures, s.stored_new, s.hits, s.misses) == (32, 1, 30, 0, 31)
    assert s.stored_tokens == total and s.retrieved_tokens == 0
    assert type(first[31].error) is ValueError and first[30].stored_tokens == 0
    assert [p.done for p in seen] == list(range(1, 33))
    again = await client.store_many(items[:30])
    assert (again.summary.hits, again.summary.stored_new) == (30, 0)  # all cached already

    queries: list[Any] = [(t, "s") if k % 3 == 0 else t for k, t in enumerate(lists)]
    queries += [fresh_tokens(32), RetrieveItem(lists[1], "other-salt"), tokens[:3]]
    got = await client.retrieve_many(queries, concurrency=3, max_bytes_in_flight=64 * BPT)
    g = got.summary
    assert (g.items, g.hits, g.misses, g.failures) == (33, 30, 3, 0)
    assert g.retrieved_tokens == total and g.bytes_moved == total * BPT
    for k in range(30):
        kv = got[k].kv
        assert kv is not None and torch.equal(kv, kvs[k]), k
    assert got[30].kv is None and got[31].kv is None and got[32].kv is None


async def test_bad_options_are_refused_before_anything_is_sent(client: AsyncClient) -> None:
    pairs = [(list(range(16)), list(range(100, 116)))]
    with pytest.raises(ValueError, match="concurrency"):
        await client.remap_many(pairs, concurrency=0)
    with pytest.raises(ValueError, match="max_bytes_in_flight"):
        await client.store_many([], max_bytes_in_flight=0)
    with pytest.raises(TypeError, match="progress"):
        await client.retrieve_many([], progress="bar")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        await client.remap_many(pairs, timeout=-1)
    with pytest.raises(ValueError, match="device must be the CPU or a CUDA device, got meta"):
        await client.retrieve_many([list(range(16))], device="meta")
    with pytest.raises(ValueError, match="device must be a torch.device or a device string"):
        await client.retrieve_many([list(range(16))], device="no-such-device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            await client.retrieve_many([list(range(16))], device="cuda")
    empty = await client.remap_many([])
    assert (len(empty), empty.summary.items, empty.summary.gb_per_s) == (0, 0, 0.0)


def test_remap_pair_normalises_and_validates() -> None:
    p = RemapPair([1, 2, 3], (4, 5), "a")
    assert (p.source_tokens, p.target_tokens, p.target_salt) == ((1, 2, 3), (4, 5), "a")
    assert RemapPair.coerce(([1], [2], "x", "y")) == RemapPair((1,), (2,), "x", "y")
    assert RemapPair.coerce(p) is p
    with pytest.raises(TypeError) as info:
        RemapPair.coerce([[1]])
    assert str(info.value) == (
        "a remap pair must be a RemapPair or a tuple (source_tokens, target_tokens[, cache_salt"
        "[, target_cache_salt]]), got list of length 1"
    )


def test_items_are_coerced_from_tuples_of_their_fields_and_nothing_else() -> None:
    kv = torch.zeros(2, 1, 16, 4)
    item = StoreItem.coerce((kv, [1, 2], "s"))
    assert (item.kv is kv, item.tokens, item.cache_salt) == (True, [1, 2], "s")
    assert StoreItem.coerce(item) is item
    part = KVPart([1, 2])
    assert ComposeItem.coerce(([3, 4], [part])) == ComposeItem([3, 4], [part], "")
    cases = [
        (
            StoreItem.coerce,
            (kv,),
            "a store item must be a StoreItem or a tuple (kv, tokens[, cache_salt]), got tuple of length 1",
        ),
        (
            StoreItem.coerce,
            (kv, [1], "s", "x"),
            "a store item must be a StoreItem or a tuple (kv, tokens[, cache_salt]), got tuple of length 4",
        ),
        (
            StoreItem.coerce,
            kv,
            "a store item must be a StoreItem or a tuple (kv, tokens[, cache_salt]), got Tensor",
        ),
        (
            ComposeItem.coerce,
            "abc",
            "a compose item must be a ComposeItem or a tuple (target_tokens, parts[, cache_salt]), got str",
        ),
        (
            RemapPair.coerce,
            ([1], [2], "", None, 5),
            "a remap pair must be a RemapPair or a tuple (source_tokens, target_tokens[, cache_salt[, target_cache_salt]]), got tuple of length 5",
        ),
    ]
    for coerce, value, message in cases:
        with pytest.raises(TypeError) as info:
            coerce(value)
        assert str(info.value) == message
    with pytest.raises(ValueError, match="cache_salt must not contain"):
        RemapPair([1], [2], "a@b")
    with pytest.raises(TypeError):
        RemapPair([1.5], [2])  # type: ignore[list-item]


def test_client_methods_mirror_the_module_functions() -> None:
    for name in ("remap_many", "store_many", "retrieve_many"):
        method = inspect.signature(getattr(AsyncClient, name))
        func = inspect.signature(getattr(bulk, name))
        assert list(method.parameters)[1:] == list(func.parameters)[1:]
        for pname in list(func.parameters)[2:]:
            if pname != "timeout":
                assert method.parameters[pname].default == func.parameters[pname].default
            assert method.parameters[pname].kind is func.parameters[pname].kind
            assert method.parameters[pname].kind in (
                inspect.Parameter.KEYWORD_ONLY,
                inspect.Parameter.VAR_KEYWORD,
            )
