"""Bulk operations: many remaps, stores or retrieves over one client, concurrently.

The job people run at scale is the *remap*: for many (source prompt, target prompt)
pairs, retrieve the KV of the source and store it under the target. :func:`remap_many`
makes that one call::

    result = await client.remap_many(
        [(source_tokens, target_tokens), RemapPair(src2, dst2, cache_salt="a")],
        concurrency=8,
        max_bytes_in_flight=2 << 30,
        progress=lambda p: print(f"{p.done}/{p.total}"),
    )
    print(result.summary.hits, result.summary.gb_per_s)
    for item in result:           # one ItemResult per pair, in input order
        if item.error is not None:
            ...

How a batch runs:

* **Concurrency.** ``concurrency`` workers share the client's one connection; each takes
  the next item in input order and runs it to completion (lookup, retrieve, store) before
  taking another.
* **Memory budget.** Before an item allocates anything it acquires its worst-case bytes
  from an asynchronous byte semaphore of ``max_bytes_in_flight`` bytes: the chunk-aligned
  token count it can move times :attr:`KVGeometry.bytes_per_token`. The semaphore is
  first-come first-served, so a large item is not starved by small ones. **An item larger
  than the whole budget does not deadlock: it waits until nothing else holds any bytes and
  then runs alone**, over the budget, while every other item waits for it. A remap job
  over thousands of long prompts therefore never holds more than the budget in KV tensors
  (plus at most one oversized item). Not counted: transient copies inside the transport
  (on the pickle transport the encoded frame and the decoded chunks, about twice the
  item again) and buffers still held by items that were abandoned on timeout (see below).
* **Buffer reuse.** :func:`remap_many` retrieves into preallocated ``out=`` tensors taken
  from a pool and stores straight from them; after the store the tensor goes back to the
  pool for the next item of a similar size (reused when it holds the item's tokens and is
  at most twice as long). Pooled tensors count against the budget while they are idle;
  they are freed when the budget is needed for another size and when the batch ends. A
  reused buffer is warm memory: no page faults, no fresh allocation per item.
* **Failures.** An item that fails (bad tokens: ``ValueError``/``TypeError``; a server
  error; a timeout: :class:`~lmcache_async.errors.LMCacheTimeoutError`) does not stop the
  batch: its :class:`ItemResult` carries the exception in ``error`` (tracebacks are kept,
  their frames' local variables are cleared so failed items do not pin tensors). With
  ``return_exceptions=False`` the first failure cancels the other items and is raised.
* **Timeouts.** ``timeout`` is per item and covers its server exchanges (for a remap: the
  retrieve and the store together); the time an item waits for a worker or for budget does
  not count. A timed-out item is cleaned up by the client in the background (its session,
  read locks and SHM reservations are released, an SHM store whose slots were reserved is
  completed); its buffer is not reused, because a copy already running may still touch it.
* **Cancellation.** Cancelling the batch cancels every in-flight item; each one releases
  its server session, locks and reservations through the client's own cancellation path
  (in the background, bounded by the client's ``cleanup_grace``); then ``CancelledError``
  is re-raised. Items not started yet are never sent.
* **Progress.** ``progress(BatchProgress)`` is called on the event loop after each item
  (in completion order), with running totals and the item just finished. It must not
  block; an exception it raises aborts the batch (like ``return_exceptions=False``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

import torch

from lmcache_async._compose import ComposeClient
from lmcache_async._defaults import DEFAULT, DefaultType, resolve_timeout
from lmcache_async._host_copy import empty_host
from lmcache_async._wire import validate_cache_salt, validate_tokens

if TYPE_CHECKING:
    from lmcache_async._compose import ComposeResult, KVPart
    from lmcache_async._ops import RemapResult
    from lmcache_async.geometry import KVGeometry
    from lmcache_async.rope import RopeSpec

__all__ = [
    "BatchProgress",
    "BatchResult",
    "BatchSummary",
    "BulkClient",
    "ComposeItem",
    "ItemResult",
    "RemapPair",
    "RetrieveItem",
    "StoreItem",
    "compose_many",
    "remap_many",
    "retrieve_many",
    "store_many",
]

log = logging.getLogger(__name__)


class BulkClient(ComposeClient, Protocol):
    """What the bulk jobs use of a client: what a composition uses
    (:class:`~lmcache_async._compose.ComposeClient`: ``chunk_size``, ``geometry``,
    ``store``, ``retrieve``) and the members below. An open
    :class:`~lmcache_async.client.AsyncClient` is one (the jobs take any object that has
    these, so this module never imports the client)."""

    timeout: float | None

    @property
    def transfer(self) -> Literal["shm", "pickle"]: ...

    async def remap(
        self,
        source_tokens: Sequence[int],
        target_tokens: Sequence[int],
        cache_salt: str = "",
        target_cache_salt: str | None = None,
        *,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> RemapResult: ...

    async def compose(
        self,
        target_tokens: Sequence[int],
        parts: Sequence[KVPart],
        *,
        rope: RopeSpec | None = None,
        cache_salt: str = "",
        timeout: float | DefaultType | None = DEFAULT,
    ) -> ComposeResult: ...


#: The default of ``timeout``: the client's timeout. An alias of
#: :data:`lmcache_async.DEFAULT`, kept for code written before it existed.
CLIENT_DEFAULT: Final = DEFAULT
#: A pooled buffer is reused for an item of at least 1/_REUSE_SLACK of its length.
_REUSE_SLACK: Final = 2

ProgressHook = Callable[["BatchProgress"], object]


# --------------------------------------------------------------------------- items


@dataclass(frozen=True, slots=True)
class RemapPair:
    """One remap: the KV of ``source_tokens`` is stored under ``target_tokens``.

    Plain tuples ``(source, target)``, ``(source, target, cache_salt)`` and
    ``(source, target, cache_salt, target_cache_salt)`` are accepted wherever a
    ``RemapPair`` is.

    Attributes:
        source_tokens: token ids of the cached prompt (stored as a tuple).
        target_tokens: token ids to store the KV under (stored as a tuple).
        cache_salt: the namespace of the source.
        target_cache_salt: the namespace of the target (``None``: same as the source).

    Raises:
        TypeError/ValueError: bad token ids or salts.
    """

    source_tokens: Sequence[int]
    target_tokens: Sequence[int]
    cache_salt: str = ""
    target_cache_salt: str | None = None

    def __post_init__(self) -> None:
        src = validate_tokens(self.source_tokens, "source_tokens")
        dst = validate_tokens(self.target_tokens, "target_tokens")
        object.__setattr__(self, "source_tokens", tuple(src))
        object.__setattr__(self, "target_tokens", tuple(dst))
        validate_cache_salt(self.cache_salt)
        if self.target_cache_salt is not None:
            validate_cache_salt(self.target_cache_salt, "target_cache_salt")

    @property
    def target_salt(self) -> str:
        """The salt the target is stored under."""
        return self.cache_salt if self.target_cache_salt is None else self.target_cache_salt

    @classmethod
    def coerce(cls, value: object) -> RemapPair:
        """``value`` as a :class:`RemapPair` (it may be one, or a 2- to 4-tuple/list)."""
        if isinstance(value, RemapPair):
            return value
        if isinstance(value, tuple | list) and 2 <= len(value) <= 4:
            return cls(*value)
        raise TypeError(
            "a remap pair must be a RemapPair or a tuple (source_tokens, target_tokens"
            f"[, cache_salt[, target_cache_salt]]), got {type(value).__name__}"
            + (f" of length {len(value)}" if isinstance(value, tuple | list) else "")
        )


@dataclass(frozen=True, slots=True)
class StoreItem:
    """One store of :func:`store_many`: ``kv`` (``[2, L, T, D]``) under ``tokens``.

    Plain tuples ``(kv, tokens)`` and ``(kv, tokens, cache_salt)`` are accepted too.
    """

    kv: torch.Tensor
    tokens: Sequence[int]
    cache_salt: str = ""

    @classmethod
    def coerce(cls, value: object) -> StoreItem:
        if isinstance(value, StoreItem):
            return value
        if isinstance(value, tuple | list) and 2 <= len(value) <= 3:
            return cls(*value)
        raise TypeError(
            "a store item must be a StoreItem or a tuple (kv, tokens[, cache_salt]), "
            f"got {type(value).__name__}"
        )


@dataclass(frozen=True, slots=True)
class RetrieveItem:
    """One retrieve of :func:`retrieve_many`.

    A plain token sequence, or a tuple ``(tokens, cache_salt)`` whose second element is a
    ``str``, is accepted too.
    """

    tokens: Sequence[int]
    cache_salt: str = ""

    @classmethod
    def coerce(cls, value: object) -> RetrieveItem:
        if isinstance(value, RetrieveItem):
            return value
        if isinstance(value, tuple | list) and len(value) == 2 and isinstance(value[1], str):
            return cls(value[0], value[1])
        return cls(value)  # type: ignore[arg-type]  # validated by the client


@dataclass(frozen=True, slots=True)
class ComposeItem:
    """One composition of :func:`compose_many`: ``parts`` (a sequence of
    :class:`~lmcache_async.KVPart`) placed into ``target_tokens`` (see
    :meth:`AsyncClient.compose <lmcache_async.AsyncClient.compose>`). Tuples
    ``(target_tokens, parts[, cache_salt])`` are accepted too."""

    target_tokens: Sequence[int]
    parts: Sequence[KVPart]
    cache_salt: str = ""

    @classmethod
    def coerce(cls, value: object) -> ComposeItem:
        if isinstance(value, ComposeItem):
            return value
        if isinstance(value, tuple | list) and 2 <= len(value) <= 3:
            return cls(*value)
        raise TypeError(
            "a compose item must be a ComposeItem or a tuple (target_tokens, parts[, cache_salt]), "
            f"got {type(value).__name__}"
        )


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class ItemResult:
    """What happened to one item of a batch.

    Attributes:
        index: position of the item in the input.
        retrieved_tokens: tokens retrieved (remap: of the source, at most the target's
            whole chunks; retrieve: the hit). 0 on a miss, for a store, or on error.
        stored_tokens: tokens handed to the server for storing (remap: the retrieved
            tokens; store: the whole chunks of the item).
        stored_new: the store added at least one chunk (False when all were cached).
        error: the exception that made the item fail, or None.
        elapsed: seconds from when a worker took the item until it finished (its wait
            for budget included).
        kv: :func:`retrieve_many` only: the retrieved ``[2, L, T_hit, D]`` tensor.
        composed: :func:`compose_many` only: the item's
            :class:`~lmcache_async.ComposeResult` (which part missed, the shifts).
    """

    index: int
    retrieved_tokens: int = 0
    stored_tokens: int = 0
    stored_new: bool = False
    error: BaseException | None = None
    elapsed: float = 0.0
    kv: torch.Tensor | None = field(default=None, repr=False, compare=False)
    composed: ComposeResult | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """The item finished without an error (a miss is ok)."""
        return self.error is None

    @property
    def hit(self) -> bool:
        """Something was retrieved (remap/retrieve)."""
        return self.retrieved_tokens > 0


@dataclass(frozen=True, slots=True)
class BatchProgress:
    """Running totals, passed to the ``progress`` hook after each item.

    Attributes:
        done: items finished (ok or failed).
        total: items in the batch.
        hits / misses / failures: as in :class:`BatchSummary`, so far.
        retrieved_tokens / stored_tokens: tokens moved so far.
        bytes_moved: bytes of KV moved so far (retrieved + stored).
        elapsed: seconds since the batch started.
        item: the item that just finished.
    """

    done: int
    total: int
    hits: int
    misses: int
    failures: int
    retrieved_tokens: int
    stored_tokens: int
    bytes_moved: int
    elapsed: float
    item: ItemResult

    @property
    def tokens(self) -> int:
        return self.retrieved_tokens + self.stored_tokens


@dataclass(frozen=True, slots=True)
class BatchSummary:
    """Totals of a finished batch.

    Attributes:
        items: items in the batch.
        hits: remap/retrieve: items whose source prefix was found (something was
            retrieved). store: items whose chunks were all cached already.
        misses: items that finished without error and are not hits (remap/retrieve:
            nothing found, or a pair shorter than one chunk; store: chunks were added, or
            there was no whole chunk).
        failures: items whose ``error`` is set.
        stored_new: items whose store added at least one chunk.
        retrieved_tokens / stored_tokens: tokens moved.
        bytes_moved: ``(retrieved_tokens + stored_tokens) * bytes_per_token``. Stored
            tokens count whether or not the server already had them.
        elapsed: seconds from the start of the batch to its end.
        peak_bytes_in_flight: the most bytes the memory budget had handed out at once.
    """

    items: int
    hits: int
    misses: int
    failures: int
    stored_new: int
    retrieved_tokens: int
    stored_tokens: int
    bytes_moved: int
    elapsed: float
    peak_bytes_in_flight: int

    @property
    def tokens(self) -> int:
        return self.retrieved_tokens + self.stored_tokens

    @property
    def gb_per_s(self) -> float:
        """``bytes_moved`` per second, in GB (1e9 bytes)."""
        return self.bytes_moved / self.elapsed / 1e9 if self.elapsed > 0 else 0.0


@dataclass(frozen=True, slots=True)
class BatchResult:
    """The per-item results (in input order) and the summary of a batch."""

    results: tuple[ItemResult, ...]
    summary: BatchSummary

    def __len__(self) -> int:
        return len(self.results)

    def __iter__(self) -> Iterator[ItemResult]:
        return iter(self.results)

    def __getitem__(self, index: int) -> ItemResult:
        return self.results[index]

    @property
    def failed(self) -> list[ItemResult]:
        """The items that failed (their ``error`` is set), in input order."""
        return [r for r in self.results if r.error is not None]


# --------------------------------------------------------------------------- budget


class _ByteBudget:
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


def _allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Allocate one KV buffer (a seam for tests that track allocations)."""
    return empty_host(shape, dtype)


