"""The engine of the bulk jobs (:mod:`lmcache_async.bulk`): the byte budget the items in
flight share, the pool of retrieve buffers counted against it, and what a kept exception
must not pin. No I/O and no client: the jobs in :mod:`lmcache_async.bulk` run their items
over these.
"""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections import deque
from typing import Final

import torch

from lmcache_async._base.host_copy import empty_host
from lmcache_async.geometry import KVGeometry

__all__ = ["FREED", "REUSE_SLACK", "Abort", "BufferPool", "ByteBudget", "Lease", "allocate", "scrub"]

#: A pooled buffer is reused for an item of at least 1/REUSE_SLACK of its length.
REUSE_SLACK: Final = 2


class ByteBudget:
    """A first-come first-served asynchronous semaphore counting bytes.

    ``acquire(n)`` waits until ``n`` more bytes fit under ``capacity``, or, for a request
    larger than the capacity, until nothing at all is held (then it runs alone). A waiter
    at the head of the queue is never overtaken, so large requests are not starved.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def fits(self, n: int) -> bool:
        """``n`` more bytes fit now (always true when nothing is held)."""
        return self.used + n <= self.capacity or self.used == 0

    def grant(self, n: int) -> None:
        """Count ``n`` more bytes as held, unconditionally (the caller checked)."""
        self.used += n
        self.peak = max(self.peak, self.used)

    async def acquire(self, n: int) -> None:
        if not self._waiters and self.fits(n):
            self.grant(n)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted, but the waiter left before using it
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, n: int) -> None:
        self.used -= n
        assert self.used >= 0, "budget released more than it granted"
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():  # a cancelled waiter
                self._waiters.popleft()
                continue
            if not self.fits(n):
                return
            self._waiters.popleft()
            self.grant(n)
            fut.set_result(None)


def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Allocate one KV buffer (a seam for tests that track allocations)."""
    return empty_host(shape, dtype)


class Lease:
    """A buffer of ``tokens`` tokens (``nbytes`` bytes of the budget) lent to one item."""

    __slots__ = ("nbytes", "tensor", "tokens")

    def __init__(self, tensor: torch.Tensor, tokens: int, nbytes: int) -> None:
        self.tensor = tensor
        self.tokens = tokens
        self.nbytes = nbytes


class Waiter:
    __slots__ = ("future", "nbytes", "tokens")

    def __init__(self, tokens: int, nbytes: int, future: asyncio.Future[Lease]) -> None:
        self.tokens = tokens
        self.nbytes = nbytes
        self.future = future


class BufferPool:
    """Retrieve buffers, pooled per length; every live one, busy or idle, is counted
    against the budget.

    A returned buffer goes straight to the first waiter if it suits that waiter's length
    (no bytes change hands), else it is kept idle for the next item when nobody waits, else
    freed so the first waiter can allocate. Waiters are served strictly in order. While
    anybody waits, no buffer sits idle (idle buffers are freed before waiting and returned
    buffers are never parked), so nobody can wait for bytes held by idle buffers.
    """

    def __init__(self, budget: ByteBudget, geometry: KVGeometry) -> None:
        self.budget = budget
        self.geometry = geometry
        self.allocations = 0
        self._idle: dict[int, list[Lease]] = {}
        self._waiters: deque[Waiter] = deque()

    @staticmethod
    def _suits(size: int, tokens: int) -> bool:
        return tokens <= size <= tokens * REUSE_SLACK

    def _take_idle(self, tokens: int) -> Lease | None:
        sizes = [s for s, leases in self._idle.items() if leases and self._suits(s, tokens)]
        if not sizes:
            return None
        return self._idle[min(sizes)].pop()

    def _free(self, lease: Lease) -> None:
        lease.tensor = FREED
        self.budget.release(lease.nbytes)

    def _evict(self, need: int | None) -> None:
        """Free idle buffers, largest first, until ``need`` more bytes fit (all: None)."""
        for size in sorted(self._idle, reverse=True):
            leases = self._idle[size]
            while leases and (need is None or not self.budget.fits(need)):
                self._free(leases.pop())
        self._idle = {s: v for s, v in self._idle.items() if v}

    def _new(self, tokens: int, nbytes: int) -> Lease:
        self.budget.grant(nbytes)
        self.allocations += 1
        return Lease(allocate(self.geometry.kv_shape(tokens), self.geometry.dtype), tokens, nbytes)

    async def acquire(self, tokens: int) -> Lease:
        """A buffer for ``tokens`` tokens (possibly longer), waiting for budget if needed."""
        nbytes = tokens * self.geometry.bytes_per_token
        if not self._waiters:
            lease = self._take_idle(tokens)
            if lease is not None:
                return lease
            self._evict(nbytes)
            if self.budget.fits(nbytes):
                return self._new(tokens, nbytes)
            self._evict(None)
        waiter = Waiter(tokens, nbytes, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            return await waiter.future
        except BaseException:
            fut = waiter.future
            if fut.done() and not fut.cancelled():
                self.release(fut.result(), reuse=True)  # served, but the waiter left
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                self._wake()
            raise

    def release(self, lease: Lease, *, reuse: bool) -> None:
        """Give ``lease`` back; ``reuse=False`` (the item failed) always frees it."""
        if reuse:
            self._drop_cancelled()
            if self._waiters:
                head = self._waiters[0]
                if self._suits(lease.tokens, head.tokens):
                    self._waiters.popleft()
                    head.future.set_result(lease)
                    return
            elif self.budget.used <= self.budget.capacity:
                self._idle.setdefault(lease.tokens, []).append(lease)
                return
        self._free(lease)
        self._wake()

    def _drop_cancelled(self) -> None:
        while self._waiters and self._waiters[0].future.done():
            self._waiters.popleft()

    def _wake(self) -> None:
        self._drop_cancelled()
        while self._waiters and self.budget.fits(self._waiters[0].nbytes):
            head = self._waiters.popleft()
            head.future.set_result(self._new(head.tokens, head.nbytes))
            self._drop_cancelled()

    def clear(self) -> None:
        """Free every idle buffer."""
        self._evict(None)


FREED: Final = torch.empty(0)


class Abort(Exception):
    """Raised by a worker to stop the batch; the reason is kept by the runner."""


def scrub(exc: BaseException) -> None:
    """Clear the local variables of the (finished) frames in ``exc``'s tracebacks, so a
    kept exception does not pin the tensors an item used."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]
