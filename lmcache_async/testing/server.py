"""An embedded, LMCache-compatible MP server for local use and tests.

:class:`EmbeddedServer` speaks the wire protocol of an LMCache MP server generation --
``generation="0.5.6"`` (default) or ``"0.5.7"`` (the 0.5.7rc3 server: packed token keys,
the msgpack tensor envelope inline, the new argument frames, optional HTTP API keys) --
over ZMQ (ROUTER, ``[identity, uid, op, *args]`` frames, legacy ids and names, silence on
bad requests) and its HTTP API (``/``, ``/healthcheck``, ``/config``, ``/status``,
``/lmc_version``). Every request goes through :class:`~lmcache_async.testing.inprocess.
InProcessServer` (typed decoding per generation, then the cache engine), which tests can
also call directly, without sockets (:attr:`EmbeddedServer.core`)::

    async with EmbeddedServer(chunk_size=16, mode="shm", generation="0.5.7") as srv:
        async with AsyncClient(srv.url, srv.http_url, "m", geometry=geom) as client:
            ...

    handle = EmbeddedServer.start_in_thread(mode="pickle")   # from sync code
    ...
    handle.stop()

Dispatch mirrors the real server with its default worker counts: registrations, ``noop``,
``get_chunk_size`` and ``get_experimental`` run inline on the receiving task (the real
"SYNC" handlers); the engine-driven transfers run one at a time, in arrival order, on a
"transfer" lane; lookups, prefetch queries, lock releases, ``end_session``, ``ping`` and
``clear`` on a "cpu" lane. The two lanes are not ordered relative to each other. Copies of
tensor data (pickle commit and retrieve) run in a worker thread so the loop keeps serving.
Unlike the real server, a message of fewer than two frames is dropped (logged) instead
of stopping the request loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hmac
import logging
import os
import secrets
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, Final, Literal, NoReturn, TypedDict, Unpack

import zmq
import zmq.asyncio
from aiohttp import web

from lmcache_async._base.zmq_context import process_context
from lmcache_async._version import __version__
from lmcache_async.testing.dialect import (
    LMC_VERSIONS,
    BadRequest,
    ServerGeneration,
    check_generation,
    decode_operation,
)
from lmcache_async.testing.engine import CacheEngine
from lmcache_async.testing.inprocess import InProcessServer, NoReply, PreparedCall
from lmcache_async.testing.models import ModelSpec, parse_size
from lmcache_async.testing.pool import SHM_DIR, segment_name
from lmcache_async.testing.vocabulary import Leftovers, Mode

__all__ = ["EmbeddedServer", "EmbeddedServerThread", "ModelSpec", "ServerOptions", "parse_size"]

log = logging.getLogger(__name__)

_State = Literal["new", "starting", "running", "stopping", "stopped"]

#: What ``/status`` says for the engine type (the real server's value).
ENGINE_TYPE: Final = "MPCacheServer"
HASH_ALGORITHM: Final = "blake2b"
#: A reply payload at least this large is sent without a copy (``zmq`` ``copy=False``);
#: smaller ones are copied, which is cheaper than tracking the buffer.
ZMQ_COPY_THRESHOLD: Final = 65536
#: With an API key, these routes still answer without one (as the real 0.5.7 server's).
PUBLIC_HTTP_PATHS: Final = frozenset({"/", "/healthcheck"})
#: The real server's answer to a missing or wrong API key (status 401).
UNAUTHORIZED_BODY: Final = {"detail": "Invalid or missing API key"}
API_KEY_HEADER: Final = "X-LMCache-API-Key"


#: A request queued on a lane: the peer's identity, the raw uid and op frames (echoed
#: byte for byte in the reply) and the decoded call.
_Queued = tuple[bytes, bytes, bytes, PreparedCall]


class ServerOptions(TypedDict, total=False):
    """The keyword arguments of :class:`EmbeddedServer`, written once:
    :meth:`EmbeddedServer.start_in_thread` takes the same (``**options``), with the
    defaults and meanings :class:`EmbeddedServer` gives."""

    host: str
    port: int
    http_port: int
    chunk_size: int
    mode: Mode
    size_bytes: int
    shm_name: str | None
    models: Sequence[ModelSpec]
    session_ttl: float
    read_lock_ttl: float
    write_ttl: float
    instance_id: str | None
    prefault: bool
    generation: ServerGeneration
    api_key: str | None


_NO_SYNC_WITH: Final = (
    "EmbeddedServer is asynchronous: use `async with EmbeddedServer(...)` in a coroutine, "
    "or `EmbeddedServer.start_in_thread(...)` (a context manager) from blocking code"
)


class EmbeddedServer:
    """An LMCache-compatible MP server running on the current event loop.

    Args:
        host: interface for both ports (loopback by default; there is no authentication).
        port: ZMQ port (0: a free one).
        http_port: HTTP port (0: a free one).
        chunk_size: tokens per chunk.
        mode: ``"shm"`` (a POSIX shared-memory pool clients map) or ``"pickle"``.
        size_bytes: the L1 byte budget; least recently used unlocked objects are evicted
            to make room. In SHM mode also the pool (and ``/dev/shm`` segment) size.
        shm_name: segment name in SHM mode (``/dev/shm/lmcache_l1_pool_<shm_name>``);
            default: a fresh unique one.
        models: models to show in ``/status`` as if an inference engine had registered them.
        session_ttl: seconds a session lives after its creation.
        read_lock_ttl: seconds a lookup's read lock lives (refreshed by each new lock).
        write_ttl: seconds an SHM write reservation lives.
        instance_id: ``/config`` ``mp.instance_id`` (default: a new uuid4 string).
        prefault: back the whole pool with memory at start (like the real server's
            non-lazy L1): slower start and ``size_bytes`` of RAM committed, but the first
            stores do not pay for page faults. Off by default.
        generation: ``"0.5.6"`` (default) or ``"0.5.7"``: the server generation whose
            wire (keys, argument frames, inline payload) and behaviour it mirrors;
            ``/lmc_version`` answers ``"0.5.6"`` or ``"0.5.7rc3.dev0"``.
        api_key: (``generation="0.5.7"`` only) require this HTTP API key on every route but
            ``/`` and ``/healthcheck`` (``Authorization: Bearer KEY`` or
            ``X-LMCache-API-Key: KEY``), else 401 with the real server's JSON body. The
            ZMQ side stays unauthenticated, as on the real server.

    Use ``async with EmbeddedServer(...) as srv`` (or :meth:`start` / :meth:`stop`), or
    :meth:`start_in_thread` from synchronous code.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        http_port: int = 0,
        chunk_size: int = 256,
        mode: Mode = "shm",
        size_bytes: int = 1 << 30,
        shm_name: str | None = None,
        models: Sequence[ModelSpec] = (),
        session_ttl: float = 600.0,
        read_lock_ttl: float = 300.0,
        write_ttl: float = 600.0,
        instance_id: str | None = None,
        prefault: bool = False,
        generation: ServerGeneration = "0.5.6",
        api_key: str | None = None,
    ) -> None:
        generation = check_generation(generation)
        if api_key is not None and (generation != "0.5.7" or not isinstance(api_key, str) or not api_key):
            raise ValueError(
                "api_key needs generation='0.5.7' and a non-empty string (0.5.6 has no API keys)"
            )
        if mode not in ("shm", "pickle"):
            raise ValueError(f"mode must be 'shm' or 'pickle', got {mode!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 4096:
            raise ValueError(f"size_bytes must be an int >= 4096, got {size_bytes!r}")
        for name, value in (("port", port), ("http_port", http_port)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536:
                raise ValueError(f"{name} must be a port number or 0, got {value!r}")
        ttls = (("session_ttl", session_ttl), ("read_lock_ttl", read_lock_ttl), ("write_ttl", write_ttl))
        for name, ttl in ttls:
            if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {ttl!r}")
        if mode == "pickle" and shm_name is not None:
            raise ValueError("shm_name is only meaningful with mode='shm'")
        if shm_name is None and mode == "shm":
            shm_name = f"lmca_emb_{os.getpid()}_{secrets.token_hex(4)}"
        if shm_name is not None:
            segment_name(shm_name)  # validates
        models = tuple(models)
        for m in models:
            if not isinstance(m, ModelSpec):
                raise TypeError(f"models must be ModelSpec instances, got {type(m).__name__}")
        self.host = host
        self._req_port = port
        self._req_http_port = http_port
        self.chunk_size = chunk_size
        self.mode: Mode = mode
        self.size_bytes = size_bytes
        self.shm_name = shm_name
        self.models = models
        self.session_ttl = float(session_ttl)
        self.read_lock_ttl = float(read_lock_ttl)
        self.write_ttl = float(write_ttl)
        self.instance_id = instance_id if instance_id is not None else str(uuid.uuid4())
        self.prefault = bool(prefault)
        self.generation: ServerGeneration = generation
        self.api_key = api_key
        self._state: _State = "new"
        self._core: InProcessServer | None = None
        self._port = 0
        self._http_port = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._runner: web.AppRunner | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._lanes: dict[str, asyncio.Queue[_Queued]] = {}
        self._send_lock: asyncio.Lock | None = None
        self.dropped = 0  # requests answered with silence (bad, unknown, failed)

    # ------------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        """ZMQ endpoint, e.g. ``tcp://127.0.0.1:40123`` (after start)."""
        self._require_started()
        return f"tcp://{self.host}:{self._port}"

    @property
    def http_url(self) -> str:
        """HTTP endpoint, e.g. ``http://127.0.0.1:40124`` (after start)."""
        self._require_started()
        return f"http://{self.host}:{self._http_port}"

    @property
    def port(self) -> int:
        self._require_started()
        return self._port

    @property
    def http_port(self) -> int:
        self._require_started()
        return self._http_port

    @property
    def shm_segment(self) -> str | None:
        """Path of the SHM pool (``/dev/shm/lmcache_l1_pool_<name>``), None in pickle mode."""
        if self.shm_name is None:
            return None
        return os.path.join(SHM_DIR, segment_name(self.shm_name))

    @property
    def core(self) -> InProcessServer:
        """The request path without sockets (see :class:`InProcessServer`): what every
        ZMQ request goes through; tests may call ``core.handle(op, args)`` directly."""
        if self._core is None:
            raise RuntimeError("the server has not been started")
        return self._core

    @property
    def engine(self) -> CacheEngine:
        """The cache state (for tests that inspect it; thread-safe)."""
        return self.core.engine

    async def handle(self, op: int | str, args: Sequence[Any]) -> Any:
        """One request without sockets: :meth:`InProcessServer.handle` (raises NoReply
        where the real server would answer nothing). Call it on the server's loop."""
        return await self.core.handle(op, args)

    def leftovers(self) -> Leftovers:
        """What the engine still holds for clients (:meth:`InProcessServer.leftovers`)."""
        return self.core.leftovers()

    @property
    def running(self) -> bool:
        return self._state == "running"

    def __repr__(self) -> str:
        where = f"{self.url} {self.http_url}" if self._state == "running" else self._state
        return f"<EmbeddedServer {self.generation} {self.mode} chunk_size={self.chunk_size} {where}>"

    def _require_started(self) -> None:
        if self._state in ("new", "starting"):
            raise RuntimeError("the server has not been started")

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> NoReturn:
        """Refuse ``with``: the server is asynchronous.

        Raises:
            TypeError: always, with the hint to use ``async with EmbeddedServer(...)`` or,
                from blocking code, ``EmbeddedServer.start_in_thread(...)``. Nothing is
                started.
        """
        raise TypeError(_NO_SYNC_WITH)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Never reached (``__enter__`` raises); present so that type checkers see the protocol."""
        raise TypeError(_NO_SYNC_WITH)

    async def __aenter__(self) -> EmbeddedServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Create the pool, bind both ports and start serving.

        Raises:
            OSError: the SHM segment cannot be created (e.g. ``/dev/shm`` too small), or
                a port cannot be bound; for a port in use ``errno`` is ``EADDRINUSE`` and
                the message names the endpoint (``tcp://HOST:PORT`` for ZMQ,
                ``http://HOST:PORT`` for HTTP). The ZMQ error, if any, is its ``__cause__``.

        Cancellation or failure undoes everything (ports closed, segment removed, no
        thread left).
        """
        if self._state != "new":
            raise RuntimeError(f"start() on a server that is {self._state}")
        self._state = "starting"
        try:
            make_core = functools.partial(
                InProcessServer,
                chunk_size=self.chunk_size,
                mode=self.mode,
                generation=self.generation,
                size_bytes=self.size_bytes,
                shm_name=self.shm_name,
                session_ttl=self.session_ttl,
                read_lock_ttl=self.read_lock_ttl,
                write_ttl=self.write_ttl,
                prefault=self.prefault,
                layouts=[(m.name, m.world_size, m.layout(self.chunk_size)) for m in self.models],
            )
            if self.prefault:  # backing the pool takes a while: keep the loop serving
                pending = asyncio.get_running_loop().run_in_executor(None, make_core)
                try:
                    self._core = await asyncio.shield(pending)
                except asyncio.CancelledError:
                    pending.add_done_callback(_close_core_later)
                    raise
            else:
                self._core = make_core()
            self._send_lock = asyncio.Lock()
            # A shadow of the process's context, never terminated (as the clients' own:
            # lmcache_async._base.zmq_context): a server dropped unstopped cannot hang the
            # process when the collector finds its context.
            self._ctx = zmq.asyncio.Context.shadow(process_context())
            sock = self._ctx.socket(zmq.ROUTER)
            self._sock = sock
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.LINGER, 0)
            url = f"tcp://{self.host}:{self._req_port or '*'}"
            try:
                sock.bind(url)
            except zmq.ZMQError as exc:
                raise _bind_error(f"bind the ZMQ endpoint {url}", exc.errno, exc.strerror) from exc
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._port = int(endpoint.rsplit(":", 1)[1])
            app = web.Application(middlewares=[self._http_auth] if self.api_key is not None else [])
            app.router.add_get("/", self._http_root)
            app.router.add_get("/healthcheck", self._http_health)
            app.router.add_get("/config", self._http_config)
            app.router.add_get("/status", self._http_status)
            app.router.add_get("/lmc_version", self._http_lmc_version)
            self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
            await self._runner.setup()
            # One listening socket, so the port is the same whatever the host resolves to.
            try:
                http_sock = socket.create_server((self.host, self._req_http_port))
            except OSError as exc:
                where = f"listen on the HTTP endpoint http://{self.host}:{self._req_http_port}"
                raise _bind_error(where, exc.errno, exc.strerror) from exc
            site = web.SockSite(self._runner, http_sock)
            await site.start()
            self._http_port = int(http_sock.getsockname()[1])
            self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmcache-embedded")
            self._lanes = {"transfer": asyncio.Queue(), "cpu": asyncio.Queue()}
            self._tasks = [
                asyncio.create_task(self._recv_loop(), name="lmcache-embedded-recv"),
                *(
                    asyncio.create_task(self._lane_loop(q), name=f"lmcache-embedded-{lane}")
                    for lane, q in self._lanes.items()
                ),
            ]
            self._state = "running"
            log.info(
                "embedded LMCache %s server (%s) on %s and %s",
                self.generation,
                self.mode,
                self.url,
                self.http_url,
            )
        except BaseException:
            await self._teardown()
            raise

    async def stop(self) -> None:
        """Stop serving, close both ports and remove the SHM segment. Idempotent.

        Requests still queued get no reply; copies already running in worker threads are
        waited for. Cancellation midway still closes the ports and removes the segment.
        """
        if self._state in ("new", "stopped", "stopping"):
            return
        self._state = "stopping"
        await self._teardown()

    async def _teardown(self) -> None:
        try:
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(BaseException):
                    await task
            self._tasks = []
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
            self._ctx = None  # a shadow: nothing to terminate
            if self._runner is not None:
                runner, self._runner = self._runner, None
                await runner.cleanup()
            if self._executor is not None:
                executor, self._executor = self._executor, None
                await asyncio.get_running_loop().run_in_executor(
                    None, functools.partial(executor.shutdown, wait=True, cancel_futures=True)
                )
        finally:
            if self._core is not None:
                self._core.close()
            self._state = "stopped"

    # ------------------------------------------------------------------ thread runner

    @classmethod
    def start_in_thread(
        cls, *, start_timeout: float = 30.0, **options: Unpack[ServerOptions]
    ) -> EmbeddedServerThread:
        """Start a server on its own event loop in a daemon thread; returns once it serves.

        The constructor's keywords (:class:`ServerOptions`), plus ``start_timeout``
        (seconds). The handle
        has the same ``url``/``http_url``/``mode``/``chunk_size``/``shm_segment``
        attributes; ``handle.stop()`` stops the server, joins the thread and always
        removes the SHM segment. Raises whatever :meth:`start` raised, or TimeoutError.
        """
        server = cls(**options)
        return EmbeddedServerThread(server, start_timeout=start_timeout)

    # ------------------------------------------------------------------ ZMQ

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                log.error("ZMQ receive failed: %s", exc)
                await asyncio.sleep(0.01)
                continue
            try:
                await self._dispatch(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must survive anything a peer sends
                self.dropped += 1
                log.exception("error handling a request (no reply)")

    async def _dispatch(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 3:
            # The real server dies here (an assertion outside any try); we only drop it.
            self.dropped += 1
            log.warning("dropping a message of %d frame(s) after the identity (no reply)", len(frames) - 1)
            return
        identity, uid_frame, op_frame = frames[0].bytes, frames[1].bytes, frames[2].bytes
        try:
            op = decode_operation(op_frame)
            prepared = self.core.prepare(op, [f.buffer for f in frames[3:]])
        except (BadRequest, NoReply) as exc:
            self.dropped += 1
            log.warning("request dropped (no reply): %s", exc)
            return
        if prepared.lane == "sync":
            await self._execute((identity, uid_frame, op_frame, prepared))
        else:
            self._lanes[prepared.lane].put_nowait((identity, uid_frame, op_frame, prepared))

    async def _lane_loop(self, queue: asyncio.Queue[_Queued]) -> None:
        while True:
            await self._execute(await queue.get())

    async def _execute(self, queued: _Queued) -> None:
        identity, uid_frame, op_frame, prepared = queued
        core = self.core
        try:
            if prepared.blocking:
                assert self._executor is not None
                result = await asyncio.get_running_loop().run_in_executor(self._executor, core.run, prepared)
            else:
                result = core.run(prepared)
        except NoReply as exc:
            self.dropped += 1
            log.warning("%s", exc)
            return
        payload = core.reply_frame(result)
        reply = [uid_frame, op_frame] if payload is None else [uid_frame, op_frame, payload]
        await self._send(identity, reply)

    async def _send(self, identity: bytes, frames: Sequence[bytes | bytearray | memoryview]) -> None:
        sock, lock = self._sock, self._send_lock
        if sock is None or lock is None:
            return
        copy = len(frames) < 3 or len(frames[2]) < ZMQ_COPY_THRESHOLD
        async with lock:
            try:
                await sock.send_multipart([identity, *frames], copy=copy)
            except zmq.ZMQError as exc:
                log.warning("response destination disconnected: %s", exc)

    # ------------------------------------------------------------------ HTTP

    def config(self) -> dict[str, Any]:
        """The ``/config`` document (shaped like the real server's, with this server's values)."""
        shm = self.shm_name if self.mode == "shm" else ""
        memory = {
            "size_in_bytes": self.size_bytes,
            "use_lazy": False,
            "init_size_in_bytes": self.size_bytes,
            "align_bytes": 4096,
            "shm_name": shm,
            "use_hugepages": False,
            "devdax_path": None,
            "devdax_size_in_bytes": 0,
        }
        eviction = {"eviction_policy": "LRU", "trigger_watermark": 1.0, "eviction_ratio": 0.0}
        l1 = {
            "memory_config": memory,
            "gds_l1_config": None,
            "write_ttl_seconds": self.write_ttl,
            "read_ttl_seconds": self.read_lock_ttl,
            "tag": "_default",
            "eviction": eviction,
        }
        return {
            "mp": {
                "transport": "zmq",
                "host": self.host,
                "port": self._port,
                "chunk_size": self.chunk_size,
                "max_workers": 1,
                "max_gpu_workers": 1,
                "max_cpu_workers": 1,
                "hash_algorithm": HASH_ALGORITHM,
                "engine_type": "default",
                "supported_transfer_mode": "auto",
                "shm_name": shm,
                "instance_id": self.instance_id,
                "session_ttl_seconds": self.session_ttl,
                "worker_reap_timeout_seconds": 0.0,
                "enable": [],
                "server_modules": [],
            },
            "storage_manager": {
                "l1_manager_config": l1,
                "eviction_config": eviction,
                "l2_adapter_config": {"adapters": []},
                "l1_manager_configs": [l1],
            },
            "http": {"http_host": self.host, "http_port": self._http_port},
            "lmcache_async_embedded": {"version": __version__, "mode": self.mode},
        }

    def status(self) -> dict[str, Any]:
        """The ``/status`` document; ``active_sessions`` and ``active_prefetch_jobs`` are exact.

        Thread-safe (may be called from any thread while the server runs).
        """
        st = self.engine.status()
        l1 = st["l1_manager"]
        regs: dict[int, dict[str, Any]] = st["registrations"]
        storage = {
            "is_healthy": l1["is_healthy"],
            "l1_managers": {"_default": l1},
            "l1_manager": l1,
            "l1_usage": st["l1_usage"],
            "l1_capacity_bytes_by_backend": {"dram": self.size_bytes},
            "l1_eviction_controller": {"is_healthy": True, "eviction_policy": "LRU"},
            "l2_adapters": [],
            "num_l2_adapters": 0,
        }
        return {
            "is_healthy": l1["is_healthy"],
            "engine_type": ENGINE_TYPE,
            "chunk_size": self.chunk_size,
            "hash_algorithm": HASH_ALGORITHM,
            "active_sessions": st["active_sessions"],
            "storage_manager": storage,
            "active_prefetch_jobs": st["active_prefetch_jobs"],
            "worker_liveness": {"enabled": False, "tracked_instances": len(regs)},
            "registered_gpu_ids": [m.registration_id for m in self.models],
            "cache_context_meta": {str(m.registration_id): m.context_meta() for m in self.models},
            "registered_non_cuda_instance_ids": list(regs),
            "non_cuda_context_meta": {str(i): r for i, r in regs.items()},
            "lmcache_async_embedded": {
                "version": __version__,
                "mode": self.mode,
                "resident_objects": st["resident_objects"],
                "pending_shm_writes": st["pending_shm_writes"],
                "pending_shm_reads": st["pending_shm_reads"],
                "evictions": st["evictions"],
                "dropped_requests": self.dropped,
                "layouts": st["layouts"],
            },
        }

    async def _http_root(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "service": "LMCache HTTP API"})

    async def _http_health(self, request: web.Request) -> web.Response:
        if self._state != "running":
            return web.json_response({"status": "unhealthy", "reason": "engine not initialized"}, status=503)
        return web.json_response({"status": "healthy"})

    async def _http_config(self, request: web.Request) -> web.Response:
        return web.json_response(self.config())

    async def _http_status(self, request: web.Request) -> web.Response:
        if self._state != "running":
            return web.json_response({"error": "engine not initialized"}, status=503)
        return web.json_response(self.status())

    async def _http_lmc_version(self, request: web.Request) -> web.Response:
        return web.json_response(LMC_VERSIONS[self.generation])

    @web.middleware
    async def _http_auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """The real 0.5.7 server's API-key check (installed only when ``api_key`` is set)."""
        if request.path in PUBLIC_HTTP_PATHS or self._authorized(request):
            return await handler(request)
        return web.json_response(UNAUTHORIZED_BODY, status=401, headers={"WWW-Authenticate": "Bearer"})

    def _authorized(self, request: web.Request) -> bool:
        key = self.api_key
        assert key is not None
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        bearer = token if scheme.lower() == "bearer" and token else None
        offered = [t for t in (bearer, request.headers.get(API_KEY_HEADER)) if t]
        return any(hmac.compare_digest(t.encode(), key.encode()) for t in offered)


# --------------------------------------------------------------------------- helpers


def _bind_error(what: str, code: int | None, reason: str | None) -> OSError:
    """The error of a port that cannot be bound: ``what`` names the endpoint."""
    if code == errno.EADDRINUSE:
        return OSError(code, f"cannot {what}: the port is in use (choose another port, or 0 for a free one)")
    return OSError(code, f"cannot {what}: {reason}")


def _close_core_later(fut: asyncio.Future[InProcessServer]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


# --------------------------------------------------------------------------- thread handle


class EmbeddedServerThread:
    """A running :class:`EmbeddedServer` on its own loop in a daemon thread.

    Created by :meth:`EmbeddedServer.start_in_thread`. Attributes mirror the server's:
    ``url``, ``http_url``, ``mode``, ``generation``, ``api_key``,
    ``chunk_size``, ``shm_name``, ``shm_segment``, ``instance_id``; ``server`` is the
    server object itself (its :meth:`~EmbeddedServer.status` and ``engine`` are
    thread-safe). Use as a context manager or call :meth:`stop`.
    """

    def __init__(self, server: EmbeddedServer, *, start_timeout: float = 30.0) -> None:
        self.server = server
        self.mode: Mode = server.mode
        self.generation: ServerGeneration = server.generation
        self.api_key = server.api_key
        self.chunk_size = server.chunk_size
        self.shm_name = server.shm_name
        self.shm_segment = server.shm_segment
        self.instance_id = server.instance_id
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="lmcache-embedded-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            self.stop()
            raise TimeoutError(f"the embedded server did not start within {start_timeout}s")
        if self._error is not None:
            self._thread.join(5.0)
            self._unlink()
            raise self._error
        self.url = server.url
        self.http_url = server.http_url
        self.port = server.port
        self.http_port = server.http_port

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to the starter if it is still waiting
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                log.exception("embedded server thread failed")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        try:
            await self.server.start()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            await self._stop_event.wait()
        finally:
            await self.server.stop()

    def status(self) -> dict[str, Any]:
        """The server's ``/status`` document (thread-safe)."""
        return self.server.status()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and join its thread; the SHM segment is removed in any case.

        Idempotent. Raises TimeoutError if the thread did not finish within ``timeout``.
        """
        if not self._stopped:
            self._stopped = True
            loop, event = self._loop, self._stop_event
            if loop is not None and event is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop may just have closed
                    loop.call_soon_threadsafe(event.set)
        self._thread.join(timeout)
        self._unlink()
        if self._thread.is_alive():
            raise TimeoutError(f"the embedded server thread did not stop within {timeout}s")

    def _unlink(self) -> None:
        if self.shm_segment is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_segment)

    def __enter__(self) -> EmbeddedServerThread:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"<EmbeddedServerThread {self.generation} {self.mode} {getattr(self, 'url', '?')} {state}>"
