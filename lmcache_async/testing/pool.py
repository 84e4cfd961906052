"""The embedded server's L1 memory: one byte arena and a slot allocator over it.

In SHM mode the arena is the POSIX shared-memory segment
``/dev/shm/lmcache_l1_pool_<name>`` (created exclusively, mode 0600, sized to the whole
byte budget, like the real server's L1 pool), so clients map it and read or write slots
in place. In pickle mode it is an anonymous private mapping of the same size. Either way
pages are only backed by memory once touched.

Slots are allocated first-fit from a sorted free list, rounded up to 4096 bytes (the real
server's ``align_bytes``), and freed with coalescing. A batch is allocated all or nothing.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from typing import Final

import torch

__all__ = ["ALIGN", "SHM_DIR", "SHM_PREFIX", "Arena", "SlotAllocator", "segment_name"]

log = logging.getLogger(__name__)

ALIGN: Final = 4096
SHM_DIR: Final = "/dev/shm"
SHM_PREFIX: Final = "lmcache_l1_pool_"

# Segments created by this process and not yet unlinked: removed at interpreter exit
# even if a server was never stopped (a daemon thread dies with the process).
_LIVE_SEGMENTS: set[str] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _unlink_leftovers() -> None:  # pragma: no cover - runs at interpreter exit
    with _LIVE_LOCK:
        paths = list(_LIVE_SEGMENTS)
        _LIVE_SEGMENTS.clear()
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def segment_name(shm_name: str) -> str:
    """``"demo"`` -> ``"lmcache_l1_pool_demo"`` (the prefix is not doubled)."""
    bare = shm_name.lstrip("/")
    if not bare or "/" in bare or bare in (".", ".."):
        raise ValueError(f"invalid shm name {shm_name!r}")
    return bare if bare.startswith(SHM_PREFIX) else SHM_PREFIX + bare


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SlotAllocator:
    """First-fit allocator of aligned byte ranges inside ``[0, size)`` (not thread-safe)."""

    def __init__(self, size: int) -> None:
        self.size = size
        usable = size // ALIGN * ALIGN
        self._starts: list[int] = [0] if usable else []
        self._lengths: list[int] = [usable] if usable else []
        self.free_bytes = usable

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a free range of ``align_up(nbytes)`` bytes, or None."""
        need = align_up(max(nbytes, 1))
        for i, length in enumerate(self._lengths):
            if length >= need:
                offset = self._starts[i]
                if length == need:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += need
                    self._lengths[i] -= need
                self.free_bytes -= need
                return offset
        return None

    def allocate_batch(self, nbytes: int, count: int) -> list[int] | None:
        """``count`` ranges of ``nbytes`` each, or None (and nothing allocated)."""
        got: list[int] = []
        for _ in range(count):
            offset = self.allocate(nbytes)
            if offset is None:
                for o in got:
                    self.free(o, nbytes)
                return None
            got.append(offset)
        return got

    def free(self, offset: int, nbytes: int) -> None:
        """Return a range obtained from :meth:`allocate` (coalescing neighbours)."""
        length = align_up(max(nbytes, 1))
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] < offset + length:
            raise ValueError(f"double free of slot at {offset}")
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] > offset:
            raise ValueError(f"double free of slot at {offset}")
        self.free_bytes += length
        # merge with the previous and/or the next free range
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == offset:
            i -= 1
            self._lengths[i] += length
        else:
            self._starts.insert(i, offset)
            self._lengths.insert(i, length)
        if i + 1 < len(self._starts) and self._starts[i] + self._lengths[i] == self._starts[i + 1]:
            self._lengths[i] += self._lengths[i + 1]
            del self._starts[i + 1], self._lengths[i + 1]


class Arena:
    """The byte arena of the L1 pool.

    Args:
        size: bytes.
        shm_name: create ``/dev/shm/lmcache_l1_pool_<shm_name>`` (a stale segment of that
            name is replaced, as the real server does); ``None`` for private memory.
        prefault: back every page at once (``MAP_POPULATE``), as the real server's
            non-lazy L1 does, so the first writes do not pay for page faults.

    Raises:
        OSError: the segment cannot be created or sized (e.g. ``/dev/shm`` too small).
    """

    def __init__(self, size: int, shm_name: str | None, *, prefault: bool = False) -> None:
        if size < ALIGN:
            raise ValueError(f"the pool needs at least {ALIGN} bytes, got {size}")
        self.size = size
        self.shm_name = segment_name(shm_name) if shm_name is not None else None
        self.path = os.path.join(SHM_DIR, self.shm_name) if self.shm_name else None
        populate = getattr(mmap, "MAP_POPULATE", 0) if prefault else 0
        if self.path is not None:
            stat = os.statvfs(SHM_DIR)
            if stat.f_bavail * stat.f_frsize < size:
                raise OSError(
                    f"{SHM_DIR} has {stat.f_bavail * stat.f_frsize} bytes free, "
                    f"the pool needs {size}; use a smaller size or mode='pickle'"
                )
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            with _LIVE_LOCK:
                _LIVE_SEGMENTS.add(self.path)
            try:
                os.ftruncate(fd, size)
                self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED | populate, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                self.unlink()
                raise
            finally:
                os.close(fd)
        else:
            self._mmap = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        self._base: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor view of the slot at ``offset`` (no copy)."""
        base = self._base
        if base is None:
            raise RuntimeError("the L1 pool is closed")
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        return base[offset : offset + nbytes].view(dtype).view(shape)

    @contextlib.contextmanager
    def raw(self) -> Iterator[memoryview]:
        """The whole pool as bytes (no copy); released when the block ends."""
        if self._base is None:
            raise RuntimeError("the L1 pool is closed")
        with memoryview(self._mmap) as pool:
            yield pool

    def write(self, offset: int, data: memoryview | bytes) -> None:
        """Copy raw bytes into the pool at ``offset`` (one memcpy, no tensor made)."""
        if self._base is None:
            raise RuntimeError("the L1 pool is closed")
        end = offset + len(data)
        if offset < 0 or end > self.size:
            raise ValueError(f"write of {len(data)} bytes at {offset} is outside the {self.size}-byte pool")
        self._mmap[offset:end] = data

    def unlink(self) -> None:
        """Remove the SHM segment's name (idempotent; clients keep their mappings)."""
        if self.path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with _LIVE_LOCK:
            _LIVE_SEGMENTS.discard(self.path)

    def close(self) -> None:
        """Unlink the segment, then unmap (if no view is alive). Idempotent."""
        self.unlink()
        self._base = None
        try:
            self._mmap.close()
        except BufferError:  # a view is still referenced; the mapping dies with it
            log.debug("L1 pool still has live views; leaving the unmap to the GC")
