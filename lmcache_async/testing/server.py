"""An embedded, LMCache-compatible MP server for local use and tests.

:class:`EmbeddedServer` speaks the wire protocol of the LMCache 0.5.6 MP server (ZMQ
ROUTER, ``[identity, uid, op, *args]`` frames, legacy ids and names, silence on bad
requests) and its HTTP API (``/healthcheck``, ``/config``, ``/status``), backed by the
in-process :class:`~lmcache_async.testing.engine.CacheEngine`::

    async with EmbeddedServer(chunk_size=16, mode="shm") as srv:
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
import functools
import hashlib
import logging
import os
import secrets
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Literal

import zmq
import zmq.asyncio
from aiohttp import web

from lmcache_async._version import __version__
from lmcache_async.errors import ProtocolError
from lmcache_async.geometry import KVGeometry, dtype_from_name
from lmcache_async.testing.engine import (
    BadRequest,
    CacheEngine,
    LayoutSpec,
    ServerKey,
    as_bool,
    as_bytes,
    as_float,
    as_int,
    as_opt_int,
    as_str,
    decode_register,
)
from lmcache_async.testing.pool import SHM_DIR, segment_name
from lmcache_async.wire import Op, PreEncoded, Request, decode_request, encode_reply, packb, unpackb

__all__ = ["EmbeddedServer", "EmbeddedServerThread", "ModelSpec", "parse_size"]

log = logging.getLogger(__name__)

Mode = Literal["shm", "pickle"]
_Lane = Literal["sync", "transfer", "cpu"]
_State = Literal["new", "starting", "running", "stopping", "stopped"]

#: What ``/status`` says for the engine type (the real server's value).
ENGINE_TYPE: Final = "MPCacheServer"
HASH_ALGORITHM: Final = "blake2b"
_KV_FORMAT: Final = "NL_X_TWO_NB_BS_NH_HS"


def parse_size(text: str | int) -> int:
    """``"2GB"``, ``"512MiB"``, ``"64k"``, ``"1073741824"`` -> bytes (binary units).

    K/KB/KiB = 1024, M/MB/MiB = 2**20, G/GB/GiB = 2**30, T/TB/TiB = 2**40 (as the real
    server's ``--l1-size-gb``, which counts GiB). Raises ``ValueError`` otherwise.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().lower().replace(" ", "")
        units = {"t": 2**40, "g": 2**30, "m": 2**20, "k": 2**10, "b": 1, "": 1}
        number = s.rstrip("bi") if s.endswith(("ib", "b")) else s
        unit = number[-1:] if number[-1:].isalpha() else ""
        digits = number[: len(number) - len(unit)]
        if unit not in units or not digits:
            raise ValueError(f"cannot parse size {text!r} (e.g. 1073741824, 512MB, 2GB)")
        try:
            value = int(float(digits) * units[unit])
        except ValueError:
            raise ValueError(f"cannot parse size {text!r} (e.g. 1073741824, 512MB, 2GB)") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model declared at start, as if an inference engine (vLLM) had registered it.

    It appears in ``/status`` ``cache_context_meta`` in the real server's format (vLLM
    flash-attention layout ``NL_X_TWO_NB_BS_NH_HS``), so :meth:`KVGeometry.from_status`
    and the official SDK derive its geometry, and its object layout
    ``[2, num_layers, chunk_size, num_kv_heads * head_dim]`` is registered so lookups of
    the model work before any client registers.

    Attributes:
        name: model name (no ``@``).
        num_layers, num_kv_heads, head_dim: geometry (heads per worker).
        block_size: the engine's tokens per paged block.
        dtype: torch dtype name, e.g. ``"bfloat16"``.
        world_size: KV world size of the registration.
        num_blocks: blocks of the pretended engine cache (only shown in ``/status``).
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "bfloat16"
    world_size: int = 1
    num_blocks: int = 2048

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "@" in self.name:
            raise ValueError(f"invalid model name {self.name!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "world_size", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be an int >= 1, got {value!r}")
        dtype_from_name(self.dtype)

    @classmethod
    def from_geometry(cls, name: str, geometry: KVGeometry, *, num_blocks: int = 2048) -> ModelSpec:
        """The spec of a (non-MLA) :class:`KVGeometry`."""
        if geometry.use_mla:
            raise ValueError("ModelSpec declares split K/V layouts only")
        return cls(
            name,
            geometry.num_layers,
            geometry.num_kv_heads,
            geometry.head_dim,
            geometry.block_size,
            str(geometry.dtype).removeprefix("torch."),
            geometry.world_size,
            num_blocks,
        )

    @property
    def registration_id(self) -> int:
        """The pretended engine registration id (stable for a name and world size)."""
        digest = hashlib.blake2b(f"{self.name}/{self.world_size}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") & (2**63 - 1)

    def geometry(self) -> KVGeometry:
        return KVGeometry(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype_from_name(self.dtype),
            block_size=self.block_size,
            world_size=self.world_size,
        )

    def layout(self, chunk_size: int) -> LayoutSpec:
        return LayoutSpec(
            (2, self.num_layers, chunk_size, self.num_kv_heads * self.head_dim), dtype_from_name(self.dtype)
        )

    def context_meta(self) -> dict[str, Any]:
        """The ``cache_context_meta`` entry the real server shows for such a vLLM worker."""
        dtype = dtype_from_name(self.dtype)
        hidden = self.num_kv_heads * self.head_dim
        shape = f"[2, {self.num_blocks}, {self.block_size}, {self.num_kv_heads}, {self.head_dim}]"
        return {
            "model_name": self.name,
            "world_size": self.world_size,
            "kv_cache_layout": {
                "num_layers": self.num_layers,
                "num_blocks": self.num_blocks,
                "cache_size_per_token": 2 * self.num_layers * hidden * dtype.itemsize,
                "kernel_groups": [
                    {
                        "kernel_group_idx": 0,
                        "engine_group_idx": 0,
                        "object_group_idx": 0,
                        "num_layers": self.num_layers,
                        "layer_indices": list(range(self.num_layers)),
                        "tokens_per_block": self.block_size,
                        "slots_per_block": self.block_size,
                        "dtype": str(dtype),
                        "engine_kv_concrete_shape": f"{self.num_layers} x {shape}",
                        "is_mla": False,
                        "engine_kv_format": _KV_FORMAT,
                        "engine_kv_shape": "NL x [2, NB, BS, NH, HS]",
                        "attention_backend": "vLLM non-MLA flash attention",
                    }
                ],
            },
        }