class _Lease:
    """A buffer of ``tokens`` tokens (``nbytes`` bytes of the budget) lent to one item."""

    __slots__ = ("nbytes", "tensor", "tokens")

    def __init__(self, tensor: torch.Tensor, tokens: int, nbytes: int) -> None:
        self.tensor = tensor
        self.tokens = tokens
        self.nbytes = nbytes


class _Waiter:
    __slots__ = ("future", "nbytes", "tokens")

    def __init__(self, tokens: int, nbytes: int, future: asyncio.Future[_Lease]) -> None:
        self.tokens = tokens
        self.nbytes = nbytes
        self.future = future


class _BufferPool:
    """Retrieve buffers, pooled per length; every live one, busy or idle, is counted
    against the budget.

    A returned buffer goes straight to the first waiter if it suits that waiter's length
    (no bytes change hands), else it is kept idle for the next item when nobody waits, else
    freed so the first waiter can allocate. Waiters are served strictly in order. While
    anybody waits, no buffer sits idle (idle buffers are freed before waiting and returned
    buffers are never parked), so nobody can wait for bytes held by idle buffers.
    """

    def __init__(self, budget: _ByteBudget, geometry: KVGeometry) -> None:
        self.budget = budget
        self.geometry = geometry
        self.allocations = 0
        self._idle: dict[int, list[_Lease]] = {}
        self._waiters: deque[_Waiter] = deque()

    @staticmethod
    def _suits(size: int, tokens: int) -> bool:
        return tokens <= size <= tokens * _REUSE_SLACK

    def _take_idle(self, tokens: int) -> _Lease | None:
        sizes = [s for s, leases in self._idle.items() if leases and self._suits(s, tokens)]
        if not sizes:
            return None
        return self._idle[min(sizes)].pop()

    def _free(self, lease: _Lease) -> None:
        lease.tensor = _FREED
        self.budget.release(lease.nbytes)

    def _evict(self, need: int | None) -> None:
        """Free idle buffers, largest first, until ``need`` more bytes fit (all: None)."""
        for size in sorted(self._idle, reverse=True):
            leases = self._idle[size]
            while leases and (need is None or not self.budget.fits(need)):
                self._free(leases.pop())
        self._idle = {s: v for s, v in self._idle.items() if v}

    def _new(self, tokens: int, nbytes: int) -> _Lease:
        self.budget.grant(nbytes)
        self.allocations += 1
        return _Lease(_allocate(self.geometry.kv_shape(tokens), self.geometry.dtype), tokens, nbytes)

    async def acquire(self, tokens: int) -> _Lease:
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
        waiter = _Waiter(tokens, nbytes, asyncio.get_running_loop().create_future())
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

    def release(self, lease: _Lease, *, reuse: bool) -> None:
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


