"""Bulk operations: many remaps, stores, retrieves or compositions over one client, concurrently.

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
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict, TypeVar, Unpack

import torch

from lmcache_async._base.timeouts import DEFAULT, DefaultType, resolve_timeout
from lmcache_async._engine.batching import Abort, BufferPool, ByteBudget, scrub
from lmcache_async._engine.compose import ComposeClient
from lmcache_async._protocol.wire import validate_cache_salt, validate_tokens

if TYPE_CHECKING:
    from lmcache_async.results import ComposeResult, KVPart, RemapResult
    from lmcache_async.rope import RopeSpec

__all__ = [
    "BatchOptions",
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
    """What the bulk jobs use of a client: what a composition uses (``chunk_size``,
    ``geometry``, ``store``, ``retrieve``) and the members below. An open
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


ProgressHook = Callable[["BatchProgress"], object]


class BatchOptions(TypedDict, total=False):
    """The keyword arguments every bulk job takes, written once: the four jobs here, their
    :class:`~lmcache_async.AsyncClient` methods and their blocking
    :class:`~lmcache_async.Client` twins take them as ``**options``.

    Attributes:
        concurrency: items in flight at once (an int >= 1; default 8).
        max_bytes_in_flight: memory budget in bytes of the items in flight (an int >= 1;
            default ``1 << 30``); see the module docstring.
        progress: called on the event loop after each item with a :class:`BatchProgress`
            (default: none); it must not block, and an exception it raises aborts the batch.
        return_exceptions: True (default): a failed item's exception is in its result.
            False: the first failure cancels the batch and is raised.
        timeout: seconds per item for its server exchanges (default: the client's
            timeout; ``None``: no deadline); the wait for a worker or for budget does not
            count.
    """

    concurrency: int
    max_bytes_in_flight: int
    progress: Callable[[BatchProgress], object] | None
    return_exceptions: bool
    timeout: float | DefaultType | None


@dataclass(frozen=True, slots=True)
class _Settings:
    """A job's :class:`BatchOptions` with the defaults filled in, checked."""

    concurrency: int
    max_bytes_in_flight: int
    progress: ProgressHook | None
    return_exceptions: bool
    deadline: float | None


def check_options(job: str, options: BatchOptions) -> None:
    """Refuse a keyword :class:`BatchOptions` does not name (``TypeError``, as Python's own
    for an unknown keyword argument), before anything runs."""
    for key in options:
        if key not in BatchOptions.__annotations__:
            raise TypeError(f"{job}() got an unexpected keyword argument {key!r}")


def _settings(job: str, client: BulkClient, options: BatchOptions) -> _Settings:
    check_options(job, options)
    got = _Settings(
        concurrency=options.get("concurrency", 8),
        max_bytes_in_flight=options.get("max_bytes_in_flight", 1 << 30),
        progress=options.get("progress"),
        return_exceptions=options.get("return_exceptions", True),
        deadline=None,
    )
    _check_options(got.concurrency, got.max_bytes_in_flight, got.progress)
    return replace(got, deadline=resolve_timeout(options.get("timeout", DEFAULT), client.timeout))


# --------------------------------------------------------------------------- items

_ItemT = TypeVar("_ItemT")


def _coerce(cls: type[_ItemT], value: object, what: str, least: int, shape: str) -> _ItemT:
    """``value`` as a ``cls``: one already, or a tuple/list of ``least`` up to all of
    ``cls``'s fields (``shape`` names them, for the error).

    Raises:
        TypeError: anything else.
    """
    if isinstance(value, cls):
        return value
    fields = len(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    if isinstance(value, tuple | list) and least <= len(value) <= fields:
        return cls(*value)
    length = f" of length {len(value)}" if isinstance(value, tuple | list) else ""
    raise TypeError(f"{what} must be a {cls.__name__} or a tuple {shape}, got {type(value).__name__}{length}")


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
        return _coerce(
            cls, value, "a remap pair", 2, "(source_tokens, target_tokens[, cache_salt[, target_cache_salt]])"
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
        return _coerce(cls, value, "a store item", 2, "(kv, tokens[, cache_salt])")


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
        return _coerce(cls, value, "a compose item", 2, "(target_tokens, parts[, cache_salt])")


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
    items: Sequence[object], body: ItemBody, batch: _Settings, tally: _Tally, budget: ByteBudget
) -> BatchResult:
    concurrency, progress, return_exceptions = batch.concurrency, batch.progress, batch.return_exceptions
    n = len(items)
    results: list[ItemResult | None] = [None] * n
    next_index = 0
    abort: list[BaseException] = []

    async def guarded(index: int) -> ItemResult:
        t0 = time.monotonic()
        try:
            result = await body(index, items[index])
        except Exception as exc:
            scrub(exc)
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
                raise Abort from None

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
        if exc is not None and not isinstance(exc, Abort):
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
    **options: Unpack[BatchOptions],
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
        **options: :class:`BatchOptions` (``concurrency``, ``max_bytes_in_flight``, the
            memory budget of the KV buffers, ``progress``, ``return_exceptions``,
            ``timeout``: seconds per item for its retrieve and store together).

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
    batch = _settings("remap_many", client, options)
    deadline = batch.deadline
    items = list(pairs)
    geom = client.geometry
    cs = client.chunk_size
    axis = geom.token_axis
    budget = ByteBudget(batch.max_bytes_in_flight)
    pool = BufferPool(budget, geom)

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
            items, body, batch, _Tally(len(items), geom.bytes_per_token, store=False), budget
        )
    finally:
        pool.clear()