_Call = Callable[[], Any]
#: Decodes the argument values of one operation; returns the call and whether it blocks
#: (runs in a worker thread). Raises (no reply) on a bad argument.
_Builder = Callable[["EmbeddedServer", list[Any]], tuple[_Call, bool]]


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
    ) -> None:
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
        self._state: _State = "new"
        self._engine: CacheEngine | None = None
        self._port = 0
        self._http_port = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._runner: web.AppRunner | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._lanes: dict[_Lane, asyncio.Queue[tuple[bytes, Request, _Call, bool]]] = {}
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
    def engine(self) -> CacheEngine:
        """The cache state (for tests that inspect it; thread-safe)."""
        if self._engine is None:
            raise RuntimeError("the server has not been started")
        return self._engine

    @property
    def running(self) -> bool:
        return self._state == "running"

    def __repr__(self) -> str:
        where = f"{self.url} {self.http_url}" if self._state == "running" else self._state
        return f"<EmbeddedServer {self.mode} chunk_size={self.chunk_size} {where}>"

    def _require_started(self) -> None:
        if self._state in ("new", "starting"):
            raise RuntimeError("the server has not been started")

    # ------------------------------------------------------------------ lifecycle

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
            OSError: the SHM segment cannot be created (e.g. ``/dev/shm`` too small).
            zmq.ZMQError / OSError: a port is taken.

        Cancellation or failure undoes everything (ports closed, segment removed).
        """
        if self._state != "new":
            raise RuntimeError(f"start() on a server that is {self._state}")
        self._state = "starting"
        try:
            make_engine = functools.partial(
                CacheEngine,
                chunk_size=self.chunk_size,
                mode=self.mode,
                size_bytes=self.size_bytes,
                shm_name=self.shm_name,
                session_ttl=self.session_ttl,
                read_lock_ttl=self.read_lock_ttl,
                write_ttl=self.write_ttl,
                prefault=self.prefault,
            )
            if self.prefault:  # backing the pool takes a while: keep the loop serving
                pending = asyncio.get_running_loop().run_in_executor(None, make_engine)
                try:
                    self._engine = await asyncio.shield(pending)
                except asyncio.CancelledError:
                    pending.add_done_callback(_close_engine_later)
                    raise
            else:
                self._engine = make_engine()
            for m in self.models:
                self._engine.register_layout(m.name, m.world_size, m.layout(self.chunk_size))
            self._send_lock = asyncio.Lock()
            self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmcache-embedded")
            self._ctx = zmq.asyncio.Context()
            sock = self._ctx.socket(zmq.ROUTER)
            self._sock = sock
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"tcp://{self.host}:{self._req_port or '*'}")
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._port = int(endpoint.rsplit(":", 1)[1])
            app = web.Application()
            app.router.add_get("/", self._http_root)
            app.router.add_get("/healthcheck", self._http_health)
            app.router.add_get("/config", self._http_config)
            app.router.add_get("/status", self._http_status)
            self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
            await self._runner.setup()
            # One listening socket, so the port is the same whatever the host resolves to.
            http_sock = socket.create_server((self.host, self._req_http_port))
            site = web.SockSite(self._runner, http_sock)
            await site.start()
            self._http_port = int(http_sock.getsockname()[1])
            self._lanes = {"transfer": asyncio.Queue(), "cpu": asyncio.Queue()}
            self._tasks = [
                asyncio.create_task(self._recv_loop(), name="lmcache-embedded-recv"),
                *(
                    asyncio.create_task(self._lane_loop(q), name=f"lmcache-embedded-{lane}")
                    for lane, q in self._lanes.items()
                ),
            ]
            self._state = "running"
            log.info("embedded LMCache server (%s) on %s and %s", self.mode, self.url, self.http_url)
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
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None
            if self._runner is not None:
                runner, self._runner = self._runner, None
                await runner.cleanup()
            if self._executor is not None:
                executor, self._executor = self._executor, None
                await asyncio.get_running_loop().run_in_executor(
                    None, functools.partial(executor.shutdown, wait=True, cancel_futures=True)
                )
        finally:
            if self._engine is not None:
                self._engine.close()
            self._state = "stopped"

    # ------------------------------------------------------------------ thread runner

    @classmethod
    def start_in_thread(
        cls,
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
        start_timeout: float = 30.0,
    ) -> EmbeddedServerThread:
        """Start a server on its own event loop in a daemon thread; returns once it serves.

        Same arguments as the constructor, plus ``start_timeout`` (seconds). The handle
        has the same ``url``/``http_url``/``mode``/``chunk_size``/``shm_segment``
        attributes; ``handle.stop()`` stops the server, joins the thread and always
        removes the SHM segment. Raises whatever :meth:`start` raised, or TimeoutError.
        """
        server = cls(
            host=host,
            port=port,
            http_port=http_port,
            chunk_size=chunk_size,
            mode=mode,
            size_bytes=size_bytes,
            shm_name=shm_name,
            models=models,
            session_ttl=session_ttl,
            read_lock_ttl=read_lock_ttl,
            write_ttl=write_ttl,
            instance_id=instance_id,
            prefault=prefault,
        )
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
        identity = frames[0].bytes
        try:
            request = decode_request([f.buffer for f in frames[1:]])
        except ProtocolError as exc:
            self.dropped += 1
            log.warning("invalid operation frame (no reply): %s", exc)
            return
        route = _ROUTES.get(request.op) if isinstance(request.op, Op) else None
        if route is None:
            self.dropped += 1
            log.warning("no handler registered for operation %s (no reply)", _op_label(request.op))
            return
        lane, arity, build = route
        if len(request.args) != arity:
            self.dropped += 1
            log.warning(
                "%s takes %d argument frames, got %d (no reply)",
                _op_label(request.op),
                arity,
                len(request.args),
            )
            return
        try:
            values = [unpackb(a) for a in request.args]
            call, blocking = build(self, values)
        except (ProtocolError, BadRequest, ValueError, TypeError) as exc:
            self.dropped += 1
            log.warning("bad %s request (no reply): %s", _op_label(request.op), exc)
            return
        if lane == "sync":
            await self._execute(identity, request, call, blocking)
        else:
            self._lanes[lane].put_nowait((identity, request, call, blocking))

    async def _lane_loop(self, queue: asyncio.Queue[tuple[bytes, Request, _Call, bool]]) -> None:
        while True:
            identity, request, call, blocking = await queue.get()
            await self._execute(identity, request, call, blocking)

    async def _execute(self, identity: bytes, request: Request, call: _Call, blocking: bool) -> None:
        try:
            if blocking:
                assert self._executor is not None
                result = await asyncio.get_running_loop().run_in_executor(self._executor, call)
            else:
                result = call()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.dropped += 1
            log.warning("error in %s handler (no reply): %r", _op_label(request.op), exc)
            return
        await self._send(identity, encode_reply(request, result))

    async def _send(self, identity: bytes, frames: Sequence[bytes | bytearray | memoryview]) -> None:
        sock, lock = self._sock, self._send_lock
        if sock is None or lock is None:
            return
        async with lock:
            try:
                await sock.send_multipart([identity, *frames], copy=len(frames) < 3 or len(frames[2]) < 65536)
            except zmq.ZMQError as exc:
                log.warning("response destination disconnected: %s", exc)

    # ------------------------------------------------------------------ handlers

    def _pickle_retrieve(self, key: ServerKey, instance_id: int) -> PreEncoded:
        # Packs in the worker thread too: the reply can be large.
        return PreEncoded(packb(self.engine.prepare_retrieve(key, instance_id)))

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


# --------------------------------------------------------------------------- routes


def _close_engine_later(fut: asyncio.Future[CacheEngine]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


def _op_label(op: Op | str) -> str:
    return op.name.lower() if isinstance(op, Op) else repr(op)


def _r_register(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    return functools.partial(s.engine.register, decode_register(a[0])), False


def _r_unregister(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    return functools.partial(s.engine.unregister, as_int(a[0])), False


def _r_prepare_store(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    return functools.partial(s.engine.prepare_store, ServerKey.decode(a[0]), as_int(a[1])), False


def _r_commit_store(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    key, iid, data = ServerKey.decode(a[0]), as_int(a[1]), as_bytes(a[2])
    if data == b"":
        return functools.partial(s.engine.commit_store_shm, key, iid), False
    return functools.partial(s.engine.commit_store_pickle, key, iid, data), True


def _r_prepare_retrieve(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    key, iid = ServerKey.decode(a[0]), as_int(a[1])
    if s.mode == "shm":
        return functools.partial(s.engine.prepare_retrieve, key, iid), False
    return functools.partial(s._pickle_retrieve, key, iid), True


def _r_commit_retrieve(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    return functools.partial(s.engine.commit_retrieve, ServerKey.decode(a[0]), as_int(a[1])), False


def _r_lookup(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    key = ServerKey.decode(a[0])
    as_int(a[1])  # tp_size: ignored, kept for arity
    return functools.partial(s.engine.lookup, key), False


def _r_query(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    return functools.partial(s.engine.query_prefetch_status, as_str(a[0])), False


def _r_wait(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    rid = as_str(a[0])
    as_float(a[1])  # prefetches finish inside lookup: there is never anything to wait for
    return functools.partial(s.engine.query_prefetch_status, rid), False


def _r_free(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    key = ServerKey.decode(a[0])
    as_int(a[1])
    return functools.partial(s.engine.free_lookup_locks, key), False


def _r_end_session(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    return functools.partial(s.engine.end_session, as_str(a[0])), False


def _r_clear(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    return functools.partial(s.engine.clear, as_bool(a[0])), False


def _r_ping(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    return functools.partial(s.engine.ping, as_opt_int(a[0])), False


def _r_chunk_size(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    return (lambda: s.chunk_size), False


def _r_noop(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    return (lambda: "OK"), False


def _r_experimental(s: EmbeddedServer, a: list[Any]) -> tuple[_Call, bool]:
    return (lambda: []), False


_ROUTES: Final[dict[Op, tuple[_Lane, int, _Builder]]] = {
    Op.REGISTER_ENGINE_DRIVEN: ("sync", 1, _r_register),
    Op.UNREGISTER_ENGINE_DRIVEN: ("sync", 1, _r_unregister),
    Op.PREPARE_STORE: ("transfer", 2, _r_prepare_store),
    Op.COMMIT_STORE: ("transfer", 3, _r_commit_store),
    Op.PREPARE_RETRIEVE: ("transfer", 2, _r_prepare_retrieve),
    Op.COMMIT_RETRIEVE: ("transfer", 2, _r_commit_retrieve),
    Op.LOOKUP: ("cpu", 2, _r_lookup),
    Op.QUERY_PREFETCH_STATUS: ("cpu", 1, _r_query),
    Op.WAIT_PREFETCH_STATUS: ("cpu", 2, _r_wait),
    Op.FREE_LOOKUP_LOCKS: ("cpu", 2, _r_free),
    Op.END_SESSION: ("cpu", 1, _r_end_session),
    Op.CLEAR: ("cpu", 1, _r_clear),
    Op.PING: ("cpu", 1, _r_ping),
    Op.GET_CHUNK_SIZE: ("sync", 0, _r_chunk_size),
    Op.NOOP: ("sync", 0, _r_noop),
    Op.GET_EXPERIMENTAL: ("sync", 0, _r_experimental),
}


# --------------------------------------------------------------------------- thread handle


class EmbeddedServerThread:
    """A running :class:`EmbeddedServer` on its own loop in a daemon thread.

    Created by :meth:`EmbeddedServer.start_in_thread`. Attributes mirror the server's:
    ``url``, ``http_url``, ``mode``, ``chunk_size``, ``shm_name``, ``shm_segment``,
    ``instance_id``; ``server`` is the server object itself (its :meth:`~EmbeddedServer.status`
    and ``engine`` are thread-safe). Use as a context manager or call :meth:`stop`.
    """

    def __init__(self, server: EmbeddedServer, *, start_timeout: float = 30.0) -> None:
        self.server = server
        self.mode: Mode = server.mode
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
        return f"<EmbeddedServerThread {self.mode} {getattr(self, 'url', '?')} {state}>"