_FREED: Final = torch.empty(0)


# --------------------------------------------------------------------------- running


class _Abort(Exception):
    """Raised by a worker to stop the batch; the reason is kept by the runner."""


def _scrub(exc: BaseException) -> None:
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


class _Tally:
    def __init__(self, total: int, bytes_per_token: int, store: bool) -> None:
        self.total = total
        self.bytes_per_token = bytes_per_token
        self.store = store
        self.start = time.monotonic()
        self.done = self.hits = self.misses = self.failures = self.stored_new = 0
        self.retrieved = self.stored = 0

    def add(self, r: ItemResult) -> None:
        self.done += 1
        if r.error is not None:
            self.failures += 1
        elif (not r.stored_new and r.stored_tokens > 0) if self.store else r.retrieved_tokens > 0:
            self.hits += 1
        else:
            self.misses += 1
        self.stored_new += r.stored_new
        self.retrieved += r.retrieved_tokens
        self.stored += r.stored_tokens

    @property
    def bytes_moved(self) -> int:
        return (self.retrieved + self.stored) * self.bytes_per_token

    def progress(self, item: ItemResult) -> BatchProgress:
        return BatchProgress(
            done=self.done,
            total=self.total,
            hits=self.hits,
            misses=self.misses,
            failures=self.failures,
            retrieved_tokens=self.retrieved,
            stored_tokens=self.stored,
            bytes_moved=self.bytes_moved,
            elapsed=time.monotonic() - self.start,
            item=item,
        )

    def summary(self, peak: int) -> BatchSummary:
        return BatchSummary(
            items=self.total,
            hits=self.hits,
            misses=self.misses,
            failures=self.failures,
            stored_new=self.stored_new,
            retrieved_tokens=self.retrieved,
            stored_tokens=self.stored,
            bytes_moved=self.bytes_moved,
            elapsed=time.monotonic() - self.start,
            peak_bytes_in_flight=peak,
        )


