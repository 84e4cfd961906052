"""The asyncio client: store, retrieve, lookup and remap KV caches on an LMCache MP server.

Every public operation runs its protocol exchange in a task of its own and the caller
awaits that task under the call's deadline (:ref:`docs/design.md`). When the caller
times out or is cancelled, the task is told it was abandoned and finishes the server
side of the exchange on its own, bounded by ``cleanup_grace`` seconds: it consumes the
prefetch result, releases the read locks it took, commits the SHM reads or writes it
holds and ends its session. A store whose slots were reserved is completed (all its
chunks are committed, never some); a retrieve no longer copies into the caller's tensor.
So a timeout or a cancellation never leaves sessions, locks or reservations behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

import torch

from lmcache_async.connection import Connection
from lmcache_async.errors import (
    ClientClosedError,
    LMCacheError,
    LMCacheTimeoutError,
    ProtocolError,
    ServerError,
    TransferError,
)
from lmcache_async.geometry import KVGeometry, dtype_name
from lmcache_async.metadata import Metadata
from lmcache_async.pickle_codec import decode_tensor_list, encode_tensor_list
from lmcache_async.shm import ShmPool
from lmcache_async.wire import (
    CacheKey,
    Op,
    PreEncoded,
    RegisterPayload,
    parse_prepare_retrieve,
    parse_prepare_store,
    parse_register_response,
    validate_cache_salt,
    validate_model_name,
    validate_tokens,
)

if TYPE_CHECKING:  # bulk imports this module; its types are needed for annotations only
    from lmcache_async.bulk import BatchProgress, BatchResult, RemapPair, RetrieveItem, StoreItem

__all__ = ["AsyncClient", "RemapResult", "connect"]

log = logging.getLogger(__name__)

T = TypeVar("T")
TransferMode = Literal["auto", "shm", "pickle"]

_DEFAULT: Final[Any] = object()
#: Copies larger than this run in a worker thread so the event loop keeps serving others.
_THREAD_COPY_BYTES: Final = 8 << 20
#: Longest single wait_prefetch_status: it blocks one of the server's CPU workers.
_PREFETCH_WAIT_SLICE: Final = 0.05


class _State(enum.Enum):
    NEW = "new"
    OPENING = "opening"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class RemapResult:
    """What :meth:`AsyncClient.remap` did.

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


class _Abandoned(Exception):
    """An operation whose caller left before it sent anything (never seen by callers)."""


class _RetrieveState:
    __slots__ = ("prepared",)

    def __init__(self) -> None:
        self.prepared = False


class _Op:
    """Shared state between a caller and the task running its operation."""

    __slots__ = ("abandoned", "deadline")

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.abandoned = False

    def remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(self.deadline - time.monotonic(), 0.0)


async def connect(
    url: str = "tcp://localhost:5555",
    http_url: str = "http://localhost:8080",
    model_name: str = "",
    *,
    geometry: KVGeometry | None = None,
    timeout: float | None = 60.0,
    transfer: TransferMode = "auto",
    num_kv_readers: int = 1,
    ping_interval: float = 20.0,
    cleanup_grace: float = 10.0,
    metadata_ttl: float = 5.0,
    prefault_shm: bool = True,
) -> AsyncClient:
    """Create an :class:`AsyncClient` and open it (see there for the arguments).

    Raises:
        LMCacheConnectionError: the HTTP or ZMQ endpoint is unreachable.
        ModelNotRegisteredError: no geometry given and ``/status`` lacks the model.
        LMCacheTimeoutError: the server did not answer within ``timeout``.

    Cancellation: everything opened so far is closed again.
    """
    client = AsyncClient(
        url,
        http_url,
        model_name,
        geometry=geometry,
        timeout=timeout,
        transfer=transfer,
        num_kv_readers=num_kv_readers,
        ping_interval=ping_interval,
        cleanup_grace=cleanup_grace,
        metadata_ttl=metadata_ttl,
        prefault_shm=prefault_shm,
    )
    await client.open()
    return client


