"""Each operation's RPC sequence, written once, over a small interface.

An :class:`Operations` object runs the exchanges of ``lookup``, ``retrieve`` (SHM or
inline), ``store`` (SHM or inline) and the SHM ``remap`` for one registration
(:class:`Registration`: model, geometry, live chunk size, wire generation, instance id,
SHM pool). It talks to the server only through a :class:`Channel` -- one method,
``call(op, args, timeout)`` returning the reply's value -- on which it builds the three
things a sequence needs: a deadline-bound call, a pipeline (several requests back to back)
and a cleanup call (its own short deadline, errors logged). The client's channel is its
ZMQ connection; a test's can be the embedded server's in-process engine
(:class:`lmcache_async.testing.InProcessServer`), so every sequence can be run, and
cancelled at each of its RPCs, without sockets.

Everything that differs between server generations is data in
:class:`~lmcache_async._wire.WireGeneration` (key encoding, trailing argument frames) and
:mod:`lmcache_async._payload.inline` (the inline tensor payload): no sequence here branches
on the generation.

The tensor copies are small named functions (:func:`fill_slots`, :func:`copy_chunks_out`,
:func:`~lmcache_async._payload.inline.encode_inline`,
:func:`~lmcache_async._payload.inline.decode_inline`), so they can be replaced or hooked in
one place. A CUDA tensor's copies go through :mod:`lmcache_async._cuda.copies` instead (side
streams ordered after the caller's ``Mark``, the pinned SHM pool, pinned staging for the
inline payload); that module is imported only when a call carries a mark.

Cancellation: a sequence is normally run by :func:`run_detached`, in a task of its own
that the caller awaits under its deadline; a caller that times out or is cancelled marks
the :class:`OpState` abandoned and the sequence finishes the server side on its own
(consumes the prefetch result, releases read locks, completes or commits what it
reserved, ends its session), bounded by the registration's ``cleanup_grace``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeGuard, TypeVar

import torch

from lmcache_async import _copies as copies
from lmcache_async._cuda.hooks import new_target
from lmcache_async._payload.inline import decode_inline, encode_inline
from lmcache_async._runner import OpState
from lmcache_async._shm import ShmPool
from lmcache_async._wire import (
    CacheKey,
    Op,
    PreEncoded,
    SlotDescriptor,
    WireGeneration,
    parse_prepare_retrieve,
    parse_prepare_store,
)
from lmcache_async.errors import (
    LayoutMismatchError,
    LMCacheError,
    ProtocolError,
    TransferError,
    UnfilledReservationError,
)
from lmcache_async.geometry import KVGeometry

if TYPE_CHECKING:
    from lmcache_async._cuda.copies import Mark

__all__ = [
    "Channel",
    "Operations",
    "Registration",
    "RemapResult",
    "store_groups",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
Configs = dict[str, Any] | None

#: Longest single wait_prefetch_status: it blocks one of the server's CPU workers.
PREFETCH_WAIT_SLICE: Final = 0.05
#: How long a store whose chunks another writer reserved waits for them at most (without
#: a deadline of its own); with one, it stops WRITER_MARGIN seconds before it.
WRITER_WAIT: Final = 10.0
WRITER_MARGIN: Final = 0.1
#: The longest the ``/status`` fetch that adds the server's L1 memory usage to such a
#: store's error may take; with a deadline, the wait for the other writer stops this much
#: earlier still, so the error (never a timeout) arrives within it.
STATUS_WAIT: Final = 0.5


@dataclass(frozen=True, slots=True)
class RemapResult:
    """What :meth:`AsyncClient.remap <lmcache_async.AsyncClient.remap>` did.

    Attributes:
        retrieved_tokens: tokens of the source prefix read from the cache (only as far as
            the target's whole chunks reach).
        stored_tokens: tokens of the target prefix written with the source KV (equal to
            ``retrieved_tokens``).
        stored_new: whether the store added any chunk (False when all were cached).
    """

    retrieved_tokens: int
    stored_tokens: int
    stored_new: bool

    @property
    def hit(self) -> bool:
        return self.retrieved_tokens > 0


class Channel(Protocol):
    """What an operation needs from a connection to the server."""

    @property
    def usable(self) -> bool:
        """Whether requests can still be sent (cleanup calls are skipped when not)."""
        ...

    async def call(self, opcode: Op, args: Sequence[Any], timeout: float | None) -> Any:
        """Send one request and return its reply's decoded value (``None``: no payload).

        Raises :class:`~lmcache_async.errors.LMCacheTimeoutError` when no reply comes
        within ``timeout``, :class:`~lmcache_async.errors.LMCacheError` subclasses on a
        lost connection. Cancellation discards the reply.
        """
        ...


@dataclass(frozen=True, slots=True)
class Registration:
    """The registration an operation runs under (a snapshot: a re-registration after a
    server restart makes a new one).

    Attributes:
        model_name, geometry: what the keys and tensors are about.
        chunk_size: the server's live chunk size.
        wire: the server generation's wire.
        instance_id: the engine-driven registration id.
        num_kv_readers: read locks a lookup reserves per object.
        pool: the mapped SHM pool, or ``None`` on the inline transport.
        server_has_shm: the server keeps its KV in SHM (an inline client cannot read it).
        fifo_cpu: the server runs lookup-pool requests one at a time in arrival order,
            so a status question may follow its lookup without waiting for the ack.
        write_ttl: the server's write-reservation lifetime in seconds (``/config``), if known.
    """

    model_name: str
    geometry: KVGeometry
    chunk_size: int
    wire: WireGeneration
    instance_id: int
    num_kv_readers: int = 1
    pool: ShmPool | None = None
    server_has_shm: bool = False
    fifo_cpu: bool = False
    write_ttl: float | None = None


class _Reserved:
    """Whether a store half sent its ``prepare_store`` and filled what it reserved."""

    __slots__ = ("filled", "sent")

    def __init__(self) -> None:
        self.sent = False
        self.filled = False


class _RetrieveState:
    __slots__ = ("ended", "gate", "prepared")

    def __init__(self) -> None:
        self.prepared = False
        #: The key gate held around prepare/commit (a CUDA retrieve may keep it until its
        #: commit is answered in the background).
        self.gate: _Gate | None = None
        #: ``end_session`` is taken care of (chained after a background commit).
        self.ended = False


def _value(reply: Any) -> Any:
    """A posted request's reply value (a :class:`~lmcache_async._wire.Reply`), or the
    :class:`ProtocolError` decoding it raised (returned, as ``gather`` returns errors)."""
    try:
        return reply.value()
    except ProtocolError as exc:
        return exc


def _cleanup_done(opcode: Op, fut: asyncio.Future[Any]) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.warning("cleanup %s failed: %s", opcode.name.lower(), exc)


class _Gate:
    """``async with``: hold the lock of one key identity (made on first use, dropped when
    its last user leaves). A class, not a generator context manager: it is entered by
    every store and retrieve."""

    __slots__ = ("_entry", "_gates", "_identity")

    def __init__(self, gates: dict[tuple[Any, ...], list[Any]], identity: tuple[Any, ...]) -> None:
        self._gates = gates
        self._identity = identity
        self._entry: list[Any] | None = None

    async def __aenter__(self) -> None:
        entry = self._gates.get(self._identity)
        if entry is None:
            entry = self._gates[self._identity] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            await entry[0].acquire()
        except BaseException:
            self._leave(entry)
            raise
        self._entry = entry

    async def __aexit__(self, *exc: object) -> None:
        entry = self._entry
        if entry is None:  # handed over by defer()
            return
        self._entry = None
        entry[0].release()
        self._leave(entry)

    def defer(self) -> Callable[[], None]:
        """Keep holding the lock after the ``async with`` block; the returned function
        releases it (call it once)."""
        entry = self._entry
        assert entry is not None
        self._entry = None

        def release() -> None:
            entry[0].release()
            self._leave(entry)

        return release

    def _leave(self, entry: list[Any]) -> None:
        entry[1] -= 1
        if entry[1] == 0:
            del self._gates[self._identity]


class Operations:
    """The RPC sequences of every operation, for one :class:`Registration`, over one
    :class:`Channel`.

    Args:
        channel: where requests go.
        reg: the registration the keys, slots and payloads are for.
        cleanup_grace: the deadline of each cleanup call (and of draining a prefetch).
        gates: per key identity, a lock and its user count: shared by the operations of
            one client, so that two of them never overlap on one key (the server keys
            pending SHM transfers by instance and key, without the request id).
        on_unfilled: called with the instance id when a ``prepare_store`` was sent and
            its slots may hold anything but the caller's data (the copy failed twice,
            the operation was cancelled or lost its connection before the copy ended):
            the client retires that registration so the server never admits the slots.
        track: given each cleanup reply awaited in the background
            (:meth:`cleanup_later`), for the client's ``drain()`` and ``aclose()``.
        server_status: ``server_status(timeout)`` fetches the server's ``/status``
            document (the client's metadata, never a cached one): a store that finds
            its chunks neither reservable nor cached adds the server's L1 memory usage
            from it to its :class:`TransferError` (bounded by :data:`STATUS_WAIT`; a
            fetch that fails or is late is said in the message, never raised).
            ``None``: the message has no memory usage.
    """

    def __init__(
        self,
        channel: Channel,
        reg: Registration,
        *,
        cleanup_grace: float = 10.0,
        gates: dict[tuple[Any, ...], list[Any]] | None = None,
        on_unfilled: Callable[[int], None] | None = None,
        track: Callable[[asyncio.Future[Any]], None] | None = None,
        server_status: Callable[[float], Awaitable[Mapping[str, Any]]] | None = None,
    ) -> None:
        self.channel = channel
        #: The channel's ``post(opcode, args, timeout) -> Future[Reply] | None``, if it has one.
        self._post: Callable[[Op, Sequence[Any], float | None], asyncio.Future[Any] | None] | None = getattr(
            channel, "post", None
        )
        self._track = track
        self.reg = reg
        self.cleanup_grace = cleanup_grace
        self._gates: dict[tuple[Any, ...], list[Any]] = {} if gates is None else gates
        self._on_unfilled = on_unfilled
        self._server_status = server_status

    # ------------------------------------------------------------------ the interface

    async def call(self, op: OpState, opcode: Op, *args: Any) -> Any:
        """One request under the operation's deadline; its reply's value."""
        return await self.channel.call(opcode, args, op.remaining())

    async def pipeline(self, op: OpState, *calls: tuple[Any, ...]) -> list[Any]:
        """Send several requests back to back (in order) and wait for all replies.

        Raises the first error after every reply (or error) is in. Over a channel that can
        ``post``, the requests go out at once as futures (no task per request); where one
        cannot go out at once, it and the rest follow one by one once the earlier replies
        are in (still in order).
        """
        post = self._post
        futs: list[asyncio.Future[Any]] = []
        if post is not None and self.channel.usable:
            remaining = op.remaining()
            for c in calls:
                fut = post(c[0], c[1:], remaining)
                if fut is None:
                    break
                futs.append(fut)
        if not futs:
            tasks = [asyncio.ensure_future(self.call(op, *c)) for c in calls]
            results = await asyncio.gather(*tasks, return_exceptions=True)
        else:
            replies = await asyncio.gather(*futs, return_exceptions=True)
            results = [r if isinstance(r, BaseException) else _value(r) for r in replies]
            for c in calls[len(futs) :]:
                try:
                    results.append(await self.call(op, *c))
                except LMCacheError as exc:
                    results.append(exc)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def cleanup_later(self, opcode: Op, *args: Any) -> None:
        """A cleanup RPC whose answer nobody needs (``end_session`` after the operation's
        last answer): sent now and its reply awaited in the background, so the caller
        gets its result one round trip sooner. The reply (or its error, logged as
        :meth:`cleanup_call` does) is tracked by the client: ``drain()`` and ``aclose()``
        wait for it. Where the channel cannot post it at once (no ``post``, not
        connected, ``max_in_flight`` reached) it is awaited as :meth:`cleanup_call`.

        Cancellation: a posted request is already sent; its reply is still awaited by the
        client in the background.
        """
        post = self._post
        if post is not None and self.channel.usable:
            fut = post(opcode, args, self.cleanup_grace)
            if fut is not None:
                fut.add_done_callback(functools.partial(_cleanup_done, opcode))
                if self._track is not None:
                    self._track(fut)
                return
        await self.cleanup_call(opcode, *args)

    async def cleanup_call(self, opcode: Op, *args: Any) -> Any:
        """A cleanup RPC: its own short deadline; errors are logged, not raised."""
        if not self.channel.usable:
            return None
        try:
            return await self.channel.call(opcode, args, self.cleanup_grace)
        except LMCacheError as exc:
            log.warning("cleanup %s failed: %s", opcode.name.lower(), exc)
            return None

    # ------------------------------------------------------------------ operations

    async def lookup(self, op: OpState, toks: list[int], end: int, salt: str, configs: Configs = None) -> int:
        """Tokens of the longest cached prefix of ``toks[:end]`` (``end`` chunk-aligned);
        locks released and session ended before returning."""
        if end == 0:
            return 0
        rid = request_id("lookup")
        key = self._key(toks, end, rid, salt, worker=False, configs=configs)
        return await self._lookup_locked(op, key, rid, release=True)

    async def retrieve(
        self,
        op: OpState,
        toks: list[int],
        end: int,
        salt: str,
        configs: Configs = None,
        out: torch.Tensor | None = None,
        *,
        mark: Mark | None = None,
    ) -> torch.Tensor | None:
        """The KV of the longest cached prefix of ``toks[:end]``, or ``None``; copied into
        ``out`` when given (a view of it is returned). ``mark``: the KV goes to a GPU
        (``out``'s, or a new tensor on the mark's device), ordered after the mark."""
        if end == 0:
            return None
        geom = self.reg.geometry
        rid = request_id("retrieve")
        key = self._key(toks, end, rid, salt, worker=False, configs=configs)
        hit = 0
        state = _RetrieveState()
        try:
            hit = await self._lookup_locked(op, key, rid, release=False)
            if hit == 0:
                return None
            rkey = self._key(toks, hit, rid, salt, worker=True, configs=configs)
            target = out.narrow(geom.token_axis, 0, hit) if out is not None else None
            if self.reg.pool is None:
                return await self._retrieve_pickle(op, rkey, hit, target, state, mark)
            # The server keys pending SHM reads by (instance, key) without the request
            # id: concurrent retrieves of one prefix must not overlap their pairs.
            state.gate = self._gate(("retrieve", salt, tuple(toks[:hit])))
            async with state.gate:
                return await self._retrieve_shm(op, rkey, hit, target, state, mark, rid)
        finally:
            if hit and not state.prepared:
                await self._free_locks(key, hit // self.reg.chunk_size)
            if not state.ended:
                await self.cleanup_later(Op.END_SESSION, rid)

    async def store(
        self,
        op: OpState,
        kv: torch.Tensor,
        toks: list[int],
        end: int,
        salt: str,
        configs: Configs = None,
        *,
        mark: Mark | None = None,
    ) -> bool:
        """Store ``kv`` (already validated) under ``toks[:end]``; False when all was cached.
        ``mark``: ``kv`` is on a GPU and is read as seen after the mark."""
        if end == 0:
            return False
        # One store per key at a time from this client: a concurrent twin would see
        # the chunks "being written" and could not tell that from out-of-memory.
        async with self._gate(("store", salt, tuple(toks[:end]))):
            if self.reg.pool is not None:
                if mark is not None and len(store_groups(end // self.reg.chunk_size)) > 1:
                    return await self._store_shm_grouped(op, kv, toks, end, salt, configs, mark)
                return await self._store_shm(op, kv, toks, end, salt, configs, mark)
            return await self._store_pickle(op, kv, toks, end, salt, configs, mark)

    async def remap(
        self, op: OpState, src: list[int], dst: list[int], n: int, salt: str, tsalt: str
    ) -> RemapResult:
        """SHM only: copy the source's slots straight into the target's (see
        :meth:`_remap_shm`)."""
        if self.reg.pool is None:
            raise TransferError("an in-pool remap needs the SHM transport")
        return await self._remap_shm(op, src, dst, n, salt, tsalt)

    # ------------------------------------------------------------------ sequences

    def _key(
        self,
        tokens: list[int],
        end: int,
        request_id: str,
        cache_salt: str,
        *,
        start: int = 0,
        worker: bool,
        configs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        geom = self.reg.geometry
        return CacheKey(
            model_name=self.reg.model_name,
            world_size=geom.world_size,
            worker_id=0 if worker else None,
            token_ids=tokens[:end],
            start=start,
            end=end,
            request_id=request_id,
            cache_salt=cache_salt,
            request_configs=configs,
            num_kv_readers=self.reg.num_kv_readers,
        ).to_wire(self.reg.wire)

    def _chunk(self, kv: torch.Tensor, index: int) -> torch.Tensor:
        geom = self.reg.geometry
        return kv.narrow(geom.token_axis, index * self.reg.chunk_size, self.reg.chunk_size)

    async def _prefetch_result(self, op: OpState, request_id: str, limit: int, first: Any = None) -> int:
        """Consume the prefetch status of ``request_id``: hit length in chunks (at most
        ``limit``, the chunks asked for; anything else is a ProtocolError).

        Asks at once (the usual case: the prefetch finished before the question arrives;
        ``first`` is the answer to a question already asked), then waits server-side in
        short slices, so no client-side polling delay is added and the server's shared
        CPU worker is never held for long.
        """
        value = first if first is not None else await self.call(op, Op.QUERY_PREFETCH_STATUS, request_id)
        while value is None:
            remaining = op.remaining()
            slice_ = PREFETCH_WAIT_SLICE if remaining is None else min(PREFETCH_WAIT_SLICE, remaining)
            value = await self.call(op, Op.WAIT_PREFETCH_STATUS, request_id, float(slice_))
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
            raise ProtocolError(f"prefetch status {value!r} is not a chunk count in [0, {limit}]")
        return value

    async def _lookup_locked(
        self, op: OpState, key: dict[str, Any], rid: str, *, release: bool, release_later: bool = False
    ) -> int:
        """lookup + consume status; when ``release``, free the locks and end the session.

        Returns tokens hit. Whatever happens, the status is consumed and (when
        ``release``) locks and session are released: awaited, or, with ``release_later``
        and an answered lookup, posted (:meth:`cleanup_later`: the caller goes on at once).
        """
        geom = self.reg.geometry
        chunks: int | None = None
        ok = False
        limit = key["end"] // self.reg.chunk_size
        try:
            if self.reg.fifo_cpu:
                # One CPU worker on the server runs lookup-pool requests in arrival
                # order, so the status question can follow the lookup without its ack.
                _, first = await self.pipeline(
                    op, (Op.LOOKUP, key, geom.world_size), (Op.QUERY_PREFETCH_STATUS, rid)
                )
                chunks = await self._prefetch_result(op, rid, limit, first)
            else:
                await self.call(op, Op.LOOKUP, key, geom.world_size)  # the ack first (pitfall 6)
                chunks = await self._prefetch_result(op, rid, limit)
            ok = True
            return chunks * self.reg.chunk_size
        finally:
            if chunks is None:
                chunks = await self._drain_prefetch(rid, limit)
            if release and release_later and ok:
                await self._free_locks(key, chunks, later=True)
                await self.cleanup_later(Op.END_SESSION, rid)
            elif release and self.reg.fifo_cpu:
                await self._release_pipelined(key, rid, chunks)
            else:
                if release or not ok:
                    await self._free_locks(key, chunks)
                if release:
                    await self.cleanup_call(Op.END_SESSION, rid)

    async def _release_pipelined(self, key: dict[str, Any], rid: str, chunks: int) -> None:
        """free_lookup_locks + end_session in one round trip (FIFO CPU worker only)."""
        calls: list[tuple[Any, ...]] = []
        if chunks:
            end = chunks * self.reg.chunk_size
            calls.append(
                (
                    Op.FREE_LOOKUP_LOCKS,
                    self.reg.wire.key_prefix(key, end),
                    key["world_size"],
                )
            )
        calls.append((Op.END_SESSION, rid))
        await asyncio.gather(*(self.cleanup_call(*c) for c in calls))

    async def _drain_prefetch(self, rid: str, limit: int) -> int:
        deadline = time.monotonic() + self.cleanup_grace
        while time.monotonic() < deadline:
            value = await self.cleanup_call(Op.WAIT_PREFETCH_STATUS, rid, PREFETCH_WAIT_SLICE)
            if value is not None:
                # Only a plausible count: locks are released on that many chunks.
                return value if type(value) is int and 0 <= value <= limit else 0
            if not self.channel.usable:
                return 0
        return 0

    async def _free_locks(self, key: dict[str, Any], chunks: int, *, later: bool = False) -> None:
        """Release the read locks a lookup took on its first ``chunks`` chunks (``later``:
        posted, see :meth:`cleanup_later`)."""
        if chunks:
            end = chunks * self.reg.chunk_size
            free_key = self.reg.wire.key_prefix(key, end)
            release = self.cleanup_later if later else self.cleanup_call
            await release(Op.FREE_LOOKUP_LOCKS, free_key, key["world_size"])

    async def _retrieve_shm(
        self,
        op: OpState,
        rkey: dict[str, Any],
        hit: int,
        target: torch.Tensor | None,
        state: _RetrieveState,
        mark: Mark | None = None,
        rid: str | None = None,
    ) -> torch.Tensor | None:
        geom = self.reg.geometry
        assert self.reg.pool is not None
        committed = False
        try:
            state.prepared = True
            resp = await self.call(op, Op.PREPARE_RETRIEVE, rkey, self.reg.instance_id)
            success, _data, slots = parse_prepare_retrieve(resp)
            if not success:
                committed = True  # nothing is pending on the server
                return None  # evicted between lookup and prepare: a miss
            n_chunks = hit // self.reg.chunk_size
            if len(slots) != n_chunks:
                raise ProtocolError(f"prepare_retrieve gave {len(slots)} slots for {n_chunks} chunks")
            views = self._stored_views(slots)
            if op.abandoned:
                return None
            if target is None:
                target, mark = new_target(geom.kv_shape(hit), geom.dtype, mark)
            await self._copy_chunks(target, views, mark)
            committed = True
            if mark is None or rid is None or not self._commit_retrieve_later(rkey, rid, state):
                await self.call(op, Op.COMMIT_RETRIEVE, rkey, self.reg.instance_id)
            return target
        finally:
            if not committed:
                await self.cleanup_call(Op.COMMIT_RETRIEVE, rkey, self.reg.instance_id)

    def _commit_retrieve_later(self, rkey: dict[str, Any], rid: str, state: _RetrieveState) -> bool:
        """CUDA retrieve: send ``commit_retrieve`` now and let the call return without
        waiting for its answer (the KV is already in the caller's tensor). The key gate
        stays held, and ``end_session`` is sent, only once the commit is answered (an
        ``end_session`` ahead of it would let it recreate the session; a retrieve of the
        same prefix must not prepare before it). Both replies are tracked by the client
        (``drain()``, ``aclose()``). False (nothing sent) where the channel cannot post.
        """
        post = self._post
        if post is None or not self.channel.usable or state.gate is None:
            return False
        fut = post(Op.COMMIT_RETRIEVE, (rkey, self.reg.instance_id), self.cleanup_grace)
        if fut is None:
            return False
        release = state.gate.defer()
        state.ended = True

        def answered(f: asyncio.Future[Any]) -> None:
            release()
            _cleanup_done(Op.COMMIT_RETRIEVE, f)
            end = post(Op.END_SESSION, (rid,), self.cleanup_grace) if self.channel.usable else None
            if end is not None:
                end.add_done_callback(functools.partial(_cleanup_done, Op.END_SESSION))
            elif self.channel.usable:
                end = asyncio.ensure_future(self.cleanup_call(Op.END_SESSION, rid))
            if end is not None and self._track is not None:
                self._track(end)

        fut.add_done_callback(answered)
        if self._track is not None:
            self._track(fut)
        return True

    async def _retrieve_pickle(
        self,
        op: OpState,
        rkey: dict[str, Any],
        hit: int,
        target: torch.Tensor | None,
        state: _RetrieveState,
        mark: Mark | None = None,
    ) -> torch.Tensor | None:
        geom = self.reg.geometry
        if self.reg.server_has_shm:
            raise TransferError("the server keeps its KV in SHM, which this client cannot map")
        state.prepared = True  # the server releases the locks when it answers
        resp = await self.call(op, Op.PREPARE_RETRIEVE, rkey, self.reg.instance_id)
        success, data, _slots = parse_prepare_retrieve(resp)
        if not success:
            return None
        n_chunks = hit // self.reg.chunk_size
        shape = geom.kv_shape(self.reg.chunk_size)
        try:
            tensors = decode_inline(self.reg.wire, data, count=n_chunks, shape=shape, dtype=geom.dtype)
        except LayoutMismatchError as exc:
            raise exc.for_model(self.reg.model_name) from None
        if op.abandoned:
            return None
        if target is None:
            target, mark = new_target(geom.kv_shape(hit), geom.dtype, mark)
        await self._copy_chunks(target, tensors, mark)
        return target

    def _stored_views(self, slots: Sequence[SlotDescriptor]) -> list[torch.Tensor]:
        """Views of the SHM slots of stored KV (a retrieve's) in the geometry's chunk shape.

        Raises:
            LayoutMismatchError: a slot of another shape or dtype, named as KV stored under
                this model by a client of another geometry.
            ProtocolError: a slot outside the pool.
        """
        geom = self.reg.geometry
        assert self.reg.pool is not None
        shape = geom.kv_shape(self.reg.chunk_size)
        try:
            return [self.reg.pool.view(s, shape, geom.dtype) for s in slots]
        except LayoutMismatchError as exc:
            raise exc.for_model(self.reg.model_name) from None

    def _gate(self, identity: tuple[Any, ...]) -> _Gate:
        """Serialize operations on one key identity within this client."""
        return _Gate(self._gates, identity)

    async def _copy_chunks(
        self, target: torch.Tensor, chunks: Sequence[torch.Tensor], mark: Mark | None = None
    ) -> None:
        if mark is not None:  # CUDA target: side streams ordered after the caller's
            from lmcache_async._cuda import copies as cuda

            pairs = [(self._chunk(target, i), c) for i, c in enumerate(chunks)]
            await cuda.to_device(pairs, mark, self.reg.pool, staged=self.reg.pool is None)
            return
        total = sum(c.numel() for c in chunks) * target.element_size()
        axis, size = self.reg.geometry.token_axis, self.reg.chunk_size
        await copies.maybe_in_thread(total, lambda: copies.copy_chunks_out(target, chunks, size, axis))

    async def _store_shm(
        self,
        op: OpState,
        kv: torch.Tensor,
        toks: list[int],
        end: int,
        salt: str,
        configs: Configs,
        mark: Mark | None = None,
    ) -> bool:
        geom = self.reg.geometry
        assert self.reg.pool is not None
        rid = request_id("store")
        key = self._key(toks, end, rid, salt, worker=True, configs=configs)
        reserved = _Reserved()
        try:
            reserved.sent = True
            resp = await self.call(op, Op.PREPARE_STORE, key, self.reg.instance_id)
            slots, indices = parse_prepare_store(resp)
            if not slots:
                reserved.sent = False  # nothing reserved: no pending entry on the server
                # Nothing reservable: every chunk is cached (or being written), or the
                # server is out of memory (it reserves a batch all-or-nothing). A lookup
                # tells which; it only runs on this uncommon path.
                await self._check_stored(op, toks, end, salt, "reserve memory for")
                return False
            n_chunks = end // self.reg.chunk_size
            if max(indices) >= n_chunks:
                raise ProtocolError(f"prepare_store asked for chunk {max(indices)} of {n_chunks}")
            shape = geom.kv_shape(self.reg.chunk_size)
            views = [self.reg.pool.view(s, shape, geom.dtype) for s in slots]
            pairs = [(v, self._chunk(kv, j)) for v, j in zip(views, indices, strict=True)]
            nbytes = sum(v.numel() for v in views) * kv.element_size()
            await self._fill_reserved(pairs, nbytes, mark)
            reserved.filled = True
            ok = await self.call(op, Op.COMMIT_STORE, key, self.reg.instance_id, b"")
            if ok is not True:
                raise TransferError("the server refused the SHM commit (registration lost?)")
            return True
        finally:
            self._settle(reserved)
            await self.cleanup_later(Op.END_SESSION, rid)

    async def _store_shm_grouped(
        self,
        op: OpState,
        kv: torch.Tensor,
        toks: list[int],
        end: int,
        salt: str,
        configs: Configs,
        mark: Mark | None,
        groups: Sequence[tuple[int, int]] | None = None,
    ) -> bool:
        """A CUDA store on SHM in groups of chunks (:func:`store_groups`), pipelined: every
        group's ``prepare_store`` goes out at once (each group a session of its own, its
        key the tokens up to the group's end with ``start`` at its first chunk, as the
        inline store keys the chunks after a cached prefix: the first, small group's
        request is small and answered soonest); each group's copy starts as soon as its slots are
        known, while the other groups' requests are in flight, and each group is
        committed as soon as its copy is done, while later groups still copy. The call
        waits for the first group's reservation, the copy, and the last group's commit.

        Each group is a store of its own for the server (its own pending reservation):
        a group whose ``prepare_store`` was sent is filled and committed, or its
        registration is retired, exactly as :meth:`_store_shm` does for the whole. A
        group with nothing reserved (cached, another writer's, no memory) is checked as
        :meth:`_store_shm` checks an empty reservation, after the others are committed.
        ``groups``: chunk ranges covering ``[0, end)`` in order (default
        :func:`store_groups`); ``mark`` None: a CPU ``kv`` (tests).
        """
        cs = self.reg.chunk_size
        if groups is None:
            groups = store_groups(end // cs)
        rids = [request_id("store") for _ in groups]
        reserved = [_Reserved() for _ in groups]

        async def group(i: int) -> bool:
            first, last = groups[i]
            gkey = self._key(toks, last * cs, rids[i], salt, start=first * cs, worker=True, configs=configs)
            reserved[i].sent = True
            resp = await self.call(op, Op.PREPARE_STORE, gkey, self.reg.instance_id)
            slots, indices = parse_prepare_store(resp)
            if not slots:
                reserved[i].sent = False  # nothing reserved: no pending entry on the server
                return False
            if max(indices) >= last - first:
                raise ProtocolError(f"prepare_store asked for chunk {max(indices)} of {last - first}")
            assert self.reg.pool is not None
            shape = self.reg.geometry.kv_shape(cs)
            views = [self.reg.pool.view(sl, shape, self.reg.geometry.dtype) for sl in slots]
            pairs = [(v, self._chunk(kv, first + j)) for v, j in zip(views, indices, strict=True)]
            await self._fill_reserved(pairs, sum(v.numel() for v in views) * kv.element_size(), mark)
            reserved[i].filled = True
            ok = await self.call(op, Op.COMMIT_STORE, gkey, self.reg.instance_id, b"")
            if ok is not True:
                raise TransferError("the server refused the SHM commit (registration lost?)")
            return True

        try:
            results = await asyncio.gather(*(group(i) for i in range(len(groups))), return_exceptions=True)
            for res in results:
                if isinstance(res, BaseException):
                    raise res
            if not all(results):
                # A group reserved nothing: cached, being written by another writer, or no
                # memory. A lookup tells which (as for an empty reservation of a whole store).
                await self._check_stored(op, toks, end, salt, "reserve memory for")
            return any(results)
        finally:
            for one in reserved:
                self._settle(one)
            for rid in rids:
                await self.cleanup_later(Op.END_SESSION, rid)

    async def _fill_reserved(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], nbytes: int, mark: Mark | None = None
    ) -> None:
        """Fill reserved slots; when the copy fails midway, fill them all again through
        :func:`refill_slots` (the slots then hold exactly the caller's data).

        ``mark``: the sources are CUDA tensors, copied on the CUDA copy streams after the
        caller's stream mark (:func:`lmcache_async._cuda.copies.to_host`); their repair waits
        for the mark on the host first, in a worker thread.

        Raises:
            UnfilledReservationError: the repair failed too (the slots hold anything).

        Cancellation: a copy running in a thread is waited for before re-raising.
        """
        try:
            if mark is not None:
                from lmcache_async._cuda import copies as cuda

                await copies.await_to_the_end(cuda.to_host(pairs, mark, self.reg.pool))
            else:
                pool = self.reg.pool
                await copies.copy_to_the_end(nbytes, lambda: copies.fill_slots(pairs, pool))
            return
        except Exception as exc:
            log.warning("copy into reserved SHM slots failed (%r); filling them again from CPU copies", exc)
        try:
            if mark is not None:
                event = mark.event

                def repair() -> None:
                    event.synchronize()  # the caller's writes to the sources are done
                    copies.refill_slots(pairs)

                await copies.copy_to_the_end(max(nbytes, copies.THREAD_COPY_BYTES), repair)
            else:
                await copies.copy_to_the_end(nbytes, lambda: copies.refill_slots(pairs))
        except Exception as exc:
            raise UnfilledReservationError(
                f"could not write {len(pairs)} reserved chunks ({exc!r}); nothing was committed "
                "and the slots stay invisible to readers (this client's registration that holds "
                "them is retired and never unregistered)"
            ) from exc

    def _settle(self, reserved: _Reserved) -> None:
        """After a store half: report a reservation that may hold anything but the data."""
        if reserved.sent and not reserved.filled and self._on_unfilled is not None:
            self._on_unfilled(self.reg.instance_id)

    async def _store_pickle(
        self,
        op: OpState,
        kv: torch.Tensor,
        toks: list[int],
        end: int,
        salt: str,
        configs: Configs,
        mark: Mark | None = None,
    ) -> bool:
        rid = request_id("store")
        lookup_key = self._key(toks, end, rid, salt, worker=False)
        try:
            # The lookup tells which chunks are cached already; its locks are not needed
            # (released in the background: they cover other chunks than the commit's).
            hit = await self._lookup_locked(op, lookup_key, rid, release=False)
            await self._free_locks(lookup_key, hit // self.reg.chunk_size, later=True)
            if hit >= end:
                return False
            first = hit // self.reg.chunk_size
            chunks = [self._chunk(kv, j) for j in range(first, end // self.reg.chunk_size)]
            nbytes = sum(c.numel() for c in chunks) * kv.element_size()
            if mark is not None:  # CUDA kv: staged through pinned memory
                from lmcache_async._cuda import copies as cuda

                frame = await cuda.encode_inline(self.reg.wire, chunks, mark)
            elif nbytes >= copies.THREAD_COPY_BYTES:
                frame = await asyncio.to_thread(encode_inline, self.reg.wire, chunks)
            else:
                frame = encode_inline(self.reg.wire, chunks)
            key = self._key(toks, end, rid, salt, start=hit, worker=True, configs=configs)
            ok = await self.call(op, Op.COMMIT_STORE, key, self.reg.instance_id, PreEncoded(frame))
            if ok is not True:
                raise TransferError("the server could not store every chunk (out of memory?)")
        finally:
            await self.cleanup_later(Op.END_SESSION, rid)
        # A pickle commit the server found no memory for still answers True: verify.
        await self._check_stored(op, toks, end, salt, "store")
        return True

    async def _check_stored(self, op: OpState, toks: list[int], end: int, salt: str, what: str) -> None:
        """Return once all of ``toks[:end]`` is cached; raise TransferError if it is not
        by the caller's deadline (at most :data:`WRITER_WAIT` seconds without one).

        The server reserved nothing for chunks that are not cached: either another writer
        holds them (it commits soon, or its reservation expires after the server's write
        TTL) or L1 has no memory. Waiting (with backoff) for the other writer turns the
        first case into "already stored" (the store answers False). The error adds the
        server's L1 memory usage (:meth:`_memory_usage`), which tells the two apart.
        """
        cached = 0
        give_up = time.monotonic() + WRITER_WAIT
        if op.caller_deadline is not None:
            reserve = WRITER_MARGIN + (STATUS_WAIT if self._server_status is not None else 0.0)
            give_up = min(give_up, op.caller_deadline - reserve)
        delay = 0.0
        while True:
            await asyncio.sleep(delay)
            rid = request_id("store-check")
            key = self._key(toks, end, rid, salt, worker=False)
            cached = await self._lookup_locked(op, key, rid, release=True, release_later=True)
            if cached >= end:
                return
            delay = min(max(delay * 2, 0.02), 0.5)
            if op.abandoned or time.monotonic() + delay > give_up:
                break
        ttl = f"{self.reg.write_ttl:g} s" if self.reg.write_ttl is not None else "unknown"
        raise TransferError(
            f"the server could not {what} {(end - cached) // self.reg.chunk_size} chunks that are not "
            "cached: they are reserved by another writer (until it commits, or until its reservation "
            f"expires after the server's write TTL of {ttl}), or L1 is out of memory"
            + await self._memory_usage(op)
        )

    async def _memory_usage(self, op: OpState) -> str:
        """`` (server L1 memory: ...)`` from a fresh ``/status``, for a store's error: how
        much of L1 is used and how much of it other writers hold reserved. Empty without
        ``server_status`` or once the caller left.

        Never raises (but for cancellation): a fetch that fails, or takes longer than
        :data:`STATUS_WAIT` or than the caller's deadline allows (less
        :data:`WRITER_MARGIN`), gives `` (server memory usage unavailable: why)``.
        """
        fetch = self._server_status
        if fetch is None or op.abandoned:
            return ""
        wait = STATUS_WAIT
        if op.caller_deadline is not None:
            wait = min(wait, op.caller_deadline - WRITER_MARGIN - time.monotonic())
        try:
            if wait <= 0:
                raise TimeoutError
            async with asyncio.timeout(wait):
                status = await fetch(wait)
            return f" (server L1 memory: {_l1_memory(status)})"
        except TimeoutError:
            return " (server memory usage unavailable: /status did not answer in time)"
        except Exception as exc:  # the store's error is what the caller must get
            return f" (server memory usage unavailable: {exc})"

    async def _remap_shm(
        self, op: OpState, src: list[int], dst: list[int], n: int, salt: str, tsalt: str
    ) -> RemapResult:
        """Remap inside the SHM pool: the source's slots are copied straight into the
        target's reserved slots (one copy, no client-side buffer).

        Cancellation/timeout: once the target's slots are reserved the copy and commit are
        completed (as for :meth:`store`); every lock, pending read and session is released.
        """
        if n == 0:
            return RemapResult(0, 0, False)
        assert self.reg.pool is not None
        rid = request_id("remap")
        key = self._key(src, n, rid, salt, worker=False)
        hit = 0
        state = _RetrieveState()
        try:
            hit = await self._lookup_locked(op, key, rid, release=False)
            if hit == 0:
                return RemapResult(0, 0, False)
            rkey = self._key(src, hit, rid, salt, worker=True)
            # Gates always in this order (retrieve, then store): no cycle between remaps.
            async with (
                self._gate(("retrieve", salt, tuple(src[:hit]))),
                self._gate(("store", tsalt, tuple(dst[:hit]))),
            ):
                return await self._remap_slots(op, rkey, dst, hit, tsalt, state)
        finally:
            if hit and not state.prepared:
                await self._free_locks(key, hit // self.reg.chunk_size)
            await self.cleanup_later(Op.END_SESSION, rid)

    async def _remap_slots(
        self, op: OpState, rkey: dict[str, Any], dst: list[int], hit: int, tsalt: str, state: _RetrieveState
    ) -> RemapResult:
        geom = self.reg.geometry
        assert self.reg.pool is not None
        shape = geom.kv_shape(self.reg.chunk_size)
        n_chunks = hit // self.reg.chunk_size
        committed = False
        try:
            state.prepared = True
            resp = await self.call(op, Op.PREPARE_RETRIEVE, rkey, self.reg.instance_id)
            success, _data, rslots = parse_prepare_retrieve(resp)
            if not success:
                committed = True
                return RemapResult(0, 0, False)  # evicted between lookup and prepare
            if len(rslots) != n_chunks:
                raise ProtocolError(f"prepare_retrieve gave {len(rslots)} slots for {n_chunks} chunks")
            sources = self._stored_views(rslots)
            if op.abandoned:  # the caller left before the store half began: skip it
                return RemapResult(hit, 0, False)
            srid = request_id("remap-store")
            skey = self._key(dst, hit, srid, tsalt, worker=True)
            reserved = _Reserved()
            try:
                reserved.sent = True
                sresp = await self.call(op, Op.PREPARE_STORE, skey, self.reg.instance_id)
                wslots, indices = parse_prepare_store(sresp)
                if not wslots:
                    reserved.sent = False
                    await self._check_stored(op, dst, hit, tsalt, "reserve memory for")
                    return RemapResult(hit, hit, False)
                if max(indices) >= n_chunks:
                    raise ProtocolError(f"prepare_store asked for chunk {max(indices)} of {n_chunks}")
                pairs = [
                    (self.reg.pool.view(w, shape, geom.dtype), sources[j])
                    for w, j in zip(wslots, indices, strict=True)
                ]
                await self._fill_reserved(pairs, len(pairs) * _shape_bytes(shape, geom.dtype))
                reserved.filled = True
                # The target is written: the source's pending read can go with its commit.
                committed = True
                ok, _ = await self.pipeline(
                    op,
                    (Op.COMMIT_STORE, skey, self.reg.instance_id, b""),
                    (Op.COMMIT_RETRIEVE, rkey, self.reg.instance_id),
                )
                if ok is not True:
                    raise TransferError("the server refused the SHM commit (registration lost?)")
                return RemapResult(hit, hit, True)
            finally:
                self._settle(reserved)
                await self.cleanup_later(Op.END_SESSION, srid)
        finally:
            if not committed:
                await self.cleanup_call(Op.COMMIT_RETRIEVE, rkey, self.reg.instance_id)


def store_groups(n_chunks: int) -> list[tuple[int, int]]:
    """How a CUDA store of ``n_chunks`` chunks on SHM is split (chunk ranges
    ``[first, last)``, in order): one group below 4 chunks; else a small first group (its
    reservation comes back soonest, so the copy starts early), a small last group (its
    commit is the one the call waits for) and the rest in two halves between them."""
    if n_chunks < 4:
        return [(0, n_chunks)]
    edge = max(1, n_chunks // 8)
    middle = n_chunks - 2 * edge
    half = middle // 2
    bounds = [0, edge, edge + half, n_chunks - edge, n_chunks]
    return [(bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1) if bounds[k + 1] > bounds[k]]


def _l1_memory(status: Mapping[str, Any]) -> str:
    """``"U of T bytes used (P%); N write reservations pending, S bytes staged"`` from a
    ``/status`` document (``storage_manager.l1_usage`` and, summed over every L1,
    ``l1_managers.*.write_locked_count`` and ``staging_bytes``: the same on 0.5.6 and
    0.5.7). Raises ProtocolError where these are missing or not counts."""
    missing = ProtocolError("/status has no L1 memory usage (storage_manager.l1_usage and l1_managers)")
    manager = status.get("storage_manager")
    usage = manager.get("l1_usage") if isinstance(manager, dict) else None
    l1s = manager.get("l1_managers") if isinstance(manager, dict) else None
    if not isinstance(usage, list) or len(usage) != 2 or not isinstance(l1s, dict) or not l1s:
        raise missing
    used, total = usage
    reserved = staged = 0
    for l1 in l1s.values():
        count, nbytes = (
            (l1.get("write_locked_count"), l1.get("staging_bytes")) if isinstance(l1, dict) else (None, None)
        )
        if not _is_count(count) or not _is_count(nbytes):
            raise missing
        reserved += count
        staged += nbytes
    if not _is_count(used) or not _is_count(total):
        raise missing
    share = f" ({used / total:.0%})" if total else ""
    return (
        f"{used} of {total} bytes used{share}; {reserved} write reservations pending, {staged} bytes staged"
    )


def _is_count(value: object) -> TypeGuard[int]:
    return type(value) is int and value >= 0


def request_id(kind: str) -> str:
    """A fresh session id (the server keys sessions by it; never reused)."""
    return f"lmca-{kind}-{uuid.uuid4().hex}"


def _shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one tensor of ``shape`` x ``dtype``."""
    return math.prod(shape) * dtype.itemsize
