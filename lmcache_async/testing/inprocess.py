"""The embedded server without sockets: one request in, its reply (or silence) out.

:class:`InProcessServer` owns the embedded server's cache engine (and its SHM pool) and
runs one request at a time through exactly the path the socket server uses -- the
generation's typed argument decoding (:mod:`lmcache_async.testing.dialect`), the route
table, the engine -- so a test can drive an operation's RPC sequence in milliseconds and
interrupt it anywhere::

    async with InProcessServer(chunk_size=16, mode="shm", generation="0.5.7") as srv:
        reply = await srv.handle("noop", [])                          # "OK"
        reg = await srv.register(geometry)                            # reg.shm_name, reg.pool_size
        try:
            await srv.handle("lookup", [bad_key, 1])
        except NoReply as silence:                                    # the real server says nothing
            print(silence.reason)
        assert srv.leftovers().is_clean()                             # no session, lock, transfer left

**Cancelling every operation at each RPC.** Run an operation against ``handle`` through
the client's call seam, cancel it after its k-th request (for k = 1, 2, ...), let its
cleanup calls run (they go through ``handle`` too), and assert ``srv.leftovers()`` is
clean: nothing it reserved, locked or opened may survive. A request reaches the engine
only when ``handle`` is called, and a request that was handed to ``handle`` runs to
completion even if the awaiting task is cancelled (as on the real server, which finishes
what it received whatever the client does) -- cancellation only discards the reply.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Literal

import torch

from lmcache_async._protocol.wire import (
    GENERATIONS,
    PreEncoded,
    RegisterPayload,
    WireGeneration,
    packb,
    parse_register_response,
    unpackb,
)
from lmcache_async.geometry import KVGeometry, dtype_name
from lmcache_async.testing.dialect import (
    ARGUMENTS,
    BadRequest,
    ServerGeneration,
    check_generation,
    decode_argument,
    decode_envelope,
    decode_pickled_chunks,
    encode_envelope,
    encode_pickled_chunks,
    operation_name,
)
from lmcache_async.testing.engine import CacheEngine
from lmcache_async.testing.vocabulary import (
    SEMANTICS_056,
    SEMANTICS_057,
    InlineChunk,
    InlineDecoder,
    InlineEncoder,
    LayoutSpec,
    Leftovers,
    Mode,
    ServerKey,
)

__all__ = ["InProcessServer", "Lane", "NoReply", "PreparedCall", "Registration"]

log = logging.getLogger(__name__)

#: Where a request runs on the socket server: inline on the receiving task ("sync", the
#: real server's SYNC handlers), or one at a time in arrival order on the "transfer" or
#: "cpu" lane (its affinity and CPU worker pools with their default size of one).
Lane = Literal["sync", "transfer", "cpu"]

#: Lane of each served operation (both generations).
LANES: Final[dict[str, Lane]] = {
    "register_kv_cache_engine_driven_context": "sync",
    "unregister_kv_cache_engine_driven_context": "sync",
    "get_chunk_size": "sync",
    "noop": "sync",
    "get_experimental": "sync",
    "report_block_allocation": "cpu",
    "prepare_store": "transfer",
    "commit_store": "transfer",
    "prepare_retrieve": "transfer",
    "commit_retrieve": "transfer",
    "lookup": "cpu",
    "query_prefetch_status": "cpu",
    "wait_prefetch_status": "cpu",
    "free_lookup_locks": "cpu",
    "end_session": "cpu",
    "clear": "cpu",
    "ping": "cpu",
}


class NoReply(Exception):
    """The real server would answer nothing to this request.

    Raised by :meth:`InProcessServer.handle` for an unknown operation, a wrong number of
    argument frames, an argument that does not decode as the generation's type, and any
    exception of the handler (``reason`` says which; the cause is chained).
    """

    def __init__(self, op: str, reason: str) -> None:
        super().__init__(f"{op}: no reply ({reason})")
        self.op = op
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PreparedCall:
    """A decoded request, ready to run: ``call()`` returns the handler's value.

    ``blocking`` calls copy tensor data and belong in a worker thread.
    """

    op: str
    lane: Lane
    call: Callable[[], Any]
    blocking: bool


_Builder = Callable[["InProcessServer", list[Any]], tuple[Callable[[], Any], bool]]


@dataclass(frozen=True, slots=True)
class Registration:
    """An engine-driven registration made with :meth:`InProcessServer.register`: what a
    client needs to drive operations against the server without sockets.

    Attributes:
        model_name: the registered model.
        geometry: its KV geometry.
        instance_id: the registration's id (what ``unregister`` takes).
        chunk_size: the server's tokens per chunk.
        wire: the client-side wire generation of the server's generation.
        shm_name: the pool segment a client maps (``""`` in pickle mode).
        pool_size: the pool's size in bytes (0 in pickle mode).
    """

    model_name: str
    geometry: KVGeometry
    instance_id: int
    chunk_size: int
    wire: WireGeneration
    shm_name: str
    pool_size: int


class InProcessServer:
    """The embedded server's engine and request path, callable without sockets.

    Args:
        chunk_size: tokens per chunk.
        mode: ``"shm"`` (a POSIX shared-memory pool clients map) or ``"pickle"`` (inline
            transfers: a pickled list of tensors on 0.5.6, the msgpack tensor envelope
            on 0.5.7).
        generation: ``"0.5.6"`` (default) or ``"0.5.7"``: the server generation whose
            wire and behaviour it mirrors.
        size_bytes: the L1 byte budget (and pool size).
        shm_name: segment name in SHM mode (``lmcache_l1_pool_`` prefixed if needed).
        session_ttl: seconds a session lives.
        read_lock_ttl: seconds a lookup's read lock lives.
        write_ttl: seconds an SHM write reservation lives.
        prefault: back the whole pool with memory at once.
        layouts: ``(model_name, world_size, layout)`` to register at start, as if an
            inference engine had.

    The engine (and in SHM mode the segment) exists from construction until
    :meth:`close` (idempotent; also ``with``/``async with``).
    """

    def __init__(
        self,
        *,
        chunk_size: int = 256,
        mode: Mode = "shm",
        generation: ServerGeneration = "0.5.6",
        size_bytes: int = 1 << 30,
        shm_name: str | None = None,
        session_ttl: float = 600.0,
        read_lock_ttl: float = 300.0,
        write_ttl: float = 600.0,
        prefault: bool = False,
        layouts: Sequence[tuple[str, int, LayoutSpec]] = (),
    ) -> None:
        if mode not in ("shm", "pickle"):
            raise ValueError(f"mode must be 'shm' or 'pickle', got {mode!r}")
        self.generation: ServerGeneration = check_generation(generation)
        self.chunk_size = chunk_size
        self.mode: Mode = mode
        self._arguments = ARGUMENTS[self.generation]
        self.engine = CacheEngine(
            chunk_size=chunk_size,
            mode=mode,
            size_bytes=size_bytes,
            shm_name=shm_name if mode == "shm" else None,
            session_ttl=session_ttl,
            read_lock_ttl=read_lock_ttl,
            write_ttl=write_ttl,
            prefault=prefault,
            semantics=SEMANTICS_057 if self.generation == "0.5.7" else SEMANTICS_056,
        )
        for model_name, world_size, layout in layouts:
            self.engine.register_layout(model_name, world_size, layout)

    # ------------------------------------------------------------------ requests

    def prepare(self, op: int | str, frames: Sequence[bytes | bytearray | memoryview]) -> PreparedCall:
        """Decode one request (its op and argument frames) as the real server would.

        Raises:
            NoReply: unknown operation, wrong frame count, or an undecodable argument.
        """
        try:
            name = operation_name(op)
        except BadRequest as exc:
            raise NoReply(repr(op), str(exc)) from None
        declared = self._arguments.get(name)
        if declared is None:
            raise NoReply(name, "no handler registered for this operation")
        if len(frames) != len(declared):
            raise NoReply(name, f"takes {len(declared)} argument frames, got {len(frames)}")
        try:
            values = [decode_argument(f, t) for f, t in zip(frames, declared, strict=True)]
            call, blocking = _BUILDERS[name](self, values)
        except (BadRequest, ValueError, TypeError) as exc:
            raise NoReply(name, f"bad request: {exc}") from exc
        return PreparedCall(name, LANES[name], call, blocking)

    async def handle(self, op: int | str, args: Sequence[Any]) -> Any:
        """Run one request; return the reply's value as a client decodes it.

        Args:
            op: the operation: its server name (``"lookup"``), or its legacy id.
            args: the argument values a client would send (each msgpack-encoded as the
                client does; a ``PreEncoded`` is taken as the frame itself).

        Returns:
            The decoded reply payload; ``None`` for a frameless reply.

        Raises:
            NoReply: the real server would send nothing (see :class:`NoReply`).

        Blocking handlers (tensor copies) run in a worker thread. Cancelling the awaiting
        task discards the reply but not the request: once handed over it runs to the end.
        """
        frames = [a.frame if isinstance(a, PreEncoded) else packb(a) for a in args]
        prepared = self.prepare(op, frames)
        if prepared.blocking:
            work = asyncio.get_running_loop().run_in_executor(None, self.run, prepared)
            work.add_done_callback(_consume_outcome)  # its NoReply is not lost if we are cancelled
            result = await asyncio.shield(work)
        else:
            result = self.run(prepared)
        return self.reply_value(result)

    async def register(
        self, geometry: KVGeometry, *, model_name: str = "m", instance_id: int = 1234, world_size: int = 1
    ) -> Registration:
        """Register an engine-driven context for ``geometry`` as a client does (one
        ``register_kv_cache_engine_driven_context`` request, one physical slot per token
        of a chunk); what the server answered.

        Raises:
            NoReply: the real server would answer nothing (an invalid registration).
            lmcache_async.errors.ProtocolError: the reply is malformed.
        """
        payload = RegisterPayload(
            instance_id=instance_id,
            model_name=model_name,
            world_size=world_size,
            block_size=geometry.block_size,
            num_layers=geometry.num_layers,
            hidden_dim_size=geometry.hidden_dim,
            dtype_str=dtype_name(geometry.dtype),
            use_mla=False,
            num_physical_slots=self.chunk_size,
        )
        reply = await self.handle("register_kv_cache_engine_driven_context", [payload.to_wire()])
        shm_name, pool_size = parse_register_response(reply)
        return Registration(
            model_name=model_name,
            geometry=geometry,
            instance_id=instance_id,
            chunk_size=self.chunk_size,
            wire=GENERATIONS[self.generation],
            shm_name=shm_name,
            pool_size=pool_size,
        )

    def run(self, prepared: PreparedCall) -> Any:
        """Run a prepared call (in this thread); the handler's value (None: frameless reply).

        Raises:
            NoReply: the handler raised (the real server logs it and answers nothing).
        """
        try:
            return prepared.call()
        except Exception as exc:
            raise NoReply(prepared.op, f"handler error: {exc!r}") from exc

    @staticmethod
    def reply_frame(result: Any) -> bytes | bytearray | memoryview | None:
        """The payload frame of a handler's value (None: a frameless reply)."""
        if result is None:
            return None
        return result.frame if isinstance(result, PreEncoded) else packb(result)

    @classmethod
    def reply_value(cls, result: Any) -> Any:
        """A handler's value as the client decodes the reply frame."""
        frame = cls.reply_frame(result)
        return None if frame is None else unpackb(frame)

    # ------------------------------------------------------------------ inspection

    def leftovers(self) -> Leftovers:
        """Sessions, prefetch jobs, read locks, pending SHM transfers and write
        reservations the engine still holds (see :meth:`Leftovers.is_clean`)."""
        return self.engine.leftovers()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Drop the cache and unlink/unmap the pool. Idempotent."""
        self.engine.close()

    def __enter__(self) -> InProcessServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> InProcessServer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ inline codecs

    def _inline_decoder(self, data: bytes) -> InlineDecoder:
        if self.generation == "0.5.7":

            def decode_057(layout: LayoutSpec, count: int) -> Sequence[InlineChunk]:
                return decode_envelope(data, shape=layout.shape, dtype=layout.dtype, count=count)

            return decode_057

        def decode_056(layout: LayoutSpec, count: int) -> Sequence[InlineChunk]:
            return decode_pickled_chunks(data)

        return decode_056

    def _inline_encoder(self) -> InlineEncoder:
        if self.generation == "0.5.7":

            def encode_057(views: Sequence[torch.Tensor], raw: Sequence[memoryview]) -> bytes | bytearray:
                named = [str(v.dtype).removeprefix("torch.") for v in views]
                return encode_envelope(
                    [(n, tuple(v.shape), r) for n, v, r in zip(named, views, raw, strict=True)]
                )

            return encode_057

        def encode_056(views: Sequence[torch.Tensor], raw: Sequence[memoryview]) -> bytes | bytearray:
            try:
                return encode_pickled_chunks(views)
            except ValueError:  # a dtype without a legacy storage class (e.g. float8)
                return pickle.dumps([v.clone() for v in views])

        return encode_056

    def _inline_retrieve(self, key: ServerKey, instance_id: int) -> PreEncoded:
        # Packs in the worker thread too: the reply can be large.
        return PreEncoded(packb(self.engine.prepare_retrieve(key, instance_id, self._inline_encoder())))


def _consume_outcome(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


# --------------------------------------------------------------------------- routes
# Each builder gets the decoded argument values (the generation's types, see
# dialect.ARGUMENTS) and returns the call and whether it blocks.


def _key(value: Any) -> ServerKey:
    return ServerKey.from_wire(value)


def _b_register(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return functools.partial(s.engine.register, a[0]), False


def _b_unregister(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return functools.partial(s.engine.unregister, a[0]), False


def _b_prepare_store(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    skipped = a[2] if len(a) > 2 else ()
    return functools.partial(s.engine.prepare_store, _key(a[0]), a[1], skipped), False


def _b_commit_store(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    key, iid, data = _key(a[0]), a[1], a[2]
    if data == b"":
        return functools.partial(s.engine.commit_store_shm, key, iid), False
    return functools.partial(s.engine.commit_store_inline, key, iid, s._inline_decoder(data)), True


def _b_prepare_retrieve(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    key, iid = _key(a[0]), a[1]
    if s.mode == "shm":
        return functools.partial(s.engine.prepare_retrieve, key, iid), False
    return functools.partial(s._inline_retrieve, key, iid), True


def _b_commit_retrieve(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return functools.partial(s.engine.commit_retrieve, _key(a[0]), a[1]), False


def _b_lookup(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return functools.partial(s.engine.lookup, _key(a[0])), False  # a[1]: tp_size, arity only


def _b_query(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return functools.partial(s.engine.query_prefetch_status, a[0]), False


def _b_wait(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    # Prefetches finish inside lookup: there is never anything to wait for.
    return functools.partial(s.engine.query_prefetch_status, a[0]), False


def _b_free(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    extra = a[2] if len(a) > 2 else ()
    return functools.partial(s.engine.free_lookup_locks, _key(a[0]), extra), False


def _b_end_session(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return functools.partial(s.engine.end_session, a[0]), False


def _b_clear(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return functools.partial(s.engine.clear, a[0]), False


def _b_ping(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return functools.partial(s.engine.ping, a[0]), False


def _b_chunk_size(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return (lambda: s.chunk_size), False


def _b_noop(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return (lambda: "OK"), False


def _b_experimental(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return (lambda: []), False


def _b_report_blocks(s: InProcessServer, a: list[Any]) -> tuple[Callable[[], Any], bool]:
    return (lambda: None), False  # observability only: the real server publishes it on its event bus


_BUILDERS: Final[dict[str, _Builder]] = {
    "register_kv_cache_engine_driven_context": _b_register,
    "unregister_kv_cache_engine_driven_context": _b_unregister,
    "prepare_store": _b_prepare_store,
    "commit_store": _b_commit_store,
    "prepare_retrieve": _b_prepare_retrieve,
    "commit_retrieve": _b_commit_retrieve,
    "lookup": _b_lookup,
    "query_prefetch_status": _b_query,
    "wait_prefetch_status": _b_wait,
    "free_lookup_locks": _b_free,
    "end_session": _b_end_session,
    "clear": _b_clear,
    "ping": _b_ping,
    "get_chunk_size": _b_chunk_size,
    "noop": _b_noop,
    "get_experimental": _b_experimental,
    "report_block_allocation": _b_report_blocks,
}
assert set(_BUILDERS) == set(LANES) == set(ARGUMENTS["0.5.6"]) == set(ARGUMENTS["0.5.7"])