ItemBody = Callable[[int, object], Awaitable[ItemResult]]


def _check_options(concurrency: object, max_bytes_in_flight: object, progress: object) -> None:
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    budget = max_bytes_in_flight
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"max_bytes_in_flight must be an int >= 1 (bytes), got {budget!r}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable or None, got {type(progress).__name__}")


async def _run_batch(
    items: Sequence[object],
    body: ItemBody,
    *,
    concurrency: int,
    progress: ProgressHook | None,
    return_exceptions: bool,
    tally: _Tally,
    budget: _ByteBudget,
) -> BatchResult:
    n = len(items)
    results: list[ItemResult | None] = [None] * n
    next_index = 0
    abort: list[BaseException] = []

    async def guarded(index: int) -> ItemResult:
        t0 = time.monotonic()
        try:
            result = await body(index, items[index])
        except Exception as exc:
            _scrub(exc)
            return ItemResult(index, error=exc, elapsed=time.monotonic() - t0)
        return replace(result, elapsed=time.monotonic() - t0)

    async def worker() -> None:
        nonlocal next_index
        while next_index < n and not abort:
            index = next_index
            next_index += 1
            result = await guarded(index)
            results[index] = result
            tally.add(result)
            try:
                if progress is not None:
                    progress(tally.progress(result))
                if result.error is not None and not return_exceptions:
                    raise result.error
            except Exception as exc:
                if not abort:
                    abort.append(exc)
                raise _Abort from None

    # Plain tasks rather than asyncio.TaskGroup: on Python 3.11 a TaskGroup whose child
    # fails while the parent waits in __aexit__ leaves a cancellation request on the
    # parent task (it never calls uncancel()), which breaks the caller's later timeouts.
    workers = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, n))]
    try:
        if workers:
            await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        # On cancellation of the batch, or after an abort: cancel the other items and let
        # each hand its server-side cleanup to the client before going on.
        for w in workers:
            w.cancel()
        if not all(w.done() for w in workers):
            await asyncio.wait(workers)
    for w in workers:
        exc = None if w.cancelled() else w.exception()
        if exc is not None and not isinstance(exc, _Abort):
            raise exc  # not an item's failure: a bug
    if abort:
        raise abort[0]
    done = [r for r in results if r is not None]
    assert len(done) == n
    return BatchResult(tuple(done), tally.summary(budget.peak))


