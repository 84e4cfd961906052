"""An operation's tensor copies: between the caller's KV and SHM slots or inline buffers,
in a worker thread when large, run to their end when the operation is cancelled, and the
repair path of a failed copy. The CUDA copies live in :mod:`lmcache_async._engine.cuda`.

The operations call these through the module (``_copies.fill_slots(...)``), so that a test
can stand in for one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Final

import torch

from lmcache_async._base.host_copy import POOL_COPY_BYTES, copy_host, copy_in_parts

if TYPE_CHECKING:
    from lmcache_async._transport.shm import ShmPool

__all__ = [
    "THREAD_COPY_BYTES",
    "await_to_the_end",
    "copy_chunks_out",
    "copy_to_the_end",
    "fill_slots",
    "maybe_in_thread",
    "refill_slots",
]

log = logging.getLogger(__name__)

#: Copies larger than this run in a worker thread so the event loop keeps serving others.
THREAD_COPY_BYTES: Final = 8 << 20


def fill_slots(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], pool: ShmPool | None = None) -> None:
    """Copy each ``(target, source)`` pair: chunks into reserved SHM slots (store), or
    source slots into target slots (SHM remap). ``pool``: map its pages under the
    target slots first (:meth:`~lmcache_async._transport.shm.ShmPool.populate`); slots that are
    only read are left to fault (see there).

    From :data:`~lmcache_async._base.host_copy.POOL_COPY_BYTES` on, into slots of ``pool`` not
    all mapped here yet, the bytes are cut into parts copied by several threads
    (:func:`~lmcache_async._base.host_copy.copy_in_parts`), each through
    :meth:`~lmcache_async._transport.shm.ShmPool.fill`: pages nobody has written yet are written
    through the segment's descriptor, the others mapped by the thread that copies them
    (see there and docs/internals/design.md). Slots already mapped (a client storing
    into slots it used before) are copied with ``Tensor.copy_``."""
    total = sum(t.numel() * t.element_size() for t, _ in pairs)
    if total >= POOL_COPY_BYTES and pool is not None and not pool.all_mapped(t for t, _ in pairs):
        copy_in_parts(pairs, pool.fill)
        return
    if pool is not None:
        pool.populate(target for target, _ in pairs)
    for target, source in pairs:
        copy_host(target, source, total)


def refill_slots(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The repair path of :func:`fill_slots`: copy each pair again, each source first
    materialised as a fresh CPU tensor of its own (so a failure of the direct copy path,
    e.g. of a device-to-host copy into a strided view, is not repeated)."""
    for target, source in pairs:
        copy_host(target, source.detach().to("cpu", copy=True).contiguous())


def copy_chunks_out(
    target: torch.Tensor,
    chunks: Sequence[torch.Tensor],
    chunk_size: int,
    token_axis: int,
) -> None:
    """Copy ``chunks`` (SHM slot views, or decoded inline tensors) into consecutive
    chunks of ``target`` along ``token_axis`` (retrieve). Slots are only read: their
    pages are left to fault in during the copy (cheaper than mapping them first, see
    :meth:`~lmcache_async._transport.shm.ShmPool.populate`)."""
    total = sum(c.numel() for c in chunks) * target.element_size()
    for i, chunk in enumerate(chunks):
        copy_host(target.narrow(token_axis, i * chunk_size, chunk_size), chunk, total)


async def maybe_in_thread(nbytes: int, fn: Callable[[], None]) -> None:
    if nbytes >= THREAD_COPY_BYTES:
        await asyncio.to_thread(fn)
    else:
        fn()


async def copy_to_the_end(nbytes: int, fn: Callable[[], None]) -> None:
    """Run a copy into reserved slots (in a thread when large) and, if the awaiting task
    is cancelled meanwhile, still wait for the thread to finish before re-raising: the
    slots are never left half-written by a copy still running after its task ended."""
    if nbytes < THREAD_COPY_BYTES:
        fn()
        return
    fut = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        # A thread cannot be interrupted: wait for the memcpy (bounded by its size).
        await asyncio.wait({fut})
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("a copy into reserved slots failed after its task was cancelled: %r", fut.exception())
        raise


async def await_to_the_end(aw: Awaitable[None]) -> None:
    """Await a copy (the CUDA path: its own worker thread) and, if the awaiting task is
    cancelled meanwhile, still wait for it to finish before re-raising (as
    :func:`copy_to_the_end`)."""
    fut = asyncio.ensure_future(aw)
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("a copy into reserved slots failed after its task was cancelled: %r", fut.exception())
        raise
