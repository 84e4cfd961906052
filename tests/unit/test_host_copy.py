"""lmcache_async._base.host_copy: the same bytes as ``Tensor.copy_``, on one thread."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lmcache_async._base import host_copy as host_copy, host_memory as host_memory
from lmcache_async._base.host_copy import copy_into
from tests.plugins.hypothesis_budget import examples

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.float8_e4m3fn,
]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)  # every bit pattern, NaN payloads included


@settings(max_examples=examples(60), deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    planes=st.integers(1, 2),
    layers=st.integers(1, 4),
    tokens=st.integers(1, 24),
    hidden=st.integers(1, 40),
    offset=st.integers(0, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_chunk_into_a_slice_is_bitwise_what_copy_gives(
    dtype: torch.dtype, planes: int, layers: int, tokens: int, hidden: int, offset: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    src = _random((planes, layers, tokens, hidden), dtype, gen)
    big = _random((planes, layers, tokens + offset + 3, hidden), dtype, gen)
    want = big.clone()
    want.narrow(2, offset, tokens).copy_(src)
    copy_into(big.narrow(2, offset, tokens), src)
    assert torch.equal(big.view(torch.uint8), want.view(torch.uint8))  # bitwise, NaNs too


def test_a_slice_out_of_a_strided_source() -> None:
    gen = torch.Generator().manual_seed(1)
    big = _random((2, 3, 40, 16), torch.bfloat16, gen)
    src = big.narrow(2, 8, 16)  # not contiguous
    dst = torch.empty(2, 3, 16, 16, dtype=torch.bfloat16)
    copy_into(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.contiguous().view(torch.uint8))


def test_the_copy_runs_on_the_calling_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy path is taken (``Tensor.copy_`` never called) for a KV-sized chunk."""
    called = []

    real = torch.Tensor.copy_

    def spy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        called.append(threading.get_ident())
        return real(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    src = torch.ones(2, 2, 256, 128, dtype=torch.bfloat16)
    dst = torch.zeros(2, 2, 1024, 128, dtype=torch.bfloat16)
    copy_into(dst.narrow(2, 256, 256), src)
    assert called == []
    assert torch.equal(dst.narrow(2, 256, 256), src)
    assert int(dst.sum()) == src.numel()


@pytest.fixture
def copy_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per ``Tensor.copy_`` call made while the test runs."""
    calls: list[bool] = []
    real = torch.Tensor.copy_

    def spy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        calls.append(True)
        return real(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    return calls


@pytest.mark.parametrize(
    "case",
    ["dtype change", "last dim strided", "grad", "conj", "meta", "sparse", "zero-dim", "bool"],
)
def test_what_numpy_cannot_view_goes_through_copy(case: str, copy_calls: list[bool]) -> None:
    if case == "dtype change":
        dst, src = torch.zeros(4, 8), torch.ones(4, 8, dtype=torch.float64)
    elif case == "last dim strided":
        dst, src = torch.zeros(4, 8), torch.arange(64, dtype=torch.float32).view(8, 8).t()[:4]
    elif case == "grad":
        dst, src = torch.zeros(4, 8, requires_grad=True), torch.ones(4, 8)
        with torch.no_grad():
            copy_into(dst, src)
        assert copy_calls == [True] and torch.equal(dst.detach(), src)
        return
    elif case == "conj":
        dst, src = torch.zeros(4, dtype=torch.complex64), (torch.ones(4) + 2j * torch.ones(4)).conj()
    elif case == "meta":
        dst, src = torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta")
        copy_into(dst, src)
        assert copy_calls == [True]
        return
    elif case == "sparse":  # copy_ refuses it: the same error reaches the caller
        with pytest.raises(RuntimeError, match="between dense and sparse"):
            copy_into(torch.zeros(4, 8), torch.eye(4, 8).to_sparse())
        assert copy_calls == [True]
        return
    elif case == "bool":  # copy_ normalises bytes other than 0/1: keep its semantics
        dst, src = (
            torch.zeros(4, dtype=torch.bool),
            torch.tensor([2, 0, 1, 255], dtype=torch.uint8).view(torch.bool),
        )
        copy_into(dst, src)
        assert copy_calls == [True] and dst.view(torch.uint8).tolist() == [1, 0, 1, 1]
        return
    else:
        dst, src = torch.tensor(0.0), torch.tensor(3.0)
    copy_into(dst, src)
    assert copy_calls == [True]
    assert torch.equal(dst, src.to(dst.dtype))


def test_bytes_view_refuses_what_it_cannot_express() -> None:
    assert host_copy._bytes_view(torch.empty(4, 8, device="meta")) is None
    assert host_copy._bytes_view(torch.eye(3).to_sparse()) is None
    assert host_copy._bytes_view(torch.tensor(1.0)) is None
    assert host_copy._bytes_view(torch.zeros(8, 8).t()) is None
    view = host_copy._bytes_view(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert view is not None and view.shape == (2, 6)


@pytest.mark.parametrize(
    ("nbytes", "pool"),
    [(None, False), (host_copy.POOL_COPY_BYTES - 1, False), (host_copy.POOL_COPY_BYTES, True)],
)
def test_copy_host_wakes_the_pool_only_for_large_copies(
    nbytes: int | None, pool: bool, copy_calls: list[bool]
) -> None:
    used = copy_calls
    src, dst = torch.arange(64, dtype=torch.float32).view(8, 8), torch.zeros(8, 8)
    host_copy.copy_host(dst, src, nbytes)
    assert used == ([True] if pool else [])
    assert torch.equal(dst, src)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


def _anon_huge_bytes(ptr: int) -> int:
    """AnonHugePages of the mapping of this process that contains ``ptr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_empty_host_memory_is_mapped_with_huge_pages() -> None:
    """A retrieve's new tensor: its aligned part is backed by 2 MiB pages once touched
    (the first touch maps 512x fewer pages); same shape, dtype and bytes as torch.empty.
    A new mapping (none kept from earlier tests: those may have been made without advice)."""
    with host_memory._lock:
        host_memory._kept.clear()
    t = host_copy.empty_host((2, 4, 64, 32768), torch.bfloat16)  # 32 MiB
    assert t.shape == (2, 4, 64, 32768) and t.dtype == torch.bfloat16 and t.is_contiguous()
    t.fill_(1.5)
    assert _anon_huge_bytes(t.data_ptr() + (16 << 20)) >= 16 << 20
    assert bool((t == 1.5).all())


def test_empty_host_without_madvise_is_plain_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_copy, "madvise", None)
    t = host_copy.empty_host((3, 5), torch.float16)
    assert t.shape == (3, 5) and t.dtype == torch.float16
    small = host_copy.empty_host((0,), torch.float32)  # nothing to advise
    assert small.numel() == 0


