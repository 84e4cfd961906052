"""The asyncio client: store, retrieve, lookup and remap KV caches on an LMCache MP server.

Every public operation runs its protocol exchange in a task of its own and the caller
awaits that task under the call's deadline (docs/internals/design.md). When the caller
times out or is cancelled, the task is told it was abandoned and finishes the server
side of the exchange on its own, bounded by ``cleanup_grace`` seconds: it consumes the
prefetch result, releases the read locks it took, commits the SHM reads or writes it
holds and ends its session. A store whose slots were reserved is completed (all its
chunks are committed, never some); a retrieve no longer copies into the caller's tensor.
So a timeout or a cancellation never leaves sessions, locks or reservations behind.

Layers: this module holds the lifecycle (detect the server generation, load the
configuration, register, keep alive, re-register after a restart) and validates every
argument; each operation's RPC sequence lives once in :mod:`lmcache_async._ops`,
over a small channel interface; what differs between server generations is data in
:class:`lmcache_async._wire.WireGeneration`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import time
import warnings
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar, Unpack

import torch

from lmcache_async import _observing as observing, management, observe
from lmcache_async._compose import ComposeResult, Fill, KVPart, compose
from lmcache_async._connection import DEFAULT_MAX_IN_FLIGHT, check_zmq_url
from lmcache_async._cuda.hooks import caller_order, kv_mark, target_mark
from lmcache_async._defaults import DEFAULT, DefaultType, check_timeout, resolve_timeout
from lmcache_async._event_stream import KVEventStream  # issue 33
from lmcache_async._ops import Operations, RemapResult
from lmcache_async._ops.shm import Source
from lmcache_async._runner import OpState, run_detached, wait_all
from lmcache_async._session import Session, TransferMode
from lmcache_async._tensor_checks import check_tensor_storage
from lmcache_async._wire import (
    Op,
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
    LMCacheTimeoutError,
    ProtocolError,
    ServerReplacedError,
    TransferError,
    WrongEventLoopError,
)
from lmcache_async.geometry import KVGeometry
from lmcache_async.hashing import check_hash_algorithm, chunk_hashes, hash_algorithm_of  # issue 33
from lmcache_async.management import DeleteResult, WarmResult  # issue 33
from lmcache_async.rope import RopeSpec

if TYPE_CHECKING:  # bulk imports this module; its types are needed for annotations only
    from lmcache_async.bulk import (
        BatchProgress,
        BatchResult,
        ComposeItem,
        RemapPair,
        RetrieveItem,
        StoreItem,
    )

__all__ = [
    "AsyncClient",
    "ClientOptions",
    "ComposeResult",
    "KVPart",
    "RemapResult",
    "TransferMode",
    "connect",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
Configs = dict[str, Any] | None


class _Lifecycle(enum.Enum):
    NEW = "new"
    OPENING = "opening"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class _Abandoned(Exception):
    """An operation whose caller left before it sent anything (never seen by callers)."""


#: Closes of clients collected while open, kept referenced until they are done.
_closing_collected: set[asyncio.Task[None]] = set()


def _close_collected(loop: asyncio.AbstractEventLoop, session: Session) -> None:
    """On the client's running loop: close the session of a collected client (background
    tasks stopped, unregistered, socket and HTTP session closed)."""
    closing = loop.create_task(session.close(unregister=True), name="lmcache-close-collected")
    _closing_collected.add(closing)
    closing.add_done_callback(_closing_collected.discard)


def _collected_open(loop: asyncio.AbstractEventLoop, session: Session, desc: str, pid: int) -> None:
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
            loop.call_soon_threadsafe(_close_collected, loop, session)
            return
    session.release_locally(loop)


class ClientOptions(TypedDict, total=False):
    """The keyword arguments of :class:`AsyncClient`, written once: :func:`connect`,
    :class:`~lmcache_async.sync_client.Client` and ``Client.connect`` take the same
    (``**options``), with the defaults and meanings :class:`AsyncClient` gives."""

    geometry: KVGeometry | None
    timeout: float | None
    transfer: TransferMode
    num_kv_readers: int
    ping_interval: float
    cleanup_grace: float
    metadata_ttl: float
    prefault_shm: bool
    api_key: str | None
    max_in_flight: int
    observers: Sequence[observe.Observer]
    tracer_provider: Any
    meter_provider: Any


async def connect(
    url: str = "tcp://localhost:5555",
    http_url: str = "http://localhost:8080",
    model_name: str = "",
    **options: Unpack[ClientOptions],
) -> AsyncClient:
    """Create an :class:`AsyncClient` and open it (see there for the arguments).

    Raises:
        LMCacheConnectionError: the HTTP or ZMQ endpoint is unreachable.
        ModelNotRegisteredError: no geometry given and ``/status`` lacks the model.
        LMCacheTimeoutError: the server did not answer within ``timeout``.

    Cancellation: everything opened so far is closed again.
    """
    client = AsyncClient(url, http_url, model_name, **options)
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
            sooner, after 1 s without replies (docs/internals/design.md, "A server replaced behind
            the connection").
        cleanup_grace: extra seconds an abandoned operation may spend cleaning up.
        metadata_ttl: seconds ``/config`` and ``/status`` stay cached.
        prefault_shm: map the pages of each SHM slot this client writes (a store's,
            a remap's targets) into this process (one ``madvise`` per 2 MiB run) the
            first time a copy writes them, in the copying thread, instead of faulting
            page by page during the copy; slots only read fault in during the copy
            (cheaper there); the cost follows the slots this client touches, never the
            pool's size (see :meth:`lmcache_async._shm.ShmPool.populate`). Slots whose
            pages nobody has written yet are written through the segment's descriptor
            instead, either way (:meth:`lmcache_async._shm.ShmPool.fill`).
        api_key: sent as ``Authorization: Bearer KEY`` on every HTTP call (servers
            started with an API key answer 401 without it); default: the
            ``LMCACHE_API_KEY`` environment variable. The ZMQ side has no keys.
        max_in_flight: most requests on the wire at once (default 1024); a request
            beyond that waits for a free place under its operation's deadline, so an
            unanswering server makes calls time out instead of growing the pending table.
        observers: told when each operation starts and ends
            (:class:`~lmcache_async.observe.Observer`), besides those
            :func:`~lmcache_async.observe.add_observer` gave every client.
        tracer_provider: an OpenTelemetry ``TracerProvider``: the client's operations
            become spans there (:mod:`lmcache_async.otel`; needs the ``otel`` extra).
            Neither this nor ``meter_provider`` given: OpenTelemetry is not imported.
        meter_provider: an OpenTelemetry ``MeterProvider``: the client's operations
            become metrics there (the same extra).
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
        observers: Sequence[observe.Observer] = (),
        tracer_provider: Any = None,
        meter_provider: Any = None,
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
        #: Told of each operation (``None``: none, and nothing is recorded).
        self._observers = _observers(observers, tracer_provider, meter_provider)
        #: An observer asks for the phases of each operation.
        self._phases = any(getattr(o, "wants_phases", False) for o in self._observers or ())
        #: server.address and server.port of the records.
        self._endpoint = observing.endpoint(url)
        self.url = url
        self.http_url = http_url
        self.model_name = model_name
        self.timeout = timeout
        self._state = _Lifecycle.NEW
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ops: set[asyncio.Future[Any]] = set()  # operation tasks and cleanup replies
        self._posted: set[asyncio.Future[Any]] = set()  # cleanup replies awaited in the background
        self._closed_event: asyncio.Event | None = None
        #: Releases the socket of a client collected while open (made by open()).
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # The session holds this client's tracking weakly: its background tasks must not
        # keep a dropped client alive (so that the finalizer can release the session).
        track = _weak_tracker(self)
        self._session = Session(
            url,
            http_url,
            model_name,
            geometry=geometry,
            transfer=transfer,
            num_kv_readers=num_kv_readers,
            ping_interval=ping_interval,
            cleanup_grace=check_timeout(cleanup_grace, "cleanup_grace", allow_none=False) or 0.0,
            metadata_ttl=metadata_ttl,
            prefault_shm=bool(prefault_shm),
            api_key=api_key,
            max_in_flight=max_in_flight,
            track=track,
        )

    # ------------------------------------------------------------------ properties

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk (the server's ``--chunk-size``)."""
        self._require_open()
        return self._session.chunk_size

    @property
    def geometry(self) -> KVGeometry:
        """The KV layout in use (explicit, or derived from ``/status``)."""
        self._require_open()
        assert self._session.geometry is not None
        return self._session.geometry

    @property
    def transfer(self) -> Literal["shm", "pickle"]:
        """``"shm"`` or ``"pickle"``: how tensors travel."""
        self._require_open()
        assert self._session.transfer is not None
        return self._session.transfer

    @property
    def server_version(self) -> str:
        """The LMCache version the server reported on ``/lmc_version`` at connect
        (``"unknown"`` for a server without that route, talked to as 0.5.6)."""
        self._require_open()
        return self._session.server_version or "unknown"

    @property
    def wire_generation(self) -> str:
        """The wire generation in use, ``"0.5.6"`` or ``"0.5.7"`` (picked from
        :attr:`server_version`)."""
        self._require_open()
        return self._session.wire.name

    @property
    def instance_id(self) -> int:
        """The engine-driven registration id of this client (random, 63 bits)."""
        return self._session.instance_id

    @property
    def closed(self) -> bool:
        return self._state is _Lifecycle.CLOSED

    @property
    def cleanup_grace(self) -> float:
        """Extra seconds an abandoned operation may spend cleaning up (settable)."""
        return self._session.cleanup_grace

    @cleanup_grace.setter
    def cleanup_grace(self, value: float) -> None:
        self._session.cleanup_grace = check_timeout(value, "cleanup_grace", allow_none=False) or 0.0

    @property
    def num_kv_readers(self) -> int:
        """Read locks a lookup reserves per object."""
        return self._session.num_kv_readers

    def __repr__(self) -> str:
        return (
            f"<AsyncClient {self.model_name!r} at {self.url} state={self._state.value} "
            f"transfer={self._session.transfer} in_flight={len(self._ops)}>"
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
            LMCacheConnectionError: an endpoint is unreachable.
            LMCacheTimeoutError: the server did not answer within ``timeout``.
            ModelNotRegisteredError: no geometry given and ``/status`` lacks the model.
            ServerError: the server does not serve engine-driven transfers, or its two
                endpoints are not one server.
            TransferError: ``transfer="shm"`` but SHM is unusable.

        Cancellation or failure closes whatever was opened.
        """
        if self._state is not _Lifecycle.NEW:
            raise ClientStateError(f"open() on a client that is {self._state.value}")
        self._state = _Lifecycle.OPENING
        self._loop = asyncio.get_running_loop()
        try:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            await self._session.open(lambda: _remaining(deadline))
            self._finalizer = weakref.finalize(
                self,
                _collected_open,
                self._loop,
                self._session,
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
        at most :data:`~lmcache_async._session.UNREGISTER_TIMEOUT` seconds (skipped while disconnected).

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
                await wait_all(self._ops, self.cleanup_grace)
        except asyncio.CancelledError:
            unregister = False
            raise
        finally:
            left = [t for t in self._ops if not t.done()]
            if left:
                self._session.retire_registration(
                    self._session.instance_id, f"{len(left)} operations were still running at close"
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
        self._session.release_locally(loop)

    def _detach_finalizer(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()

    async def _shutdown(self, *, unregister: bool) -> None:
        try:
            await self._session.close(unregister=unregister)
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
        self._session.drop_inherited()
        self._ops = set()
        self._posted = set()

    def _check_loop(self) -> None:
        """Refuse a call from an event loop other than the one that opened the client."""
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise WrongEventLoopError(
                "the client is used from an event loop other than the one that opened it"
            )

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
        self,
        name: str,
        timeout: float | None,
        body: Callable[[Operations, OpState], Awaitable[T]],
        finish: Callable[[observe.Operation, T], None] | None = None,
        asked: int = 0,
        salt: str = "",
    ) -> T:
        """Run ``body`` over this client's operations in a task of its own (see
        :func:`~lmcache_async._runner.run_detached`), re-registering first if needed.
        With observers, it is an observed operation: ``finish`` fills in what its result
        says, ``asked`` and ``salt`` are its tokens asked and cache salt."""
        self._require_open()
        self._check_loop()

        async def run(op: OpState) -> T:
            # Started while the server is away: wait briefly for the reconnection (then the
            # new server is registered with first), or fail fast with a connection error.
            session = self._session
            await session.conn.wait_usable(op.remaining())
            if session.watch.due():  # silence: was the server replaced behind the connection?
                await session.watch.check_quietly(op.remaining())
            for attempt in (1, 2):
                try:
                    await session.ensure_registered(op.remaining())
                    if op.abandoned:  # the caller left before anything was sent
                        raise _Abandoned
                    return await body(session.operations(), op)
                except LMCacheTimeoutError:
                    # Unanswered prepare/commit requests are what a reaped registration looks
                    # like; re-registering an existing id is cheap, so do it before the next op.
                    session.stale = True
                    raise
                except ServerReplacedError as exc:
                    # Everything this attempt did was on the old server (gone with it) or
                    # sent under a retired id (nothing for the new one): run it again once,
                    # on the new server, unless the caller left.
                    if attempt == 2 or op.abandoned:
                        again = " (again, after running it once more)" if attempt == 2 else ""
                        raise ServerReplacedError(f"{name}: {exc}{again}") from exc
                    log.debug("%s: the server was replaced while it ran; running it again", name)
            raise AssertionError("unreachable")

        if self._observers is None or finish is None:
            return await run_detached(name, timeout, self.cleanup_grace, run, self._track)
        record = self._record(name, asked, salt)
        return await observing.observed(
            self._observers,
            record,
            lambda: run_detached(name, timeout, self.cleanup_grace, run, self._track, record),
            finish,
        )

    def _record(self, name: str, asked: int = 0, salt: str = "") -> observe.Operation:
        """A new observed record of operation ``name`` (the client is open)."""
        s = self._session
        address, port = self._endpoint
        return observe.Operation(
            name,
            address,
            port,
            self.model_name,
            s.transfer,
            s.wire.name,
            s.chunk_size,
            asked,
            observe.salt_hash(salt),
            phases=[] if self._phases else None,
        )

    async def _observe(
        self,
        name: str,
        run: Callable[[], Awaitable[T]],
        finish: Callable[[observe.Operation, T], None],
        asked: int = 0,
        salt: str = "",
    ) -> T:
        """``await run()`` as observed operation ``name`` (a bulk job, a pickle remap):
        the parent of the operations it runs."""
        if self._observers is None:
            return await run()
        return await observing.observed(self._observers, self._record(name, asked, salt), run, finish)

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

    # ------------------------------------------------------------------ helpers

    def _aligned(self, n: int) -> int:
        return n // self._session.chunk_size * self._session.chunk_size

    def _check_kv(self, kv: object, num_tokens: int) -> torch.Tensor:
        geom = self._session.geometry
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
            observing.finish_lookup,
            len(toks),
            cache_salt,
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
                (``docs/internals/design.md``, "CUDA tensors").
            request_configs: LMCache request configs carried in the keys of the lookup
                and the retrieve (str keys, msgpack-encodable values), as the official
                SDK sends them; e.g. ``{"lmcache.skip_load": True}`` makes a 0.5.7
                server report a miss.
            timeout: deadline in seconds (default: the client's).

        Returns:
            ``[2, L, T_hit, D]`` (on ``device``, or ``out``'s), or ``None`` on a miss. A
            new CPU tensor of 4 MiB or more reuses the memory of an earlier one of its
            size that is gone (at most 1 GiB is kept for that): its storage cannot be
            resized (``resize_`` raises); copy it to resize.

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

        if self._session.cannot_retrieve is not None:  # before anything is sent: never a silent miss
            raise TransferError(self._session.cannot_retrieve)

        def body(ops: Operations, op: OpState) -> Awaitable[torch.Tensor | None]:
            n = _align(len(toks), ops.reg.chunk_size)
            if out is not None:  # a new chunk size may align further than ``out`` reaches
                n = min(n, _align(out.shape[axis], ops.reg.chunk_size))
            return ops.retrieve(op, toks, n, cache_salt, configs, out, mark=mark)

        return await self._run("retrieve", timeout, body, observing.finish_retrieve, len(toks), cache_salt)

    def _check_out(self, out: object, end: int) -> None:
        geom = self._session.geometry
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
            observing.finish_store,
            len(toks),
            cache_salt,
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
        if self._session.pool is not None:
            # The target takes no more than its whole chunks (of the live chunk size).
            return await self._run(
                "remap",
                timeout,
                lambda ops, op: ops.remap(
                    op, src, dst, _align(min(len(src), len(dst)), ops.reg.chunk_size), cache_salt, tsalt
                ),
                observing.finish_remap,
                len(src),
                cache_salt,
            )
        if self._observers is None:
            return await self._remap_pickle(src, dst, cache_salt, tsalt, timeout)
        return await self._observe(
            "remap",
            lambda: self._remap_pickle(src, dst, cache_salt, tsalt, timeout),
            observing.finish_remap,
            len(src),
            cache_salt,
        )

    async def _remap_pickle(
        self, src: list[int], dst: list[int], cache_salt: str, tsalt: str, timeout: float | None
    ) -> RemapResult:
        """A remap on the pickle transport: a retrieve, then a store of what it found."""
        n = self._aligned(min(len(src), len(dst)))
        start = time.monotonic()
        kv = await self.retrieve(src[:n], cache_salt, timeout=timeout)
        if kv is None:
            return RemapResult(0, 0, False)
        hit = kv.shape[self.geometry.token_axis]
        left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
        new = await self.store(kv, dst[:hit], tsalt, timeout=left)
        return RemapResult(hit, hit, new)

    async def compose(
        self,
        target_tokens: Sequence[int],
        parts: Sequence[KVPart],
        *,
        rope: RopeSpec | None = None,
        cache_salt: str = "",
        timeout: float | DefaultType | None = DEFAULT,
    ) -> ComposeResult:
        """Store under ``target_tokens`` the KV of cached ranges placed one after another.

        Each :class:`KVPart` is ``source_tokens[start:end]``'s KV from the cache, placed
        next in the target (the first at position 0), its keys rotated by (its position
        in the target - ``start``) with ``rope`` (:class:`~lmcache_async.RopeSpec`);
        values are copied. The parts may be shorter than the target; the target's whole
        chunks they cover are stored, as :meth:`store` does. On SHM the composition runs
        inside the server's pool, as :meth:`remap` does: the sources' slots are read
        (each distinct source once, as far as its parts reach) straight into the
        target's reserved slots, keys rotated on the way, one commit. Otherwise each
        distinct source is retrieved once, all concurrently, and the target is stored
        with one store. ``cache_salt`` is the target's namespace and the default
        of the parts' ``cache_salt``. :meth:`remap` is the case of one unshifted part.

        Returns:
            A :class:`~lmcache_async.ComposeResult`: per part its offset, shift, hit
            and tokens placed; the tokens stored and whether a chunk was added.

        Raises:
            ValueError/TypeError: bad arguments, parts longer than the target, a shifted
                part without ``rope``, a part reaching past its source's whole chunks
                (all before anything is sent).
            LMCacheTimeoutError: no answer within ``timeout`` (one deadline for the
                retrieves and the store).

        A part whose range is not cached makes the call store nothing: the result says
        which (:attr:`ComposeResult.missed`). Cancellation/timeout: before the target's
        slots are reserved nothing is stored (read locks, pending reads and sessions are
        released in the background); after, as :meth:`store` (the chunks are written and
        all of them committed).
        """
        self._require_open()
        in_pool = self._compose_in_pool if self._session.pool is not None else None

        async def run() -> ComposeResult:
            return await compose(
                self,
                target_tokens,
                parts,
                rope=rope,
                cache_salt=cache_salt,
                timeout=self._timeout(timeout),
                in_pool=in_pool,
            )

        if in_pool is not None:  # one operation of its own (observed in _compose_in_pool)
            return await run()
        asked = len(target_tokens) if isinstance(target_tokens, Sized) else 0
        return await self._observe(
            "compose",
            run,
            lambda o, r: observing.finish_compose(
                o,
                [p.tokens for p in r.parts],
                [p.tokens if p.hit else 0 for p in r.parts],
                r.stored_tokens,
                r.stored_new,
            ),
            asked,
            cache_salt,
        )

    async def _compose_in_pool(
        self,
        sources: list[Source],
        target: list[int],
        stored: int,
        salt: str,
        fill: Fill,
        timeout: float | None,
    ) -> tuple[list[int], bool]:
        needed = [read for _, read, _ in sources]
        return await self._run(
            "compose",
            timeout,
            lambda ops, op: ops.compose_in_pool(op, sources, target, stored, salt, fill),
            lambda o, r: observing.finish_compose(o, needed, r[0], stored, r[1]),
            len(target),
            salt,
        )

    # ------------------------------------------------------------------ misc

    async def noop(self, *, timeout: float | DefaultType | None = DEFAULT) -> float:
        """Round-trip a ``noop``; returns the round-trip time in seconds."""
        self._require_open()
        self._check_loop()
        t0 = time.perf_counter()
        reply = await self._session.conn.call(Op.NOOP, (), timeout=self._timeout(timeout))
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
            await wait_all(self._posted, timeout)  # replies may post follow-ups: a loop
            if timeout is not None:
                timeout = max(timeout - (time.monotonic() - start), 0.0)
        return await self._session.meta.status(max_age=max_age, timeout=timeout)

    async def config(
        self, *, max_age: float | None = None, timeout: float | DefaultType | None = DEFAULT
    ) -> dict[str, Any]:
        """The server's ``/config`` document (cached for ``metadata_ttl`` seconds).

        Cancellation: a fetch shared with other callers keeps running for them.
        """
        self._require_open()
        self._check_loop()
        return await self._session.meta.config(max_age=max_age, timeout=self._timeout(timeout))

    async def drain(self, timeout: float | DefaultType | None = DEFAULT) -> bool:
        """Wait until operations abandoned by a timeout or a cancellation have finished
        their server-side cleanup (sessions ended, locks released), and until the
        ``end_session`` messages of operations that returned (sent in the background,
        see docs/internals/design.md) are answered.

        Returns True when none is left, False if ``timeout`` passed first. Cancelling
        the wait does not cancel the cleanups.
        """
        timeout = self._timeout(timeout)
        self._check_loop()
        return await wait_all(self._ops, timeout)

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
        return await self._observe(
            "remap_many",
            lambda: bulk.remap_many(
                self,
                pairs,
                concurrency=concurrency,
                max_bytes_in_flight=max_bytes_in_flight,
                progress=progress,
                return_exceptions=return_exceptions,
                timeout=self._timeout(timeout),
            ),
            observing.finish_batch,
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
            return await self._observe(
                "store_many",
                lambda: bulk.store_many(
                    self,
                    items,
                    concurrency=concurrency,
                    max_bytes_in_flight=max_bytes_in_flight,
                    progress=progress,
                    return_exceptions=return_exceptions,
                    timeout=self._timeout(timeout),
                ),
                observing.finish_batch,
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
        device: torch.device | str | None = None,
    ) -> BatchResult:
        """Retrieve many prompts concurrently (token lists or ``(tokens, cache_salt)``): see
        :func:`lmcache_async.bulk.retrieve_many`. Each result's ``kv`` holds the tensor,
        on ``device`` (default: the CPU).

        Cancellation/timeout: as for :meth:`retrieve`, per item; ``CancelledError`` is
        re-raised.
        """
        from lmcache_async import bulk

        _check_iterable(token_lists, "token_lists")
        target_mark(None, device)  # a bad device= is refused before anything is sent
        self._require_open()
        self._check_loop()
        with caller_order():  # GPU tensors: ordered after the caller's streams, now
            return await self._observe(
                "retrieve_many",
                lambda: bulk.retrieve_many(
                    self,
                    token_lists,
                    concurrency=concurrency,
                    max_bytes_in_flight=max_bytes_in_flight,
                    progress=progress,
                    return_exceptions=return_exceptions,
                    timeout=self._timeout(timeout),
                    device=device,
                ),
                observing.finish_batch,
            )

    async def compose_many(
        self,
        items: Iterable[ComposeItem | Sequence[Any]],
        *,
        rope: RopeSpec | None = None,
        concurrency: int = 8,
        max_bytes_in_flight: int = 1 << 30,
        progress: Callable[[BatchProgress], object] | None = None,
        return_exceptions: bool = True,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> BatchResult:
        """Run many :meth:`compose` calls (``(target_tokens, parts[, cache_salt])``)
        concurrently: see :func:`lmcache_async.bulk.compose_many`.

        Cancellation/timeout: as for :meth:`compose`, per item; ``CancelledError`` is
        re-raised.
        """
        from lmcache_async import bulk

        _check_iterable(items, "items")
        self._require_open()
        self._check_loop()
        return await self._observe(
            "compose_many",
            lambda: bulk.compose_many(
                self,
                items,
                rope=rope,
                concurrency=concurrency,
                max_bytes_in_flight=max_bytes_in_flight,
                progress=progress,
                return_exceptions=return_exceptions,
                timeout=self._timeout(timeout),
            ),
            observing.finish_batch,
        )

    # ---- end of bulk operations ----

    def _timeout(self, timeout: float | DefaultType | None) -> float | None:
        return resolve_timeout(timeout, self.timeout)

    # ---- issue 33: KV events, chunk hashes, management calls (the logic lives in
    # lmcache_async._event_stream, lmcache_async.hashing and lmcache_async.management)

    def kv_events(
        self,
        model_name: str | None = None,
        *,
        cursor: int = 0,
        incarnation: int | None = None,
        max_events: int = 256,
        ping_interval: float = 10.0,
        reconnect_timeout: float | None = 60.0,
    ) -> KVEventStream:
        """The server's KV events for ``model_name`` (default: this client's model), as
        an async iterator of :class:`~lmcache_async.events.StoredEvent`,
        :class:`~lmcache_async.events.RemovedEvent` and
        :class:`~lmcache_async.events.Resync` items::

            async with client.kv_events() as events:
                async for ev in events:
                    ...

        The subscription uses a random subscriber id of its own (pinged every
        ``ping_interval`` seconds, never this client's registration id); the server sends
        the next batch of at most ``max_events`` records (1..1024) only when the
        consumer asked for the item after the previous batch's last one; a lost
        connection or a restarted server is resumed from :attr:`KVEventStream.cursor`
        (``cursor``/``incarnation`` resume a stream of an earlier process), and a
        ``Resync`` says events were missed. ``stored`` events come only from the
        lmcache-driven (vLLM) path: stores made by this client publish none
        (docs/guides/routing.md).

        Raises (here, nothing sent): ValueError/TypeError for bad arguments.
        Iteration raises what :meth:`KVEventStream.__anext__` says; waiting for an
        event has no deadline (an idle server sends nothing).

        Cancellation, ``aclose()``, leaving ``async with``, or dropping the iterator:
        the subscription is cancelled on the server.
        """
        name = self.model_name if model_name is None else validate_model_name(model_name)
        stream = KVEventStream(
            self._session.conn,
            name,
            cursor=cursor,
            incarnation=incarnation,
            max_events=max_events,
            ping_interval=ping_interval,
            reconnect_timeout=reconnect_timeout,
        )
        self._require_open()
        self._check_loop()
        return stream

    def chunk_hashes(self, tokens: Sequence[int], *, start: int = 0, end: int | None = None) -> list[bytes]:
        """The server's chunk hashes (32-byte blake3 digests) of ``tokens`` at this
        server's chunk size: the hashes its KV events carry
        (:func:`lmcache_async.hashing.chunk_hashes`; ``start``/``end`` as there).

        Raises:
            UnsupportedHashAlgorithmError: the server's ``/status`` or ``/config`` (read
                at connect) names another hash algorithm than blake3.
            ValueError/TypeError: bad tokens or bounds.
        """
        self._require_open()
        self._check_hash_algorithm()
        return chunk_hashes(tokens, self._session.chunk_size, start=start, end=end)

    def _check_hash_algorithm(self) -> None:
        meta = self._session.meta
        config, status = meta._cache["config"].value, meta._cache["status"].value
        check_hash_algorithm(hash_algorithm_of(config, status), self.http_url)

    async def experimental(self, *, timeout: float | DefaultType | None = DEFAULT) -> frozenset[str]:
        """The experimental features the server advertises (``get_experimental``):
        0.5.6 says ``"kv_event_stream"`` when its event channel is on; 0.5.7 lists only
        features its modules add (``"transfer_query"``), and an empty set is usual.

        Raises:
            LMCacheTimeoutError: no answer within ``timeout``. ProtocolError: not a list of str.
        """
        self._require_open()
        self._check_loop()
        reply = await self._session.conn.call(Op.GET_EXPERIMENTAL, (), timeout=self._timeout(timeout))
        value = reply.value()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ProtocolError(f"get_experimental answered {value!r}")
        return frozenset(value)

    async def clear(self, *, force: bool, timeout: float | DefaultType | None = DEFAULT) -> None:
        """DANGER: empty the server's L1 cache for EVERY model and EVERY cache salt,
        not only this client's (the ``clear`` RPC; L2 is untouched).

        ``force`` must be given: ``False`` frees what no reader or writer holds (locked
        objects and live reservations stay); ``True`` frees everything, including
        objects other clients are reading and reservations they are filling (their
        operations may then fail or read freed memory: only on a server nobody else uses).
        The removals are published as ``removed`` KV events.

        Raises:
            TypeError: ``force`` is not a bool (nothing sent).
            LMCacheTimeoutError: no answer within ``timeout`` (the clear may still run).
        """
        if not isinstance(force, bool):
            raise TypeError(f"force must be a bool, got {type(force).__name__}")
        self._require_open()
        self._check_loop()
        await self._session.conn.call(Op.CLEAR, (force,), timeout=self._timeout(timeout))

    async def warm(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        poll_interval: float = 0.05,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> WarmResult:
        """Load ``tokens``' chunks from the server's L2 into its L1 and leave them there
        (``POST /cache/prefetches``, polled until it completes).

        Best effort: the chunks are resident but unlocked, so the next eviction may take
        them; chunks missing from L2 are skipped (gaps allowed); ``found`` counts chunks
        already in L1 too. Needs a server with an L2 adapter and a layout registered for
        the model by an inference engine.

        Raises:
            ServerError: the server cannot warm (no L2, no layout for the model, no route).
            LMCacheTimeoutError: not completed within ``timeout`` (the prefetch may go on).

        Cancellation: the polling stops; the server's prefetch goes on.
        """
        toks = validate_tokens(tokens)
        validate_cache_salt(cache_salt)
        timeout = self._timeout(timeout)
        self._require_open()
        self._check_loop()
        return await management.warm(
            self._session.meta,
            self.model_name,
            self.geometry.world_size,
            toks,
            cache_salt,
            timeout,
            poll_interval,
        )

    async def delete(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        start: int = 0,
        tier: Literal["l1", "l2", "all"] = "l1",
        force: bool = False,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> DeleteResult:
        """Delete the chunks of ``tokens`` from ``start`` (a multiple of the chunk size)
        to the last whole chunk, for this client's model and ``cache_salt``, on every
        rank (``DELETE /cache/objects`` with keys computed here).

        DANGER: the chunks go for every client of this model and salt, and a prompt
        sharing the prefix loses it too (chunks are named by the whole prefix up to
        them). With ``force`` locked chunks are deleted as well (a reader holding them
        may read freed memory). ``tier="l2"``/``"all"`` also deletes from L2. Published
        as ``removed`` KV events (L1).

        Raises:
            UnsupportedHashAlgorithmError: the server does not hash with blake3.
            ServerError/HTTPStatusError: the server refused the delete.
            LMCacheTimeoutError: no answer within ``timeout``.
        """
        toks = validate_tokens(tokens)
        validate_cache_salt(cache_salt)
        if tier not in ("l1", "l2", "all"):
            raise ValueError(f"tier must be 'l1', 'l2' or 'all', got {tier!r}")
        if not isinstance(force, bool):
            raise TypeError(f"force must be a bool, got {type(force).__name__}")
        timeout = self._timeout(timeout)
        hashes = self.chunk_hashes(toks, start=start)
        keys = management.object_keys(hashes, self.model_name, self.geometry.world_size, cache_salt)
        self._check_loop()
        if not keys:
            return DeleteResult(0, 0)
        return await management.delete(self._session.meta, keys, tier, force, timeout)

    # ---- end issue 33


def _observers(
    given: Sequence[observe.Observer], tracer_provider: Any, meter_provider: Any
) -> tuple[observe.Observer, ...] | None:
    """The client's observers: ``given``, the OpenTelemetry one if a provider is given,
    and those :func:`~lmcache_async.observe.add_observer` gave; ``None`` when none."""
    if isinstance(given, str) or not isinstance(given, Sequence):
        raise TypeError(f"observers must be a sequence of observers, got {type(given).__name__}")
    found = [*given]
    for o in found:
        if not callable(getattr(o, "operation_started", None)) or not callable(
            getattr(o, "operation_ended", None)
        ):
            raise TypeError(
                "an observer needs operation_started(op) and operation_ended(op) methods, "
                f"got {type(o).__name__}"
            )
    if tracer_provider is not None or meter_provider is not None:
        from lmcache_async.otel import OpenTelemetryObserver  # only when asked for

        found.append(OpenTelemetryObserver(tracer_provider, meter_provider))
    found.extend(o for o in observe.observers() if o not in found)
    return tuple(found) or None


def _check_iterable(value: object, name: str) -> None:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of items, got {type(value).__name__}")


#: The prefix the server gives its SHM pool's name (``engine_context._compute_shm_pool_info``).


def _align(n: int, chunk_size: int) -> int:
    """``n`` rounded down to whole chunks."""
    return n // chunk_size * chunk_size


def _weak_tracker(client: AsyncClient) -> Callable[[asyncio.Future[Any]], None]:
    """``client._track_posted`` through a weak reference (a no-op once it is collected)."""
    ref = weakref.ref(client)

    def track(fut: asyncio.Future[Any]) -> None:
        alive = ref()
        if alive is not None:
            alive._track_posted(fut)

    return track


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)
