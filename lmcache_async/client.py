"""The asyncio client: store, retrieve, lookup and remap KV caches on an LMCache MP server.

Every public operation runs its protocol exchange in a task of its own and the caller
awaits that task under the call's deadline (:ref:`docs/design.md`). When the caller
times out or is cancelled, the task is told it was abandoned and finishes the server
side of the exchange on its own, bounded by ``cleanup_grace`` seconds: it consumes the
prefetch result, releases the read locks it took, commits the SHM reads or writes it
holds and ends its session. A store whose slots were reserved is completed (all its
chunks are committed, never some); a retrieve no longer copies into the caller's tensor.
So a timeout or a cancellation never leaves sessions, locks or reservations behind.

Layers: this module holds the lifecycle (detect the server generation, load the
configuration, register, keep alive, re-register after a restart) and validates every
argument; each operation's RPC sequence lives once in :mod:`lmcache_async._operations`,
over a small channel interface; what differs between server generations is data in
:class:`lmcache_async._wire.WireGeneration`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import secrets
import time
import warnings
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

import torch

from lmcache_async._connection import DEFAULT_MAX_IN_FLIGHT, Connection, check_zmq_url
from lmcache_async._cuda.hooks import caller_order, kv_mark, target_mark
from lmcache_async._defaults import DEFAULT, DefaultType, check_timeout, resolve_timeout
from lmcache_async._metadata import Metadata
from lmcache_async._operations import Operations, OpState, Registration, RemapResult, run_detached
from lmcache_async._replacement import ServerWatch
from lmcache_async._shm import ShmPool
from lmcache_async._task_cancel import cancel_and_wait
from lmcache_async._tensor_checks import check_tensor_storage
from lmcache_async._wire import (
    GEN_0_5_6,
    Op,
    RegisterPayload,
    WireGeneration,
    generation_for_version,
    op_name,
    parse_register_response,
    validate_cache_salt,
    validate_model_name,
    validate_request_configs,
    validate_tokens,
)
from lmcache_async.errors import (
    ClientClosedError,
    ClientNotOpenError,
    ClientStateError,
    ForkedClientError,
    LMCacheError,
    LMCacheTimeoutError,
    ProtocolError,
    ServerError,
    ServerReplacedError,
    TransferError,
    WrongEventLoopError,
)
from lmcache_async.geometry import KVGeometry, dtype_name

if TYPE_CHECKING:  # bulk imports this module; its types are needed for annotations only
    from lmcache_async.bulk import BatchProgress, BatchResult, RemapPair, RetrieveItem, StoreItem

__all__ = ["AsyncClient", "RemapResult", "connect"]

log = logging.getLogger(__name__)

T = TypeVar("T")
TransferMode = Literal["auto", "shm", "pickle"]
Configs = dict[str, Any] | None

#: Longest wait for the ``unregister`` reply when closing.
UNREGISTER_TIMEOUT: Final = 2.0


class _Lifecycle(enum.Enum):
    NEW = "new"
    OPENING = "opening"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


async def _wait_all(futures: set[asyncio.Future[Any]], timeout: float | None) -> bool:
    """Wait until ``futures`` (a live set: done ones leave it, follow-ups join it) is
    empty; False if ``timeout`` passed first."""
    end = None if timeout is None else time.monotonic() + timeout
    settled = False
    while True:
        pending = {f for f in futures if not f.done()}
        if not pending:
            if settled:
                return True
            settled = True
            await asyncio.sleep(0)  # done-callbacks may still post follow-ups
            continue
        settled = False
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            return False
        await asyncio.wait(pending, timeout=left)


class _Abandoned(Exception):
    """An operation whose caller left before it sent anything (never seen by callers)."""


class _ConnectionChannel:
    """The :class:`~lmcache_async._operations.Channel` of a ZMQ connection, for the
    operations of one server: when that server is found replaced, the channel is retired
    (a new one serves the new server) and its operations' requests fail at once with
    :class:`ServerReplacedError`, cleanups included (nothing of theirs exists there)."""

    __slots__ = ("_conn", "retired")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.retired = False

    @property
    def usable(self) -> bool:
        return not self.retired and self._conn.usable

    async def call(self, opcode: Op, args: Sequence[Any], timeout: float | None) -> Any:
        if self.retired:
            raise ServerReplacedError(_replaced_message(opcode, self._conn.url))
        reply = await self._conn.call(opcode, args, timeout=timeout)
        return reply.value()

    def post(self, opcode: Op, args: Sequence[Any], timeout: float | None) -> asyncio.Future[Any] | None:
        """Send a request now and return the future of its reply (a
        :class:`~lmcache_async._wire.Reply`) without waiting; ``None`` when it cannot be
        sent at once (see :meth:`~lmcache_async._connection.Connection.send_nowait`)."""
        if self.retired:
            return None
        return self._conn.send_nowait(opcode, args, timeout=timeout)


def _replaced_message(opcode: Op, url: str) -> str:
    return (
        f"{op_name(opcode)}: the LMCache server behind {url} was replaced (a new server instance, "
        "with no visible disconnect); the client registers with the new one"
    )


_F = TypeVar("_F", bound=Callable[..., Any])


def _weakly(method: _F) -> _F:
    """``method`` (bound) called through a weak reference to its object: a background
    task holding it does not keep the object alive. Once the object is collected a call
    raises :class:`ClientClosedError`."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        if bound is None:
            raise ClientClosedError("the client was garbage-collected")
        return bound(*args)

    return call  # type: ignore[return-value]


