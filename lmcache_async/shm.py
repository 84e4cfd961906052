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
import logging
import mmap
import os
import threading

import torch

from lmcache_async.errors import TransferError
from lmcache_async.geometry import dtype_name
from lmcache_async.wire import SlotDescriptor

__all__ = ["ShmPool"]

log = logging.getLogger(__name__)

#: madvise(MADV_POPULATE_READ) (Linux 5.14+): map the pages of a range into this process.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_PREFAULT_STEP = 16 << 20


class ShmPool:
    """A read/write mapping of the server's SHM pool.

    Raises:
        TransferError: the segment cannot be opened or is smaller than ``pool_size``.
    """

    def __init__(self, shm_name: str, pool_size: int) -> None:
        bare = shm_name.lstrip("/")
        if not bare or "/" in bare or bare in (".", ".."):
            raise TransferError(f"invalid shm name {shm_name!r}")
        self.name = bare
        self.pool_size = pool_size
        path = os.path.join("/dev/shm", bare)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise TransferError(f"cannot open shared memory {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < pool_size or pool_size <= 0:
                raise TransferError(f"{path} has {size} bytes, the server announced {pool_size}")
            self._mmap = mmap.mmap(fd, pool_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise TransferError(f"cannot map {path}: {exc}") from exc
        finally:
            os.close(fd)
        self._base: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._stop = threading.Event()
        self._prefaulter: threading.Thread | None = None
        #: Whether the mapping is registered as pinned CUDA memory: None until the first
        #: CUDA copy asks (:func:`lmcache_async.cuda.pin_pool`), then True or False.
        self.cuda_pinned: bool | None = None
        self.cuda_lock = threading.Lock()

    def address_range(self) -> tuple[int, int]:
        """(start address, length) of the mapping in this process."""
        base = self._base
        if base is None:
            raise TransferError("the SHM pool is closed")
        return base.data_ptr(), self.pool_size

    def start_prefault(self) -> None:
        """Map the whole pool into this process in the background.

        A page of the pool costs a page fault the first time this process touches it;
        on this kind of VM that makes a first copy into or out of a slot 3-4x slower than
        a warm one. A daemon thread walks the pool with ``madvise(MADV_POPULATE_READ)``
        in 16 MiB steps (about 0.7 s of one core per GiB here); transfers meanwhile work
        as usual. Stops at :meth:`close`; without kernel support it just stops.
        """
        if self._prefaulter is not None:
            return
        self._prefaulter = threading.Thread(
            target=self._prefault, name=f"lmcache-shm-prefault {self.name}", daemon=True
        )
        self._prefaulter.start()

    def _prefault(self) -> None:
        # Through ctypes, which releases the GIL (mmap.madvise holds it for the whole
        # call, which would stall the event loop for tens of milliseconds per step).
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        base = self._base
        if base is None:
            return
        address = base.data_ptr()
        del base
        for start in range(0, self.pool_size, _PREFAULT_STEP):
            if self._stop.is_set():
                return
            if madvise(address + start, min(_PREFAULT_STEP, self.pool_size - start), _MADV_POPULATE_READ):
                log.debug("SHM prefault stopped: errno %d", ctypes.get_errno())  # e.g. an old kernel
                return

    def view(self, slot: SlotDescriptor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor view of ``slot``, after validating it (ProtocolError if it is bad)."""
        base = self._base
        if base is None:
            raise TransferError("the SHM pool is closed")
        slot.check(self.pool_size, shape, dtype_name(dtype), dtype.itemsize)
        return base[slot.offset : slot.offset + slot.length].view(dtype).view(shape)

    def close(self) -> None:
        """Unmap the pool (views made by :meth:`view` must be gone). Idempotent.

        A pool pinned for CUDA copies is unregistered first (after the copy streams are
        idle), never after it is unmapped.
        """
        if self._base is None:
            return
        self._stop.set()
        if self._prefaulter is not None:
            self._prefaulter.join(timeout=5.0)  # at most one 16 MiB madvise to finish
        with self.cuda_lock:
            if self.cuda_pinned:
                from lmcache_async import cuda  # only ever loaded when a CUDA copy pinned it

                cuda.unpin_pool(self)
                self.cuda_pinned = False
        self._base = None
        # A view still alive somewhere keeps the mapping until it is collected.
        with contextlib.suppress(BufferError):
            self._mmap.close()