def _left(start: float, timeout: float | None) -> float | None:
    return None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)


# --------------------------------------------------------------------------- API


async def remap_many(
    client: BulkClient,
    pairs: Iterable[RemapPair | Sequence[Any]],
    *,
    concurrency: int = 8,
    max_bytes_in_flight: int = 1 << 30,
    progress: ProgressHook | None = None,
    return_exceptions: bool = True,
    timeout: float | DefaultType | None = DEFAULT,
) -> BatchResult:
    """Remap many pairs: retrieve each source's KV and store it under its target.

    Each pair is retrieved only as far as its target can take (the shorter of the two,
    cut to whole chunks) into a pooled buffer, then stored from that buffer under the
    target's first tokens; see the module docstring for concurrency, the memory budget
    and buffer reuse. A pair shorter than one chunk (source or target) is a miss.

    Args:
        client: an open :class:`~lmcache_async.client.AsyncClient`.
        pairs: :class:`RemapPair` objects or tuples ``(source, target[, salt[, target_salt]])``;
            read once, up front.
        concurrency: items in flight at once (>= 1).
        max_bytes_in_flight: memory budget in bytes for the KV buffers (>= 1).
        progress: called on the event loop after each item with a :class:`BatchProgress`.
        return_exceptions: True (default): a failed item's exception is in its result.
            False: the first failure cancels the batch and is raised.
        timeout: seconds per item for its retrieve and store together (default: the
            client's timeout; ``None``: no deadline).

    Returns:
        A :class:`BatchResult`: one :class:`ItemResult` per pair, in input order, and a
        :class:`BatchSummary`.

    Raises:
        ValueError: bad options (nothing is sent). Bad pairs fail their item.
        TypeError: bad options (nothing is sent).
        Exception: whatever failed first, when ``return_exceptions`` is False.

    Cancellation: every in-flight item is cancelled and cleans up its server session,
    locks and reservations in the background; items not started are never sent;
    ``CancelledError`` is re-raised. A timed-out item is cleaned up the same way.
    """
    _check_options(concurrency, max_bytes_in_flight, progress)
    deadline = resolve_timeout(timeout, client.timeout)
    items = list(pairs)
    geom = client.geometry
    cs = client.chunk_size
    axis = geom.token_axis
    budget = _ByteBudget(max_bytes_in_flight)
    pool = _BufferPool(budget, geom)

    async def body(index: int, raw: object) -> ItemResult:
        pair = RemapPair.coerce(raw)
        src, dst = pair.source_tokens, pair.target_tokens
        n = min(len(src), len(dst)) // cs * cs
        if n == 0:
            return ItemResult(index)
        if client.transfer == "shm":
            # The client copies the source's slots straight into the target's inside the
            # server's pool: no buffer here; the budget only paces the items.
            nbytes = n * geom.bytes_per_token
            await budget.acquire(nbytes)
            try:
                res = await client.remap(
                    src[:n], dst[:n], pair.cache_salt, pair.target_salt, timeout=deadline
                )
            finally:
                budget.release(nbytes)
            return ItemResult(index, res.retrieved_tokens, res.stored_tokens, res.stored_new)
        lease = await pool.acquire(n)
        start = time.monotonic()
        reuse = False
        try:
            kv = await client.retrieve(src[:n], pair.cache_salt, out=lease.tensor, timeout=deadline)
            if kv is None:
                reuse = True
                return ItemResult(index)
            hit = kv.shape[axis]
            new = await client.store(kv, dst[:hit], pair.target_salt, timeout=_left(start, deadline))
            del kv
            reuse = True
            return ItemResult(index, hit, hit, new)
        finally:
            pool.release(lease, reuse=reuse)
            del lease

    try:
        return await _run_batch(
            items,
            body,
            concurrency=concurrency,
            progress=progress,
            return_exceptions=return_exceptions,
            tally=_Tally(len(items), geom.bytes_per_token, store=False),
            budget=budget,
        )
    finally:
        pool.clear()


