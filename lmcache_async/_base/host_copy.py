"""Host-memory tensor copies on one thread (memmove or numpy), not torch's intra-op pool,
and the allocation of the tensor a retrieve fills (docs/internals/design.md, section
"Transfers", "Host copies").

:func:`copy_into` gives the same bytes as ``Tensor.copy_``; tensors numpy cannot view go
through ``Tensor.copy_``. :func:`empty_host` allocates large tensors over memory kept
warm by :mod:`lmcache_async._base.host_memory`.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import numpy as np
import torch

from lmcache_async._base.host_memory import MIN_BYTES, host_buffer

__all__ = ["HUGE_PAGE", "POOL_COPY_BYTES", "copy_host", "copy_in_parts", "copy_into", "empty_host", "madvise"]

#: From this size on, :func:`copy_host` uses ``Tensor.copy_``: its threads share the page
#: faults of fresh memory and the memory bandwidth, which pays off on large copies
#: (a 128 MiB retrieve into a fresh tensor took twice as long on one thread).
POOL_COPY_BYTES: Final = 8 << 20


#: The transparent huge page size of x86-64 and of arm64 with 4 KiB base pages.
HUGE_PAGE: Final = 2 << 20


def _load_madvise() -> Callable[[int, int, int], int] | None:
    # Through ctypes, which releases the GIL (mmap.madvise holds it for the whole call).
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


#: ``madvise(addr, length, advice)`` of the C library (Linux), or None.
madvise: Final = _load_madvise()


def empty_host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU (undefined content). From
    :data:`~lmcache_async._base.host_memory.MIN_BYTES` on, over a mapping of
    :func:`~lmcache_async._base.host_memory.host_buffer`: the memory of an earlier tensor of
    the same size that is gone (warm: its first touch faults nothing), else a new
    mapping advised ``MADV_HUGEPAGE`` (where transparent huge pages are ``madvise`` or
    ``always`` its first touch maps 2 MiB at a time; elsewhere 4 KiB pages).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or not sys.platform.startswith("linux"):
        return torch.empty(shape, dtype=dtype)
    return host_buffer(nbytes, madvise).view(dtype).view(shape)


_memmove: Final = ctypes.memmove


def _bytes_view(t: torch.Tensor) -> np.ndarray | None:
    """``t`` as a numpy ``uint8`` array over the same memory (last axis widened to
    bytes), or ``None`` where numpy cannot express it."""
    if t.layout != torch.strided or t.device.type != "cpu" or t.is_conj() or t.is_neg() or t.dim() == 0:
        return None
    if t.stride(-1) != 1 and t.size(-1) != 1:
        return None
    try:
        return t.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for host tensors, on the calling thread only.

    ``dst`` and ``src`` have the same shape; when their dtypes match and both are CPU
    tensors numpy can view, the bytes are copied by numpy (single-threaded, GIL
    released); otherwise ``dst.copy_(src)`` (also for ``bool``, whose ``copy_``
    normalises bytes other than 0 and 1). Blocking; no timeout (a memcpy).
    """
    same = dst.dtype == src.dtype and dst.shape == src.shape
    if same and dst.dtype is not torch.bool and not dst.requires_grad:
        if (
            dst.device.type == "cpu"
            and src.device.type == "cpu"
            and dst.layout == torch.strided
            and src.layout == torch.strided
            and dst.is_contiguous()
            and src.is_contiguous()
            and dst.dim() > 0
            and not (src.is_conj() or src.is_neg() or dst.is_conj() or dst.is_neg())
        ):
            # One contiguous block each (a 1-chunk slot, a whole chunk): one memmove
            # through ctypes (GIL released), without numpy's views.
            _memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
            return
        d = _bytes_view(dst)
        if d is not None:
            s = _bytes_view(src.detach())
            if s is not None and s.shape == d.shape:
                np.copyto(d, s, casting="no")
                return
    dst.copy_(src)


def _cut(dst: torch.Tensor, src: torch.Tensor, parts: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``(dst, src)`` as up to ``parts`` lists of pairs of views, cut along dimension 0 when
    it has ``parts`` indices or more (or is the only one), else along dimension 1 under
    each index of dimension 0 (``[2, L, T, D]``: K and V, each cut by layers)."""
    n0 = dst.shape[0]
    if n0 >= parts or dst.dim() == 1:
        bounds = [(n0 * k // parts, n0 * (k + 1) // parts) for k in range(parts)]
        return [[(dst[lo:hi], src[lo:hi])] for lo, hi in bounds if hi > lo]
    n1 = dst.shape[1]
    bounds = [(n1 * k // parts, n1 * (k + 1) // parts) for k in range(parts)]
    return [[(dst[i, lo:hi], src[i, lo:hi]) for i in range(n0)] for lo, hi in bounds if hi > lo]


_workers: ThreadPoolExecutor | None = None
_workers_lock = threading.Lock()


def _copy_workers() -> ThreadPoolExecutor:
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = ThreadPoolExecutor(max(1, os.cpu_count() or 1), thread_name_prefix="lmcache-copy")
        return _workers


def copy_in_parts(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    copy_part: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None] | None = None,
    parts: int | None = None,
) -> None:
    """``dst.copy_(src)`` for each ``(dst, src)`` pair of host tensors of one shape, the
    bytes cut into ``parts`` parts (default: ``torch.get_num_threads()``, the threads
    ``Tensor.copy_`` would use), each part copied in a thread of its own: the first by
    the calling thread, the others by this module's worker threads. A part is a list of
    pairs of views; ``copy_part(part)`` copies it (default: :func:`copy_into` on each
    pair). The SHM pool's :meth:`~lmcache_async._transport.shm.ShmPool.fill` is one: the first
    touch of pool pages nobody has used yet allocates them, and that work is shared by
    the threads as the copy is. Pairs of other kinds (shapes that differ, another
    device, 0-d) are copied whole in the calling thread (``copy_part`` too, else
    :func:`copy_host`).

    Blocking; no timeout (memcpy). Every part is waited for, also when one fails; the
    first failure is then raised. Not to be called from one of those worker threads.
    """
    n = parts if parts is not None else torch.get_num_threads()
    cut: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(max(1, n))]
    whole: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in pairs:
        if n > 1 and dst.shape == src.shape and dst.dim() > 0 and dst.is_cpu and src.is_cpu:
            for k, part in enumerate(_cut(dst, src, n)):
                cut[k].extend(part)
        else:
            whole.append((dst, src))

    def run(part: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if copy_part is not None:
            copy_part(part)
            return
        for d, s in part:
            copy_into(d, s)

    busy = [part for part in cut if part]
    futures = [_copy_workers().submit(run, part) for part in busy[1:]]
    first: BaseException | None = None
    try:
        if busy:
            run(busy[0])
        if whole and copy_part is not None:
            copy_part(whole)
        elif whole:
            total = sum(s.numel() * s.element_size() for _, s in whole)
            for d, s in whole:
                copy_host(d, s, total)
    except BaseException as exc:
        first = exc
    for fut in futures:
        failed = fut.exception()  # waits
        if failed is not None and first is None:
            first = failed
    if first is not None:
        raise first


def copy_host(dst: torch.Tensor, src: torch.Tensor, nbytes: int | None = None) -> None:
    """``dst.copy_(src)``: through :func:`copy_into` when the copy (or the batch it belongs
    to, ``nbytes``) is below :data:`POOL_COPY_BYTES`, else with ``Tensor.copy_``."""
    if nbytes is None:
        nbytes = src.numel() * src.element_size()
    if nbytes < POOL_COPY_BYTES:
        copy_into(dst, src)
    else:
        dst.copy_(src)
