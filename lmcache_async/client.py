"""The asyncio client: store, retrieve, lookup and remap KV caches on an LMCache MP server.

Every public operation runs its protocol exchange in a task of its own and the caller
awaits that task under the call's deadline (docs/internals/design.md). When the caller
times out or is cancelled, the task is told it was abandoned and finishes the server
side of the exchange on its own, bounded by ``cleanup_grace`` seconds: it consumes the
prefetch result, releases the read locks it took, commits the SHM reads or writes it
holds and ends its session. A store whose slots were reserved is completed (all its
chunks are committed, never some); a retrieve no longer copies into the caller's tensor.
So a timeout or a cancellation never leaves sessions, locks or reservations behind.

Layers (docs/internals/design.md): this module holds the public API, the argument checks
and the client's lifecycle; the operation runner it holds runs each call over the session,
the one way to the server.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
import warnings
import weakref
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence, Sized
from typing import Any, Literal, TypedDict, Unpack

import torch

from lmcache_async import bulk, management, observe
from lmcache_async._base.tasks import wait_all
from lmcache_async._base.timeouts import DEFAULT, DefaultType, check_timeout, resolve_timeout
from lmcache_async._engine import compose as _compose, observing as observing
from lmcache_async._engine.cuda.hooks import kv_mark, target_mark
from lmcache_async._engine.event_stream import refuse_embedded, subscribe
from lmcache_async._engine.op_runner import OperationRunner, check_iterable, client_observers, weakly
from lmcache_async._engine.ops.calls import ComposeCall, LookupCall, RemapCall, RetrieveCall, StoreCall, align
from lmcache_async._engine.session import Session, collected_open
from lmcache_async._engine.tensor_checks import check_kv, check_out
from lmcache_async._protocol.urls import check_zmq_url
from lmcache_async._protocol.wire import (
    Op,
    validate_cache_salt,
    validate_model_name,
    validate_request_configs,
    validate_tokens,
)
from lmcache_async._transport.connection import DEFAULT_MAX_IN_FLIGHT
from lmcache_async.bulk import BatchOptions, BatchResult, ComposeItem, RemapPair, RetrieveItem, StoreItem
from lmcache_async.errors import (
    ClientClosedError,
    ClientNotOpenError,
    ClientStateError,
    ForkedClientError,
    ProtocolError,
    TransferError,
    WrongEventLoopError,
)
from lmcache_async.events import KVEvent
from lmcache_async.geometry import KVGeometry
from lmcache_async.hashing import chunk_hashes
from lmcache_async.results import ComposeResult, KVPart, RemapResult, TransferMode
from lmcache_async.rope import RopeSpec

__all__ = ["AsyncClient", "ClientOptions", "connect"]

log = logging.getLogger(__name__)


class _Lifecycle(enum.Enum):
    NEW = "new"
    OPENING = "opening"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


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
            ``"shm"`` or ``"inline"`` to insist (``"pickle"``: the older name of
            ``"inline"``; :attr:`transfer` reports ``"pickle"`` for both).
        num_kv_readers: read locks a lookup reserves per object (>= 1).
        ping_interval: seconds between keep-alive refreshes of the registration (<= 30);
            a refresh is also made at once when the connection comes back after a loss.
            A server replaced behind a connection that stays up (a proxy) is noticed
            sooner, after 1 s without replies (docs/internals/design.md, "A server replaced behind
            the connection").
        cleanup_grace: extra seconds an abandoned operation may spend cleaning up.
        metadata_ttl: seconds ``/config`` and ``/status`` stay cached.
        prefault_shm: map the pages of each SHM slot this client writes (a store's, a
            remap's targets) into this process (one ``madvise`` per 2 MiB run) the first
            time a copy writes them, instead of faulting page by page during the copy; the
            cost follows the slots this client touches, never the pool's size. Slots
            nobody has written yet are written through the segment's descriptor instead.
        api_key: sent as ``Authorization: Bearer KEY`` on every HTTP call (servers
            started with an API key answer 401 without it); default: the
            ``LMCACHE_API_KEY`` environment variable. The ZMQ side has no keys.
        max_in_flight: most requests on the wire at once (default 1024); a request
            beyond that waits for a free place under its operation's deadline, so an
            unanswering server makes calls time out instead of growing the pending table.
        observers: told when each operation starts and ends
            (:class:`~lmcache_async.observe.Observer`), besides those
            :func:`~lmcache_async.observe.add_observer` gave every client; for
            OpenTelemetry spans and metrics, an
            :class:`~lmcache_async.otel.OpenTelemetryObserver` (the ``otel`` extra).
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
    ) -> None:
        check_zmq_url(url)
        if not isinstance(http_url, str) or not http_url.startswith(("http://", "https://")):
            raise ValueError(f"http_url must start with http:// or https://, got {http_url!r}")
        validate_model_name(model_name)
        if geometry is not None and not isinstance(geometry, KVGeometry):
            raise TypeError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        timeout = check_timeout(timeout, "timeout")
        if transfer not in ("auto", "shm", "inline", "pickle"):
            raise ValueError(
                f"transfer must be 'auto', 'shm' or 'pickle' (or 'inline', the same), got {transfer!r}"
            )
        if isinstance(num_kv_readers, bool) or not isinstance(num_kv_readers, int) or num_kv_readers < 1:
            raise ValueError(f"num_kv_readers must be an int >= 1, got {num_kv_readers!r}")
        if not 0 < ping_interval <= 30:
            raise ValueError(f"ping_interval must be in (0, 30] seconds, got {ping_interval!r}")
        # Runs the operations (observed by ``observers``), tracks their tasks; the
        # lifecycle check it calls holds this client weakly.
        self._runner = OperationRunner(
            model_name, observing.endpoint(url), client_observers(observers), weakly(self._live)
        )
        self.url = url
        self.http_url = http_url
        self.model_name = model_name
        self.timeout = timeout
        self._state = _Lifecycle.NEW
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed_event: asyncio.Event | None = None
        #: The task running the session's open steps, while open() runs.
        self._opening: asyncio.Task[None] | None = None
        #: aclose() was called while open() ran.
        self._close_asked = False
        #: Releases the socket of a client collected while open (made by open()).
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # The session holds the runner's tracking weakly: its background tasks must not
        # keep a dropped client alive (so that the finalizer can release the session).
        track = self._runner.weak_tracker()
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
        self._runner.session = self._session

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
    def usable(self) -> bool:
        """Open, and connected to the server now (no I/O: the connection's last news; a
        server down makes the next call wait briefly for it, then fail)."""
        return self._state is _Lifecycle.OPEN and self._session.conn.usable

    @property
    def in_flight(self) -> int:
        """Operations of this client running now (bulk jobs and their items included;
        the cleanup replies they left in the background not)."""
        return self._runner.in_flight

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

    @property
    def hash_algorithm(self) -> str:
        """The server's ``--hash-algorithm`` (read at connect; chunk hashes: blake3 only)."""
        self._require_open()
        return management.hash_algorithm(self._session.meta)

    def __repr__(self) -> str:
        return (
            f"<AsyncClient {self.model_name!r} at {self.url} state={self._state.value} "
            f"transfer={self._session.transfer} in_flight={len(self._runner.ops)}>"
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
            HybridLayoutError: no geometry given and the model's registration has
                several KV groups (a hybrid model).
            ServerError: the server does not serve engine-driven transfers, or its two
                endpoints are not one server.
            TransferError: ``transfer="shm"`` but SHM is unusable.
            ClientClosedError: :meth:`aclose` was called before or while this ran.

        Failure closes whatever was opened (a registration made is undone). Cancellation
        of the caller: ``CancelledError`` propagates once socket and session are closed
        (the unregister is skipped, as in :meth:`aclose`). :meth:`aclose` called while
        this runs stops it at once: this raises ``ClientClosedError`` once everything it
        opened is closed and unregistered, and that ``aclose()`` returns then.
        """
        if self._state is not _Lifecycle.NEW:
            if self._state in (_Lifecycle.CLOSING, _Lifecycle.CLOSED):
                raise ClientClosedError(f"open() on a client that is {self._state.value}")
            raise ClientStateError(f"open() on a client that is {self._state.value}")
        self._state = _Lifecycle.OPENING
        self._loop = asyncio.get_running_loop()
        self._closed_event = asyncio.Event()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        # The steps run in a task of their own, which aclose() can cancel without
        # cancelling the caller's task (whose CancelledError would then be a lie).
        opening = asyncio.create_task(
            self._session.open(lambda: None if deadline is None else max(deadline - time.monotonic(), 0.0)),
            name=f"lmcache-open {self.url}",
        )
        self._opening = opening
        try:
            try:
                await opening
            finally:
                self._opening = None
            if self._close_asked:
                raise ClientClosedError("the client was closed while it was opening")
            self._finalizer = weakref.finalize(
                self,
                collected_open,
                self._loop,
                self._session,
                f"<lmcache_async.AsyncClient {self.model_name!r} at {self.url}>",
                self._pid,
            )
            self._state = _Lifecycle.OPEN
        except BaseException as exc:
            task = asyncio.current_task()
            caller_cancelled = isinstance(exc, asyncio.CancelledError) and (
                task is None or task.cancelling() > 0
            )
            self._state = _Lifecycle.CLOSING
            await self._shutdown(unregister=not caller_cancelled)
            if self._close_asked and not caller_cancelled and not isinstance(exc, ClientClosedError):
                raise ClientClosedError("the client was closed while it was opening") from exc
            raise

    async def aclose(self) -> None:
        """Close the client: refuse new calls, let running operations (abandoned ones
        finishing their server-side cleanup) end, unregister, close socket and session.

        What it waits for, in order: the operations still running, at most
        ``cleanup_grace`` seconds (those left are cancelled, and the registration is then
        retired rather than unregistered: a cancelled store may hold reserved slots that
        unregistering would admit); the keep-alive task's end; the ``unregister`` reply,
        at most :data:`~lmcache_async._engine.session.UNREGISTER_TIMEOUT` seconds (skipped while
        disconnected);
        the server's end of each open ``kv_events()`` subscription, cancelled there, at most 1 s.

        Called while :meth:`open` runs, it stops the open (which raises
        ``ClientClosedError``) and returns once the open has closed what it opened.

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
        if self._state is _Lifecycle.OPENING:
            # open() closes what it opened and raises ClientClosedError; wait for that.
            self._close_asked = True
            if self._opening is not None:
                self._opening.cancel()
        if self._state in (_Lifecycle.OPENING, _Lifecycle.CLOSING):
            assert self._closed_event is not None
            await self._closed_event.wait()
            return
        opened = self._state is _Lifecycle.OPEN
        self._state = _Lifecycle.CLOSING
        self._closed_event = asyncio.Event()
        unregister = opened
        try:
            if self._runner.ops:
                await wait_all(self._runner.ops, self.cleanup_grace)
        except asyncio.CancelledError:
            unregister = False
            raise
        finally:
            left = [t for t in self._runner.ops if not t.done()]
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
        self._runner.forget()

    def _check_loop(self) -> None:
        """Refuse a call from an event loop other than the one that opened the client."""
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise WrongEventLoopError(
                "the client is used from an event loop other than the one that opened it"
            )

    def _timeout(self, timeout: float | DefaultType | None) -> float | None:
        return resolve_timeout(timeout, self.timeout)

    def _live(self) -> None:
        """The lifecycle check of every call that reaches the server: open, on its loop."""
        self._require_open()
        self._check_loop()

    def _enter(self, timeout: float | DefaultType | None) -> float | None:
        """A one-shot call's checks once its arguments are: its timeout, then :meth:`_live`."""
        wait = self._timeout(timeout)
        self._live()
        return wait

    def _require_open(self) -> None:
        if self._state is not _Lifecycle.OPEN:
            if self._state in (_Lifecycle.CLOSING, _Lifecycle.CLOSED):
                raise ClientClosedError("the client is closed")
            raise ClientNotOpenError(f"the client is {self._state.value}; use 'async with' or connect()")
        if os.getpid() != self._pid:
            raise ForkedClientError(
                "this client was created in another process (before fork); create a new one", self._pid
            )

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
        return await self._runner.run(LookupCall(toks, cache_salt, configs), timeout)

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
        end = align(len(toks), self._session.chunk_size)
        if out is not None:
            check_out(self.geometry, out, end)
        axis = self.geometry.token_axis
        mark = target_mark(out, device)  # None unless the KV goes to a GPU
        if self._session.cannot_retrieve is not None:  # before anything is sent: never a silent miss
            raise TransferError(self._session.cannot_retrieve)
        return await self._runner.run(RetrieveCall(toks, cache_salt, configs, out, axis, mark), timeout)

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
        kv, toks = check_kv(self.geometry, kv, toks)
        # A CUDA kv: the bytes stored are kv as seen from the caller's current stream, now.
        mark = kv_mark(kv)
        return await self._runner.run(StoreCall(kv, toks, cache_salt, configs, mark), timeout)

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
        call = RemapCall(src, dst, cache_salt, tsalt)
        if self._session.pool is not None:  # in the pool, as far as the target's whole chunks take
            return await self._runner.run(call, timeout)
        if self._runner.observers is None:
            return await _compose.remap_inline(self, src, dst, cache_salt, tsalt, timeout)
        return await self._runner.observe(  # a recipe over retrieve and store, their parent
            "remap",
            lambda: _compose.remap_inline(self, src, dst, cache_salt, tsalt, timeout),
            call.finish,
            call.asked,
            cache_salt,
        )

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
        if self._session.pool is None:  # a recipe over retrieve and store, their parent
            return await self._runner.observe(
                "compose",
                lambda: _compose.compose_inline(
                    self, target_tokens, parts, rope, cache_salt, self._timeout(timeout)
                ),
                observing.finish_compose_result,
                len(target_tokens) if isinstance(target_tokens, Sized) else 0,
                cache_salt,
            )
        # Every check before anything is sent (the plan); then one operation in the pool.
        deadline = self._timeout(timeout)
        the_plan = _compose.plan(target_tokens, parts, rope, cache_salt, self.geometry, self.chunk_size)
        reads = _compose.pool_sources(the_plan)
        fill = _compose.slot_filler(the_plan, self.geometry, self.chunk_size, reads.index)
        call = ComposeCall(
            reads.sources, list(the_plan.target[: the_plan.stored]), the_plan.stored, the_plan.salt, fill
        )
        cached, new = await self._runner.run(call, deadline)
        return _compose.pool_result(the_plan, reads, cached, new)

    # ------------------------------------------------------------------ misc

    async def noop(self, *, timeout: float | DefaultType | None = DEFAULT) -> float:
        """Round-trip a ``noop``; returns the round-trip time in seconds."""
        self._live()
        wait = self._timeout(timeout)
        t0 = time.perf_counter()
        reply = await self._session.call(Op.NOOP, (), wait)
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
        if self._runner.posted:
            start = time.monotonic()
            await wait_all(self._runner.posted, timeout)  # replies may post follow-ups: a loop
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
        return await wait_all(self._runner.ops, timeout)

    async def kv_events(
        self,
        model_name: str | None = None,
        *,
        cursor: int = 0,
        incarnation: int | None = None,
        max_events: int = 256,
        ping_interval: float = 10.0,
        reconnect_timeout: float | None = 60.0,
    ) -> AsyncGenerator[KVEvent]:
        """The server's KV events of ``model_name`` (default: this client's) as they come: arguments, errors,
        cancellation: :class:`lmcache_async.events.KVEventStream`; what they see: docs/guides/routing.md.
        At the first step, before anything is sent, also the client's state errors, and
        ``KVEventsDisabledError`` for lmcache_async's embedded server."""
        s = self._session
        name = self.model_name if model_name is None else model_name
        stream = subscribe(
            s.conn, name, s.chunk_size, cursor, incarnation, max_events, ping_interval, reconnect_timeout
        )
        self._live()
        refuse_embedded(s.meta, self.url)
        async with stream:
            async for event in stream:
                yield event

    async def experimental(self, *, timeout: float | DefaultType | None = DEFAULT) -> frozenset[str]:
        """The server's advertised experimental features: :func:`lmcache_async.management.experimental`."""
        return await management.experimental(self._session.call, self._enter(timeout))

    async def report_block_allocation(
        self, records: Sequence[management.BlockAllocation], *, timeout: float | DefaultType | None = DEFAULT
    ) -> None:
        """Report GPU block allocations: see :func:`lmcache_async.management.report_block_allocation`."""
        wire = management.check_allocations(records)
        wait = self._enter(timeout)
        call = self._session.call
        await management.report_block_allocation(call, self.instance_id, self.model_name, wire, wait)

    async def clear(self, *, force: bool, timeout: float | DefaultType | None = DEFAULT) -> None:
        """DANGER: empties L1 for EVERY model and salt: see :func:`lmcache_async.management.clear`."""
        management.check_force(force)
        await management.clear(self._session.call, force, self._enter(timeout))

    async def warm(
        self, tokens: Sequence[int], cache_salt: str = "", *, timeout: float | DefaultType | None = DEFAULT
    ) -> management.WarmResult:
        """Loads ``tokens``' chunks from L2 into L1, left there: see :func:`lmcache_async.management.warm`."""
        toks = validate_tokens(tokens)
        validate_cache_salt(cache_salt)
        wait = self._enter(timeout)
        world = self.geometry.world_size
        return await management.warm(self._session.meta, self.model_name, world, toks, cache_salt, wait)

    async def delete(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        start: int = 0,
        tier: management.Tier = "l1",
        force: bool = False,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> management.DeleteResult:
        """DANGER: deletes chunks for all the model's clients: see :func:`lmcache_async.management.delete`."""
        toks = validate_tokens(tokens)
        validate_cache_salt(cache_salt)
        management.check_delete(tier, force)
        wait = self._enter(timeout)
        hashes = chunk_hashes(toks, self, start=start)
        keys = management.object_keys(hashes, self.model_name, self.geometry.world_size, cache_salt)
        return await management.delete(self._session.meta, keys, tier, force, wait)

    # ---- bulk operations (lmcache_async.bulk) ----

    async def remap_many(
        self, pairs: Iterable[RemapPair | Sequence[Any]], **options: Unpack[BatchOptions]
    ) -> BatchResult:
        """Remap many (source, target) pairs concurrently: see :func:`lmcache_async.bulk.remap_many`.

        ``pairs`` are :class:`~lmcache_async.bulk.RemapPair` objects or tuples
        ``(source_tokens, target_tokens[, cache_salt[, target_cache_salt]])``; the options,
        :class:`~lmcache_async.bulk.BatchOptions` (``timeout`` is per item).

        Returns:
            A :class:`~lmcache_async.bulk.BatchResult` (per-item results in input order and
            a summary). A failed item carries its exception unless ``return_exceptions`` is
            False, in which case the first failure cancels the batch and is raised.

        Cancellation: every in-flight item is cancelled and releases its server session,
        locks and reservations in the background; ``CancelledError`` is re-raised.
        """
        check_iterable(pairs, "pairs")
        bulk.check_options("remap_many", options)
        return await self._runner.job("remap_many", lambda: bulk.remap_many(self, pairs, **options))

    async def store_many(
        self, items: Iterable[StoreItem | Sequence[Any]], **options: Unpack[BatchOptions]
    ) -> BatchResult:
        """Store many ``(kv, tokens[, cache_salt])`` items concurrently: see
        :func:`lmcache_async.bulk.store_many` (options: :class:`~lmcache_async.bulk.BatchOptions`).

        Cancellation/timeout: as for :meth:`store`, per item; ``CancelledError`` is re-raised.
        """
        check_iterable(items, "items")
        bulk.check_options("store_many", options)
        return await self._runner.job("store_many", lambda: bulk.store_many(self, items, **options), True)

    async def retrieve_many(
        self,
        token_lists: Iterable[RetrieveItem | Sequence[Any]],
        *,
        device: torch.device | str | None = None,
        **options: Unpack[BatchOptions],
    ) -> BatchResult:
        """Retrieve many prompts concurrently (token lists or ``(tokens, cache_salt)``): see
        :func:`lmcache_async.bulk.retrieve_many` (options:
        :class:`~lmcache_async.bulk.BatchOptions`). Each result's ``kv`` holds the tensor,
        on ``device`` (default: the CPU).

        Cancellation/timeout: as for :meth:`retrieve`, per item; ``CancelledError`` is
        re-raised.
        """
        check_iterable(token_lists, "token_lists")
        target_mark(None, device)  # a bad device= is refused before anything is sent
        bulk.check_options("retrieve_many", options)
        return await self._runner.job(
            "retrieve_many",
            lambda: bulk.retrieve_many(self, token_lists, device=device, **options),
            True,
        )

    async def compose_many(
        self,
        items: Iterable[ComposeItem | Sequence[Any]],
        *,
        rope: RopeSpec | None = None,
        **options: Unpack[BatchOptions],
    ) -> BatchResult:
        """Run many :meth:`compose` calls (``(target_tokens, parts[, cache_salt])``)
        concurrently: see :func:`lmcache_async.bulk.compose_many` (options:
        :class:`~lmcache_async.bulk.BatchOptions`).

        Cancellation/timeout: as for :meth:`compose`, per item; ``CancelledError`` is
        re-raised.
        """
        check_iterable(items, "items")
        bulk.check_options("compose_many", options)
        return await self._runner.job(
            "compose_many", lambda: bulk.compose_many(self, items, rope=rope, **options)
        )