async def _keepalive_loop(
    ref: weakref.ReferenceType[AsyncClient], conn: Connection, ping_interval: float
) -> None:
    """Every ``ping_interval`` seconds, and at once when the connection comes back after a
    loss: check that the server is the one registered with (``/config`` instance id) and
    refresh the registration, or register again (and re-map SHM) with the new server.
    Holds the client weakly between refreshes (it ends when the client was collected).

    The refresh is a re-registration of the same id, which the server answers as a
    liveness refresh. It is deliberately not a ``ping``: a pinged instance is reaped 120 s
    after its last message and reaping admits its pending write reservations, while a
    never-pinged one is reaped only after ``--worker-registration-grace-seconds`` (3600 s),
    by which time such reservations expired and are dropped, never admitted (see
    :meth:`AsyncClient._retire_registration`).
    """
    reconnected = conn.reconnected
    assert reconnected is not None
    while True:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ping_interval):
                await reconnected.wait()
        if reconnected.is_set():
            reconnected.clear()
            log.info("reconnected to %s; registering again", conn.url)
        client = ref()
        if client is None:
            return
        try:
            await client._refresh_registration()
        except LMCacheError as exc:
            log.debug("keep-alive failed: %s", exc)
        finally:
            del client


#: Closes of clients collected while open, kept referenced until they are done.
_closing_collected: set[asyncio.Task[None]] = set()


def _release_locally(
    loop: asyncio.AbstractEventLoop, conn: Connection, meta: Metadata, tasks: Sequence[asyncio.Task[None]]
) -> None:
    """Release a client's socket, ZMQ context and HTTP session without awaiting anything
    (``loop``, theirs, is closed or not running)."""
    if not loop.is_closed():
        for task in tasks:
            task.cancel()
    conn.abandon()
    meta.abandon()


async def _unregister_and_close(conn: Connection, meta: Metadata, instance_id: int) -> None:
    try:
        if conn.usable:
            with contextlib.suppress(LMCacheError):
                await conn.call(Op.UNREGISTER_ENGINE_DRIVEN, (instance_id,), timeout=UNREGISTER_TIMEOUT)
    finally:
        try:
            await conn.close()
        finally:
            await meta.close()


def _close_collected(
    loop: asyncio.AbstractEventLoop,
    conn: Connection,
    meta: Metadata,
    tasks: Sequence[asyncio.Task[None]],
    instance_id: int,
) -> None:
    """On the client's running loop: stop the background tasks of a collected client,
    unregister it and close its socket and session."""
    for task in tasks:
        task.cancel()
    closing = loop.create_task(_unregister_and_close(conn, meta, instance_id), name="lmcache-close-collected")
    _closing_collected.add(closing)
    closing.add_done_callback(_closing_collected.discard)


