"""Opening the server's SHM segment: the checks :class:`~lmcache_async._transport.shm.ShmPool` makes
before it maps the pool, without torch (``lmcache-async status`` uses them to tell
whether this host can map a server's pool, and must not pay torch's import for that)."""

from __future__ import annotations

import mmap
import os

from lmcache_async.errors import TransferError

__all__ = ["map_segment", "open_segment"]


def map_segment(shm_name: str, pool_size: int) -> tuple[str, mmap.mmap]:
    """``(bare name, read/write shared mapping of its first pool_size bytes)`` of the
    segment ``/dev/shm/NAME`` (a leading ``/`` is dropped).

    Raises:
        TransferError: the name is not a plain file name, the segment cannot be opened or
            mapped, or it is smaller than ``pool_size`` (or ``pool_size`` is not positive).
    """
    bare, fd, mapping = open_segment(shm_name, pool_size)
    os.close(fd)
    return bare, mapping


def open_segment(shm_name: str, pool_size: int) -> tuple[str, int, mmap.mmap]:
    """As :func:`map_segment`, and the segment's open descriptor too (read/write; the
    caller closes it): ``(bare name, descriptor, mapping)``."""
    bare = shm_name.lstrip("/")
    if not bare or "/" in bare or bare in (".", ".."):
        raise TransferError(f"invalid shm name {shm_name!r}")
    path = os.path.join("/dev/shm", bare)
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise TransferError(f"cannot open shared memory {path}: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if size < pool_size or pool_size <= 0:
            raise TransferError(f"{path} has {size} bytes, the server announced {pool_size}")
        return bare, fd, mmap.mmap(fd, pool_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        raise TransferError(f"cannot map {path}: {exc}") from exc
    except BaseException:
        os.close(fd)
        raise