async def store_many(
    client: BulkClient,
    items: Iterable[StoreItem | Sequence[Any]],
    *,
    concurrency: int = 8,
    max_bytes_in_flight: int = 1 << 30,
    progress: ProgressHook | None = None,
    return_exceptions: bool = True,
    timeout: float | DefaultType | None = DEFAULT,
) -> BatchResult:
    """Store many KV tensors, concurrently.

    The tensors belong to the caller; the budget (each item's whole chunks times
    ``bytes_per_token``) bounds the transport's copies in flight (the encoded frames on
    the pickle transport; nothing is allocated on SHM, where it only paces the items).

    Args:
        items: :class:`StoreItem` objects or tuples ``(kv, tokens[, cache_salt])``.
        timeout: seconds per item (default: the client's timeout).
        concurrency: items in flight at once (as for :func:`remap_many`).
        max_bytes_in_flight: the byte budget of the items in flight (as for
            :func:`remap_many`).
        progress: called after each item (as for :func:`remap_many`).
        return_exceptions: as for :func:`remap_many`.

    Returns:
        A :class:`BatchResult`; ``stored_tokens`` is each item's whole chunks,
        ``stored_new`` whether a chunk was added. Summary ``hits`` are items whose chunks
        were all cached already.

    Cancellation/timeout: as :meth:`AsyncClient.store`: a store whose slots the server
    reserved is completed in the background; sessions are always ended. Items not
    started are never sent; ``CancelledError`` is re-raised.
    """
    _check_options(concurrency, max_bytes_in_flight, progress)
    deadline = resolve_timeout(timeout, client.timeout)
    materialized = list(items)
    geom = client.geometry
    cs = client.chunk_size
    budget = _ByteBudget(max_bytes_in_flight)

    async def body(index: int, raw: object) -> ItemResult:
        item = StoreItem.coerce(raw)
        tokens = validate_tokens(item.tokens)
        covered = len(tokens)
        if isinstance(item.kv, torch.Tensor) and item.kv.dim() == len(geom.kv_shape(0)):
            covered = min(covered, item.kv.shape[geom.token_axis])  # stored under tokens[:T]
        n = covered // cs * cs
        nbytes = n * geom.bytes_per_token
        await budget.acquire(nbytes)
        try:
            new = await client.store(item.kv, tokens, item.cache_salt, timeout=deadline)
            return ItemResult(index, 0, n, new)
        finally:
            budget.release(nbytes)

    return await _run_batch(
        materialized,
        body,
        concurrency=concurrency,
        progress=progress,
        return_exceptions=return_exceptions,
        tally=_Tally(len(materialized), geom.bytes_per_token, store=True),
        budget=budget,
    )