def _collected_open(
    loop: asyncio.AbstractEventLoop,
    conn: Connection,
    meta: Metadata,
    tasks: list[asyncio.Task[None]],
    instance_id: int,
    desc: str,
    pid: int,
) -> None:
    """``weakref.finalize`` callback of an :class:`AsyncClient` collected while open: a
    :class:`ResourceWarning`, then the close. On its loop, if that loop still runs (the
    callback may run in any thread: the close is handed over thread-safely), with the
    unregister; else here, without it."""
    if os.getpid() != pid:
        return  # inherited across fork: the parent owns the socket and the registration
    warnings.warn(
        f"{desc} was never closed; closing it now (use 'async with AsyncClient(...)' or "
        "'await client.aclose()')",
        ResourceWarning,
        stacklevel=2,
    )
    if loop.is_running():
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(_close_collected, loop, conn, meta, tasks, instance_id)
            return
    _release_locally(loop, conn, meta, tasks)


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
    api_key: str | None = None,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
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
        api_key=api_key,
        max_in_flight=max_in_flight,
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
        ping_interval: seconds between keep-alive refreshes of the registration (<= 30);
            a refresh is also made at once when the connection comes back after a loss.
            A server replaced behind a connection that stays up (a proxy) is noticed
            sooner, after 1 s without replies (docs/design.md, "A server replaced behind
            the connection").
        cleanup_grace: extra seconds an abandoned operation may spend cleaning up.
        metadata_ttl: seconds ``/config`` and ``/status`` stay cached.
        prefault_shm: map the pages of each SHM slot this client writes (a store's,
            a remap's targets) into this process (one ``madvise`` per 2 MiB run) the
            first time a copy writes them, in the copying thread, instead of faulting
            page by page during the copy; slots only read fault in during the copy
            (cheaper there); the cost follows the slots this client touches, never the
            pool's size (see :meth:`lmcache_async._shm.ShmPool.populate`).
        api_key: sent as ``Authorization: Bearer KEY`` on every HTTP call (servers
            started with an API key answer 401 without it); default: the
            ``LMCACHE_API_KEY`` environment variable. The ZMQ side has no keys.
        max_in_flight: most requests on the wire at once (default 1024); a request
            beyond that waits for a free place under its operation's deadline, so an
            unanswering server makes calls time out instead of growing the pending table.
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
        api_key: str | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        check_zmq_url(url)
        if not isinstance(http_url, str) or not http_url.startswith(("http://", "https://")):
            raise ValueError(f"http_url must start with http:// or https://, got {http_url!r}")
        validate_model_name(model_name)
        if geometry is not None and not isinstance(geometry, KVGeometry):
            raise TypeError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        timeout = check_timeout(timeout, "timeout")
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
        self.cleanup_grace = check_timeout(cleanup_grace, "cleanup_grace", allow_none=False) or 0.0
        self.num_kv_readers = num_kv_readers
        self._want_transfer: TransferMode = transfer
        self._prefault_shm = bool(prefault_shm)
        self._explicit_geometry = geometry
        self._geometry: KVGeometry | None = geometry
        self._ping_interval = ping_interval
        self._meta = Metadata(http_url, ttl=metadata_ttl, api_key=api_key)
        self._wire: WireGeneration = GEN_0_5_6
        self._server_version: str | None = None
        self._conn = Connection(url, max_in_flight=max_in_flight)
        self._channel = _ConnectionChannel(self._conn)
        self._state = _Lifecycle.NEW
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._chunk_size = 0
        self._fifo_cpu = False
        self._write_ttl: float | None = None
        self._expected_pool: tuple[str, int] | None = None  # from /config, when it says
        self._instance_id = secrets.randbits(63)
        self._registered_id: int | None = None  # the id the server knows this client by
        self._pool_identity: tuple[str, int] = ("", 0)  # (shm name, pool size) registered with
        self._retired_ids: list[int] = []
        self._server_instance: object = None
        self._pool: ShmPool | None = None
        self._transfer: Literal["shm", "pickle"] | None = None
        self._server_has_shm = False
        self._cannot_retrieve: str | None = None  # why retrieve can't work (SHM server, no map)
        self._reg_generation = -1
        self._stale = False
        self._reg_lock: asyncio.Lock | None = None
        self._ops: set[asyncio.Future[Any]] = set()  # operation tasks and cleanup replies
        self._posted: set[asyncio.Future[Any]] = set()  # cleanup replies awaited in the background
        self._gates: dict[tuple[Any, ...], list[Any]] = {}
        self._operations_cache: tuple[tuple[Any, ...], Operations] | None = None
        self._keepalive: asyncio.Task[None] | None = None
        # Weakly: the watch task runs on the loop, and must not keep a dropped client alive
        # (so that its finalizer can release what it holds).
        self._watch = ServerWatch(
            self._conn, _weakly(self._fetch_identity), _weakly(self._known_instance), _weakly(self._replaced)
        )
        self._watch_task: asyncio.Task[None] | None = None
        self._closed_event: asyncio.Event | None = None
        #: Releases the socket of a client collected while open (made by open()).
        self._finalizer: weakref.finalize[Any, Any] | None = None

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
    def server_version(self) -> str:
        """The LMCache version the server reported on ``/lmc_version`` at connect
        (``"unknown"`` for a server without that route, talked to as 0.5.6)."""
        self._require_open()
        return self._server_version or "unknown"

    @property
    def wire_generation(self) -> str:
        """The wire generation in use, ``"0.5.6"`` or ``"0.5.7"`` (picked from
        :attr:`server_version`)."""
        self._require_open()
        return self._wire.name

    @property
    def instance_id(self) -> int:
        """The engine-driven registration id of this client (random, 63 bits)."""
        return self._instance_id

    @property
    def closed(self) -> bool:
        return self._state is _Lifecycle.CLOSED

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
        if self._state is not _Lifecycle.NEW:
            raise ClientStateError(f"open() on a client that is {self._state.value}")
        self._state = _Lifecycle.OPENING
        self._loop = asyncio.get_running_loop()
        self._reg_lock = asyncio.Lock()
        try:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            await self._detect_generation(_remaining(deadline))
            await self._load_config(_remaining(deadline))
            if self._geometry is None:
                status = await self._meta.status(max_age=0, timeout=_remaining(deadline))
                self._geometry = KVGeometry.from_status(status, self.model_name)
            if self._chunk_size % self._geometry.block_size:
                raise ServerError(
                    f"chunk size {self._chunk_size} is not a multiple of the block size "
                    f"{self._geometry.block_size}"
                )
            await self._conn.open(_remaining(deadline))
            reply = await self._conn.call(Op.NOOP, (), timeout=_remaining(deadline))
            if reply.value() != "OK":
                raise ProtocolError(f"noop answered {reply.value()!r}")
            await self._check_chunk_size_over_zmq(_remaining(deadline))
            await self._register(_remaining(deadline))
            self._keepalive = asyncio.create_task(
                _keepalive_loop(weakref.ref(self), self._conn, self._ping_interval), name="lmcache-keepalive"
            )
            self._watch_task = asyncio.create_task(self._watch.run(), name="lmcache-server-watch")
            self._finalizer = weakref.finalize(
                self,
                _collected_open,
                self._loop,
                self._conn,
                self._meta,
                [self._keepalive, self._watch_task],
                self._instance_id,
                f"<lmcache_async.AsyncClient {self.model_name!r} at {self.url}>",
                self._pid,
            )
            self._state = _Lifecycle.OPEN
        except BaseException:
            self._state = _Lifecycle.CLOSING
            await self._shutdown(unregister=False)
            raise

    async def aclose(self) -> None:
        """Close the client: refuse new calls, let running operations (abandoned ones
        finishing their server-side cleanup) end, unregister, close socket and session.

        What it waits for, in order: the operations still running, at most
        ``cleanup_grace`` seconds (those left are cancelled, and the registration is then
        retired rather than unregistered: a cancelled store may hold reserved slots that
        unregistering would admit); the keep-alive task's end; the ``unregister`` reply,
        at most :data:`UNREGISTER_TIMEOUT` seconds (skipped while disconnected).

        Idempotent; a call while another ``aclose()`` runs waits for that one. In a
        process forked from the one that opened the client it only drops the inherited
        socket, context and session, without touching them (they are the parent's).

        Cancellation: ``CancelledError`` propagates, and the client still ends CLOSED:
        operations cancelled, keep-alive stopped, socket and session closed (the
        unregister is skipped).
        """
        if os.getpid() != self._pid:
            self._drop_inherited()
            return
        if self._state is _Lifecycle.CLOSED:
            return
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            await self._close_from_another_loop(self._loop)
            return
        if self._state is _Lifecycle.CLOSING:
            assert self._closed_event is not None
            await self._closed_event.wait()
            return
        opened = self._state is _Lifecycle.OPEN
        self._state = _Lifecycle.CLOSING
        self._closed_event = asyncio.Event()
        unregister = opened
        try:
            if self._ops:
                await _wait_all(self._ops, self.cleanup_grace)
        except asyncio.CancelledError:
            unregister = False
            raise
        finally:
            left = [t for t in self._ops if not t.done()]
            if left:
                self._retire_registration(
                    self._instance_id, f"{len(left)} operations were still running at close"
                )
                for task in left:
                    task.cancel()
            await self._shutdown(unregister=unregister)

    async def _close_from_another_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """:meth:`aclose` called on a loop other than the one that opened the client.

        The owner loop still running (in another thread): the close runs there, and this
        waits for it. The owner loop closed or stopped (an ``asyncio.run()`` that ended):
        nothing can be awaited on it, so the socket, its context and the HTTP session are
        released here, without the server-side unregister, with a :class:`RuntimeWarning`.
        """
        if loop.is_running():
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.aclose(), loop))
            return
        how = "closed" if loop.is_closed() else "not running"
        warnings.warn(
            f"{self!r} was opened on an event loop that is {how}: "
            "closing it here releases its socket and HTTP session, but cannot unregister it from "
            "the server, which drops the registration when it expires",
            RuntimeWarning,
            stacklevel=3,
        )
        self._detach_finalizer()
        self._state = _Lifecycle.CLOSED
        self._pool = None
        tasks = [t for t in (self._keepalive, self._watch_task) if t is not None]
        _release_locally(loop, self._conn, self._meta, tasks)

    def _detach_finalizer(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()

    async def _shutdown(self, *, unregister: bool) -> None:
        try:
            if self._watch_task is not None:
                await cancel_and_wait(self._watch_task, "the server watch")
            if self._keepalive is not None:
                await cancel_and_wait(self._keepalive, "the keep-alive")
            registered = self._registered_id is not None and self._registered_id == self._instance_id
            if unregister and registered and self._conn.usable:
                with contextlib.suppress(LMCacheError):
                    await self._conn.call(
                        Op.UNREGISTER_ENGINE_DRIVEN, (self._instance_id,), timeout=UNREGISTER_TIMEOUT
                    )
        finally:
            try:
                if self._pool is not None:
                    self._pool.close()
                    self._pool = None
                await self._conn.close()
            finally:
                try:
                    await self._meta.close()
                finally:
                    self._detach_finalizer()
                    self._state = _Lifecycle.CLOSED
                    if self._closed_event is not None:
                        self._closed_event.set()

    def _drop_inherited(self) -> None:
        """In a forked child: forget the parent's socket, context, session and pool
        without closing them (closing would unregister the parent's file descriptors
        from the event-loop selector both processes share)."""
        if self._state is _Lifecycle.CLOSED:
            return
        self._state = _Lifecycle.CLOSED
        self._detach_finalizer()
        self._conn.drop_inherited()
        self._meta.drop_inherited()
        self._pool = None
        self._keepalive = None
        self._watch_task = None
        self._ops = set()
        self._posted = set()

    def _check_loop(self) -> None:
        """Refuse a call from an event loop other than the one that opened the client."""
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise WrongEventLoopError(
                "the client is used from an event loop other than the one that opened it"
            )

    async def _detect_generation(self, timeout: float | None) -> None:
        """Ask ``/lmc_version`` which generation the server is and speak its wire.

        Raises:
            UnsupportedServerVersionError: a version older than 0.5.6 or unparseable.
            AuthenticationError: the server wants an API key (0.5.7 with keys).
        """
        version = await self._meta.version(timeout=timeout)
        if version is None:
            log.warning(
                "%s has no /lmc_version (a server older than lmcache 0.5.6?); talking to it as 0.5.6",
                self.http_url,
            )
            wire = GEN_0_5_6
        else:
            wire = generation_for_version(version)
        self._server_version = version
        self._wire = wire
        self._conn.wire = wire

    async def _load_config(self, timeout: float | None) -> None:
        config = await self._meta.config(max_age=0, timeout=timeout)
        mp = Metadata.mp_section(config)
        if self._wire.chunk_size_from == "status":
            # The configured size is only a minimum the server may round up; /status
            # has the live one (get_chunk_size would freeze it: never used as a probe).
            status = await self._meta.status(max_age=0, timeout=timeout)
            chunk_size = status.get("chunk_size")
            where = "/status chunk_size"
        else:
            chunk_size = mp.get("chunk_size")
            where = "/config mp.chunk_size"
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ProtocolError(f"{where} is {chunk_size!r}")
        mode = mp.get("supported_transfer_mode", "engine_driven")
        if mode not in ("engine_driven", "auto"):
            raise ServerError(
                f"the server runs --supported-transfer-mode {mode}; engine-driven requests would "
                "go unanswered (start it with --supported-transfer-mode auto or engine_driven)"
            )
        self._chunk_size = chunk_size
        self._expected_pool = _expected_pool(config)
        self._server_instance = mp.get("instance_id")
        self._fifo_cpu = mp.get("max_cpu_workers") == 1
        ttl = _find_number(config, "write_ttl_seconds")
        grace = mp.get("worker_registration_grace_seconds")
        self._write_ttl = ttl
        if (
            ttl is not None
            and isinstance(grace, int | float)
            and not isinstance(grace, bool)
            and grace <= ttl
        ):
            log.warning(
                "the server reaps silent registrations after %gs, before write reservations expire "
                "(%gs): a reservation this client cannot fill could be admitted when its "
                "retired registration is reaped (see docs/design.md)",
                grace,
                ttl,
            )

    def _register_payload(self) -> RegisterPayload:
        geom = self._geometry
        assert geom is not None
        return RegisterPayload(
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

    async def _check_chunk_size_over_zmq(self, timeout: float | None) -> None:
        """On 0.5.6 (where ``get_chunk_size`` is a pure query; on 0.5.7 it would freeze
        the chunk size) check that the ZMQ endpoint has the chunk size ``/config`` gave.

        Raises:
            ServerError: the two endpoints are not the same server.
        """
        if self._wire.chunk_size_from != "config":
            return
        reply = await self._conn.call(Op.GET_CHUNK_SIZE, (), timeout=timeout)
        zmq_chunk = reply.value()
        if zmq_chunk != self._chunk_size:
            raise ServerError(
                f"{self.url} and {self.http_url} are not the same LMCache server: the ZMQ endpoint "
                f"has chunk size {zmq_chunk!r}, the HTTP endpoint's /config {self._chunk_size}"
            )

    async def _register(self, timeout: float | None) -> None:
        payload = self._register_payload()
        generation = self._conn.generation
        reply = await self._conn.call(Op.REGISTER_ENGINE_DRIVEN, (payload.to_wire(),), timeout=timeout)
        shm_name, pool_size = parse_register_response(reply.value())
        self._registered_id = payload.instance_id
        self._pool_identity = (shm_name, pool_size)
        if self._expected_pool is not None and self._expected_pool != (shm_name, pool_size):
            # Another server than the one whose /config was read: undo the registration.
            with contextlib.suppress(LMCacheError):
                await self._conn.call(Op.UNREGISTER_ENGINE_DRIVEN, (payload.instance_id,), timeout=timeout)
            self._registered_id = None
            raise ServerError(
                f"{self.url} and {self.http_url} are not the same LMCache server: the ZMQ endpoint "
                f"serves the SHM pool {shm_name!r} ({pool_size} bytes), the HTTP endpoint's /config "
                f"describes {self._expected_pool[0]!r} ({self._expected_pool[1]} bytes)"
            )
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._server_has_shm = bool(shm_name) and pool_size > 0
        why_not = "transfer='pickle' was asked for"
        if self._server_has_shm and self._want_transfer != "pickle":
            try:
                self._pool = ShmPool(shm_name, pool_size)
                if not self._prefault_shm:
                    self._pool.populate_on_use = False
            except TransferError as exc:
                if self._want_transfer == "shm":
                    raise
                why_not = str(exc)
        elif self._want_transfer == "shm":
            raise TransferError("transfer='shm' but the server has no SHM pool (--shm-name)")
        self._transfer = "shm" if self._pool is not None else "pickle"
        # An SHM server answers prepare_retrieve only with slots in its pool, never with
        # inline data: a client that cannot map the pool (another host) can store over
        # TCP but never retrieve. Say so now, and make every retrieve fail with it.
        self._cannot_retrieve = None
        if self._server_has_shm and self._pool is None:
            self._cannot_retrieve = (
                f"the server {self.url} keeps its KV in the shared-memory pool {shm_name!r}, which this "
                f"client does not map ({why_not}); an SHM server never sends KV over TCP, so retrieve "
                "and remap cannot work from here. Run the client on the server's host, or start the "
                "server with --shm-name '' to serve KV over TCP. store and lookup work."
            )
            log.warning("%s", self._cannot_retrieve)
        self._reg_generation = generation
        self._stale = False

    def _known_instance(self) -> object:
        """The identity (``/config`` instance id) of the server registered with."""
        return self._server_instance

    async def _refresh_registration(self) -> None:
        config = await self._meta.config(max_age=0, timeout=10.0)
        identity = Metadata.mp_section(config).get("instance_id")
        if identity != self._server_instance:
            log.info("server restarted (instance id changed); re-registering")
            self._replaced(identity)
        if self._stale or self._reg_generation != self._conn.generation:
            await self._ensure_registered(30.0)
            return
        reply = await self._conn.call(
            Op.REGISTER_ENGINE_DRIVEN, (self._register_payload().to_wire(),), timeout=10.0
        )
        if parse_register_response(reply.value()) != self._pool_identity:
            log.info("the server's SHM pool changed; re-registering")
            self._stale = True
            await self._ensure_registered(30.0)

    async def _ensure_registered(self, timeout: float | None) -> None:
        """Re-register (and re-map SHM) after a reconnect or a server restart."""
        if self._reg_generation == self._conn.generation and not self._stale:
            return
        assert self._reg_lock is not None
        async with self._reg_lock:
            if self._reg_generation == self._conn.generation and not self._stale:
                return
            log.info("re-registering %s with %s", self.model_name, self.url)
            before = self._chunk_size
            await self._load_config(timeout)
            assert self._geometry is not None
            if self._chunk_size % self._geometry.block_size:
                raise ServerError(
                    f"the server now has chunk size {self._chunk_size}, not a multiple of the block "
                    f"size {self._geometry.block_size}"
                )
            if self._chunk_size != before:
                log.warning("the server's chunk size changed from %d to %d", before, self._chunk_size)
            await self._register(timeout)

    async def _fetch_identity(self, timeout: float) -> object:
        """The server's identity: ``/config`` ``mp.instance_id`` (new for every server
        process, on both generations; see :mod:`lmcache_async._replacement`)."""
        config = await self._meta.config(max_age=0, timeout=timeout)
        return Metadata.mp_section(config).get("instance_id")

    def _replaced(self, identity: object) -> None:
        """The server now has another identity than the one registered with.

        After a visible disconnect the reconnection already made the registration stale
        and failed the old server's requests: register again (same id). With no visible
        disconnect (a proxy kept the connection up), requests of the old server are still
        waiting and more may reach the new server: fail them with
        :class:`ServerReplacedError` (their operations are run again once, see
        :meth:`_run`), retire the channel they use, and retire the registration id too
        (a fresh one is registered), so nothing sent under it, queued by a proxy and
        delivered late, can act on the new server.
        """
        self._server_instance = identity
        self._stale = True
        if self._reg_generation != self._conn.generation:
            return
        log.warning(
            "the LMCache server behind %s was replaced (no disconnect seen); registering again", self.url
        )
        self._retire_registration(self._instance_id, "the server was replaced")
        self._channel.retired = True
        self._channel = _ConnectionChannel(self._conn)
        url = self.url
        self._conn.fail_pending(lambda opcode: ServerReplacedError(_replaced_message(opcode, url)))

    def _require_open(self) -> None:
        if self._state is not _Lifecycle.OPEN:
            if self._state in (_Lifecycle.CLOSING, _Lifecycle.CLOSED):
                raise ClientClosedError("the client is closed")
            raise ClientNotOpenError(f"the client is {self._state.value}; use 'async with' or connect()")
        if os.getpid() != self._pid:
            raise ForkedClientError(
                "this client was created in another process (before fork); create a new one", self._pid
            )

    # ------------------------------------------------------------------ op runner

    async def _run(
        self, name: str, timeout: float | None, body: Callable[[Operations, OpState], Awaitable[T]]
    ) -> T:
        """Run ``body`` over this client's operations in a task of its own (see
        :func:`~lmcache_async._operations.run_detached`), re-registering first if needed."""
        self._require_open()
        self._check_loop()

        async def run(op: OpState) -> T:
            # Started while the server is away: wait briefly for the reconnection (then the
            # new server is registered with first), or fail fast with a connection error.
            await self._conn.wait_usable(op.remaining())
            if self._watch.due():  # silence: was the server replaced behind the connection?
                await self._watch.check_quietly(op.remaining())
            for attempt in (1, 2):
                try:
                    await self._ensure_registered(op.remaining())
                    if op.abandoned:  # the caller left before anything was sent
                        raise _Abandoned
                    return await body(self._operations(), op)
                except LMCacheTimeoutError:
                    # Unanswered prepare/commit requests are what a reaped registration looks
                    # like; re-registering an existing id is cheap, so do it before the next op.
                    self._stale = True
                    raise
                except ServerReplacedError as exc:
                    # Everything this attempt did was on the old server (gone with it) or
                    # sent under a retired id (nothing for the new one): run it again once,
                    # on the new server, unless the caller left.
                    if attempt == 2 or op.abandoned:
                        again = " (again, after running it once more)" if attempt == 2 else ""
                        raise ServerReplacedError(f"{name}: {exc}{again}") from exc
                    log.info("%s: the server was replaced while it ran; running it again", name)
            raise AssertionError("unreachable")

        return await run_detached(name, timeout, self.cleanup_grace, run, self._track)

    def _track_posted(self, fut: asyncio.Future[Any]) -> None:
        self._posted.add(fut)
        fut.add_done_callback(self._posted.discard)
        self._track(fut)

    def _track(self, task: asyncio.Future[Any]) -> None:
        self._ops.add(task)
        task.add_done_callback(self._op_done)

    def _op_done(self, task: asyncio.Future[Any]) -> None:
        self._ops.discard(task)
        if not task.cancelled():
            exc = task.exception()  # mark retrieved: the caller may have left
            if exc is not None:
                log.debug("operation task ended with %r", exc)

    def _operations(self) -> Operations:
        """The operations of the current registration (built again only when something
        it is made of changed: re-registration, a new pool, a new chunk size)."""
        geom = self._geometry
        assert geom is not None
        made_of = (
            geom, self._chunk_size, self._wire, self._instance_id, self.num_kv_readers, self._pool,
            self._server_has_shm, self._fifo_cpu, self._write_ttl, self.cleanup_grace,
        )  # fmt: skip
        cached = self._operations_cache
        if cached is not None and cached[0] == made_of:
            return cached[1]
        reg = Registration(
            model_name=self.model_name,
            geometry=geom,
            chunk_size=self._chunk_size,
            wire=self._wire,
            instance_id=self._instance_id,
            num_kv_readers=self.num_kv_readers,
            pool=self._pool,
            server_has_shm=self._server_has_shm,
            fifo_cpu=self._fifo_cpu,
            write_ttl=self._write_ttl,
        )
        ops = Operations(
            self._channel,
            reg,
            cleanup_grace=self.cleanup_grace,
            gates=self._gates,
            on_unfilled=self._retire_registration,
            track=self._track_posted,
            server_status=self._fresh_status,
        )
        self._operations_cache = (made_of, ops)
        return ops

    async def _fresh_status(self, timeout: float) -> dict[str, Any]:
        """``/status`` fetched now (a store's error reports the server's memory use)."""
        return await self._meta.status(max_age=0, timeout=timeout)

    def _retire_registration(
        self, instance_id: int, reason: str = "a store's reserved slots could not be filled"
    ) -> None:
        """Stop using ``instance_id``: a reservation of it may hold anything but KV.

        The LMCache server has no operation that drops a write reservation: committing
        it, unregistering its instance, or the server reaping a silent instance that has
        *pinged* (120 s) all admit the reserved slots as valid KV, whatever they hold.
        Only a reservation whose write lock expired (``--l1-write-ttl-seconds``, 600 s)
        is never admitted. So the retired id is never unregistered and never refreshed
        again; as it never pinged (this client keeps alive by re-registering, see
        :meth:`_keepalive_loop`), the server reaps it only after
        ``--worker-registration-grace-seconds`` (3600 s) of silence, after its write
        locks expired. This client registers a fresh id before its next operation.
        """
        if instance_id != self._instance_id:
            return  # already retired
        log.warning(
            "retiring registration %d (%s): reservations it may hold stay invisible and expire "
            "on the server; registering a new id",
            instance_id,
            reason,
        )
        self._retired_ids.append(instance_id)
        self._instance_id = secrets.randbits(63)
        self._stale = True

    # ------------------------------------------------------------------ helpers

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
        check_tensor_storage(kv, "kv")
        return kv

    # ------------------------------------------------------------------ operations

    async def lookup(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        request_configs: Mapping[str, Any] | None = None,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> int:
        """Length in tokens of the longest cached chunk-aligned prefix of ``tokens``.

        Releases the read locks the lookup took and ends its session before returning.
        ``request_configs`` (LMCache request configs, e.g. ``{"lmcache.skip_load":
        True}`` on 0.5.7) travel in the key, as the official SDK sends them.

        Raises:
            ValueError/TypeError: bad arguments (nothing is sent).
            LMCacheTimeoutError: no answer within ``timeout``.

        Cancellation/timeout: the prefetch result is consumed, locks released and the
        session ended in the background.
        """
        toks = validate_tokens(tokens)
        validate_cache_salt(cache_salt)
        configs = validate_request_configs(request_configs)
        timeout = self._timeout(timeout)
        self._require_open()

        # Aligned with the chunk size of the registration the operation runs under (a
        # server restarted with another chunk size is registered with first).
        return await self._run(
            "lookup",
            timeout,
            lambda ops, op: ops.lookup(op, toks, _align(len(toks), ops.reg.chunk_size), cache_salt, configs),
        )

    async def retrieve(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        out: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        request_configs: Mapping[str, Any] | None = None,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> torch.Tensor | None:
        """The KV of the longest cached chunk-aligned prefix of ``tokens``, or ``None``.

        Args:
            tokens: token ids; only whole chunks are looked up.
            cache_salt: the namespace the KV was stored under.
            out: optional preallocated tensor (CPU, pinned or CUDA) of shape
                ``[2, L, T, D]`` (``[L, T, D]`` for MLA) with ``T >=`` the chunk-aligned
                token count; it is filled without any other allocation of that size and
                a view of its first ``T_hit`` tokens is returned.
            device: where a tensor allocated without ``out`` lives (default: the CPU);
                a CUDA device allocates on the GPU. With ``out``, it must name its device.
                A CUDA ``out``/``device`` is written on side streams ordered after the
                caller's current stream, and complete when the call returns
                (``docs/design.md``, "CUDA tensors").
            request_configs: LMCache request configs carried in the keys of the lookup
                and the retrieve (str keys, msgpack-encodable values), as the official
                SDK sends them; e.g. ``{"lmcache.skip_load": True}`` makes a 0.5.7
                server report a miss.
            timeout: deadline in seconds (default: the client's).

        Returns:
            ``[2, L, T_hit, D]`` (on ``device``, or ``out``'s), or ``None`` on a miss.

        Raises:
            ValueError/TypeError: bad arguments (nothing is sent).
            LMCacheTimeoutError: no answer within ``timeout``.
            TransferError: the server keeps KV in SHM this client cannot map (a client on
                another host): raised by every retrieve, hit or miss, before anything is sent.

        Cancellation/timeout: nothing more is copied into ``out`` once the caller has
        left (a copy already running finishes); read locks, SHM reads and the session
        are released in the background.
        """
        toks = validate_tokens(tokens)
        validate_cache_salt(cache_salt)
        configs = validate_request_configs(request_configs)
        timeout = self._timeout(timeout)
        self._require_open()
        end = self._aligned(len(toks))
        if out is not None:
            self._check_out(out, end)
        axis = self.geometry.token_axis
        mark = target_mark(out, device)  # None unless the KV goes to a GPU

        if self._cannot_retrieve is not None:  # before anything is sent: never a silent miss
            raise TransferError(self._cannot_retrieve)

        def body(ops: Operations, op: OpState) -> Awaitable[torch.Tensor | None]:
            n = _align(len(toks), ops.reg.chunk_size)
            if out is not None:  # a new chunk size may align further than ``out`` reaches
                n = min(n, _align(out.shape[axis], ops.reg.chunk_size))
            return ops.retrieve(op, toks, n, cache_salt, configs, out, mark=mark)

        return await self._run("retrieve", timeout, body)

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
        check_tensor_storage(out, "out", writable=True)

    async def store(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        request_configs: Mapping[str, Any] | None = None,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> bool:
        """Store ``kv`` (``[2, L, T, D]``, or ``[L, T, D]`` for MLA) under ``tokens``.

        ``tokens`` may be longer than the KV's ``T`` tokens: the KV is then stored under
        ``tokens[:T]`` (so ``store(retrieve(source), target)`` works for prompts of any
        length, although a retrieve returns whole chunks only); fewer tokens than ``T``
        raise ``ValueError``. Tokens beyond the last whole chunk are ignored (as in the
        official SDK). Chunks already cached are not sent again. ``request_configs``
        travel in the keys of the store's requests (as in the official SDK); the
        client's own check of which chunks are cached runs without them.

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
        configs = validate_request_configs(request_configs)
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
        # A CUDA kv: the bytes stored are kv as seen from the caller's current stream, now.
        mark = kv_mark(kv)

        return await self._run(
            "store",
            timeout,
            lambda ops, op: ops.store(
                op, kv, toks, _align(len(toks), ops.reg.chunk_size), cache_salt, configs, mark=mark
            ),
        )

    async def remap(
        self,
        source_tokens: Sequence[int],
        target_tokens: Sequence[int],
        cache_salt: str = "",
        target_cache_salt: str | None = None,
        *,
        timeout: float | DefaultType | None = DEFAULT,
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
        self._require_open()
        if self._pool is not None:
            # The target takes no more than its whole chunks (of the live chunk size).
            return await self._run(
                "remap",
                timeout,
                lambda ops, op: ops.remap(
                    op, src, dst, _align(min(len(src), len(dst)), ops.reg.chunk_size), cache_salt, tsalt
                ),
            )
        n = self._aligned(min(len(src), len(dst)))
        start = time.monotonic()
        kv = await self.retrieve(src[:n], cache_salt, timeout=timeout)
        if kv is None:
            return RemapResult(0, 0, False)
        hit = kv.shape[self.geometry.token_axis]
        left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
        new = await self.store(kv, dst[:hit], tsalt, timeout=left)
        return RemapResult(hit, hit, new)

    # ------------------------------------------------------------------ misc

    async def noop(self, *, timeout: float | DefaultType | None = DEFAULT) -> float:
        """Round-trip a ``noop``; returns the round-trip time in seconds."""
        self._require_open()
        self._check_loop()
        t0 = time.perf_counter()
        reply = await self._conn.call(Op.NOOP, (), timeout=self._timeout(timeout))
        if reply.value() != "OK":
            raise ProtocolError(f"noop answered {reply.value()!r}")
        return time.perf_counter() - t0

    async def status(
        self, *, max_age: float | None = None, timeout: float | DefaultType | None = DEFAULT
    ) -> dict[str, Any]:
        """The server's ``/status`` document (cached for ``metadata_ttl`` seconds).

        A fresh fetch first waits (within ``timeout``) for the ``end_session`` messages
        that operations which already returned sent in the background, so that the
        server's session counts reflect every operation that returned before this call.

        Cancellation: a fetch shared with other callers keeps running for them.
        """
        self._require_open()
        self._check_loop()
        timeout = self._timeout(timeout)
        if self._posted:
            start = time.monotonic()
            await _wait_all(self._posted, timeout)  # replies may post follow-ups: a loop
            if timeout is not None:
                timeout = max(timeout - (time.monotonic() - start), 0.0)
        return await self._meta.status(max_age=max_age, timeout=timeout)

    async def config(
        self, *, max_age: float | None = None, timeout: float | DefaultType | None = DEFAULT
    ) -> dict[str, Any]:
        """The server's ``/config`` document (cached for ``metadata_ttl`` seconds).

        Cancellation: a fetch shared with other callers keeps running for them.
        """
        self._require_open()
        self._check_loop()
        return await self._meta.config(max_age=max_age, timeout=self._timeout(timeout))

    async def drain(self, timeout: float | DefaultType | None = DEFAULT) -> bool:
        """Wait until operations abandoned by a timeout or a cancellation have finished
        their server-side cleanup (sessions ended, locks released), and until the
        ``end_session`` messages of operations that returned (sent in the background,
        see docs/design.md) are answered.

        Returns True when none is left, False if ``timeout`` passed first. Cancelling
        the wait does not cancel the cleanups.
        """
        timeout = self._timeout(timeout)
        self._check_loop()
        return await _wait_all(self._ops, timeout)

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
        timeout: float | DefaultType | None = DEFAULT,
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

        _check_iterable(pairs, "pairs")
        self._require_open()
        self._check_loop()
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
        timeout: float | DefaultType | None = DEFAULT,
    ) -> BatchResult:
        """Store many ``(kv, tokens[, cache_salt])`` items concurrently: see
        :func:`lmcache_async.bulk.store_many`.

        Cancellation/timeout: as for :meth:`store`, per item; ``CancelledError`` is re-raised.
        """
        from lmcache_async import bulk

        _check_iterable(items, "items")
        self._require_open()
        self._check_loop()
        with caller_order():  # GPU tensors: ordered after the caller's streams, now
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
        timeout: float | DefaultType | None = DEFAULT,
    ) -> BatchResult:
        """Retrieve many prompts concurrently (token lists or ``(tokens, cache_salt)``): see
        :func:`lmcache_async.bulk.retrieve_many`. Each result's ``kv`` holds the tensor.

        Cancellation/timeout: as for :meth:`retrieve`, per item; ``CancelledError`` is
        re-raised.
        """
        from lmcache_async import bulk

        _check_iterable(token_lists, "token_lists")
        self._require_open()
        self._check_loop()
        with caller_order():  # GPU tensors: ordered after the caller's streams, now
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

    def _timeout(self, timeout: float | DefaultType | None) -> float | None:
        return resolve_timeout(timeout, self.timeout)


def _check_iterable(value: object, name: str) -> None:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of items, got {type(value).__name__}")


#: The prefix the server gives its SHM pool's name (``engine_context._compute_shm_pool_info``).
_POOL_PREFIX: Final = "lmcache_l1_pool_"


def _expected_pool(config: object) -> tuple[str, int] | None:
    """The ``(shm_name, pool_size)`` a registration with the server whose ``/config`` this
    is answers, or ``None`` when ``/config`` does not say (then nothing is checked)."""
    if not isinstance(config, dict):
        return None
    sm = config.get("storage_manager")
    if not isinstance(sm, dict):
        return None
    configs = sm.get("l1_manager_configs")
    if isinstance(configs, list) and len(configs) != 1:
        return ("", 0)
    l1 = sm.get("l1_manager_config")
    mem = l1.get("memory_config") if isinstance(l1, dict) else None
    if not isinstance(mem, dict):
        return None
    name = mem.get("shm_name") or ""
    if not isinstance(name, str):
        return None
    if not name or mem.get("use_lazy") or mem.get("devdax_path"):
        return ("", 0)
    size = mem.get("size_in_bytes")
    if isinstance(size, bool) or not isinstance(size, int):
        return None
    if not name.lstrip("/").startswith(_POOL_PREFIX):
        name = _POOL_PREFIX + name.lstrip("/")
    return (name, size)


def _find_number(doc: object, name: str) -> float | None:
    """The first number under key ``name`` anywhere in a JSON document (depth first)."""
    if isinstance(doc, dict):
        value = doc.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        for v in doc.values():
            found = _find_number(v, name)
            if found is not None:
                return found
    elif isinstance(doc, list):
        for v in doc:
            found = _find_number(v, name)
            if found is not None:
                return found
    return None


def _align(n: int, chunk_size: int) -> int:
    """``n`` rounded down to whole chunks."""
    return n // chunk_size * chunk_size


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)
