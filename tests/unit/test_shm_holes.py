"""Stores into pool pages nobody has written yet: written through the segment's descriptor,
bitwise; slots with pages written before go through the mapping; a short write is resumed."""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

import lmcache_async as lmc
from lmcache_async._protocol.wire import SlotDescriptor
from lmcache_async._transport import shm as shm
from lmcache_async._transport.shm import ShmPool
from lmcache_async.testing import EmbeddedServer
from tests.helpers import peek
from tests.plugins.hypothesis_budget import examples

# 8 layers x 2 heads x 128, bf16: 2 MiB a 256-token chunk; 8 chunks = 16 MiB (a large store),
# each chunk 32 runs of 128 KiB in the caller's [2, L, T, D] tensor.
GEOMETRY = lmc.KVGeometry(num_layers=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, block_size=16)
TOKENS = list(range(8 * 256))


def _data_bytes(path: str) -> int:
    """Bytes of the segment that are not holes (SEEK_DATA / SEEK_HOLE)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size, pos, total = os.fstat(fd).st_size, 0, 0
        while pos < size:
            try:
                pos = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, pos, os.SEEK_HOLE)
            total, pos = total + end - pos, end
        return total
    finally:
        os.close(fd)


def _write_every_page(path: str) -> None:
    with open(path, "r+b") as f:
        f.write(b"\x01" * os.path.getsize(path))


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of every pwritev the pool makes."""
    made: list[int] = []
    real = os.pwritev

    def spy(fd: int, buffers: Any, offset: int) -> int:
        n = real(fd, buffers, offset)
        made.append(n)
        return n

    monkeypatch.setattr(os, "pwritev", spy)
    return made


@pytest.mark.anyio
async def test_a_store_into_holes_writes_through_the_descriptor_and_maps_nothing(writes: list[int]) -> None:
    kv = torch.randn(GEOMETRY.kv_shape(len(TOKENS))).to(GEOMETRY.dtype)
    async with EmbeddedServer(chunk_size=256, mode="shm", size_bytes=256 << 20) as srv:
        path = srv.shm_segment
        assert path is not None
        assert _data_bytes(path) == 0  # a fresh pool: all holes
        async with lmc.AsyncClient(srv.url, srv.http_url, "m", geometry=GEOMETRY) as c:
            pool: Any = peek(c).pool
            assert await c.store(kv, TOKENS) is True
            assert sum(writes) == kv.numel() * 2 and pool.mapped_bytes == 0
            assert _data_bytes(path) == kv.numel() * 2  # exactly the slots' pages were written
        async with lmc.AsyncClient(srv.url, srv.http_url, "m", geometry=GEOMETRY) as reader:
            got = await reader.retrieve(TOKENS)
            assert got is not None and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))  # bitwise


@pytest.mark.anyio
async def test_slots_whose_pages_were_written_go_through_the_mapping(writes: list[int]) -> None:
    kv = torch.randn(GEOMETRY.kv_shape(len(TOKENS))).to(GEOMETRY.dtype)
    other = torch.randn(GEOMETRY.kv_shape(len(TOKENS))).to(GEOMETRY.dtype)
    async with EmbeddedServer(chunk_size=256, mode="shm", size_bytes=256 << 20) as srv:
        path = srv.shm_segment
        assert path is not None
        _write_every_page(path)  # a pool used before
        async with lmc.AsyncClient(srv.url, srv.http_url, "m", geometry=GEOMETRY) as c:
            pool: Any = peek(c).pool
            assert await c.store(kv, TOKENS) is True
            assert await c.store(other, [t + 10_000 for t in TOKENS]) is True
            assert writes == [] and pool.mapped_bytes >= 2 * kv.numel() * 2
            got = await c.retrieve(TOKENS)
            assert got is not None and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
            got = await c.retrieve([t + 10_000 for t in TOKENS])
            assert got is not None and torch.equal(got.view(torch.uint8), other.view(torch.uint8))


