"""ShmPool.populate: pages are mapped where a client copies, once, never the whole pool."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import lmcache_async as lmc
from lmcache_async._protocol.wire import SlotDescriptor
from lmcache_async._transport import shm as shm
from lmcache_async._transport.shm import GRANULE, ShmPool
from lmcache_async.testing import EmbeddedServer
from tests.helpers import peek

POOL = 64 << 20  # 32 granules


@pytest.fixture
def segment() -> Iterator[str]:
    name = f"lmca_populate_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, POOL)
    finally:
        os.close(fd)
    try:
        yield name
    finally:
        os.unlink(path)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every madvise(MADV_POPULATE_READ) the pool makes, as (offset in the pool, length)."""
    made: list[tuple[int, int]] = []
    real = shm._madvise
    assert real is not None, "libc madvise is not reachable through ctypes"

    def spy(address: int, length: int, advice: int) -> int:
        assert advice == shm._MADV_POPULATE_READ
        made.append((address, length))
        return real(address, length, advice)

    monkeypatch.setattr(shm, "_madvise", spy)
    return made


def _slot(offset: int, length: int) -> SlotDescriptor:
    return SlotDescriptor(offset=offset, length=length, shape=(length,), dtype="uint8")


def _relative(pool: ShmPool, made: list[tuple[int, int]]) -> list[tuple[int, int]]:
    origin = pool.address_range()[0]
    return [(a - origin, n) for a, n in made]


def test_only_the_granules_under_the_slots_are_mapped_once(
    segment: str, calls: list[tuple[int, int]]
) -> None:
    pool = ShmPool(segment, POOL)
    try:
        assert pool.mapped_bytes == 0
        a = pool.view(_slot(3 * GRANULE + 100, GRANULE), (GRANULE,), torch.uint8)  # granules 3 and 4
        b = pool.view(_slot(10 * GRANULE, 256 << 10), (256 << 10,), torch.uint8)  # granule 10
        mine = torch.zeros(GRANULE, dtype=torch.uint8)  # not in the pool: ignored
        pool.populate([a, b, mine])
        assert _relative(pool, calls) == [(3 * GRANULE, 2 * GRANULE), (10 * GRANULE, GRANULE)]
        assert pool.mapped_bytes == 3 * GRANULE
        pool.populate([a, b])  # already mapped: no call
        assert len(calls) == 2
        c = pool.view(_slot(2 * GRANULE, 4 * GRANULE), (4 * GRANULE,), torch.uint8)  # granules 2-5
        pool.populate([c])  # only the unmapped runs: 2, then 5
        assert _relative(pool, calls)[2:] == [(2 * GRANULE, GRANULE), (5 * GRANULE, GRANULE)]
        assert pool.mapped_bytes == 5 * GRANULE
        last = pool.view(_slot(POOL - 4096, 4096), (4096,), torch.uint8)  # the last granule
        pool.populate([last])
        assert _relative(pool, calls)[4:] == [(POOL - GRANULE, GRANULE)]
        del a, b, c, last
    finally:
        pool.close()


def test_populate_off_maps_nothing(segment: str, calls: list[tuple[int, int]]) -> None:
    pool = ShmPool(segment, POOL)
    try:
        pool.populate_on_use = False
        pool.populate([pool.view(_slot(0, GRANULE), (GRANULE,), torch.uint8)])
        assert calls == [] and pool.mapped_bytes == 0
    finally:
        pool.close()


def test_an_unsupported_kernel_turns_it_off(segment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []

    def einval(address: int, length: int, advice: int) -> int:
        made.append(length)
        return -1

    monkeypatch.setattr(shm, "_madvise", einval)
    pool = ShmPool(segment, POOL)
    try:
        v = pool.view(_slot(0, GRANULE), (GRANULE,), torch.uint8)
        pool.populate([v])
        pool.populate([v])
        assert made == [GRANULE] and pool.populate_on_use is False and pool.mapped_bytes == 0
        del v
    finally:
        pool.close()


@pytest.mark.anyio
@pytest.mark.parametrize("prefault", [True, False])
async def test_a_client_maps_what_it_copies_not_the_pool(
    prefault: bool, calls: list[tuple[int, int]]
) -> None:
    """A 1 GiB pool; one store and one retrieve of 4 chunks of 256 KiB: the client maps the
    granules under those slots (at most 4 x 2 granules), never the pool."""
    geometry = lmc.KVGeometry(num_layers=2, num_kv_heads=1, head_dim=128, dtype=torch.bfloat16, block_size=16)
    async with EmbeddedServer(chunk_size=256, mode="shm", size_bytes=1 << 30) as srv:
        async with lmc.AsyncClient(srv.url, srv.http_url, "m", geometry=geometry, prefault_shm=prefault) as c:
            pool: Any = peek(c).pool
            assert pool is not None and pool.populate_on_use is prefault
            tokens = list(range(4 * 256))
            kv = torch.randn(geometry.kv_shape(len(tokens))).to(geometry.dtype)
            assert await c.store(kv, tokens) is True
            got = await c.retrieve(tokens)
            assert got is not None and torch.equal(got, kv)
            if prefault:
                assert 1 <= len(calls) <= 8
                assert 0 < pool.mapped_bytes <= 8 * GRANULE
                again = len(calls)
                again_got = await c.retrieve(tokens)
                assert again_got is not None and torch.equal(again_got, kv)
                assert len(calls) == again  # the same slots: nothing more to map
            else:
                assert calls == [] and pool.mapped_bytes == 0


@pytest.mark.anyio
async def test_slots_only_read_are_left_to_fault_and_a_remap_maps_its_targets(
    calls: list[tuple[int, int]],
) -> None:
    """A fresh client retrieving what another stored maps nothing first (read faults
    map neighbouring pages too: cheaper than populating, benchmarks/probes/bench_shm_pages.py);
    a remap maps the granules under its target slots only, not under its sources."""
    geometry = lmc.KVGeometry(num_layers=2, num_kv_heads=1, head_dim=128, dtype=torch.bfloat16, block_size=16)
    tokens = list(range(4 * 256))
    target_tokens = [t + 100_000 for t in tokens]
    kv = torch.randn(geometry.kv_shape(len(tokens))).to(geometry.dtype)
    async with EmbeddedServer(chunk_size=256, mode="shm", size_bytes=1 << 30) as srv:
        async with lmc.AsyncClient(srv.url, srv.http_url, "m", geometry=geometry) as writer:
            assert await writer.store(kv, tokens) is True
        stored_by_writer = len(calls)
        assert stored_by_writer >= 1
        async with lmc.AsyncClient(srv.url, srv.http_url, "m", geometry=geometry) as reader:
            pool: Any = peek(reader).pool
            got = await reader.retrieve(tokens)
            assert got is not None and torch.equal(got, kv)
            assert len(calls) == stored_by_writer and pool.mapped_bytes == 0
            result = await reader.remap(tokens, target_tokens)
            assert (result.retrieved_tokens, result.stored_tokens, result.stored_new) == (1024, 1024, True)
            assert len(calls) > stored_by_writer
            # 4 target slots of 256 KiB: at most 4 granules (sources not among them).
            assert 0 < pool.mapped_bytes <= 4 * GRANULE
            again = await reader.retrieve(target_tokens)
            assert again is not None and torch.equal(again, kv)
