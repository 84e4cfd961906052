"""_host_memory: a retrieve's new tensor reuses the memory of one that is gone, never of one alive."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from lmcache_async._base import host_copy as host_copy, host_memory as host_memory
from lmcache_async._base.host_memory import MIN_BYTES, host_buffer

SHAPE = (2, 4, 256, 1024)  # 4 MiB of bf16: the smallest size that is kept


@pytest.fixture(autouse=True)
def empty_keep() -> Iterator[None]:
    """Each test starts and ends with nothing kept (other tests' buffers are dropped)."""

    def drop() -> None:
        gc.collect()
        with host_memory._lock:
            host_memory._kept.clear()
        gc.collect()

    drop()
    yield
    drop()


def test_a_tensor_gone_gives_its_memory_to_the_next_one_of_its_size() -> None:
    a = host_copy.empty_host(SHAPE, torch.bfloat16)
    assert a.shape == SHAPE and a.dtype == torch.bfloat16 and a.is_contiguous() and a.device.type == "cpu"
    assert a.numel() * 2 == MIN_BYTES
    a.fill_(1.5)
    ptr = a.data_ptr()
    b = host_copy.empty_host(SHAPE, torch.bfloat16)  # `a` is alive: other memory
    assert b.data_ptr() != ptr and host_memory.kept_bytes() == 0
    view = a[1]
    del a
    gc.collect()
    c = host_copy.empty_host(SHAPE, torch.bfloat16)  # a view of `a` is alive: still not its memory
    assert c.data_ptr() not in (ptr, b.data_ptr())
    assert bool((view == 1.5).all())
    del view
    gc.collect()
    assert host_memory.kept_bytes() == MIN_BYTES
    d = host_copy.empty_host(SHAPE, torch.bfloat16)
    assert d.data_ptr() == ptr and host_memory.kept_bytes() == 0
    d.copy_(torch.full(SHAPE, -2.0, dtype=torch.bfloat16))
    assert torch.equal(d, torch.full(SHAPE, -2.0, dtype=torch.bfloat16))
    other = host_copy.empty_host((2, 4, 512, 1024), torch.float16)  # another size: new memory
    assert other.data_ptr() not in (ptr, b.data_ptr(), c.data_ptr())


def test_small_tensors_are_plain_torch_empty() -> None:
    t = host_copy.empty_host((2, 4, 16, 128), torch.bfloat16)
    assert t.shape == (2, 4, 16, 128) and t.untyped_storage().resizable()  # torch's own allocation
    del t
    gc.collect()
    assert host_memory.kept_bytes() == 0


def test_what_is_kept_is_bounded_oldest_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "KEEP_BYTES", 2 * MIN_BYTES)
    bufs = [host_buffer(MIN_BYTES, None) for _ in range(3)]
    ptrs = [b.data_ptr() for b in bufs]
    while bufs:
        bufs.pop(0)  # freed in order: 0, 1, 2
        gc.collect()
    assert host_memory.kept_bytes() == 2 * MIN_BYTES
    again = [host_buffer(MIN_BYTES, None) for _ in range(2)]
    assert {b.data_ptr() for b in again} == set(ptrs[1:])  # the first one freed was dropped
    del again
    gc.collect()
    assert host_memory.kept_bytes() == 2 * MIN_BYTES
    big = host_buffer(3 * MIN_BYTES, None)  # larger than what may be kept: unmapped when gone
    del big
    gc.collect()
    assert host_memory.kept_bytes() == 2 * MIN_BYTES