async def retrieve_many(
    client: BulkClient,
    token_lists: Iterable[RetrieveItem | Sequence[Any]],
    *,
    concurrency: int = 8,
    max_bytes_in_flight: int = 1 << 30,
    progress: ProgressHook | None = None,
    return_exceptions: bool = True,
    timeout: float | DefaultType | None = DEFAULT,
    device: torch.device | str | None = None,
) -> BatchResult:
    """Retrieve the KV of many prompts, concurrently.

    Each item's tensor (``[2, L, T_hit, D]``, or ``None`` on a miss) is in its result's
    ``kv``. The budget bounds the retrieves *in flight*; the returned tensors belong to the
    caller and are not counted once their item is done, so a batch returns as many bytes
    as it hits — use :func:`remap_many`, or several smaller batches, to bound memory.

    Args:
        token_lists: token sequences, :class:`RetrieveItem` objects, or tuples
            ``(tokens, cache_salt)``.
        timeout: seconds per item (default: the client's timeout).
        concurrency: items in flight at once (as for :func:`remap_many`).
        max_bytes_in_flight: the byte budget of the items in flight (as for
            :func:`remap_many`).
        progress: called after each item (as for :func:`remap_many`).
        return_exceptions: as for :func:`remap_many`.
        device: where each item's tensor is allocated (default: the CPU); a CUDA device
            allocates on the GPU and copies on side streams ordered after the streams
            current when the batch was called (as :meth:`AsyncClient.retrieve`'s
            ``device``). Checked before anything is sent.

    Cancellation/timeout: as :meth:`AsyncClient.retrieve`: read locks, SHM reads and the
    session are released in the background. ``CancelledError`` is re-raised.
    """
    _check_options(concurrency, max_bytes_in_flight, progress)
    deadline = resolve_timeout(timeout, client.timeout)
    materialized = list(token_lists)
    geom = client.geometry
    cs = client.chunk_size
    axis = geom.token_axis
    budget = _ByteBudget(max_bytes_in_flight)

    async def body(index: int, raw: object) -> ItemResult:
        item = RetrieveItem.coerce(raw)
        tokens = validate_tokens(item.tokens)
        n = len(tokens) // cs * cs
        if n == 0:
            validate_cache_salt(item.cache_salt)
            return ItemResult(index)
        nbytes = n * geom.bytes_per_token
        await budget.acquire(nbytes)
        try:
            kv = await client.retrieve(tokens, item.cache_salt, device=device, timeout=deadline)
        finally:
            budget.release(nbytes)
        hit = 0 if kv is None else kv.shape[axis]
        return ItemResult(index, hit, kv=kv)

    return await _run_batch(
        materialized,
        body,
        concurrency=concurrency,
        progress=progress,
        return_exceptions=return_exceptions,
        tally=_Tally(len(materialized), geom.bytes_per_token, store=False),
        budget=budget,
    )