async def store_many(
    client: BulkClient,
    items: Iterable[StoreItem | Sequence[Any]],
    **options: Unpack[BatchOptions],
) -> BatchResult:
    """Store many KV tensors, concurrently.

    The tensors belong to the caller; the budget (each item's whole chunks times
    ``bytes_per_token``) bounds the transport's copies in flight (the encoded frames on
    the pickle transport; nothing is allocated on SHM, where it only paces the items).

    Args:
        items: :class:`StoreItem` objects or tuples ``(kv, tokens[, cache_salt])``.
        **options: :class:`BatchOptions` (``timeout``: seconds per item).

    Returns:
        A :class:`BatchResult`; ``stored_tokens`` is each item's whole chunks,
        ``stored_new`` whether a chunk was added. Summary ``hits`` are items whose chunks
        were all cached already.

    Cancellation/timeout: as :meth:`AsyncClient.store`: a store whose slots the server
    reserved is completed in the background; sessions are always ended. Items not
    started are never sent; ``CancelledError`` is re-raised.
    """
    batch = _settings("store_many", client, options)
    deadline = batch.deadline
    materialized = list(items)
    geom = client.geometry
    cs = client.chunk_size
    budget = ByteBudget(batch.max_bytes_in_flight)

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
        materialized, body, batch, _Tally(len(materialized), geom.bytes_per_token, store=True), budget
    )


async def retrieve_many(
    client: BulkClient,
    token_lists: Iterable[RetrieveItem | Sequence[Any]],
    *,
    device: torch.device | str | None = None,
    **options: Unpack[BatchOptions],
) -> BatchResult:
    """Retrieve the KV of many prompts, concurrently.

    Each item's tensor (``[2, L, T_hit, D]``, or ``None`` on a miss) is in its result's
    ``kv``. The budget bounds the retrieves *in flight*; the returned tensors belong to the
    caller and are not counted once their item is done, so a batch returns as many bytes
    as it hits — use :func:`remap_many`, or several smaller batches, to bound memory.

    Args:
        token_lists: token sequences, :class:`RetrieveItem` objects, or tuples
            ``(tokens, cache_salt)``.
        **options: :class:`BatchOptions` (``timeout``: seconds per item).
        device: where each item's tensor is allocated (default: the CPU); a CUDA device
            allocates on the GPU and copies on side streams ordered after the streams
            current when the batch was called (as :meth:`AsyncClient.retrieve`'s
            ``device``). Checked before anything is sent.

    Cancellation/timeout: as :meth:`AsyncClient.retrieve`: read locks, SHM reads and the
    session are released in the background. ``CancelledError`` is re-raised.
    """
    batch = _settings("retrieve_many", client, options)
    deadline = batch.deadline
    materialized = list(token_lists)
    geom = client.geometry
    cs = client.chunk_size
    axis = geom.token_axis
    budget = ByteBudget(batch.max_bytes_in_flight)

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
        materialized, body, batch, _Tally(len(materialized), geom.bytes_per_token, store=False), budget
    )


async def compose_many(
    client: BulkClient,
    items: Iterable[ComposeItem | Sequence[Any]],
    *,
    rope: RopeSpec | None = None,
    **options: Unpack[BatchOptions],
) -> BatchResult:
    """Run many compositions (:meth:`AsyncClient.compose
    <lmcache_async.AsyncClient.compose>`) concurrently, with one ``rope`` for all.

    An item holds its budget while it runs: the tokens its parts read plus the tokens it
    stores, times ``bytes_per_token`` (the retrieved sources and the assembled target).

    Args:
        items: :class:`ComposeItem` objects or tuples ``(target_tokens, parts[, salt])``.
        rope: the model's rotary embedding, for items with shifted parts.
        **options: :class:`BatchOptions` (``timeout``: seconds per item for its
            retrieves and store together).

    Returns:
        A :class:`BatchResult`; per item ``retrieved_tokens`` and ``stored_tokens`` are
        the target tokens stored (0 when a part missed: a miss), ``composed`` the
        item's :class:`~lmcache_async.ComposeResult`. A refused item (a shifted part
        without ``rope``...) fails with its ``ValueError`` before it sends anything.

    Cancellation/timeout: as :meth:`AsyncClient.compose`, per item; items not started
    are never sent; ``CancelledError`` is re-raised.
    """
    batch = _settings("compose_many", client, options)
    deadline = batch.deadline
    materialized = list(items)
    geom = client.geometry
    cs = client.chunk_size
    budget = ByteBudget(batch.max_bytes_in_flight)

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
        materialized, body, batch, _Tally(len(materialized), geom.bytes_per_token, store=False), budget
    )