@pytest.mark.anyio
async def test_a_short_write_is_resumed_where_it_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev
    shorts: list[int] = []

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:
        want = sum(b.nbytes for b in buffers)
        if want > 200_000:  # write 3 iovecs and 1,000 bytes of the fourth, once per call
            head = [*buffers[:3], buffers[3][:1000]]
            shorts.append(want)
            return real(fd, head, offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", short)
    kv = torch.randn(GEOMETRY.kv_shape(len(TOKENS))).to(GEOMETRY.dtype)
    async with EmbeddedServer(chunk_size=256, mode="shm", size_bytes=256 << 20) as srv:
        async with lmc.AsyncClient(srv.url, srv.http_url, "m", geometry=GEOMETRY) as c:
            assert await c.store(kv, TOKENS) is True
            got = await c.retrieve(TOKENS)
            assert got is not None and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    assert shorts  # the short writes happened, and the slots hold every byte all the same


@pytest.mark.anyio
async def test_a_new_tensor_reuses_the_memory_of_a_retrieve_that_is_gone() -> None:
    kv = torch.randn(GEOMETRY.kv_shape(len(TOKENS))).to(GEOMETRY.dtype)
    async with EmbeddedServer(chunk_size=256, mode="shm", size_bytes=256 << 20) as srv:
        async with lmc.AsyncClient(srv.url, srv.http_url, "m", geometry=GEOMETRY) as c:
            assert await c.store(kv, TOKENS) is True
            first = await c.retrieve(TOKENS)
            assert first is not None and torch.equal(first.view(torch.uint8), kv.view(torch.uint8))
            ptr = first.data_ptr()
            first.zero_()  # the caller's own writes are its own: the next retrieve overwrites all
            del first
            again = await c.retrieve(TOKENS)
            assert again is not None and again.data_ptr() == ptr
            assert torch.equal(again.view(torch.uint8), kv.view(torch.uint8))


def test_closing_the_pool_during_a_write_closes_its_descriptor_after_the_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    size = 4 << 20
    name = f"lmca_holes_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    real = os.pwritev
    inside, go_on = threading.Event(), threading.Event()

    def held(fd: int, buffers: Any, offset: int) -> int:
        inside.set()
        assert go_on.wait(30)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", held)
    pool = ShmPool(name, size)
    try:
        pool_fd = pool._fd
        target = pool.view(SlotDescriptor(0, 1 << 20, (1 << 20,), "uint8"), (1 << 20,), torch.uint8)
        source = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        writer = threading.Thread(target=pool.fill, args=([(target, source)],))
        writer.start()
        assert inside.wait(30)
        pool.close()  # the write is running: its descriptor stays open
        os.fstat(pool_fd)
        go_on.set()
        writer.join(30)
        assert not writer.is_alive()
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(pool_fd)  # closed by the write, once done
        with open(f"/dev/shm/{name}", "rb") as f:
            assert f.read(1 << 20) == source.numpy().tobytes()
        del target
    finally:
        pool.close()
        os.unlink(f"/dev/shm/{name}")


@settings(max_examples=examples(40), deadline=None)
@given(
    mla=st.booleans(),
    layers=st.integers(1, 5),
    tokens=st.integers(1, 9),
    hidden=st.integers(1, 17),
    chunks=st.integers(1, 3),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.int8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_descriptor_writes_are_bitwise_the_source_in_the_slot_layout(
    mla: bool, layers: int, tokens: int, hidden: int, chunks: int, dtype: torch.dtype, seed: int
) -> None:
    """Every chunk of a [2, L, T, D] (or MLA [L, T, D]) tensor written into hole slots
    through the descriptor, runs of any length (MIN_RUN lowered to one byte)."""
    gen = torch.Generator().manual_seed(seed)
    lead = (layers,) if mla else (2, layers)
    raw = torch.randint(
        0, 256, (*lead, tokens * chunks, hidden * dtype.itemsize), dtype=torch.uint8, generator=gen
    )
    kv = raw.view(dtype)
    step = kv.narrow(len(lead), 0, tokens).numel() * dtype.itemsize
    stride = -(-step // 4096) * 4096  # slots start on pages, as the server's do
    size = chunks * stride + 4096
    name = f"lmca_holes_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    pool = ShmPool(name, size)
    real_min = shm.MIN_RUN
    shm.MIN_RUN = 1
    try:
        shape = (*lead, tokens, hidden)
        slots = [
            pool.view(
                SlotDescriptor(k * stride, step, shape, str(dtype).removeprefix("torch.")), shape, dtype
            )
            for k in range(chunks)
        ]
        pairs = [(slots[k], kv.narrow(len(lead), (chunks - 1 - k) * tokens, tokens)) for k in range(chunks)]
        pool.fill(pairs)
        assert pool.mapped_bytes == 0  # all written through the descriptor
        with open(f"/dev/shm/{name}", "rb") as f:
            data = f.read()
        for k, (_, src) in enumerate(pairs):
            assert (
                data[k * stride : k * stride + step] == src.contiguous().view(torch.uint8).numpy().tobytes()
            )
            assert data[k * stride + step : (k + 1) * stride] == bytes(stride - step)  # nothing beyond
        assert data[chunks * stride :] == bytes(size - chunks * stride)
        del slots, pairs
    finally:
        shm.MIN_RUN = real_min
        pool.close()
        os.unlink(f"/dev/shm/{name}")