async def compose_many(
    client: BulkClient,
    items: Iterable[ComposeItem | Sequence[Any]],
    *,
    rope: RopeSpec | None = None,
    concurrency: int = 8,
    max_bytes_in_flight: int = 1 << 30,
    progress: ProgressHook | None = None,
    return_exceptions: bool = True,
    timeout: float | DefaultType | None = DEFAULT,
) -> BatchResult:
    """Run many compositions (:meth:`AsyncClient.compose
    <lmcache_async.AsyncClient.compose>`) concurrently, with one ``rope`` for all.

    An item holds its budget while it runs: the tokens its parts read plus the tokens it
    stores, times ``bytes_per_token`` (the retrieved sources and the assembled target).

    Args:
        items: :class:`ComposeItem` objects or tuples ``(target_tokens, parts[, salt])``.
        rope: the model's rotary embedding, for items with shifted parts.
        concurrency: items in flight at once (as for :func:`remap_many`).
        max_bytes_in_flight: the byte budget of the items in flight (as for
            :func:`remap_many`).
        progress: called after each item (as for :func:`remap_many`).
        return_exceptions: as for :func:`remap_many`.
        timeout: seconds per item for its retrieves and store together (default: the
            client's timeout).

    Returns:
        A :class:`BatchResult`; per item ``retrieved_tokens`` and ``stored_tokens`` are
        the target tokens stored (0 when a part missed: a miss), ``composed`` the
        item's :class:`~lmcache_async.ComposeResult`. A refused item (a shifted part
        without ``rope``...) fails with its ``ValueError`` before it sends anything.

    Cancellation/timeout: as :meth:`AsyncClient.compose`, per item; items not started
    are never sent; ``CancelledError`` is re-raised.
    """
    _check_options(concurrency, max_bytes_in_flight, progress)
    deadline = resolve_timeout(timeout, client.timeout)
    materialized = list(items)
    geom = client.geometry
    cs = client.chunk_size
    budget = _ByteBudget(max_bytes_in_flight)

    async def body(index: int, raw: object) -> ItemResult:
        item = ComposeItem.coerce(raw)
        parts = item.parts if isinstance(item.parts, Sequence) else ()  # the client checks them
        reads = sum(-(-(getattr(p, "end", None) or 0) // cs) * cs for p in parts)
        nbytes = (reads + len(item.target_tokens)) * geom.bytes_per_token
        await budget.acquire(nbytes)
        try:
            res = await client.compose(
                item.target_tokens, item.parts, rope=rope, cache_salt=item.cache_salt, timeout=deadline
            )
        finally:
            budget.release(nbytes)
        n = res.stored_tokens
        return ItemResult(index, n, n, res.stored_new, composed=res)

    return await _run_batch(
        materialized,
        body,
        concurrency=concurrency,
        progress=progress,
        return_exceptions=return_exceptions,
        tally=_Tally(len(materialized), geom.bytes_per_token, store=False),
        budget=budget,
    )
