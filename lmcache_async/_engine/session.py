"""A client's life with one LMCache server: discovery, registration, keep-alive,
re-registration, retirement, shut-down.

:class:`Session` owns everything an :class:`~lmcache_async.client.AsyncClient` holds of
the server: the ZMQ connection, the HTTP metadata session, the server's generation and
configuration (:class:`~lmcache_async._protocol.server_config.ServerConfig`), the registration
(its id, the SHM pool it maps, whether it is stale), the keep-alive task and the watch for
a server replaced behind the connection; and it makes the
:class:`~lmcache_async._engine.ops.Operations` of the current registration. The client
keeps argument checks, the public methods and its lifecycle state, and runs operations
over :meth:`Session.operations`.

The request path goes down from here: ``client`` -> ``_engine.session`` ->
``_engine.ops`` -> ``_transport.connection`` -> ``_protocol.wire``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Final, Literal, TypeVar

from lmcache_async._base.deadline import Deadline
from lmcache_async._base.tasks import cancel_and_wait
from lmcache_async._engine.ops import LateEnds, Operations, Registration
from lmcache_async._engine.ops.calls import Call
from lmcache_async._engine.runner import OpState
from lmcache_async._protocol.server_config import ServerConfig, server_instance
from lmcache_async._protocol.wire import (
    GEN_0_5_6,
    Op,
    RegisterPayload,
    Reply,
    WireGeneration,
    generation_for_version,
    op_name,
    parse_register_response,
)
from lmcache_async._transport.channel import ConnectionChannel, replaced_message
from lmcache_async._transport.connection import Connection
from lmcache_async._transport.metadata import Metadata
from lmcache_async._transport.replacement import ServerWatch
from lmcache_async._transport.shm import ShmPool
from lmcache_async.errors import (
    ClientClosedError,
    LMCacheError,
    LMCacheTimeoutError,
    ProtocolError,
    ServerError,
    ServerReplacedError,
    TransferError,
)
from lmcache_async.geometry import KVGeometry, check_server_geometry, dtype_name
from lmcache_async.results import TransferMode

__all__ = ["EXIT_UNREGISTER_WAIT", "UNREGISTER_TIMEOUT", "Session", "collected_open"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest wait for the ``unregister`` reply when closing.
UNREGISTER_TIMEOUT: Final = 2.0

#: At interpreter exit, how long the release of a client collected unclosed waits for the
#: unregister's reply (the process would end before its socket sent it otherwise).
EXIT_UNREGISTER_WAIT: Final = 0.5


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) called through a weak reference to its object: a background
    task holding it does not keep the object alive. Once the object is collected a call
    raises :class:`ClientClosedError`."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        if bound is None:
            raise ClientClosedError("the client was garbage-collected")
        return bound(*args)

    return call


async def _keepalive_loop(
    ref: weakref.ReferenceType[Session], conn: Connection, ping_interval: float
) -> None:
    """Every ``ping_interval`` seconds, and at once when the connection comes back after a
    loss: check that the server is the one registered with (``/config`` instance id) and
    refresh the registration, or register again (and re-map SHM) with the new server.
    Holds the session weakly between refreshes (it ends when the session was collected).

    The refresh is a re-registration of the same id, never a ``ping``: reaping a pinged
    instance would admit its pending write reservations (docs/internals/design.md, section
    "The transport", "Keep-alive without ``ping``").
    """
    reconnected = conn.reconnected
    assert reconnected is not None
    while True:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ping_interval):
                await reconnected.wait()
        if reconnected.is_set():
            reconnected.clear()
            log.debug("reconnected to %s; refreshing the registration", conn.url)
        session = ref()
        if session is None:
            return
        try:
            await session.refresh_registration()
        except LMCacheError as exc:
            log.debug("keep-alive failed: %s", exc)
        finally:
            del session


class _Abandoned(Exception):
    """An operation whose caller left before it sent anything (never seen by callers)."""


class Session:
    """Everything of one client that concerns the server (see the module docstring).

    Made by the client's constructor (no I/O); :meth:`open` on the loop that will use it.
    All methods but :meth:`release_locally` and :meth:`drop_inherited` must be called on
    that loop.
    """

    def __init__(
        self,
        url: str,
        http_url: str,
        model_name: str,
        *,
        geometry: KVGeometry | None,
        transfer: TransferMode,
        num_kv_readers: int,
        ping_interval: float,
        cleanup_grace: float,
        metadata_ttl: float,
        prefault_shm: bool,
        api_key: str | None,
        max_in_flight: int,
        track: Callable[[asyncio.Future[Any]], None],
    ) -> None:
        self.url = url
        self.http_url = http_url
        self.model_name = model_name
        self.num_kv_readers = num_kv_readers
        self.cleanup_grace = cleanup_grace
        self._want_transfer: TransferMode = transfer  # "inline" and "pickle": the same
        self._prefault_shm = prefault_shm
        self._ping_interval = ping_interval
        self._track = track
        #: The KV layout: explicit, or derived from ``/status`` by :meth:`open`.
        self.geometry: KVGeometry | None = geometry
        self.meta = Metadata(http_url, ttl=metadata_ttl, api_key=api_key)
        self.conn = Connection(url, max_in_flight=max_in_flight)
        self.channel = ConnectionChannel(self.conn)
        #: The server generation's wire, and the version ``/lmc_version`` reported.
        self.wire: WireGeneration = GEN_0_5_6
        self.server_version: str | None = None
        #: What ``/config`` (and on 0.5.7 ``/status``) said, read again at each re-registration.
        self.config = ServerConfig()
        self.instance_id = secrets.randbits(63)
        self.registered_id: int | None = None  # the id the server knows this client by
        #: The id of a register request sent whose reply has not been read (cancelled or
        #: failed mid-call): the server may know it, so closing unregisters it too.
        self._register_unanswered: int | None = None
        self.pool_identity: tuple[str, int] = ("", 0)  # (shm name, pool size) registered with
        self.retired_ids: list[int] = []
        self.pool: ShmPool | None = None
        self.transfer: Literal["shm", "pickle"] | None = None
        self.server_has_shm = False
        #: Why retrieve cannot work (an SHM server whose pool this client cannot map).
        self.cannot_retrieve: str | None = None
        self.reg_generation = -1
        self.stale = False
        self._reg_lock: asyncio.Lock | None = None
        self._gates: dict[tuple[Any, ...], list[Any]] = {}
        #: The end_session requests held back for late replies, over every registration.
        self.late_ends = LateEnds()
        self._operations_cache: tuple[tuple[Any, ...], Operations] | None = None
        self.keepalive: asyncio.Task[None] | None = None
        # Weakly: the watch task runs on the loop, and must not keep a dropped client alive
        # (so that its finalizer can release what it holds).
        self.watch = ServerWatch(
            self.conn, _weakly(self.fetch_identity), _weakly(self.known_instance), _weakly(self.replaced)
        )
        self.watch_task: asyncio.Task[None] | None = None

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    # ------------------------------------------------------------------ opening

    async def open(self, remaining: Callable[[], float | None]) -> None:
        """Detect the generation, read the configuration (and the geometry from
        ``/status`` when none was given), connect, check both endpoints are one server,
        register (mapping SHM), then start the keep-alive and the server watch.

        ``remaining()`` gives the time left of the caller's deadline at each step.
        Failure or cancellation leaves what was opened for :meth:`close` to close.
        """
        self._reg_lock = asyncio.Lock()
        await self.detect_generation(remaining())
        await self.load_config(remaining())
        if self.geometry is None:
            status = await self.meta.status(max_age=0, timeout=remaining())
            self.geometry = KVGeometry.from_status(status, self.model_name)
            check_server_geometry(self.geometry, self.chunk_size)
        if self.chunk_size % self.geometry.block_size:
            raise ServerError(
                f"chunk size {self.chunk_size} is not a multiple of the block size {self.geometry.block_size}"
            )
        await self.conn.open(remaining())
        reply = await self.conn.call(Op.NOOP, (), timeout=remaining())
        if reply.value() != "OK":
            raise ProtocolError(f"noop answered {reply.value()!r}")
        await self.check_chunk_size_over_zmq(remaining())
        await self.register(remaining())
        self.keepalive = asyncio.create_task(
            _keepalive_loop(weakref.ref(self), self.conn, self._ping_interval), name="lmcache-keepalive"
        )
        self.watch_task = asyncio.create_task(self.watch.run(), name="lmcache-server-watch")

    async def detect_generation(self, timeout: float | None) -> None:
        """Ask ``/lmc_version`` which generation the server is and speak its wire.

        Raises:
            UnsupportedServerVersionError: a version older than 0.5.6 or unparseable.
            AuthenticationError: the server wants an API key (0.5.7 with keys).
        """
        version = await self.meta.version(timeout=timeout)
        if version is None:
            log.warning(
                "%s has no /lmc_version (a server older than lmcache 0.5.6?); talking to it as 0.5.6",
                self.http_url,
            )
            wire = GEN_0_5_6
        else:
            wire = generation_for_version(version)
        self.server_version = version
        self.wire = wire
        self.conn.wire = wire

    async def load_config(self, timeout: float | None) -> None:
        """Read ``/config`` (and on 0.5.7, where the chunk size is live there, ``/status``)
        into :attr:`config`.

        Raises:
            ProtocolError: no usable chunk size. ServerError: the server does not serve
            engine-driven transfers.
        """
        config = await self.meta.config(max_age=0, timeout=timeout)
        status = None
        if self.wire.chunk_size_from == "status":
            # The configured size is only a minimum the server may round up; /status
            # has the live one (get_chunk_size would freeze it: never used as a probe).
            status = await self.meta.status(max_age=0, timeout=timeout)
        self.config = ServerConfig.parse(config, status)
        grace, ttl = self.config.registration_grace, self.config.write_ttl
        if ttl is not None and grace is not None and grace <= ttl:
            log.warning(
                "the server reaps silent registrations after %gs, before write reservations expire "
                "(%gs): a reservation this client cannot fill could be admitted when its "
                "retired registration is reaped (see docs/internals/design.md)",
                grace,
                ttl,
            )

    def _register_payload(self) -> RegisterPayload:
        geom = self.geometry
        assert geom is not None
        return RegisterPayload(
            instance_id=self.instance_id,
            model_name=self.model_name,
            world_size=geom.world_size,
            block_size=geom.block_size,
            num_layers=geom.num_layers,
            hidden_dim_size=geom.hidden_dim,
            dtype_str=dtype_name(geom.dtype),
            use_mla=geom.use_mla,
            num_physical_slots=self.chunk_size,
        )

    async def check_chunk_size_over_zmq(self, timeout: float | None) -> None:
        """On 0.5.6 (where ``get_chunk_size`` is a pure query; on 0.5.7 it would freeze
        the chunk size) check that the ZMQ endpoint has the chunk size ``/config`` gave.

        Raises:
            ServerError: the two endpoints are not the same server.
        """
        if self.wire.chunk_size_from != "config":
            return
        reply = await self.conn.call(Op.GET_CHUNK_SIZE, (), timeout=timeout)
        zmq_chunk = reply.value()
        if zmq_chunk != self.chunk_size:
            raise ServerError(
                f"{self.url} and {self.http_url} are not the same LMCache server: the ZMQ endpoint "
                f"has chunk size {zmq_chunk!r}, the HTTP endpoint's /config {self.chunk_size}"
            )

    # ------------------------------------------------------------------ registration

    async def register(self, timeout: float | None) -> None:
        """Register :attr:`instance_id`, check the SHM pool is the one ``/config``
        describes, and map it (or say why retrieve cannot work from here).

        Raises:
            ServerError: the ZMQ endpoint serves another pool than ``/config`` says (the
                registration is undone). TransferError: ``transfer="shm"`` but SHM is
                unusable.
        """
        payload = self._register_payload()
        generation = self.conn.generation
        self._register_unanswered = payload.instance_id
        reply = await self.conn.call(Op.REGISTER_ENGINE_DRIVEN, (payload.to_wire(),), timeout=timeout)
        shm_name, pool_size = parse_register_response(reply.value())
        self.registered_id = payload.instance_id
        self._register_unanswered = None
        self.pool_identity = (shm_name, pool_size)
        expected = self.config.expected_pool
        if expected is not None and expected != (shm_name, pool_size):
            # Another server than the one whose /config was read: undo the registration.
            with contextlib.suppress(LMCacheError):
                await self.conn.call(Op.UNREGISTER_ENGINE_DRIVEN, (payload.instance_id,), timeout=timeout)
            self.registered_id = None
            raise ServerError(
                f"{self.url} and {self.http_url} are not the same LMCache server: the ZMQ endpoint "
                f"serves the SHM pool {shm_name!r} ({pool_size} bytes), the HTTP endpoint's /config "
                f"describes {expected[0]!r} ({expected[1]} bytes)"
            )
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.server_has_shm = bool(shm_name) and pool_size > 0
        why_not = f"transfer={self._want_transfer!r} was asked for"
        if self.server_has_shm and self._want_transfer not in ("pickle", "inline"):
            try:
                self.pool = ShmPool(shm_name, pool_size)
                if not self._prefault_shm:
                    self.pool.populate_on_use = False
            except TransferError as exc:
                if self._want_transfer == "shm":
                    raise
                why_not = str(exc)
        elif self._want_transfer == "shm":
            raise TransferError("transfer='shm' but the server has no SHM pool (--shm-name)")
        self.transfer = "shm" if self.pool is not None else "pickle"
        # An SHM server answers prepare_retrieve only with slots in its pool, never with
        # inline data: a client that cannot map the pool (another host) can store over
        # TCP but never retrieve. Say so now, and make every retrieve fail with it.
        self.cannot_retrieve = None
        if self.server_has_shm and self.pool is None:
            self.cannot_retrieve = (
                f"the server {self.url} keeps its KV in the shared-memory pool {shm_name!r}, which this "
                f"client does not map ({why_not}); an SHM server never sends KV over TCP, so retrieve "
                "and remap cannot work from here. Run the client on the server's host, or start the "
                "server with --shm-name '' to serve KV over TCP. store and lookup work."
            )
            log.warning("%s", self.cannot_retrieve)
        self.reg_generation = generation
        self.stale = False

    def known_instance(self) -> object:
        """The identity (``/config`` instance id) of the server registered with."""
        return self.config.instance

    async def refresh_registration(self) -> None:
        """The keep-alive's step: notice a replaced server, and refresh the registration
        (or register again, when it is stale or the pool changed)."""
        config = await self.meta.config(max_age=0, timeout=10.0)
        identity = server_instance(config)
        if identity != self.config.instance:
            log.debug("the server has a new instance id; registering again")
            self.replaced(identity)
        if self.stale or self.reg_generation != self.conn.generation:
            await self.ensure_registered(30.0)
            return
        reply = await self.conn.call(
            Op.REGISTER_ENGINE_DRIVEN, (self._register_payload().to_wire(),), timeout=10.0
        )
        if parse_register_response(reply.value()) != self.pool_identity:
            log.debug("the server's SHM pool changed; registering again")
            self.stale = True
            await self.ensure_registered(30.0)

    async def ensure_registered(self, timeout: float | None) -> None:
        """Re-register (and re-map SHM) after a reconnect or a server restart."""
        if self.reg_generation == self.conn.generation and not self.stale:
            return
        assert self._reg_lock is not None
        async with self._reg_lock:
            if self.reg_generation == self.conn.generation and not self.stale:
                return
            log.warning("re-registering %s with %s", self.model_name, self.url)
            before = self.chunk_size
            await self.load_config(timeout)
            assert self.geometry is not None
            if self.chunk_size % self.geometry.block_size:
                raise ServerError(
                    f"the server now has chunk size {self.chunk_size}, not a multiple of the block "
                    f"size {self.geometry.block_size}"
                )
            if self.chunk_size != before:
                log.warning("the server's chunk size changed from %d to %d", before, self.chunk_size)
            await self.register(timeout)

    async def fetch_identity(self, timeout: float) -> object:
        """The server's identity: ``/config`` ``mp.instance_id`` (new for every server
        process, on both generations; see :mod:`lmcache_async._transport.replacement`)."""
        config = await self.meta.config(max_age=0, timeout=timeout)
        return server_instance(config)

    def replaced(self, identity: object) -> None:
        """The server now has another identity than the one registered with.

        After a visible disconnect the reconnection already made the registration stale
        and failed the old server's requests: register again (same id). With no visible
        disconnect (a proxy kept the connection up), requests of the old server are still
        waiting and more may reach the new server: fail them with
        :class:`ServerReplacedError` (their operations are run again once by the client),
        retire the channel they use, and retire the registration id too (a fresh one is
        registered), so nothing sent under it, queued by a proxy and delivered late, can
        act on the new server.
        """
        self.config = self.config.with_instance(identity)
        self.stale = True
        if self.reg_generation != self.conn.generation:
            return
        log.warning(
            "the LMCache server behind %s was replaced (no disconnect seen); registering again", self.url
        )
        self.retire_registration(self.instance_id, "the server was replaced")
        self.channel.retired = True
        self.channel = ConnectionChannel(self.conn)
        url = self.url
        self.conn.fail_pending(lambda opcode: ServerReplacedError(replaced_message(opcode, url)))

    def retire_registration(
        self, instance_id: int, reason: str = "a store's reserved slots could not be filled"
    ) -> None:
        """Stop using ``instance_id``: a reservation of it may hold anything but KV.

        The retired id is never unregistered and never refreshed again (either would admit
        its reservations), so the server reaps it only after its write locks expired
        (docs/internals/design.md, section "A store that fails after ``prepare_store``").
        A fresh id is registered before the next operation.
        """
        if instance_id != self.instance_id:
            return  # already retired
        log.warning(
            "retiring registration %d (%s): reservations it may hold stay invisible and expire "
            "on the server; registering a new id",
            instance_id,
            reason,
        )
        self.retired_ids.append(instance_id)
        self.instance_id = secrets.randbits(63)
        self.stale = True

    # ------------------------------------------------------------------ operations

    async def call(self, op: Op, args: tuple[Any, ...], timeout: float | None) -> Reply:
        """One RPC that opens no server session (``noop``, ``clear``, ``get_experimental``),
        through the gate of :meth:`run`: wait for a usable connection, check for a server
        replaced behind it, register again if needed, then the call; once more on
        :class:`ServerReplacedError`. ``timeout`` (checked) covers all of it.

        Raises:
            LMCacheTimeoutError: ``timeout`` passed (at the start: nothing is sent).
            LMCacheConnectionError: not connected (no reconnection in time), or the reader
                stopped. ClientClosedError: the connection is closed.
            ServerReplacedError: the server was replaced while it ran, twice.

        Cancellation: the reply is dropped when it comes.
        """
        name = op_name(op)
        deadline = Deadline(timeout, name)
        await self.conn.wait_usable(deadline.left())
        if self.watch.due():
            await self.watch.check_quietly(deadline.left())
        for attempt in (1, 2):
            try:
                await self.ensure_registered(deadline.left())
                return await self.conn.call(op, args, timeout=deadline.left())
            except ServerReplacedError as exc:
                if attempt == 2:
                    raise ServerReplacedError(f"{name}: {exc} (again, after running it once more)") from exc
                log.debug("%s: the server was replaced while it ran; running it again", name)
        raise AssertionError("unreachable")

    async def run(self, call: Call[T], op: OpState) -> T:
        """The session's half of running ``call`` (in its own task, see
        :func:`~lmcache_async._engine.runner.run_detached`): wait for a usable connection, check
        for a server replaced behind it, register again if needed, then the call's
        sequence over the current :meth:`operations`; run once more on
        :class:`ServerReplacedError`, and mark the registration stale on a timeout.

        Raises what the sequence raises (a :class:`ServerReplacedError` the second time,
        or when the caller left, with the call's name and "again" in its message).
        """
        name = call.name
        # Started while the server is away: wait briefly for the reconnection (then the
        # new server is registered with first), or fail fast with a connection error.
        await self.conn.wait_usable(op.remaining())
        if self.watch.due():  # silence: was the server replaced behind the connection?
            await self.watch.check_quietly(op.remaining())
        for attempt in (1, 2):
            try:
                await self.ensure_registered(op.remaining())
                if op.abandoned:  # the caller left before anything was sent
                    raise _Abandoned
                return await call.run(self.operations(), op)
            except LMCacheTimeoutError:
                # Unanswered prepare/commit requests are what a reaped registration looks
                # like; re-registering an existing id is cheap, so do it before the next op.
                self.stale = True
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

    def operations(self) -> Operations:
        """The operations of the current registration (built again only when something
        it is made of changed: re-registration, a new pool, a new chunk size)."""
        geom = self.geometry
        assert geom is not None
        cfg = self.config
        made_of = (
            geom, cfg.chunk_size, self.wire, self.instance_id, self.num_kv_readers, self.pool,
            self.server_has_shm, cfg.fifo_cpu, cfg.write_ttl, self.cleanup_grace, self.channel,
        )  # fmt: skip
        cached = self._operations_cache
        if cached is not None and cached[0] == made_of:
            return cached[1]
        reg = Registration(
            model_name=self.model_name,
            geometry=geom,
            chunk_size=cfg.chunk_size,
            wire=self.wire,
            instance_id=self.instance_id,
            num_kv_readers=self.num_kv_readers,
            pool=self.pool,
            server_has_shm=self.server_has_shm,
            fifo_cpu=cfg.fifo_cpu,
            write_ttl=cfg.write_ttl,
        )
        ops = Operations(
            self.channel,
            reg,
            cleanup_grace=self.cleanup_grace,
            gates=self._gates,
            late_ends=self.late_ends,
            on_unfilled=self.retire_registration,
            track=self._track,
            server_status=self.fresh_status,
        )
        self._operations_cache = (made_of, ops)
        return ops

    async def fresh_status(self, timeout: float) -> dict[str, Any]:
        """``/status`` fetched now (a store's error reports the server's memory use)."""
        return await self.meta.status(max_age=0, timeout=timeout)

    # ------------------------------------------------------------------ closing

    def _maybe_registered(self) -> bool:
        """Whether the server may know this client under its current id."""
        return self.instance_id in (self.registered_id, self._register_unanswered)

    async def close(self, *, unregister: bool) -> None:
        """Stop the server watch and the keep-alive, unregister (when asked, registered
        under the current id and connected; at most :data:`UNREGISTER_TIMEOUT` seconds),
        unmap the pool, close the socket and the HTTP session.

        Cancellation: ``CancelledError`` propagates once the pool, socket and session
        are closed all the same.
        """
        try:
            if self.watch_task is not None:
                await cancel_and_wait(self.watch_task, "the server watch")
            if self.keepalive is not None:
                await cancel_and_wait(self.keepalive, "the keep-alive")
            if unregister and self._maybe_registered() and self.conn.usable:
                with contextlib.suppress(LMCacheError):
                    await self.conn.call(
                        Op.UNREGISTER_ENGINE_DRIVEN, (self.instance_id,), timeout=UNREGISTER_TIMEOUT
                    )
        finally:
            try:
                if self.pool is not None:
                    self.pool.close()
                    self.pool = None
                await self.conn.close()
            finally:
                await self.meta.close()

    def release_locally(
        self, loop: asyncio.AbstractEventLoop, *, unregister: bool = False, unregister_wait: float = 0.0
    ) -> None:
        """Release the SHM pool, the socket and the HTTP session without awaiting anything: ``loop``,
        theirs, is closed or not running, or this runs on it (a client collected there).

        ``unregister``: if registered under the current id and connected, the unregister
        request is sent, its reply not awaited (the server drops the registration when it
        processes it; a closed socket keeps sending it for up to a second), or waited for
        (blocking) at most ``unregister_wait`` seconds: at interpreter exit, where the
        process would end before the socket sent it."""
        if not loop.is_closed():
            for task in (self.keepalive, self.watch_task):
                if task is not None:
                    task.cancel()
        farewell = (
            (Op.UNREGISTER_ENGINE_DRIVEN, (self.instance_id,))
            if unregister and self._maybe_registered()
            else None
        )
        pool, self.pool = self.pool, None
        try:
            if pool is not None:
                pool.close()  # its descriptor; the mapping stays while a view is alive
        finally:
            self.conn.abandon(farewell, unregister_wait)
            self.meta.abandon()

    def drop_inherited(self) -> None:
        """In a forked child: forget the parent's socket, context, session and pool
        without closing them (closing would unregister the parent's file descriptors
        from the event-loop selector both processes share)."""
        self.conn.drop_inherited()
        self.meta.drop_inherited()
        self.pool = None
        self.keepalive = None
        self.watch_task = None


def _release_collected(
    loop: asyncio.AbstractEventLoop, session: Session, wait: float, done: threading.Event
) -> None:
    """Release a collected client's session (on its loop's thread, or with its loop not
    running): background tasks cancelled, the unregister sent (its reply waited for at
    most ``wait`` seconds), socket and HTTP session closed. Synchronous: nothing waits for
    a loop that may never run again."""
    try:
        session.release_locally(loop, unregister=True, unregister_wait=wait)
    finally:
        done.set()


def collected_open(loop: asyncio.AbstractEventLoop, session: Session, desc: str, pid: int) -> None:
    """``weakref.finalize`` callback of an :class:`~lmcache_async.AsyncClient` collected
    while open (or still open at interpreter exit): a :class:`ResourceWarning`, then the
    release, at once (:meth:`Session.release_locally`: nothing is awaited, no event loop
    needs to run again).

    It runs on whichever thread collects the client. On the client's loop's thread, or
    with that loop not running, it releases here; with the loop running in another thread
    (whose reader may be using the socket) it hands the release to that thread. At
    interpreter exit the unregister's reply is waited for (at most
    :data:`EXIT_UNREGISTER_WAIT` seconds; a hand-over, that and a second more). A release
    handed to a loop that stops first is done by the connection's own finalizer when it is
    collected (the socket; the HTTP session is then aiohttp's to warn about)."""
    if os.getpid() != pid:
        return  # inherited across fork: the parent owns the socket and the registration
    warnings.warn(
        f"{desc} was never closed; closing it now (use 'async with AsyncClient(...)' or "
        "'await client.aclose()')",
        ResourceWarning,
        stacklevel=2,
    )
    # At exit (threading has shut down: atexit handlers, weakref's among them, run next).
    exiting = sys.is_finalizing() or not threading.main_thread().is_alive()
    wait = EXIT_UNREGISTER_WAIT if exiting else 0.0
    done = threading.Event()
    if loop.is_running() and _running_loop() is not loop:
        try:
            loop.call_soon_threadsafe(_release_collected, loop, session, wait, done)
        except RuntimeError:  # the loop closed meanwhile
            pass
        else:
            if exiting:
                done.wait(wait + 1.0)
            return
    _release_collected(loop, session, wait, done)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
