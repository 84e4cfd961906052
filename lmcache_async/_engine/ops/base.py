"""The shared part of every operation's RPC sequence: the deadline-bound call, the
pipeline, the cleanup calls, keys, lookups with read locks, the gates that keep two
operations of one client off one key, and the checks after a store (see
:mod:`lmcache_async._engine.ops`).

Invariant: over a :class:`LateReplyChannel`, a session's ``end_session`` goes out only
after the late replies of its affinity requests (``prepare_*``/``commit_*``) arrived, in
the background, at most ``cleanup_grace`` seconds; :class:`LateEnds` counts the ones sent
without them or not sent (docs/internals/design.md, section "A session ends after its late
requests").
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
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeGuard, TypeVar, runtime_checkable

import torch

from lmcache_async._base.deadline import async_timeout
from lmcache_async._engine import copies as copies
from lmcache_async._engine.cuda import hooks as cuda_hooks
from lmcache_async._engine.runner import OpState
from lmcache_async._protocol.wire import (
    CacheKey,
    Op,
    WireGeneration,
)
from lmcache_async._transport.shm import ShmPool
from lmcache_async.errors import (
    LMCacheError,
    ProtocolError,
    TransferError,
)
from lmcache_async.geometry import KVGeometry
from lmcache_async.results import RemapResult

if TYPE_CHECKING:
    from lmcache_async._engine.cuda.copies import Mark

__all__ = [
    "AFFINITY_OPS",
    "Channel",
    "Configs",
    "LateEnds",
    "LateReplyChannel",
    "OperationsBase",
    "PostingChannel",
    "Registration",
    "RemapResult",
    "Reserved",
    "RetrieveState",
    "cleanup_done",
    "request_id",
    "shape_bytes",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
Configs = dict[str, Any] | None
#: Given the future of a request's late reply (see :class:`LateReplyChannel`).
OnLate = Callable[[asyncio.Future[None]], None]

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
#: The requests the server runs on the connection's FIFO affinity worker that carry a
#: session's key: each may create that session, unordered with its ``end_session``.
AFFINITY_OPS: Final = frozenset({Op.PREPARE_STORE, Op.COMMIT_STORE, Op.PREPARE_RETRIEVE, Op.COMMIT_RETRIEVE})


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


@runtime_checkable
class PostingChannel(Channel, Protocol):
    """A :class:`Channel` that can also send a request without waiting for its reply: the
    cleanups (``end_session`` and the like) are then posted in the background instead of
    awaited (:class:`~lmcache_async._transport.channel.ConnectionChannel` is one)."""

    def post(self, opcode: Op, args: Sequence[Any], timeout: float | None) -> asyncio.Future[Any] | None:
        """Send one request now and return the future of its reply (a
        :class:`~lmcache_async._protocol.wire.Reply`); ``None`` when it cannot be sent at once."""
        ...


@runtime_checkable
class LateReplyChannel(PostingChannel, Protocol):
    """A :class:`PostingChannel` that can also watch for the late reply of a request its
    caller stopped waiting for (timeout, cancellation), so that a session's
    ``end_session`` is sent after it (:class:`~lmcache_async._transport.channel.ConnectionChannel`
    is one; see the module)."""

    async def call_noting_late(
        self, opcode: Op, args: Sequence[Any], timeout: float | None, on_late: OnLate, *, urgent: bool = False
    ) -> Any:
        """``call`` (``urgent``: sent at once, as a cleanup); when it stops waiting after
        sending, ``on_late`` is given a future that is done when the late reply arrives,
        fails when it cannot come any more, and must be cancelled by its waiter."""
        ...

    def post_noting_late(
        self, opcode: Op, args: Sequence[Any], timeout: float | None, on_late: OnLate
    ) -> asyncio.Future[Any] | None:
        """``post``, with ``on_late`` as in :meth:`call_noting_late`."""
        ...


class LateEnds:
    """Counts of the ``end_session`` requests held back for late replies (see the
    module), shared by the operations of one client.

    Attributes:
        deferred: held back until the late replies of the session's requests arrived.
        unordered: sent without some of them (not in by ``cleanup_grace``, or the
            connection was lost): the late request may still create the session again.
        unsent: never sent (the client closed, or the wait was cancelled at close).
    """

    __slots__ = ("deferred", "unordered", "unsent")

    def __init__(self) -> None:
        self.deferred = 0
        self.unordered = 0
        self.unsent = 0


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


class Reserved:
    """Whether a store half sent its ``prepare_store`` and filled what it reserved."""

    __slots__ = ("filled", "sent")

    def __init__(self) -> None:
        self.sent = False
        self.filled = False


class RetrieveState:
    __slots__ = ("ended", "gate", "prepared")

    def __init__(self) -> None:
        self.prepared = False
        #: The key gate held around prepare/commit (a CUDA retrieve may keep it until its
        #: commit is answered in the background).
        self.gate: _Gate | None = None
        #: ``end_session`` is taken care of (chained after a background commit).
        self.ended = False


def _value(reply: Any) -> Any:
    """A posted request's reply value (a :class:`~lmcache_async._protocol.wire.Reply`), or the
    :class:`ProtocolError` decoding it raised (returned, as ``gather`` returns errors)."""
    try:
        return reply.value()
    except ProtocolError as exc:
        return exc


def cleanup_done(opcode: Op, rid: str | None, fut: asyncio.Future[Any]) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        _cleanup_failed(opcode, rid, exc)


def _request_of(args: Sequence[Any]) -> str | None:
    """The request id a cleanup call is about (its first argument: the id, or a key)."""
    first = args[0] if args else None
    if isinstance(first, str):
        return first
    if isinstance(first, dict):
        rid = first.get("request_id")
        return rid if isinstance(rid, str) else None
    return None


def _cleanup_failed(opcode: Op, rid: str | None, exc: BaseException) -> None:
    """Log a failed cleanup call once, with its request id (``extra`` ``request_id``)."""
    name = opcode.name.lower()
    log.warning("cleanup %s of request %s failed: %s", name, rid, exc, extra={"request_id": rid})


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


class OperationsBase:
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
        late_ends: where the ``end_session`` requests held back for late replies are
            counted (see the module); a new one by default.
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
        late_ends: LateEnds | None = None,
    ) -> None:
        self.channel = channel
        #: The channel's ``post(opcode, args, timeout) -> Future[Reply] | None``, if it has one.
        self._post: Callable[[Op, Sequence[Any], float | None], asyncio.Future[Any] | None] | None = (
            channel.post if isinstance(channel, PostingChannel) else None
        )
        #: The channel's ``call_urgent`` (a cleanup is sent at once), if it has one.
        self._call_urgent: Callable[[Op, Sequence[Any], float | None], Awaitable[Any]] = getattr(
            channel, "call_urgent", channel.call
        )
        self._track = track
        #: The channel, where it reports late replies (see the module).
        self._late_channel: LateReplyChannel | None = (
            channel if isinstance(channel, LateReplyChannel) else None
        )
        #: Per request id, the late replies of its affinity requests still to come.
        self._late: dict[str, list[asyncio.Future[None]]] = {}
        #: The ``end_session`` requests waiting for late replies (held here until done).
        self._ending: set[asyncio.Future[None]] = set()
        self.late_ends = LateEnds() if late_ends is None else late_ends
        self.reg = reg
        self.cleanup_grace = cleanup_grace
        self._gates: dict[tuple[Any, ...], list[Any]] = {} if gates is None else gates
        self._on_unfilled = on_unfilled
        self._server_status = server_status

    # ------------------------------------------------------------------ the interface

    async def call(self, op: OpState, opcode: Op, *args: Any) -> Any:
        """One request under the operation's deadline; its reply's value (noted as a
        phase where the operation's record asks for phases)."""
        record = op.record
        if record is None or record.phases is None:
            return await self._send(opcode, args, op.remaining())
        start = time.time_ns()
        try:
            return await self._send(opcode, args, op.remaining())
        finally:
            record.phases.append((opcode.phase, start, time.time_ns()))

    def _noter(self, opcode: Op, args: Sequence[Any]) -> OnLate | None:
        """Where the late reply of request ``opcode(*args)`` is noted, if it is an affinity
        request with a session (and the channel reports late replies)."""
        if self._late_channel is None or opcode not in AFFINITY_OPS:
            return None
        rid = _request_of(args)
        return None if rid is None else functools.partial(self._note_late, rid)

    def _note_late(self, rid: str, late: asyncio.Future[None]) -> None:
        self._late.setdefault(rid, []).append(late)
        late.add_done_callback(functools.partial(self._late_settled, rid))

    def _late_settled(self, rid: str, late: asyncio.Future[None]) -> None:
        waiting = self._late.get(rid)
        if waiting is not None and late in waiting:
            waiting.remove(late)
            if not waiting:
                del self._late[rid]

    async def _send(
        self, opcode: Op, args: Sequence[Any], timeout: float | None, urgent: bool = False
    ) -> Any:
        """One request over the channel (``urgent``: a cleanup, sent at once), its late
        reply watched for where it is an affinity request with a session."""
        noter = self._noter(opcode, args)
        if noter is not None:
            assert self._late_channel is not None
            return await self._late_channel.call_noting_late(opcode, args, timeout, noter, urgent=urgent)
        if urgent:
            return await self._call_urgent(opcode, args, timeout)
        return await self.channel.call(opcode, args, timeout)

    def _post_request(
        self, opcode: Op, args: Sequence[Any], timeout: float | None
    ) -> asyncio.Future[Any] | None:
        """Post one request (the channel can post), its late reply watched for as in
        :meth:`_send`."""
        noter = self._noter(opcode, args)
        if noter is not None:
            assert self._late_channel is not None
            return self._late_channel.post_noting_late(opcode, args, timeout, noter)
        assert self._post is not None
        return self._post(opcode, args, timeout)

    async def pipeline(self, op: OpState, *calls: tuple[Any, ...]) -> list[Any]:
        """Send several requests back to back (in order) and wait for all replies.

        Raises the first error after every reply (or error) is in. Over a channel that can
        ``post``, the requests go out at once as futures (no task per request); where one
        cannot go out at once, it and the rest follow one by one once the earlier replies
        are in (still in order).
        """
        record = op.record
        if record is None or record.phases is None:
            return await self._pipeline(op, calls)
        start = time.time_ns()
        try:
            return await self._pipeline(op, calls)
        finally:
            op.phase(calls[0][0].phase, start)

    async def _pipeline(self, op: OpState, calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        futs: list[asyncio.Future[Any]] = []
        if self._post is not None and self.channel.usable:
            remaining = op.remaining()
            for c in calls:
                fut = self._post_request(c[0], c[1:], remaining)
                if fut is None:
                    break
                futs.append(fut)
        if not futs:
            tasks = [asyncio.ensure_future(self._send(c[0], c[1:], op.remaining())) for c in calls]
            results = await asyncio.gather(*tasks, return_exceptions=True)
        else:
            replies = await asyncio.gather(*futs, return_exceptions=True)
            results = [r if isinstance(r, BaseException) else _value(r) for r in replies]
            for c in calls[len(futs) :]:
                try:
                    results.append(await self._send(c[0], c[1:], op.remaining()))
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

        An ``end_session`` whose session has affinity requests with late replies to come
        waits for them first, in the background (see the module).

        Cancellation: a posted request is already sent; its reply is still awaited by the
        client in the background.
        """
        if opcode is Op.END_SESSION and self._end_after_late(args[0]):
            return
        post = self._post
        if post is not None and self.channel.usable:
            fut = post(opcode, args, self.cleanup_grace)
            if fut is not None:
                fut.add_done_callback(functools.partial(cleanup_done, opcode, _request_of(args)))
                if self._track is not None:
                    self._track(fut)
                return
        await self.cleanup_call(opcode, *args)

    async def cleanup_call(self, opcode: Op, *args: Any) -> Any:
        """A cleanup RPC: its own short deadline; errors are logged, not raised.

        Over a channel with ``call_urgent`` (the client's connection) it is sent at once,
        whatever the number of requests in flight or queued on the client: a backlog
        never delays it past its deadline, so it is never dropped unsent (a reply late
        past the deadline is logged; the server still runs the request). An
        ``end_session`` waits for late replies as in :meth:`cleanup_later`, in the
        background (``None`` at once).
        """
        if opcode is Op.END_SESSION and self._end_after_late(args[0]):
            return None
        if not self.channel.usable:
            return None
        try:
            return await self._send(opcode, args, self.cleanup_grace, urgent=True)
        except LMCacheError as exc:
            _cleanup_failed(opcode, _request_of(args), exc)
            return None

    def _end_after_late(self, rid: str) -> bool:
        """When affinity requests of session ``rid`` have late replies still to come,
        send its ``end_session`` once they are in, in the background (see the module),
        and return True; False when the ``end_session`` can go now."""
        waiting = self._late.pop(rid, None)
        late = [f for f in waiting or () if not f.done()]
        if not late:
            return False
        self.late_ends.deferred += 1
        task = asyncio.ensure_future(self._end_session_after(rid, late))
        self._ending.add(task)
        task.add_done_callback(functools.partial(self._end_settled, rid, late))
        if self._track is not None:
            self._track(task)
        return True

    async def _end_session_after(self, rid: str, late: list[asyncio.Future[None]]) -> None:
        """``end_session(rid)`` once every reply of ``late`` has arrived, or after
        ``cleanup_grace`` seconds (logged). Never raises, but for cancellation (at close:
        then it is not sent, see :meth:`_end_settled`)."""
        try:
            _, pending = await asyncio.wait(late, timeout=self.cleanup_grace)
        finally:
            for f in late:
                f.cancel()
        lost = [f for f in late if not f.cancelled() and f.exception() is not None]
        if not self.channel.usable:
            self.late_ends.unsent += 1
            log.warning(
                "end_session of request %s not sent: the connection was closed, or its server "
                "replaced, before the late reply of its request came",
                rid,
                extra={"request_id": rid},
            )
            return
        if pending or lost:
            self.late_ends.unordered += 1
            why = "did not come" if pending else "cannot come (connection lost)"
            log.warning(
                "end_session of request %s sent without waiting for %d late replies, which %s "
                "within %gs: the server may create the session again",
                rid,
                len(pending) + len(lost),
                why,
                self.cleanup_grace,
                extra={"request_id": rid},
            )
        await self.cleanup_call(Op.END_SESSION, rid)

    def _end_settled(self, rid: str, late: list[asyncio.Future[None]], task: asyncio.Future[None]) -> None:
        """A held ``end_session`` is done; one cancelled (``aclose()`` stopped waiting for
        it, perhaps before it began) was not sent: said and counted here."""
        self._ending.discard(task)
        if not task.cancelled():
            return
        for f in late:
            f.cancel()
        self.late_ends.unsent += 1
        log.warning(
            "end_session of request %s not sent: the client closed before the late reply of its request came",
            rid,
            extra={"request_id": rid},
        )

    # ------------------------------------------------------------------ operations

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

    def _gate(self, identity: tuple[Any, ...]) -> _Gate:
        """Serialize operations on one key identity within this client."""
        return _Gate(self._gates, identity)

    async def _copy_chunks(
        self, target: torch.Tensor, chunks: Sequence[torch.Tensor], mark: Mark | None = None
    ) -> None:
        if mark is not None:  # CUDA target: side streams ordered after the caller's
            pairs = [(self._chunk(target, i), c) for i, c in enumerate(chunks)]
            await cuda_hooks.to_device(pairs, mark, self.reg.pool, staged=self.reg.pool is None)
            return
        total = sum(c.numel() for c in chunks) * target.element_size()
        axis, size = self.reg.geometry.token_axis, self.reg.chunk_size
        await copies.maybe_in_thread(total, lambda: copies.copy_chunks_out(target, chunks, size, axis))

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
            rid = request_id("store-check", op)
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
            async with async_timeout(wait):
                status = await fetch(wait)
            return f" (server L1 memory: {l1_memory(status)})"
        except TimeoutError:
            return " (server memory usage unavailable: /status did not answer in time)"
        except Exception as exc:  # the store's error is what the caller must get
            return f" (server memory usage unavailable: {exc})"


def l1_memory(status: Mapping[str, Any]) -> str:
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


def request_id(kind: str, op: OpState | None = None) -> str:
    """A fresh session id (the server keys sessions by it; never reused), noted in
    ``op``'s observed record if it has one."""
    rid = f"lmca-{kind}-{uuid.uuid4().hex}"
    if op is not None and op.record is not None:
        op.record.request_ids.append(rid)
    return rid


def shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one tensor of ``shape`` x ``dtype``."""
    return math.prod(shape) * dtype.itemsize
