"""The SHM transport: the server's L1 pool mapped into this process.

A server started with ``--shm-name NAME --no-l1-use-lazy`` keeps its whole L1 in the
POSIX shared-memory segment ``/dev/shm/lmcache_l1_pool_NAME``; ``prepare_store`` and
``prepare_retrieve`` answer with slot descriptors (byte offset, length, shape, dtype)
into it. :class:`ShmPool` maps the segment and turns descriptors into tensor views only
after checking each against the pool size, the expected shape and dtype, so a wrong or
hostile server can never make the client read or write outside the pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from lmcache_async._base.host_copy import copy_into, madvise
from lmcache_async._protocol.wire import SlotDescriptor
from lmcache_async._transport.shm_segment import open_segment
from lmcache_async.errors import TransferError
from lmcache_async.geometry import dtype_name

__all__ = ["ShmPool"]

log = logging.getLogger(__name__)

#: madvise(MADV_POPULATE_READ) (Linux 5.14+): map the pages of a range into this process.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
#: The step of :meth:`ShmPool.populate` (and of its memory of what is mapped).
GRANULE = 2 << 20
#: The smallest contiguous run of a source that :meth:`ShmPool.fill` writes through the
#: segment's descriptor (one iovec each); sources of shorter runs are copied through the mapping.
MIN_RUN = 64 << 10
#: The most iovecs one ``pwritev`` takes (Linux's ``IOV_MAX``).
_IOV_MAX = 1024


_madvise = madvise


class ShmPool:
    """A read/write mapping of the server's SHM pool.

    Raises:
        TransferError: the segment cannot be opened or is smaller than ``pool_size``.
    """

    def __init__(self, shm_name: str, pool_size: int) -> None:
        self.name, self._fd, self._mmap = open_segment(shm_name, pool_size)
        self.pool_size = pool_size
        self._base: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._origin = self._base.data_ptr()
        #: Whether :meth:`populate` maps pages before copies (``prefault_shm`` of the client).
        self.populate_on_use = _madvise is not None
        self._mapped = bytearray(-(-pool_size // GRANULE))  # 1: granule mapped by populate()
        #: Whether :meth:`fill` writes pages nobody has written yet through the descriptor.
        self.write_holes = hasattr(os, "SEEK_DATA") and hasattr(os, "pwritev")
        # The descriptor is closed by close() only once no write through it is running
        # (a copy thread may still be writing when the client closes).
        self._fd_lock = threading.Lock()
        self._fd_users = 0
        self._fd_closing = False
        self._close_hooks: list[Callable[[ShmPool], None]] = []

    def call_before_close(self, hook: Callable[[ShmPool], None]) -> None:
        """Have :meth:`close` call ``hook(pool)`` before it unmaps the pool (the CUDA
        copies unregister a pool they pinned this way), once."""
        self._close_hooks.append(hook)

    def address_range(self) -> tuple[int, int]:
        """(start address, length) of the mapping in this process."""
        base = self._base
        if base is None:
            raise TransferError("the SHM pool is closed")
        return base.data_ptr(), self.pool_size

    def populate(self, tensors: Iterable[torch.Tensor]) -> None:
        """Map into this process the pages under those of ``tensors`` that lie in the
        pool and were not mapped yet, before a copy *writes* them.

        Only slots about to be written come here; slots only read are left to fault
        (docs/internals/design.md, section "Transfers"). Works in :data:`GRANULE` (2 MiB)
        steps and remembers what it mapped. Blocking (the GIL is released); no-op when
        :attr:`populate_on_use` is off or the kernel lacks the call (before Linux 5.14).
        """
        madvise = _madvise
        if not self.populate_on_use or self._base is None or madvise is None:
            return
        origin = self._origin
        mapped = self._mapped
        for t in tensors:
            offset = t.data_ptr() - origin
            if offset < 0 or offset >= self.pool_size:
                continue  # not in the pool (the caller's own tensor)
            first = offset // GRANULE
            last = min(offset + t.numel() * t.element_size(), self.pool_size) - 1
            g = first
            while g <= last // GRANULE:
                if mapped[g]:
                    g += 1
                    continue
                run = g
                while run <= last // GRANULE and not mapped[run]:
                    run += 1
                begin = g * GRANULE
                length = min(run * GRANULE, self.pool_size) - begin
                if madvise(origin + begin, length, _MADV_POPULATE_READ) != 0:
                    log.debug("SHM populate unavailable: errno %d", ctypes.get_errno())  # e.g. an old kernel
                    self.populate_on_use = False
                    return
                mapped[g:run] = b"\x01" * (run - g)
                g = run

    def fill(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each ``(target, source)`` pair of a store, ``target`` a contiguous view of
        this pool (the part of a slot :func:`~lmcache_async._base.host_copy.copy_in_parts`
        gave this thread).

        A target whose pages nobody has written yet (a hole of the segment) is written
        through the segment's descriptor with ``pwritev`` and stays unmapped here; every
        other pair is copied through the mapping, its pages mapped first (:meth:`populate`)
        (docs/internals/design.md, section "Transfers"). Blocking (the GIL is released
        during the copies); no timeout (a memcpy).
        """
        rest = [(t, s) for t, s in pairs if not self._write_hole(t, s)]
        if rest:
            self.populate(t for t, _ in rest)
            for target, source in rest:
                copy_into(target, source)

    def _write_hole(self, target: torch.Tensor, source: torch.Tensor) -> bool:
        """Write ``source`` into ``target`` through the descriptor if the target's bytes
        are all a hole of the segment and ``source`` is made of contiguous runs of at
        least :data:`MIN_RUN` bytes; False (nothing written) otherwise."""
        if not self.write_holes or self._base is None:
            return False
        runs = _runs(target, source)
        if runs is None:
            return False
        offset = target.data_ptr() - self._origin
        nbytes = target.numel() * target.element_size()
        if offset < 0 or offset + nbytes > self.pool_size:
            return False
        with self._fd_lock:
            if self._fd < 0 or self._fd_closing:
                return False
            fd = self._fd
            self._fd_users += 1
        try:
            try:
                data = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no data from offset to the end
                    self.write_holes = False  # e.g. a file system without SEEK_DATA
                    return False
                data = self.pool_size
            if data < offset + nbytes:
                return False  # some page under the target was written before: map it
            _pwrite_all(fd, runs, offset)
            return True
        finally:
            with self._fd_lock:
                self._fd_users -= 1
                last = self._fd_closing and self._fd_users == 0 and self._fd >= 0
                if last:
                    fd, self._fd = self._fd, -1
            if last:
                os.close(fd)

    def all_mapped(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether :meth:`populate` has mapped every granule under those of ``tensors``
        that lie in the pool (slots this client wrote before: a warm copy)."""
        origin, mapped = self._origin, self._mapped
        for t in tensors:
            offset = t.data_ptr() - origin
            if offset < 0 or offset >= self.pool_size:
                continue
            last = min(offset + t.numel() * t.element_size(), self.pool_size) - 1
            if not all(mapped[offset // GRANULE : last // GRANULE + 1]):
                return False
        return True

    @property
    def mapped_bytes(self) -> int:
        """How much of the pool :meth:`populate` has mapped so far (granules x size)."""
        return min(sum(self._mapped) * GRANULE, self.pool_size)

    def view(self, slot: SlotDescriptor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor view of ``slot``, after validating it (ProtocolError if it is bad)."""
        base = self._base
        if base is None:
            raise TransferError("the SHM pool is closed")
        slot.check(self.pool_size, shape, dtype_name(dtype), dtype.itemsize)
        return base[slot.offset : slot.offset + slot.length].view(dtype).view(shape)

    def close(self) -> None:
        """Unmap the pool (views made by :meth:`view` must be gone). Idempotent.

        The hooks given to :meth:`call_before_close` run first: a pool pinned for CUDA
        copies is unregistered (after the copy streams are idle), never after it is unmapped.
        """
        if self._base is None:
            return
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            hook(self)
        self._base = None
        with self._fd_lock:
            self._fd_closing = True
            fd = -1
            if self._fd_users == 0:
                fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # else the last write through it closes it
        # A view still alive somewhere keeps the mapping until it is collected.
        with contextlib.suppress(BufferError):
            self._mmap.close()


def _runs(target: torch.Tensor, source: torch.Tensor) -> list[memoryview] | None:
    """``source``'s bytes as memoryviews over its contiguous runs, in ``target``'s
    (contiguous) byte order; None where that does not hold or a run is shorter than
    :data:`MIN_RUN` (or the source is no plain host tensor of the same shape and dtype)."""
    if (
        source.shape != target.shape
        or source.dtype != target.dtype
        or source.dtype is torch.bool
        or not target.is_contiguous()
        or source.device.type != "cpu"
        or source.layout != torch.strided
        or source.is_conj()
        or source.is_neg()
        or source.dim() == 0
    ):
        return None
    shape, strides = source.shape, source.stride()
    run = 1
    dim = source.dim()
    while dim > 0 and (shape[dim - 1] == 1 or strides[dim - 1] == run):
        run *= shape[dim - 1]
        dim -= 1
    size = source.element_size()
    run_bytes = run * size
    if run_bytes < MIN_RUN:
        return None
    base = source.data_ptr()
    starts = [0]
    for d in range(dim):
        starts = [s + i * strides[d] for s in starts for i in range(shape[d])]
    return [memoryview((ctypes.c_char * run_bytes).from_address(base + s * size)).cast("B") for s in starts]


def _pwrite_all(fd: int, views: list[memoryview], offset: int) -> None:
    """``pwritev`` the views one after the other from ``offset``, to their last byte."""
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        want = sum(v.nbytes for v in batch)
        done = os.pwritev(fd, batch, offset)
        offset += done
        if done == want:
            i += len(batch)
            continue
        if done == 0:
            raise OSError(errno.EIO, "pwritev into the SHM pool wrote nothing")
        # A short write: drop what was written and go on from there.
        rest = list(batch)
        while done >= rest[0].nbytes:
            done -= rest.pop(0).nbytes
        rest[0] = rest[0][done:]
        views = rest + views[i + len(batch) :]
        i = 0