def test_two_contiguous_tensors_are_copied_with_one_memmove(
    monkeypatch: pytest.MonkeyPatch, copy_calls: list[bool]
) -> None:
    moves: list[int] = []
    real = host_copy._memmove

    def spy(dst: int, src: int, n: int) -> object:
        moves.append(n)
        return real(dst, src, n)

    monkeypatch.setattr(host_copy, "_memmove", spy)
    gen = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        src = _random((2, 2, 256, 16), dtype, gen)
        dst = torch.zeros_like(src)
        copy_into(dst, src)
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))  # bitwise, NaNs too
    big = _random((2, 2, 40, 16), torch.bfloat16, gen)
    copy_into(big[1], big[0])  # contiguous views into one tensor
    assert torch.equal(big[1].view(torch.uint8), big[0].view(torch.uint8))
    copy_into(torch.empty(0, 3), torch.empty(0, 3))
    assert moves == [2 * 2 * 256 * 16 * d.itemsize for d in DTYPES] + [2 * 40 * 16 * 2, 0]
    assert copy_calls == []
    # Not both contiguous: numpy's strided copy, no memmove.
    copy_into(big.narrow(2, 0, 8), big.narrow(2, 8, 8))
    assert len(moves) == len(DTYPES) + 2
    assert torch.equal(big.narrow(2, 0, 8).view(torch.uint8), big.narrow(2, 8, 8).view(torch.uint8))


def test_a_conjugate_or_negative_view_as_target_is_written_as_copy_writes_it() -> None:
    # A conj/neg-bit view is resolved on write by Tensor.copy_; a raw memmove would not.
    src = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for make in (torch.Tensor.conj, torch._neg_view):
        base, want = torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.complex64)
        make(want).copy_(src)
        copy_into(make(base), src)
        assert torch.equal(base, want)
