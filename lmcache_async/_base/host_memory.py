"""The host memory of the tensors a retrieve returns: anonymous mappings kept warm for the
next retrieve of the same size (docs/internals/design.md, section "Transfers").

:func:`host_buffer` takes a mapping back when the last tensor over it is gone; memory kept
is at most :data:`KEEP_BYTES`, oldest first out, and advised ``MADV_FREE`` while kept.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Callable
from typing import Final

import numpy as np
import torch

__all__ = ["KEEP_BYTES", "MIN_BYTES", "host_buffer", "kept_bytes"]

#: The most memory kept for reuse after its tensors are gone.
KEEP_BYTES: Final = 1 << 30
#: From this size on :func:`host_buffer` hands out mappings (below: glibc's heap reuses memory).
MIN_BYTES: Final = 4 << 20
_STEP: Final = 2 << 20  # sizes are rounded up to the huge page size
_MADV_HUGEPAGE: Final = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_FREE: Final = getattr(mmap, "MADV_FREE", 8)

_lock = threading.Lock()
_kept: list[tuple[int, mmap.mmap, int]] = []  # (size, mapping, address), oldest first


def kept_bytes() -> int:
    """How much memory is kept for reuse now."""
    with _lock:
        return sum(size for size, _, _ in _kept)


def _give_back(
    size: int, mapping: mmap.mmap, address: int, advise: Callable[[int, int, int], int] | None
) -> None:
    """The finalizer of a buffer: keep its mapping for the next one (advised MADV_FREE).

    It runs while the dying array still holds the mapping's buffer: a mapping not kept is
    unmapped when its last reference goes, never closed here."""
    if size > KEEP_BYTES:
        return
    if advise is not None:
        advise(address, size, _MADV_FREE)  # a refusal (old kernel) keeps the pages as they are
    with _lock:
        _kept.append((size, mapping, address))
        total = sum(s for s, _, _ in _kept)
        while total > KEEP_BYTES:
            total -= _kept.pop(0)[0]


def host_buffer(nbytes: int, advise: Callable[[int, int, int], int] | None) -> torch.Tensor:
    """A 1-D ``uint8`` CPU tensor of ``nbytes`` (at least :data:`MIN_BYTES`) over a mapping
    kept from an earlier buffer of the same rounded size, else over a new anonymous
    mapping advised ``MADV_HUGEPAGE`` (through ``advise``, libc's ``madvise``, where given).
    Its content is undefined, as ``torch.empty``'s. The mapping is kept for reuse once no
    tensor (or view) over it is left. Never blocks beyond a lock held for a list operation.
    """
    size = -(-nbytes // _STEP) * _STEP
    found: tuple[int, mmap.mmap, int] | None = None
    with _lock:
        for i in range(len(_kept) - 1, -1, -1):  # the most recently used first
            if _kept[i][0] == size:
                found = _kept.pop(i)
                break
    mapping = found[1] if found is not None else mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
    address = int(array.ctypes.data)
    if found is None and advise is not None:
        advise(address, size, _MADV_HUGEPAGE)  # a refusal leaves 4 KiB pages
    fin = weakref.finalize(array, _give_back, size, mapping, address, advise)
    fin.atexit = False
    return torch.from_numpy(array)
