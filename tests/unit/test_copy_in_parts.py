"""copy_in_parts: a large store's copy cut into parts, each thread mapping and copying its own."""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lmcache_async._base import host_copy as host_copy
from lmcache_async._base.host_copy import copy_in_parts
from lmcache_async._engine import copies as copies
from lmcache_async._protocol.wire import SlotDescriptor
from lmcache_async._transport.shm import ShmPool
from tests.plugins.hypothesis_budget import examples

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float8_e4m3fn]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)  # every bit pattern, NaN payloads included


def _spans(targets: list[torch.Tensor], origin: int) -> list[tuple[int, int]]:
    return [(t.data_ptr() - origin, t.data_ptr() - origin + t.numel() * t.element_size()) for t in targets]


@settings(max_examples=examples(60), deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    mla=st.booleans(),
    layers=st.integers(1, 9),
    tokens=st.integers(1, 12),
    hidden=st.integers(1, 24),
    chunks=st.integers(1, 4),
    parts=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_slots_hold_bitwise_the_chunks_and_each_byte_is_in_one_part(
    dtype: torch.dtype,
    mla: bool,
    layers: int,
    tokens: int,
    hidden: int,
    chunks: int,
    parts: int,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    lead = (layers,) if mla else (2, layers)
    axis = len(lead)
    kv = _random((*lead, tokens * chunks, hidden), dtype, gen)
    slot_shape = (*lead, tokens, hidden)
    pool = torch.zeros(chunks * kv[..., :tokens, :].numel() * dtype.itemsize + 64, dtype=torch.uint8)
    step = kv[..., :tokens, :].numel() * dtype.itemsize
    order = torch.randperm(chunks, generator=gen).tolist()  # the server may reserve any slots
    slots = [pool[32 + k * step : 32 + (k + 1) * step].view(dtype).view(slot_shape) for k in range(chunks)]
    pairs = [(slots[k], kv.narrow(axis, j * tokens, tokens)) for k, j in enumerate(order)]
    seen: list[tuple[str, list[tuple[int, int]]]] = []
    lock = threading.Lock()

    def copy_part(part: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with lock:
            seen.append((threading.current_thread().name, _spans([d for d, _ in part], pool.data_ptr())))
        for d, s in part:
            host_copy.copy_into(d, s)

    copy_in_parts(pairs, copy_part, parts=parts)
    for slot, (_, src) in zip(slots, pairs, strict=True):
        assert torch.equal(slot.view(torch.uint8), src.contiguous().view(torch.uint8))  # bitwise
    assert torch.equal(pool[:32], torch.zeros(32, dtype=torch.uint8))  # nothing outside the slots
    assert torch.equal(pool[32 + chunks * step :], torch.zeros(32, dtype=torch.uint8))
    # Every byte of every slot was copied by exactly one part, each part in one call.
    spans = sorted(span for _, part in seen for span in part)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "a byte in two parts"
    assert sum(hi - lo for lo, hi in spans) == chunks * step
    if parts == 1:
        want = 1
    elif mla:
        want = min(parts, layers) if layers >= parts else min(parts, tokens)
    else:
        want = parts if parts <= 2 else min(parts, layers)
    assert len(seen) == want
    names = {name for name, _ in seen}
    assert threading.current_thread().name in names and len(names) >= min(2, want)


def test_pairs_it_cannot_cut_are_copied_whole_by_the_caller() -> None:
    seen: list[list[torch.Tensor]] = []

    def copy_part(part: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        seen.append([d for d, _ in part])
        for d, s in part:
            host_copy.copy_into(d, s)

    dst_a, src_a = torch.zeros(4, 8), torch.arange(32, dtype=torch.float32).view(4, 8)
    dst_b, src_b = torch.zeros(4, 8), torch.arange(8, dtype=torch.float32)  # broadcast: not cut
    dst_c, src_c = torch.tensor(0.0), torch.tensor(5.0)  # 0-d
    copy_in_parts([(dst_a, src_a), (dst_b, src_b), (dst_c, src_c)], copy_part, parts=2)
    assert torch.equal(dst_a, src_a) and torch.equal(dst_b, src_b.expand(4, 8)) and float(dst_c) == 5.0
    whole = [t for part in seen for t in part if t.data_ptr() in (dst_b.data_ptr(), dst_c.data_ptr())]
    assert len(seen) == 3 and len(whole) == 2  # dst_a in two parts, b and c together


def test_a_failing_part_is_raised_after_every_part_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    done: list[int] = []
    started = threading.Barrier(2, timeout=30)
    real = host_copy.copy_into

    def flaky(dst: torch.Tensor, src: torch.Tensor) -> None:
        started.wait()  # both parts run at once
        if threading.current_thread() is threading.main_thread():
            raise RuntimeError("the first part failed")
        real(dst, src)
        done.append(dst.numel())

    monkeypatch.setattr(host_copy, "copy_into", flaky)
    dst, src = torch.zeros(2, 6, 8), torch.ones(2, 6, 8)
    with pytest.raises(RuntimeError, match="^the first part failed$"):
        copy_in_parts([(dst, src)], parts=2)
    assert done == [6 * 8]  # the other part finished before the error reached the caller
    assert torch.equal(dst[1], src[1]) and torch.equal(dst[0], torch.zeros(6, 8))


def test_fill_slots_cuts_large_stores_into_unmapped_slots_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Into slots not mapped yet: cut into parts (each through ShmPool.fill); into slots
    this client mapped before, and below POOL_COPY_BYTES: Tensor.copy_ / copy_host as before."""
    made: list[int] = []
    real = host_copy.copy_in_parts

    def spy(
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        copy_part: Any = None,
        parts: int | None = None,
    ) -> None:
        made.append(len(pairs))
        real(pairs, copy_part, parts=2)

    monkeypatch.setattr(copies, "copy_in_parts", spy)
    size = 2 * host_copy.POOL_COPY_BYTES
    name = f"lmca_parts_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    pool = ShmPool(name, size)
    try:
        shape = (2, 4, host_copy.POOL_COPY_BYTES // (2 * 4 * 64 * 2), 64)
        src = torch.randn(shape).to(torch.bfloat16)
        big = pool.view(SlotDescriptor(0, src.numel() * 2, shape, "bfloat16"), shape, torch.bfloat16)
        copies.fill_slots([(big, src)], pool)  # a hole: cut into parts
        assert made == [1] and torch.equal(big.view(torch.uint8), src.view(torch.uint8))
        pool.populate([big])
        again = torch.randn(shape).to(torch.bfloat16)
        copies.fill_slots([(big, again)], pool)  # mapped before: Tensor.copy_
        assert made == [1] and torch.equal(big.view(torch.uint8), again.view(torch.uint8))
        other = pool.view(
            SlotDescriptor(src.numel() * 2, 4 << 10, (4 << 10,), "uint8"), (4 << 10,), torch.uint8
        )
        small_src = torch.arange(4 << 10, dtype=torch.int32).to(torch.uint8)
        copies.fill_slots([(other, small_src)], pool)  # small: on the caller, as before
        assert made == [1] and torch.equal(other, small_src)
        del big, other
    finally:
        pool.close()
        os.unlink(f"/dev/shm/{name}")
