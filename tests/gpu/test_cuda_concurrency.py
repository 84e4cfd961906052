"""CUDA stores and retrieves many at a time: each store reads its KV as its caller's
stream saw it, one cancelled store of several leaves nothing half-stored and the others
intact, one reservation and one commit per store, ``retrieve_many(device=...)``.

Marked ``gpu`` and skipped without CUDA; run on a GPU machine with the other GPU tests
(``python -m pytest -m gpu tests/gpu -q``). The servers are those of ``test_cuda.py``
(the embedded server, SHM and inline as 0.5.6 and 0.5.7).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from lmcache_async import Client
from tests.gpu.test_cuda import (
    CS,
    HAVE_CUDA,
    Busy,
    aclient,
    busy,
    geometry,
    gpu_server,
    rand_kv,
    sessions,
    warm_up,
)
from tests.helpers import fresh_tokens, unique_model

__all__ = ["busy", "gpu_server"]  # the fixtures, imported to be used here

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")]

ITEMS = 6


@pytest.mark.anyio
@pytest.mark.parametrize("api", ["store", "store_many"])
async def test_concurrent_stores_read_kv_as_the_callers_stream_saw_it(
    gpu_server: Any, busy: Busy, api: str
) -> None:
    """Six KV tensors written on a busy side stream, then stored all at once: every
    stored byte is the written one, and each target holds its own tensor."""
    geom = geometry()
    async with aclient(gpu_server, geom) as c:
        await warm_up(c, geom, 4 * CS)
        tokens = [fresh_tokens(4 * CS) for _ in range(ITEMS)]
        refs = [rand_kv(geom, 4 * CS) for _ in range(ITEMS)]
        kvs = [torch.zeros_like(r) for r in refs]
        torch.cuda.synchronize()
        with torch.cuda.stream(busy.stream):
            busy.queue()
            for kv, ref in zip(kvs, refs, strict=True):
                kv.copy_(ref)  # the engine's writes, queued behind the matmuls
            if api == "store":
                done = await asyncio.gather(*(c.store(kv, t) for kv, t in zip(kvs, tokens, strict=True)))
                assert done == [True] * ITEMS
            else:
                res = await c.store_many(list(zip(kvs, tokens, strict=True)), concurrency=4)
                assert (res.summary.failures, res.summary.stored_new) == (0, ITEMS)
        for t, ref in zip(tokens, refs, strict=True):
            got = await c.retrieve(t)
            assert got is not None and torch.equal(got, ref.cpu())


def test_concurrent_stores_through_the_blocking_client_from_threads(gpu_server: Any, busy: Busy) -> None:
    """Four threads store through one ``Client`` at once, the KV written on the side stream
    (behind queued matmuls) that is each thread's current stream: the facade captures
    each calling thread's stream before handing the call over."""
    geom = geometry()
    with Client(gpu_server.url, gpu_server.http_url, unique_model("cuda"), geometry=geom, timeout=60) as c:
        warm = fresh_tokens(4 * CS)
        assert c.store(rand_kv(geom, len(warm)), warm) is True
        tokens = [fresh_tokens(4 * CS) for _ in range(4)]
        refs = [rand_kv(geom, 4 * CS) for _ in range(4)]
        kvs = [torch.zeros_like(r) for r in refs]
        torch.cuda.synchronize()
        results: list[object] = [None] * 4
        start = threading.Barrier(4)
        with torch.cuda.stream(busy.stream):  # the writes, queued behind the matmuls
            busy.queue()
            for kv, ref in zip(kvs, refs, strict=True):
                kv.copy_(ref)

        def worker(i: int) -> None:
            try:
                start.wait(timeout=30)
                with torch.cuda.stream(busy.stream):  # each thread's current stream
                    results[i] = c.store(kvs[i], tokens[i])
            except BaseException as exc:  # reported below, with its thread
                results[i] = exc

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert results == [True] * 4
        for t, ref in zip(tokens, refs, strict=True):
            got = c.retrieve(t)
            assert got is not None and torch.equal(got, ref.cpu())
        # retrieve_many onto the GPU, through the facade too
        many = c.retrieve_many(tokens, device="cuda")
        assert many.summary.hits == 4
        for item, ref in zip(many, refs, strict=True):
            assert item.kv is not None and item.kv.is_cuda and torch.equal(item.kv, ref)