class AsyncClient:
    """An asyncio client of one LMCache MP server for one model.

    One ZMQ DEALER socket carries all operations, any number concurrently; one aiohttp
    session reads ``/config`` and ``/status``. Use ``async with AsyncClient(...)`` or
    :func:`connect`; call :meth:`aclose` when done.

    Args:
        url: ZMQ endpoint of the server, e.g. ``tcp://localhost:5555``.
        http_url: HTTP endpoint of the server, e.g. ``http://localhost:8080``.
        model_name: the model whose KV is stored (no ``@``).
        geometry: the KV layout; when omitted it is derived from ``/status``, which
            requires an inference engine (vLLM) to have registered the model.
        timeout: default deadline in seconds of every operation (``None``: no deadline).
        transfer: ``"auto"`` (SHM when the server offers it and the segment maps),
            ``"shm"`` or ``"pickle"`` to insist.
        num_kv_readers: read locks a lookup reserves per object (>= 1).
        ping_interval: seconds between keep-alive pings of the registration (<= 30).
        cleanup_grace: extra seconds an abandoned operation may spend cleaning up.
        metadata_ttl: seconds ``/config`` and ``/status`` stay cached.
        prefault_shm: map the whole SHM pool into this process in a background thread
            after connecting, so that no transfer pays first-touch page faults (see
            :meth:`lmcache_async.shm.ShmPool.start_prefault`).
    """

    def __init__(
        self,
        url: str = "tcp://localhost:5555",
        http_url: str = "http://localhost:8080",
        model_name: str = "",
        *,
        geometry: KVGeometry | None = None,
        timeout: float | None = 60.0,
        transfer: TransferMode = "auto",
        num_kv_readers: int = 1,
        ping_interval: float = 20.0,
        cleanup_grace: float = 10.0,
        metadata_ttl: float = 5.0,
        prefault_shm: bool = True,
    ) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise ValueError(f"url must look like tcp://host:port, got {url!r}")
        if not isinstance(http_url, str) or not http_url.startswith(("http://", "https://")):
            raise ValueError(f"http_url must start with http:// or https://, got {http_url!r}")
        validate_model_name(model_name)
        if geometry is not None and not isinstance(geometry, KVGeometry):
            raise TypeError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        _check_timeout(timeout, "timeout")
        if transfer not in ("auto", "shm", "pickle"):
            raise ValueError(f"transfer must be 'auto', 'shm' or 'pickle', got {transfer!r}")
        if isinstance(num_kv_readers, bool) or not isinstance(num_kv_readers, int) or num_kv_readers < 1:
            raise ValueError(f"num_kv_readers must be an int >= 1, got {num_kv_readers!r}")
        if not 0 < ping_interval <= 30:
            raise ValueError(f"ping_interval must be in (0, 30] seconds, got {ping_interval!r}")
        self.url = url
        self.http_url = http_url
        self.model_name = model_name
        self.timeout = timeout
        self.cleanup_grace = float(cleanup_grace)
        self.num_kv_readers = num_kv_readers
        self._want_transfer: TransferMode = transfer
        self._prefault_shm = bool(prefault_shm)
        self._explicit_geometry = geometry
        self._geometry: KVGeometry | None = geometry
        self._ping_interval = ping_interval
        self._meta = Metadata(http_url, ttl=metadata_ttl)
        self._conn = Connection(url)
        self._state = _State.NEW
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._chunk_size = 0
        self._fifo_cpu = False
        self._instance_id = secrets.randbits(63)
        self._server_instance: object = None
        self._pool: ShmPool | None = None
        self._transfer: Literal["shm", "pickle"] | None = None
        self._server_has_shm = False
        self._reg_generation = -1
        self._stale = False
        self._reg_lock: asyncio.Lock | None = None
        self._ops: set[asyncio.Task[Any]] = set()
        self._gates: dict[tuple[Any, ...], list[Any]] = {}
        self._keepalive: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ properties

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk (the server's ``--chunk-size``)."""
        self._require_open()
        return self._chunk_size

    @property
    def geometry(self) -> KVGeometry:
        """The KV layout in use (explicit, or derived from ``/status``)."""
        self._require_open()
        assert self._geometry is not None
        return self._geometry

    @property
    def transfer(self) -> Literal["shm", "pickle"]:
        """``"shm"`` or ``"pickle"``: how tensors travel."""
        self._require_open()
        assert self._transfer is not None
        return self._transfer

    @property
    def instance_id(self) -> int:
        """The engine-driven registration id of this client (random, 63 bits)."""
        return self._instance_id

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    def __repr__(self) -> str:
        return (
            f"<AsyncClient {self.model_name!r} at {self.url} state={self._state.value} "
            f"transfer={self._transfer} in_flight={len(self._ops)}>"
        )

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> AsyncClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Fetch ``/config`` (and ``/status``), connect, register, map SHM.

        Raises:
            LMCacheConnectionError, LMCacheTimeoutError, ModelNotRegisteredError,
            ServerError (server not serving engine-driven transfers), TransferError
            (``transfer="shm"`` but SHM unusable).

        Cancellation or failure closes whatever was opened.
        """
        if self._state is not _State.NEW:
            raise LMCacheError(f"open() on a client that is {self._state.value}")
        self._state = _State.OPENING
        self._loop = asyncio.get_running_loop()
        self._reg_lock = asyncio.Lock()
        try:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            await self._load_config(_remaining(deadline))
            if self._geometry is None:
                status = await self._meta.status(max_age=0, timeout=_remaining(deadline))
                self._geometry = KVGeometry.from_status(status, self.model_name)
            if self._chunk_size % self._geometry.block_size:
                raise ServerError(
                    f"chunk size {self._chunk_size} is not a multiple of the block size "
                    f"{self._geometry.block_size}"
                )
            await self._conn.open()
            reply = await self._conn.call(Op.NOOP, (), timeout=_remaining(deadline))
            if reply.value() != "OK":
                raise ProtocolError(f"noop answered {reply.value()!r}")
            await self._register(_remaining(deadline))
            self._keepalive = asyncio.create_task(self._keepalive_loop(), name="lmcache-keepalive")
            self._state = _State.OPEN
        except BaseException:
            self._state = _State.CLOSING
            await self._shutdown(unregister=False)
            raise

    async def aclose(self) -> None:
        """Close the client: refuse new calls, let abandoned operations finish their
        cleanup (bounded by ``cleanup_grace``), unregister, close socket and session.

        Idempotent. Cancellation midway still closes the socket and session.
        """
        if self._state in (_State.CLOSED, _State.CLOSING):
            return
        opened = self._state is _State.OPEN
        self._state = _State.CLOSING
        if self._ops:
            _done, pending = await asyncio.wait(set(self._ops), timeout=self.cleanup_grace)
            for task in pending:
                task.cancel()
        await self._shutdown(unregister=opened)

    async def _shutdown(self, *, unregister: bool) -> None:
        try:
            if self._keepalive is not None:
                self._keepalive.cancel()
                with contextlib.suppress(BaseException):
                    await self._keepalive
            if unregister and self._conn.connected and os.getpid() == self._pid:
                with contextlib.suppress(LMCacheError):
                    await self._conn.call(Op.UNREGISTER_ENGINE_DRIVEN, (self._instance_id,), timeout=5.0)
        finally:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
            await self._conn.close()
            await self._meta.close()
            self._state = _State.CLOSED

    async def _load_config(self, timeout: float | None) -> None:
        config = await self._meta.config(max_age=0, timeout=timeout)
        mp = Metadata.mp_section(config)
        chunk_size = mp.get("chunk_size")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ProtocolError(f"/config mp.chunk_size is {chunk_size!r}")
        mode = mp.get("supported_transfer_mode", "engine_driven")
        if mode not in ("engine_driven", "auto"):
            raise ServerError(
                f"the server runs --supported-transfer-mode {mode}; engine-driven requests would "
                "go unanswered (start it with --supported-transfer-mode auto or engine_driven)"
            )
        self._chunk_size = chunk_size
        self._server_instance = mp.get("instance_id")
        self._fifo_cpu = mp.get("max_cpu_workers") == 1

    async def _register(self, timeout: float | None) -> None:
        geom = self._geometry
        assert geom is not None
        payload = RegisterPayload(
            instance_id=self._instance_id,
            model_name=self.model_name,
            world_size=geom.world_size,
            block_size=geom.block_size,
            num_layers=geom.num_layers,
            hidden_dim_size=geom.hidden_dim,
            dtype_str=dtype_name(geom.dtype),
            use_mla=geom.use_mla,
            num_physical_slots=self._chunk_size,
        )
        generation = self._conn.generation
        reply = await self._conn.call(Op.REGISTER_ENGINE_DRIVEN, (payload.to_wire(),), timeout=timeout)
        shm_name, pool_size = parse_register_response(reply.value())
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._server_has_shm = bool(shm_name) and pool_size > 0
        if self._server_has_shm and self._want_transfer != "pickle":
            try:
                self._pool = ShmPool(shm_name, pool_size)
                if self._prefault_shm:
                    self._pool.start_prefault()
            except TransferError:
                if self._want_transfer == "shm":
                    raise
                log.warning("cannot map the server's SHM pool %s; storing over pickle", shm_name)
        elif self._want_transfer == "shm":
            raise TransferError("transfer='shm' but the server has no SHM pool (--shm-name)")
        self._transfer = "shm" if self._pool is not None else "pickle"
        self._reg_generation = generation
        self._stale = False

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(self._ping_interval)
            try:
                await self._conn.call(Op.PING, (self._instance_id,), timeout=min(10.0, self._ping_interval))
                config = await self._meta.config(max_age=0, timeout=10.0)
                if Metadata.mp_section(config).get("instance_id") != self._server_instance:
                    log.info("server restarted (instance id changed); re-registering")
                    self._stale = True
                    await self._ensure_registered(30.0)
            except LMCacheError as exc:
                log.debug("keep-alive failed: %s", exc)

    async def _ensure_registered(self, timeout: float | None) -> None:
        """Re-register (and re-map SHM) after a reconnect or a server restart."""
        if self._reg_generation == self._conn.generation and not self._stale:
            return
        assert self._reg_lock is not None
        async with self._reg_lock:
            if self._reg_generation == self._conn.generation and not self._stale:
                return
            log.info("re-registering %s with %s", self.model_name, self.url)
            await self._load_config(timeout)
            await self._register(timeout)

    def _require_open(self) -> None:
        if self._state is not _State.OPEN:
            if self._state in (_State.CLOSING, _State.CLOSED):
                raise ClientClosedError("the client is closed")
            raise LMCacheError(f"the client is {self._state.value}; use 'async with' or connect()")
        if os.getpid() != self._pid:
            raise LMCacheError("this client was created in another process (before fork); create a new one")

    # ------------------------------------------------------------------ op runner

    async def _run(self, name: str, timeout: float | None, body: Callable[[_Op], Awaitable[T]]) -> T:
        self._require_open()
        if asyncio.get_running_loop() is not self._loop:
            raise LMCacheError("the client is used from an event loop other than the one that opened it")
        start = time.monotonic()
        op = _Op(None if timeout is None else start + timeout + self.cleanup_grace)

        async def run() -> T:
            await self._ensure_registered(op.remaining())
            if op.abandoned:  # the caller left before anything was sent
                raise _Abandoned
            try:
                return await body(op)
            except LMCacheTimeoutError:
                # Unanswered prepare/commit requests are what a reaped registration looks
                # like; re-registering an existing id is cheap, so do it before the next op.
                self._stale = True
                raise

        task = asyncio.ensure_future(run())
        self._ops.add(task)
        task.add_done_callback(self._op_done)
        try:
            async with asyncio.timeout(timeout) as cm:
                return await asyncio.shield(task)
        except TimeoutError:
            if not cm.expired():
                raise
            op.abandoned = True
            raise LMCacheTimeoutError(name, time.monotonic() - start) from None
        except asyncio.CancelledError:
            op.abandoned = True
            raise

    def _op_done(self, task: asyncio.Task[Any]) -> None:
        self._ops.discard(task)
        if not task.cancelled():
            exc = task.exception()  # mark retrieved: the caller may have left
            if exc is not None:
                log.debug("operation task ended with %r", exc)

    async def _call(self, op: _Op, opcode: Op, *args: Any) -> Any:
        reply = await self._conn.call(opcode, args, timeout=op.remaining())
        return reply.value()

    async def _cleanup_call(self, opcode: Op, *args: Any) -> Any:
        """A cleanup RPC: its own short deadline; errors are logged, not raised."""
        if not self._conn.connected or self._conn.closed:
            return None
        try:
            reply = await self._conn.call(opcode, args, timeout=self.cleanup_grace)
            return reply.value()
        except LMCacheError as exc:
            log.warning("cleanup %s failed: %s", opcode.name.lower(), exc)
            return None

    # ------------------------------------------------------------------ helpers

    def _key(
        self,
        tokens: list[int],
        end: int,
        request_id: str,
        cache_salt: str,
        *,
        start: int = 0,
        worker: bool,
    ) -> dict[str, Any]:
        geom = self._geometry
        assert geom is not None
        return CacheKey(
            model_name=self.model_name,
            world_size=geom.world_size,
            worker_id=0 if worker else None,
            token_ids=tokens[:end],
            start=start,
            end=end,
            request_id=request_id,
            cache_salt=cache_salt,
            num_kv_readers=self.num_kv_readers,
        ).to_wire()

    def _aligned(self, n: int) -> int:
        return n // self._chunk_size * self._chunk_size

    def _check_kv(self, kv: object, num_tokens: int) -> torch.Tensor:
        geom = self._geometry
        assert geom is not None
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        want = geom.kv_shape(num_tokens)
        if kv.dim() != len(want):
            raise ValueError(
                f"kv must have {len(want)} dimensions {list(geom.kv_shape(-1))!s} "
                f"(T = tokens), got shape {list(kv.shape)}"
            )
        if tuple(kv.shape) != want:
            raise ValueError(f"kv has shape {list(kv.shape)}, expected {list(want)} for {num_tokens} tokens")
        if kv.dtype != geom.dtype:
            raise TypeError(f"kv has dtype {kv.dtype}, the geometry says {geom.dtype}")
        return kv

    def _chunk(self, kv: torch.Tensor, index: int) -> torch.Tensor:
        geom = self._geometry
        assert geom is not None
        return kv.narrow(geom.token_axis, index * self._chunk_size, self._chunk_size)

    async def _prefetch_result(self, op: _Op, request_id: str, first: Any = None) -> int:
        """Consume the prefetch status of ``request_id``: hit length in chunks.

        Asks at once (the usual case: the prefetch finished before the question arrives;
        ``first`` is the answer to a question already asked), then waits server-side in
        short slices, so no client-side polling delay is added and the server's shared
        CPU worker is never held for long.
        """
        value = first if first is not None else await self._call(op, Op.QUERY_PREFETCH_STATUS, request_id)
        while value is None:
            remaining = op.remaining()
            slice_ = _PREFETCH_WAIT_SLICE if remaining is None else min(_PREFETCH_WAIT_SLICE, remaining)
            value = await self._call(op, Op.WAIT_PREFETCH_STATUS, request_id, float(slice_))
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ProtocolError(f"prefetch status {value!r} is not a chunk count")
        return value

    # ------------------------------------------------------------------ operations

    async def lookup(
        self, tokens: Sequence[int], cache_salt: str = "", *, timeout: float | None = _DEFAULT
    ) -> int:
        """Length in tokens of the longest cached chunk-aligned prefix of ``tokens``.

        Releases the read locks the lookup took and ends its session before returning.

        Raises:
            ValueError/TypeError: bad arguments (nothing is sent).
            LMCacheTimeoutError: no answer within ``timeout``.

        Cancellation/timeout: the prefetch result is consumed, locks released and the
        session ended in the background.
        """
        toks = validate_tokens(tokens)
        validate_cache_salt(cache_salt)
        timeout = self._timeout(timeout)
        end = self._aligned(len(toks))

        async def body(op: _Op) -> int:
            if end == 0:
                return 0
            rid = _request_id("lookup")
            key = self._key(toks, end, rid, cache_salt, worker=False)
            return await self._lookup_locked(op, key, rid, release=True)

        return await self._run("lookup", timeout, body)

    async def _lookup_locked(self, op: _Op, key: dict[str, Any], rid: str, *, release: bool) -> int:
        """lookup + consume status; when ``release``, free the locks and end the session.

        Returns tokens hit. Whatever happens, the status is consumed and (when
        ``release``) locks and session are released.
        """
        geom = self._geometry
        assert geom is not None
        chunks: int | None = None
        ok = False
        try:
            if self._fifo_cpu:
                # One CPU worker on the server runs lookup-pool requests in arrival
                # order, so the status question can follow the lookup without its ack.
                _, first = await self._pipeline(
                    op, (Op.LOOKUP, key, geom.world_size), (Op.QUERY_PREFETCH_STATUS, rid)
                )
                chunks = await self._prefetch_result(op, rid, first)
            else:
                await self._call(op, Op.LOOKUP, key, geom.world_size)  # the ack first (pitfall 6)
                chunks = await self._prefetch_result(op, rid)
            ok = True
            return chunks * self._chunk_size
        finally:
            if chunks is None:
                chunks = await self._drain_prefetch(rid)
            if release and self._fifo_cpu:
                await self._release_pipelined(key, rid, chunks)
            else:
                if release or not ok:
                    await self._free_locks(key, chunks)
                if release:
                    await self._cleanup_call(Op.END_SESSION, rid)

    async def _pipeline(self, op: _Op, *calls: tuple[Any, ...]) -> list[Any]:
        """Send several requests back to back (in order) and wait for all replies.

        Raises the first error after every reply (or error) is in.
        """
        tasks = [asyncio.ensure_future(self._call(op, *c)) for c in calls]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def _release_pipelined(self, key: dict[str, Any], rid: str, chunks: int) -> None:
        """free_lookup_locks + end_session in one round trip (FIFO CPU worker only)."""
        calls: list[tuple[Any, ...]] = []
        if chunks:
            end = chunks * self._chunk_size
            calls.append(
                (
                    Op.FREE_LOOKUP_LOCKS,
                    dict(key, end=end, token_ids=key["token_ids"][:end]),
                    key["world_size"],
                )
            )
        calls.append((Op.END_SESSION, rid))
        await asyncio.gather(*(self._cleanup_call(*c) for c in calls))

    async def _drain_prefetch(self, rid: str) -> int:
        deadline = time.monotonic() + self.cleanup_grace
        while time.monotonic() < deadline:
            value = await self._cleanup_call(Op.WAIT_PREFETCH_STATUS, rid, _PREFETCH_WAIT_SLICE)
            if value is not None:
                return value if isinstance(value, int) else 0
            if not self._conn.connected:
                return 0
        return 0

    async def _free_locks(self, key: dict[str, Any], chunks: int) -> None:
        """Release the read locks a lookup took on its first ``chunks`` chunks."""
        if chunks:
            end = chunks * self._chunk_size
            free_key = dict(key, end=end, token_ids=key["token_ids"][:end])
            await self._cleanup_call(Op.FREE_LOOKUP_LOCKS, free_key, key["world_size"])

    async def retrieve(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        out: torch.Tensor | None = None,
        *,
        timeout: float | None = _DEFAULT,
    ) -> torch.Tensor | None:
        """The KV of the longest cached chunk-aligned prefix of ``tokens``, or ``None``.

        Args:
            tokens: token ids; only whole chunks are looked up.
            cache_salt: the namespace the KV was stored under.
            out: optional preallocated tensor (CPU, pinned or CUDA) of shape
                ``[2, L, T, D]`` (``[L, T, D]`` for MLA) with ``T >=`` the chunk-aligned
                token count; it is filled without any other allocation of that size and
                a view of its first ``T_hit`` tokens is returned.
            timeout: deadline in seconds (default: the client's).

        Returns:
            ``[2, L, T_hit, D]`` (CPU unless ``out`` says otherwise), or ``None`` on a miss.

        Raises:
            ValueError/TypeError: bad arguments (nothing is sent).
            LMCacheTimeoutError: no answer within ``timeout``.
            TransferError: the server keeps KV in SHM this client cannot map.

        Cancellation/timeout: nothing more is copied into ``out`` once the caller has
        left (a copy already running finishes); read locks, SHM reads and the session
        are released in the background.
        """
        toks = validate_tokens(tokens)
        validate_cache_salt(cache_salt)
        timeout = self._timeout(timeout)
        geom = self.geometry
        end = self._aligned(len(toks))
        if out is not None:
            self._check_out(out, end)

        async def body(op: _Op) -> torch.Tensor | None:
            if end == 0:
                return None
            rid = _request_id("retrieve")
            key = self._key(toks, end, rid, cache_salt, worker=False)
            hit = 0
            state = _RetrieveState()
            try:
                hit = await self._lookup_locked(op, key, rid, release=False)
                if hit == 0:
                    return None
                rkey = self._key(toks, hit, rid, cache_salt, worker=True)
                target = out.narrow(geom.token_axis, 0, hit) if out is not None else None
                if self._pool is None:
                    return await self._retrieve_pickle(op, rkey, hit, target, state)
                # The server keys pending SHM reads by (instance, key) without the request
                # id: concurrent retrieves of one prefix must not overlap their pairs.
                async with self._gate(("retrieve", cache_salt, tuple(toks[:hit]))):
                    return await self._retrieve_shm(op, rkey, hit, target, state)
            finally:
                if hit and not state.prepared:
                    await self._free_locks(key, hit // self._chunk_size)
                await self._cleanup_call(Op.END_SESSION, rid)

        return await self._run("retrieve", timeout, body)

    async def _retrieve_shm(
        self, op: _Op, rkey: dict[str, Any], hit: int, target: torch.Tensor | None, state: _RetrieveState
    ) -> torch.Tensor | None:
        geom = self._geometry
        assert geom is not None and self._pool is not None
        committed = False
        try:
            state.prepared = True
            resp = await self._call(op, Op.PREPARE_RETRIEVE, rkey, self._instance_id)
            success, _data, slots = parse_prepare_retrieve(resp)
            if not success:
                committed = True  # nothing is pending on the server
                return None  # evicted between lookup and prepare: a miss
            n_chunks = hit // self._chunk_size
            if len(slots) != n_chunks:
                raise ProtocolError(f"prepare_retrieve gave {len(slots)} slots for {n_chunks} chunks")
            shape = geom.kv_shape(self._chunk_size)
            views = [self._pool.view(s, shape, geom.dtype) for s in slots]
            if op.abandoned:
                return None
            if target is None:
                target = torch.empty(geom.kv_shape(hit), dtype=geom.dtype)
            await self._copy_chunks(target, views)
            committed = True
            await self._call(op, Op.COMMIT_RETRIEVE, rkey, self._instance_id)
            return target
        finally:
            if not committed:
                await self._cleanup_call(Op.COMMIT_RETRIEVE, rkey, self._instance_id)

    async def _retrieve_pickle(
        self, op: _Op, rkey: dict[str, Any], hit: int, target: torch.Tensor | None, state: _RetrieveState
    ) -> torch.Tensor | None:
        geom = self._geometry
        assert geom is not None
        if self._server_has_shm:
            raise TransferError("the server keeps its KV in SHM, which this client cannot map")
        state.prepared = True  # the server releases the locks when it answers
        resp = await self._call(op, Op.PREPARE_RETRIEVE, rkey, self._instance_id)
        success, data, _slots = parse_prepare_retrieve(resp)
        if not success:
            return None
        n_chunks = hit // self._chunk_size
        shape = geom.kv_shape(self._chunk_size)
        tensors = decode_tensor_list(data, count=n_chunks, shape=shape, dtype=geom.dtype)
        if op.abandoned:
            return None
        if target is None:
            target = torch.empty(geom.kv_shape(hit), dtype=geom.dtype)
        await self._copy_chunks(target, tensors)
        return target

    @contextlib.asynccontextmanager
    async def _gate(self, identity: tuple[Any, ...]) -> AsyncIterator[None]:
        """Serialize operations on one key identity within this client."""
        entry = self._gates.get(identity)
        if entry is None:
            entry = self._gates[identity] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._gates[identity]

    def _check_out(self, out: object, end: int) -> None:
        geom = self._geometry
        assert geom is not None
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        want = list(geom.kv_shape(end))
        got = list(out.shape)
        ax = geom.token_axis
        if len(got) != len(want) or got[:ax] + got[ax + 1 :] != want[:ax] + want[ax + 1 :] or got[ax] < end:
            raise ValueError(f"out has shape {got}, expected {want} (token axis may be longer)")
        if out.dtype != geom.dtype:
            raise TypeError(f"out has dtype {out.dtype}, the geometry says {geom.dtype}")

    async def _copy_chunks(self, target: torch.Tensor, chunks: Sequence[torch.Tensor]) -> None:
        total = sum(c.numel() for c in chunks) * target.element_size()

        def copy_all() -> None:
            for i, chunk in enumerate(chunks):
                self._chunk(target, i).copy_(chunk)

        if total >= _THREAD_COPY_BYTES:
            await asyncio.to_thread(copy_all)
        else:
            copy_all()

    async def store(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        timeout: float | None = _DEFAULT,
    ) -> bool:
        """Store ``kv`` (``[2, L, T, D]``, or ``[L, T, D]`` for MLA) under ``tokens``.

        ``tokens`` may be longer than the KV's ``T`` tokens: the KV is then stored under
        ``tokens[:T]`` (so ``store(retrieve(source), target)`` works for prompts of any
        length, although a retrieve returns whole chunks only); fewer tokens than ``T``
        raise ``ValueError``. Tokens beyond the last whole chunk are ignored (as in the
        official SDK). Chunks already cached are not sent again.

        Returns:
            True if at least one chunk was added; False exactly when every chunk was
            already cached (or there is no whole chunk).

        Raises:
            ValueError/TypeError: bad arguments (nothing is sent).
            LMCacheTimeoutError: no answer within ``timeout``; the store may still
                complete on its own (see cancellation).
            TransferError: the server refused the commit.

        Cancellation/timeout: once the server has reserved the slots, the store is
        completed in the background (all chunks or none are committed); its session is
        ended either way.
        """
        toks = validate_tokens(tokens)
        validate_cache_salt(cache_salt)
        timeout = self._timeout(timeout)
        self._require_open()
        if isinstance(kv, torch.Tensor) and kv.dim() == len(self.geometry.kv_shape(0)):
            covered = kv.shape[self.geometry.token_axis]  # the KV may cover a prefix of tokens
            if len(toks) < covered:
                raise ValueError(
                    f"kv covers {covered} tokens but tokens has {len(toks)}: tokens may be longer "
                    "than the KV (it is stored under tokens[:T]), never shorter"
                )
            toks = toks[:covered]
        kv = self._check_kv(kv, len(toks))
        end = self._aligned(len(toks))

        async def body(op: _Op) -> bool:
            if end == 0:
                return False
            # One store per key at a time from this client: a concurrent twin would see
            # the chunks "being written" and could not tell that from out-of-memory.
            async with self._gate(("store", cache_salt, tuple(toks[:end]))):
                if self._pool is not None:
                    return await self._store_shm(op, kv, toks, end, cache_salt)
                return await self._store_pickle(op, kv, toks, end, cache_salt)

        return await self._run("store", timeout, body)

    async def _store_shm(self, op: _Op, kv: torch.Tensor, toks: list[int], end: int, salt: str) -> bool:
        geom = self._geometry
        assert geom is not None and self._pool is not None
        rid = _request_id("store")
        key = self._key(toks, end, rid, salt, worker=True)
        try:
            resp = await self._call(op, Op.PREPARE_STORE, key, self._instance_id)
            slots, indices = parse_prepare_store(resp)
            if not slots:
                # Nothing reservable: every chunk is cached (or being written), or the
                # server is out of memory (it reserves a batch all-or-nothing). A lookup
                # tells which; it only runs on this uncommon path.
                await self._check_stored(op, toks, end, salt, "reserve memory for")
                return False
            n_chunks = end // self._chunk_size
            if max(indices) >= n_chunks:
                raise ProtocolError(f"prepare_store asked for chunk {max(indices)} of {n_chunks}")
            shape = geom.kv_shape(self._chunk_size)
            views = [self._pool.view(s, shape, geom.dtype) for s in slots]
            pairs = [(v, self._chunk(kv, j)) for v, j in zip(views, indices, strict=True)]
            nbytes = sum(v.numel() for v in views) * kv.element_size()

            def fill() -> None:
                for view, src in pairs:
                    view.copy_(src)

            if nbytes >= _THREAD_COPY_BYTES:
                await asyncio.to_thread(fill)
            else:
                fill()
            ok = await self._call(op, Op.COMMIT_STORE, key, self._instance_id, b"")
            if ok is not True:
                raise TransferError("the server refused the SHM commit (registration lost?)")
            return True
        finally:
            await self._cleanup_call(Op.END_SESSION, rid)

    async def _store_pickle(self, op: _Op, kv: torch.Tensor, toks: list[int], end: int, salt: str) -> bool:
        rid = _request_id("store")
        lookup_key = self._key(toks, end, rid, salt, worker=False)
        try:
            # The lookup tells which chunks are cached already; its locks are not needed.
            hit = await self._lookup_locked(op, lookup_key, rid, release=False)
            await self._free_locks(lookup_key, hit // self._chunk_size)
            if hit >= end:
                return False
            first = hit // self._chunk_size
            chunks = [self._chunk(kv, j) for j in range(first, end // self._chunk_size)]
            nbytes = sum(c.numel() for c in chunks) * kv.element_size()
            if nbytes >= _THREAD_COPY_BYTES:
                frame = await asyncio.to_thread(encode_tensor_list, chunks)
            else:
                frame = encode_tensor_list(chunks)
            key = self._key(toks, end, rid, salt, start=hit, worker=True)
            ok = await self._call(op, Op.COMMIT_STORE, key, self._instance_id, PreEncoded(frame))
            if ok is not True:
                raise TransferError("the server could not store every chunk (out of memory?)")
        finally:
            await self._cleanup_call(Op.END_SESSION, rid)
        # A pickle commit the server found no memory for still answers True: verify.
        await self._check_stored(op, toks, end, salt, "store")
        return True

    async def _check_stored(self, op: _Op, toks: list[int], end: int, salt: str, what: str) -> None:
        """Raise TransferError unless all of ``toks[:end]`` is cached (re-checked briefly,
        in case another writer is committing the same chunks right now)."""
        cached = 0
        for delay in (0.0, 0.02, 0.1):
            await asyncio.sleep(delay)
            rid = _request_id("store-check")
            key = self._key(toks, end, rid, salt, worker=False)
            cached = await self._lookup_locked(op, key, rid, release=True)
            if cached >= end:
                return
        raise TransferError(
            f"the server could not {what} {(end - cached) // self._chunk_size} chunks "
            "(L1 full of locked or reserved objects?)"
        )

    async def remap(
        self,
        source_tokens: Sequence[int],
        target_tokens: Sequence[int],
        cache_salt: str = "",
        target_cache_salt: str | None = None,
        *,
        timeout: float | None = _DEFAULT,
    ) -> RemapResult:
        """Retrieve the KV of ``source_tokens`` and store it under ``target_tokens``.

        Only the source prefix the target's whole chunks can take is read. On SHM the
        source's slots are copied straight into the target's reserved slots (one copy,
        no buffer in this process); on pickle the KV makes the round trip through here.
        ``target_cache_salt`` defaults to ``cache_salt``. The deadline covers both halves.

        Cancellation/timeout: as for :meth:`retrieve` and :meth:`store`.
        """
        src = validate_tokens(source_tokens, "source_tokens")
        dst = validate_tokens(target_tokens, "target_tokens")
        validate_cache_salt(cache_salt)
        tsalt = (
            cache_salt
            if target_cache_salt is None
            else validate_cache_salt(target_cache_salt, "target_cache_salt")
        )
        timeout = self._timeout(timeout)
        n = self._aligned(min(len(src), len(dst)))  # the target takes no more than this
        if self._pool is not None:
            return await self._run(
                "remap", timeout, lambda op: self._remap_shm(op, src, dst, n, cache_salt, tsalt)
            )
        start = time.monotonic()
        kv = await self.retrieve(src[:n], cache_salt, timeout=timeout)
        if kv is None:
            return RemapResult(0, 0, False)
        hit = kv.shape[self.geometry.token_axis]
        left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
        new = await self.store(kv, dst[:hit], tsalt, timeout=left)
        return RemapResult(hit, hit, new)

    async def _remap_shm(
        self, op: _Op, src: list[int], dst: list[int], n: int, salt: str, tsalt: str
    ) -> RemapResult:
        """Remap inside the SHM pool: the source's slots are copied straight into the
        target's reserved slots (one copy, no client-side buffer).

        Cancellation/timeout: once the target's slots are reserved the copy and commit are
        completed (as for :meth:`store`); every lock, pending read and session is released.
        """
        if n == 0:
            return RemapResult(0, 0, False)
        geom = self._geometry
        assert geom is not None and self._pool is not None
        rid = _request_id("remap")
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
                await self._free_locks(key, hit // self._chunk_size)
            await self._cleanup_call(Op.END_SESSION, rid)

    async def _remap_slots(
        self, op: _Op, rkey: dict[str, Any], dst: list[int], hit: int, tsalt: str, state: _RetrieveState
    ) -> RemapResult:
        geom = self._geometry
        assert geom is not None and self._pool is not None
        shape = geom.kv_shape(self._chunk_size)
        n_chunks = hit // self._chunk_size
        committed = False
        try:
            state.prepared = True
            resp = await self._call(op, Op.PREPARE_RETRIEVE, rkey, self._instance_id)
            success, _data, rslots = parse_prepare_retrieve(resp)
            if not success:
                committed = True
                return RemapResult(0, 0, False)  # evicted between lookup and prepare
            if len(rslots) != n_chunks:
                raise ProtocolError(f"prepare_retrieve gave {len(rslots)} slots for {n_chunks} chunks")
            sources = [self._pool.view(s, shape, geom.dtype) for s in rslots]
            if op.abandoned:  # the caller left before the store half began: skip it
                return RemapResult(hit, 0, False)
            srid = _request_id("remap-store")
            skey = self._key(dst, hit, srid, tsalt, worker=True)
            try:
                sresp = await self._call(op, Op.PREPARE_STORE, skey, self._instance_id)
                wslots, indices = parse_prepare_store(sresp)
                if not wslots:
                    await self._check_stored(op, dst, hit, tsalt, "reserve memory for")
                    return RemapResult(hit, hit, False)
                if max(indices) >= n_chunks:
                    raise ProtocolError(f"prepare_store asked for chunk {max(indices)} of {n_chunks}")
                pairs = [
                    (self._pool.view(w, shape, geom.dtype), sources[j])
                    for w, j in zip(wslots, indices, strict=True)
                ]

                def fill() -> None:
                    for target, source in pairs:
                        target.copy_(source)

                if len(pairs) * _shape_bytes(shape, geom.dtype) >= _THREAD_COPY_BYTES:
                    await asyncio.to_thread(fill)
                else:
                    fill()
                # The target is written: the source's pending read can go with its commit.
                committed = True
                ok, _ = await self._pipeline(
                    op,
                    (Op.COMMIT_STORE, skey, self._instance_id, b""),
                    (Op.COMMIT_RETRIEVE, rkey, self._instance_id),
                )
                if ok is not True:
                    raise TransferError("the server refused the SHM commit (registration lost?)")
                return RemapResult(hit, hit, True)
            finally:
                await self._cleanup_call(Op.END_SESSION, srid)
        finally:
            if not committed:
                await self._cleanup_call(Op.COMMIT_RETRIEVE, rkey, self._instance_id)

    # ------------------------------------------------------------------ misc

    async def noop(self, *, timeout: float | None = _DEFAULT) -> float:
        """Round-trip a ``noop``; returns the round-trip time in seconds."""
        self._require_open()
        t0 = time.perf_counter()
        reply = await self._conn.call(Op.NOOP, (), timeout=self._timeout(timeout))
        if reply.value() != "OK":
            raise ProtocolError(f"noop answered {reply.value()!r}")
        return time.perf_counter() - t0

    async def status(
        self, *, max_age: float | None = None, timeout: float | None = _DEFAULT
    ) -> dict[str, Any]:
        """The server's ``/status`` document (cached for ``metadata_ttl`` seconds).

        Cancellation: a fetch shared with other callers keeps running for them.
        """
        self._require_open()
        return await self._meta.status(max_age=max_age, timeout=self._timeout(timeout))

    async def config(
        self, *, max_age: float | None = None, timeout: float | None = _DEFAULT
    ) -> dict[str, Any]:
        """The server's ``/config`` document (cached for ``metadata_ttl`` seconds).

        Cancellation: a fetch shared with other callers keeps running for them.
        """
        self._require_open()
        return await self._meta.config(max_age=max_age, timeout=self._timeout(timeout))

    async def drain(self, timeout: float | None = _DEFAULT) -> bool:
        """Wait until operations abandoned by a timeout or a cancellation have finished
        their server-side cleanup (sessions ended, locks released).

        Returns True when none is left, False if ``timeout`` passed first. Cancelling
        the wait does not cancel the cleanups.
        """
        timeout = self._timeout(timeout)
        pending = set(self._ops)
        if not pending:
            return True
        _done, still = await asyncio.wait(pending, timeout=timeout)
        return not still

    # ---- bulk operations (lmcache_async.bulk) ----
    # Thin wrappers: the implementation and its documentation live in lmcache_async.bulk,
    # imported lazily (it imports this module for its types only).

    async def remap_many(
        self,
        pairs: Iterable[RemapPair | Sequence[Any]],
        *,
        concurrency: int = 8,
        max_bytes_in_flight: int = 1 << 30,
        progress: Callable[[BatchProgress], object] | None = None,
        return_exceptions: bool = True,
        timeout: float | None = _DEFAULT,
    ) -> BatchResult:
        """Remap many (source, target) pairs concurrently: see :func:`lmcache_async.bulk.remap_many`.

        ``pairs`` are :class:`~lmcache_async.bulk.RemapPair` objects or tuples
        ``(source_tokens, target_tokens[, cache_salt[, target_cache_salt]])``. At most
        ``concurrency`` items run at once and at most ``max_bytes_in_flight`` bytes of KV
        buffers are held (an item larger than that runs alone). ``progress`` is called on
        the event loop after each item. ``timeout`` is per item (default: the client's).

        Returns:
            A :class:`~lmcache_async.bulk.BatchResult` (per-item results in input order and
            a summary). A failed item carries its exception unless ``return_exceptions`` is
            False, in which case the first failure cancels the batch and is raised.

        Cancellation: every in-flight item is cancelled and releases its server session,
        locks and reservations in the background; ``CancelledError`` is re-raised.
        """
        from lmcache_async import bulk

        return await bulk.remap_many(
            self,
            pairs,
            concurrency=concurrency,
            max_bytes_in_flight=max_bytes_in_flight,
            progress=progress,
            return_exceptions=return_exceptions,
            timeout=self._timeout(timeout),
        )

    async def store_many(
        self,
        items: Iterable[StoreItem | Sequence[Any]],
        *,
        concurrency: int = 8,
        max_bytes_in_flight: int = 1 << 30,
        progress: Callable[[BatchProgress], object] | None = None,
        return_exceptions: bool = True,
        timeout: float | None = _DEFAULT,
    ) -> BatchResult:
        """Store many ``(kv, tokens[, cache_salt])`` items concurrently: see
        :func:`lmcache_async.bulk.store_many`.

        Cancellation/timeout: as for :meth:`store`, per item; ``CancelledError`` is re-raised.
        """
        from lmcache_async import bulk

        return await bulk.store_many(
            self,
            items,
            concurrency=concurrency,
            max_bytes_in_flight=max_bytes_in_flight,
            progress=progress,
            return_exceptions=return_exceptions,
            timeout=self._timeout(timeout),
        )

    async def retrieve_many(
        self,
        token_lists: Iterable[RetrieveItem | Sequence[Any]],
        *,
        concurrency: int = 8,
        max_bytes_in_flight: int = 1 << 30,
        progress: Callable[[BatchProgress], object] | None = None,
        return_exceptions: bool = True,
        timeout: float | None = _DEFAULT,
    ) -> BatchResult:
        """Retrieve many prompts concurrently (token lists or ``(tokens, cache_salt)``): see
        :func:`lmcache_async.bulk.retrieve_many`. Each result's ``kv`` holds the tensor.

        Cancellation/timeout: as for :meth:`retrieve`, per item; ``CancelledError`` is
        re-raised.
        """
        from lmcache_async import bulk

        return await bulk.retrieve_many(
            self,
            token_lists,
            concurrency=concurrency,
            max_bytes_in_flight=max_bytes_in_flight,
            progress=progress,
            return_exceptions=return_exceptions,
            timeout=self._timeout(timeout),
        )

    # ---- end of bulk operations ----

    def _timeout(self, timeout: float | None) -> float | None:
        if timeout is _DEFAULT:
            return self.timeout
        return _check_timeout(timeout, "timeout")


def _check_timeout(timeout: object, name: str) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
        raise ValueError(f"{name} must be a non-negative number of seconds or None, got {timeout!r}")
    return float(timeout)


def _shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one tensor of ``shape`` x ``dtype``."""
    return math.prod(shape) * dtype.itemsize


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def _request_id(kind: str) -> str:
    return f"lmca-{kind}-{uuid.uuid4().hex}"