@pytest.mark.anyio
async def test_cancelling_one_of_several_in_flight_stores_leaves_nothing_half_stored(
    gpu_server: Any, busy: Busy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four stores in flight, their copies held behind the caller's queued work; one is
    cancelled: it raises CancelledError, and afterwards each of the four targets is whole
    and bitwise its own KV (a store whose slots were reserved is completed), no session
    is left."""
    from lmcache_async._engine.cuda import copies as cuda

    name = "to_host" if gpu_server.mode == "shm" else "encode_inline"
    real = getattr(cuda, name)
    started: set[int] = set()  # the KV tensors whose copy has begun (by storage)
    all_started = asyncio.Event()

    async def spy(*args: Any, **kw: Any) -> Any:
        source = args[0][0][1] if name == "to_host" else args[1][0]  # (pairs,...) / (wire, chunks, ...)
        started.add(source.untyped_storage().data_ptr())
        if len(started) >= 4:
            all_started.set()
        return await real(*args, **kw)

    monkeypatch.setattr(cuda, name, spy)
    geom = geometry()
    async with aclient(gpu_server, geom) as c:
        await warm_up(c, geom, 4 * CS)
        base = await sessions(c)
        tokens = [fresh_tokens(4 * CS) for _ in range(4)]
        refs = [rand_kv(geom, 4 * CS) for _ in range(4)]
        kvs = [torch.zeros_like(r) for r in refs]
        torch.cuda.synchronize()
        started.clear()  # the warm-up's copies do not count
        with torch.cuda.stream(busy.stream):
            busy.queue()  # the copies wait for these: all four are in flight together
            for kv, ref in zip(kvs, refs, strict=True):
                kv.copy_(ref)
            tasks = [asyncio.ensure_future(c.store(kv, t)) for kv, t in zip(kvs, tokens, strict=True)]
            await asyncio.sleep(0)  # the stores start (and mark the stream) in here
        await asyncio.wait_for(all_started.wait(), 60)
        tasks[1].cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert outcomes[0] is True and outcomes[2] is True and outcomes[3] is True
        assert isinstance(outcomes[1], asyncio.CancelledError)
        assert await c.drain(timeout=60)
        for t, ref in zip(tokens, refs, strict=True):
            assert await c.lookup(t) == len(t)  # whole: never a part of the chunks
            got = await c.retrieve(t)
            assert got is not None and torch.equal(got, ref.cpu())
        assert await sessions(c) == base


@pytest.mark.anyio
async def test_a_cuda_store_is_one_reservation_and_one_commit_whatever_its_size(
    gpu_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16-chunk store alone and four at once: one ``prepare_store`` and one
    ``commit_store`` each (a store split into groups cost the server a reservation, a
    commit and a session per group, and was no faster)."""
    if gpu_server.mode != "shm":
        pytest.skip("SHM only")
    from lmcache_async._engine.ops.base import OperationsBase
    from lmcache_async._protocol.wire import Op

    real = OperationsBase.call
    sent: list[Op] = []

    async def spy(self: Any, op: Any, opcode: Op, *args: Any) -> Any:
        sent.append(opcode)
        return await real(self, op, opcode, *args)

    monkeypatch.setattr(OperationsBase, "call", spy)
    geom = geometry()
    async with aclient(gpu_server, geom) as c:
        alone = fresh_tokens(16 * CS)
        kv = rand_kv(geom, len(alone))
        assert await c.store(kv, alone) is True
        assert (sent.count(Op.PREPARE_STORE), sent.count(Op.COMMIT_STORE)) == (1, 1)
        tokens = [fresh_tokens(16 * CS) for _ in range(4)]
        assert await asyncio.gather(*(c.store(kv, t) for t in tokens)) == [True] * 4
        assert (sent.count(Op.PREPARE_STORE), sent.count(Op.COMMIT_STORE)) == (5, 5)
        for t in [alone, *tokens]:
            got = await c.retrieve(t, device="cuda")
            assert got is not None and torch.equal(got, kv)
