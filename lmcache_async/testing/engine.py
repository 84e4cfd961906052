"""The embedded server's cache engine: the state machine behind every operation, no I/O.

It models the parts of the LMCache 0.5.6 MP server an engine-driven client can observe
(docs/embedded-server.md lists what differs):

* **Object identity** ``(chunk_hash, model_name, kv_rank, object_group 0, cache_salt)``,
  ``kv_rank = world_size<<24 | worker<<16 | world_size<<8 | worker``. Chunk hashes chain
  over whole chunks: ``h_0 = H(NONE || tokens_0)``, ``h_i = H(h_{i-1} || tokens_i)``
  with tokens as big-endian uint32 (blake2b-256 here, blake3 in the real server).
* **L1 objects** are *resident* (readable, LRU-ordered, read-lock counters with a TTL)
  or *staging* (write-reserved, invisible to readers, write lock with a TTL). A batch
  reservation is all or nothing; when the byte budget is exhausted, least recently used
  resident objects that hold no read lock (and expired reservations) are evicted first.
* **Layouts** per ``(model_name, world_size)``, ref-counted, last writer wins.
* **Sessions** per ``request_id`` with a TTL counted from creation, caching the chain of
  chunk hashes (never invalidated, as in the real server).
* **Prefetch jobs**: ``lookup`` takes ``num_kv_readers`` read locks on the longest
  resident prefix (every kv rank when ``worker_id`` is nil) and records the hit length in
  chunks, which ``query_prefetch_status`` hands out exactly once.
* **Pending SHM transfers** keyed by ``(instance_id, key identity)``.

Every public method takes the engine lock; methods that copy tensor data do the copy
outside it. A method raises (any exception) exactly where the real server's handler
would raise, and the server then sends no reply.
"""

from __future__ import annotations

import hashlib
import logging
import math
import pickle
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import torch

from lmcache_async.pickle_codec import decode_tensor_list, encode_tensor_list
from lmcache_async.testing.pool import ALIGN, Arena, SlotAllocator, align_up

__all__ = [
    "BadRequest",
    "CacheEngine",
    "ChunkHasher",
    "LayoutSpec",
    "ServerKey",
    "as_bool",
    "as_bytes",
    "as_float",
    "as_int",
    "as_opt_int",
    "as_str",
    "decode_register",
    "kv_rank",
]

log = logging.getLogger(__name__)

Mode = Literal["shm", "pickle"]
#: ``(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)``
ObjectId = tuple[bytes, str, int, int, str]

_SALT_FORBIDDEN: Final = frozenset("@/\\\x00")
_SALT_MAX: Final = 128
_U64: Final = 2**64
_I64_MIN: Final = -(2**63)


class BadRequest(ValueError):
    """A request the real server would reject (it never replies to it)."""


# --------------------------------------------------------------------------- decoding
# msgspec semantics: nested ints reject bools and floats, strings reject bin and vice
# versa; a whole argument declared exactly ``int``/``bool`` is coerced with int()/bool().


def _strict_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name}: expected int, got {type(value).__name__}")
    if not _I64_MIN <= value < _U64:
        raise BadRequest(f"{name}: integer out of range")
    return value


def _strict_str(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{name}: expected str, got {type(value).__name__}")
    return value


def as_int(value: object) -> int:
    """A whole argument declared ``int``: coerced like ``int(value)``."""
    try:
        coerced: int = int(value)  # type: ignore[call-overload]
        return coerced
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadRequest(f"cannot coerce {value!r} to int") from exc


def as_bool(value: object) -> bool:
    """A whole argument declared ``bool``: coerced like ``bool(value)``."""
    return bool(value)


def as_opt_int(value: object) -> int | None:
    """``int | None`` (strict)."""
    return None if value is None else _strict_int(value, "argument")


def as_str(value: object) -> str:
    """``str`` (strict)."""
    return _strict_str(value, "argument")


def as_float(value: object) -> float:
    """``float``: an int or a float, not a bool."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"expected float, got {type(value).__name__}")
    return float(value)


def as_bytes(value: object) -> bytes:
    """``bytes``: msgpack bin only."""
    if not isinstance(value, bytes):
        raise BadRequest(f"expected bin, got {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class ServerKey:
    """``IPCCacheServerKey`` as the server decodes it.

    ``ident`` is what the real key compares by (request id, configs and reader count are
    not part of it).
    """

    model_name: str
    world_size: int
    worker_id: int | None
    token_ids: tuple[int, ...]
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    request_configs: Mapping[str, Any] | None = None
    num_kv_readers: int = 0

    @property
    def ident(self) -> tuple[Any, ...]:
        return (
            self.model_name,
            self.world_size,
            self.worker_id,
            self.token_ids,
            self.start,
            self.end,
            self.cache_salt,
        )

    def without_worker(self) -> ServerKey:
        return ServerKey(
            self.model_name,
            self.world_size,
            None,
            self.token_ids,
            self.start,
            self.end,
            self.request_id,
            self.cache_salt,
            self.request_configs,
            self.num_kv_readers,
        )

    def require_num_kv_readers(self) -> int:
        if self.num_kv_readers < 1:
            raise BadRequest(
                f"num_kv_readers={self.num_kv_readers}: this server requires clients that "
                "send IPCCacheServerKey.num_kv_readers"
            )
        return self.num_kv_readers

    @classmethod
    def decode(cls, obj: object) -> ServerKey:
        """Decode a key map (any order, unknown keys ignored); BadRequest if invalid."""
        if not isinstance(obj, dict):
            raise BadRequest("a cache key must be a map")
        try:
            tokens = obj["token_ids"]
            if not isinstance(tokens, list):
                raise BadRequest("token_ids: expected array")
            worker = obj["worker_id"]
            configs = obj.get("request_configs")
            if configs is not None and not isinstance(configs, dict):
                raise BadRequest("request_configs: expected map or nil")
            key = cls(
                model_name=_strict_str(obj["model_name"], "model_name"),
                world_size=_strict_int(obj["world_size"], "world_size"),
                worker_id=None if worker is None else _strict_int(worker, "worker_id"),
                token_ids=tuple(_strict_int(t, "token_ids[]") for t in tokens),
                start=_strict_int(obj["start"], "start"),
                end=_strict_int(obj["end"], "end"),
                request_id=_strict_str(obj["request_id"], "request_id"),
                cache_salt=_strict_str(obj.get("cache_salt", ""), "cache_salt"),
                request_configs=configs,
                num_kv_readers=_strict_int(obj.get("num_kv_readers", 0), "num_kv_readers"),
            )
        except KeyError as exc:
            raise BadRequest(f"cache key lacks required field {exc.args[0]!r}") from None
        bad = _SALT_FORBIDDEN & set(key.cache_salt)
        if bad:
            raise BadRequest(f"cache_salt must not contain {sorted(bad)!r}")
        if len(key.cache_salt) > _SALT_MAX:
            raise BadRequest(f"cache_salt exceeds {_SALT_MAX} characters")
        return key


@dataclass(frozen=True, slots=True)
class RegisterRequest:
    """``RegisterEngineDrivenContextPayload`` as the server decodes it."""

    instance_id: int
    model_name: str
    world_size: int
    block_size: int
    num_layers: int
    hidden_dim_size: int
    dtype_str: str
    use_mla: bool
    num_physical_slots: int | None


def decode_register(obj: object) -> RegisterRequest:
    """Decode the register payload map; BadRequest on a missing field or a wrong type."""
    if not isinstance(obj, dict):
        raise BadRequest("register payload must be a map")
    try:
        use_mla = obj["use_mla"]
        if not isinstance(use_mla, bool):
            raise BadRequest("use_mla: expected bool")
        slots = obj.get("num_physical_slots")
        return RegisterRequest(
            instance_id=_strict_int(obj["instance_id"], "instance_id"),
            model_name=_strict_str(obj["model_name"], "model_name"),
            world_size=_strict_int(obj["world_size"], "world_size"),
            block_size=_strict_int(obj["block_size"], "block_size"),
            num_layers=_strict_int(obj["num_layers"], "num_layers"),
            hidden_dim_size=_strict_int(obj["hidden_dim_size"], "hidden_dim_size"),
            dtype_str=_strict_str(obj["dtype_str"], "dtype_str"),
            use_mla=use_mla,
            num_physical_slots=None if slots is None else _strict_int(slots, "num_physical_slots"),
        )
    except KeyError as exc:
        raise BadRequest(f"register payload lacks field {exc.args[0]!r}") from None


# --------------------------------------------------------------------------- hashing


def kv_rank(world_size: int, worker_id: int) -> int:
    """The real server's kv rank of one worker."""
    return (world_size << 24) | (worker_id << 16) | (world_size << 8) | worker_id


class ChunkHasher:
    """Chained prefix hashes over whole chunks (blake2b-256)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.none_hash = self._digest(struct.pack(">qI", 0, 0))

    @staticmethod
    def _digest(data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=32).digest()

    def hash_tokens(self, tokens: Sequence[int], prefix: bytes) -> bytes:
        """Raises ``struct.error`` for a token outside ``[0, 2**32)`` (as blake3 packing)."""
        return self._digest(prefix + struct.pack(f">{len(tokens)}I", *tokens))

    def chunk_hashes(self, tokens: Sequence[int], start: int = 0, end: int | None = None) -> list[bytes]:
        """Hashes of the complete chunks of ``tokens[:end]`` whose first token is ``>= start``."""
        out: list[bytes] = []
        prefix = self.none_hash
        effective = len(tokens) if end is None else min(len(tokens), end)
        complete = effective - effective % self.chunk_size
        for i in range(0, complete, self.chunk_size):
            prefix = self.hash_tokens(tokens[i : i + self.chunk_size], prefix)
            if i >= start:
                out.append(prefix)
        return out


# --------------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """The object layout of one registration: shape and dtype of one chunk."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(slots=True)
class _Obj:
    offset: int
    layout: LayoutSpec
    lock_count: int = 0  # read locks (resident) or write lock (staging, 0/1)
    lock_expiry: float = 0.0

    def lock(self, now: float, ttl: float, n: int = 1) -> None:
        if now >= self.lock_expiry:
            self.lock_count = 0
        self.lock_count += n
        self.lock_expiry = now + ttl

    def unlock(self, n: int = 1) -> None:
        self.lock_count = max(0, self.lock_count - n)

    def locked(self, now: float) -> bool:
        return self.lock_count > 0 and now < self.lock_expiry


@dataclass(slots=True)
class _LayoutEntry:
    layout: LayoutSpec
    ref_count: int


@dataclass(slots=True)
class _Registration:
    model_name: str
    world_size: int
    block_size: int
    use_mla: bool
    layout: LayoutSpec
    last_seen: float
    pinged: bool = False


@dataclass(slots=True)
class _Session:
    created: float
    tokens: tuple[int, ...] = ()
    hashes: list[bytes] = field(default_factory=list)
    lookup_key: ServerKey | None = None
    hit_chunks: int = -1

    def get_hashes(self, hasher: ChunkHasher, start: int, end: int | None = None) -> list[bytes]:
        """The session's cached chain, extended as needed (never invalidated)."""
        cs = hasher.chunk_size
        assert start % cs == 0, f"start ({start}) must be a multiple of chunk_size ({cs})"
        if end is not None and end > len(self.tokens):
            raise BadRequest(f"end ({end}) exceeds the session's {len(self.tokens)} tokens")
        if end is None:
            end = len(self.tokens) - len(self.tokens) % cs
        assert end % cs == 0, f"end ({end}) must be a multiple of chunk_size ({cs})"
        end_chunk = end // cs
        while len(self.hashes) < end_chunk:
            i = len(self.hashes) * cs
            prefix = self.hashes[-1] if self.hashes else hasher.none_hash
            self.hashes.append(hasher.hash_tokens(self.tokens[i : i + cs], prefix))
        return self.hashes[start // cs : end_chunk]


class CacheEngine:
    """The server state. Thread-safe.

    Args:
        chunk_size: tokens per chunk.
        mode: ``"shm"`` (slots in a shared-memory pool) or ``"pickle"``.
        size_bytes: the L1 byte budget (and pool size).
        shm_name: segment name for SHM mode (``lmcache_l1_pool_`` prefixed if needed).
        session_ttl, read_lock_ttl, write_ttl: seconds.
        prefault: back the whole pool with memory at once.
    """

    def __init__(
        self,
        *,
        chunk_size: int,
        mode: Mode,
        size_bytes: int,
        shm_name: str | None,
        session_ttl: float,
        read_lock_ttl: float,
        write_ttl: float,
        prefault: bool = False,
    ) -> None:
        self.chunk_size = chunk_size
        self.mode: Mode = mode
        self.session_ttl = session_ttl
        self.read_lock_ttl = read_lock_ttl
        self.write_ttl = write_ttl
        self.hasher = ChunkHasher(chunk_size)
        self.arena = Arena(size_bytes, shm_name if mode == "shm" else None, prefault=prefault)
        self._alloc = SlotAllocator(size_bytes)
        self._lock = threading.RLock()
        self._resident: OrderedDict[ObjectId, _Obj] = OrderedDict()  # LRU: oldest first
        self._staging: dict[ObjectId, _Obj] = {}
        self._layouts: dict[tuple[str, int], _LayoutEntry] = {}
        self._registrations: dict[int, _Registration] = {}
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # by creation time
        self._jobs: dict[str, int] = {}
        self._pending_writes: dict[tuple[int, tuple[Any, ...]], list[ObjectId]] = {}
        self._pending_reads: dict[tuple[int, tuple[Any, ...]], list[ObjectId]] = {}
        self.evictions = 0
        self.closed = False

    # ------------------------------------------------------------------ properties

    @property
    def shm_name(self) -> str:
        """The pool's segment name (``""`` in pickle mode)."""
        return self.arena.shm_name or ""

    @property
    def pool_size(self) -> int:
        return self.arena.size if self.mode == "shm" else 0

    def close(self) -> None:
        """Unlink and unmap the pool. Idempotent."""
        with self._lock:
            self.closed = True
            self._resident.clear()
            self._staging.clear()
            self._pending_reads.clear()
            self._pending_writes.clear()
        self.arena.close()

    # ------------------------------------------------------------------ helpers

    def _now(self) -> float:
        return time.monotonic()

    def _sweep_sessions(self, now: float) -> None:
        while self._sessions:
            rid, session = next(iter(self._sessions.items()))
            if now - session.created <= self.session_ttl:
                break
            del self._sessions[rid]

    def _session(self, request_id: str, now: float) -> _Session:
        self._sweep_sessions(now)
        session = self._sessions.get(request_id)
        if session is None:
            session = self._sessions[request_id] = _Session(created=now)
        return session

    def _object_ids(self, key: ServerKey, hashes: Iterable[bytes]) -> list[ObjectId]:
        if "@" in key.model_name:
            raise BadRequest(f"model_name must not contain '@' (got {key.model_name!r})")
        if key.worker_id is None:
            ranks = [kv_rank(key.world_size, w) for w in range(key.world_size)]
        else:
            ranks = [kv_rank(key.world_size, key.worker_id)]
        return [(h, key.model_name, r, 0, key.cache_salt) for h in hashes for r in ranks]

    def _resolve_transfer_ids(self, key: ServerKey, now: float) -> list[ObjectId]:
        """Object ids of a prepare/commit key (via the session's hash cache)."""
        session = self._session(key.request_id, now)
        session.tokens = key.token_ids
        if session.lookup_key is None:
            session.lookup_key = key.without_worker()
        hashes = session.get_hashes(self.hasher, key.start, key.end)
        if key.worker_id is None:
            raise BadRequest("Must resolve keys with worker_id != None")
        return self._object_ids(key, hashes)

    def _registration(self, instance_id: int, now: float) -> _Registration:
        reg = self._registrations.get(instance_id)
        if reg is None:
            raise BadRequest(f"non-GPU context not registered for instance ID {instance_id}")
        reg.last_seen = now
        return reg

    # ---- L1 object lifecycle

    def _free(self, obj: _Obj) -> None:
        self._alloc.free(obj.offset, obj.layout.nbytes)

    def _evictable(self, now: float) -> list[tuple[str, ObjectId, _Obj]]:
        out: list[tuple[str, ObjectId, _Obj]] = [
            ("staging", k, o) for k, o in self._staging.items() if not o.locked(now)
        ]
        out += [("resident", k, o) for k, o in self._resident.items() if not o.locked(now)]
        return out

    def _allocate(self, layout: LayoutSpec, count: int, now: float) -> list[int] | None:
        offsets = self._alloc.allocate_batch(layout.nbytes, count)
        if offsets is not None:
            return offsets
        victims = self._evictable(now)
        need = align_up(layout.nbytes) * count
        if self._alloc.free_bytes + sum(align_up(o.layout.nbytes) for _, _, o in victims) < need:
            return None  # cannot fit even after evicting everything evictable
        for kind, oid, obj in victims:
            if kind == "staging":
                del self._staging[oid]
            else:
                del self._resident[oid]
                self.evictions += 1
            self._free(obj)
            offsets = self._alloc.allocate_batch(layout.nbytes, count)
            if offsets is not None:
                return offsets
        return None

    def _reserve_write(self, ids: Sequence[ObjectId], layout: LayoutSpec, now: float) -> dict[ObjectId, _Obj]:
        """Reserve staging objects for the ids not resident and not being written."""
        reserved: dict[ObjectId, _Obj] = {}
        fresh: list[ObjectId] = []
        for oid in ids:
            if oid in self._resident or oid in reserved or oid in fresh:
                continue
            staged = self._staging.get(oid)
            if staged is not None:
                if staged.locked(now):
                    continue
                if staged.layout != layout:  # expired, other layout: reclaim
                    del self._staging[oid]
                    self._free(staged)
                else:  # expired: hand the buffer to the new writer
                    staged.lock(now, self.write_ttl)
                    reserved[oid] = staged
                    continue
            fresh.append(oid)
        if fresh:
            offsets = self._allocate(layout, len(fresh), now)
            if offsets is not None:
                for oid, offset in zip(fresh, offsets, strict=True):
                    obj = _Obj(offset, layout)
                    obj.lock(now, self.write_ttl)
                    self._staging[oid] = reserved[oid] = obj
        return reserved

    def _finish_write(self, ids: Iterable[ObjectId], now: float) -> None:
        """Admit live reservations (an expired one stays staged, as in the real server)."""
        admitted: list[tuple[ObjectId, _Obj]] = []
        for oid in ids:
            staged = self._staging.get(oid)
            if staged is None:
                continue
            if not staged.locked(now):
                log.warning("finish write on %s whose write reservation expired", oid[0].hex()[:16])
                continue
            del self._staging[oid]
            if oid in self._resident:
                self._free(staged)
                continue
            staged.lock_count = 0
            staged.lock_expiry = 0.0
            admitted.append((oid, staged))
        # Inserted last chunk first, so a request's later chunks are evicted first.
        for oid, obj in reversed(admitted):
            self._resident[oid] = obj

    def _reserve_read(self, ids: Iterable[ObjectId], n: int, now: float) -> None:
        for oid in ids:
            obj = self._resident.get(oid)
            if obj is not None:
                obj.lock(now, self.read_lock_ttl, n)

    def _finish_read(self, ids: Iterable[ObjectId], n: int, now: float) -> None:
        for oid in ids:
            obj = self._resident.get(oid)
            if obj is None:
                log.debug("finish read on a key that does not exist")
                continue
            if not obj.locked(now):
                log.debug("finish read on a key that is not read-locked")
                continue
            obj.unlock(n)

    def _touch(self, ids: Sequence[ObjectId]) -> None:
        for oid in reversed(ids):
            if oid in self._resident:
                self._resident.move_to_end(oid)

    def _slot(self, obj: _Obj) -> dict[str, Any]:
        return {
            "offset": obj.offset,
            "length": obj.layout.nbytes,
            "shape": list(obj.layout.shape),
            "dtype": str(obj.layout.dtype).split(".")[-1],
        }

    def _locked_objects(self, ids: Sequence[ObjectId], now: float) -> list[tuple[ObjectId, _Obj]]:
        found: list[tuple[ObjectId, _Obj]] = []
        for oid in ids:
            obj = self._resident.get(oid)
            if obj is not None and obj.locked(now):
                found.append((oid, obj))
        return found

    # ------------------------------------------------------------------ layouts

    def register_layout(self, model_name: str, world_size: int, layout: LayoutSpec) -> None:
        """Register a layout for ``(model_name, world_size)`` (ref-counted, last writer wins)."""
        with self._lock:
            entry = self._layouts.get((model_name, world_size))
            if entry is None:
                self._layouts[(model_name, world_size)] = _LayoutEntry(layout, 1)
            else:
                entry.layout = layout
                entry.ref_count += 1

    def _unregister_layout(self, model_name: str, world_size: int) -> None:
        entry = self._layouts.get((model_name, world_size))
        if entry is None:
            return
        if entry.ref_count <= 1:
            del self._layouts[(model_name, world_size)]
        else:
            entry.ref_count -= 1

    # ------------------------------------------------------------------ engine-driven ops

    def _register_reply(self) -> dict[str, Any]:
        return {"shm_name": self.shm_name if self.mode == "shm" else "", "pool_size": self.pool_size}

    def register(self, req: RegisterRequest) -> dict[str, Any]:
        """``register_kv_cache_engine_driven_context``: a known id only refreshes liveness."""
        with self._lock:
            now = self._now()
            existing = self._registrations.get(req.instance_id)
            if existing is not None:
                existing.last_seen = now
                return self._register_reply()
            dtype = getattr(torch, req.dtype_str, None)
            if not isinstance(dtype, torch.dtype):
                raise BadRequest(f"Invalid dtype_str {req.dtype_str!r}")
            slots = self.chunk_size if req.num_physical_slots is None else req.num_physical_slots
            if slots <= 0:
                raise BadRequest(f"num_physical_slots must be positive, got {slots}")
            if req.num_layers <= 0 or req.hidden_dim_size <= 0 or req.world_size <= 0:
                raise BadRequest("num_layers, hidden_dim_size and world_size must be positive")
            shape = (
                (req.num_layers, slots, req.hidden_dim_size)
                if req.use_mla
                else (2, req.num_layers, slots, req.hidden_dim_size)
            )
            layout = LayoutSpec(shape, dtype)
            self._registrations[req.instance_id] = _Registration(
                req.model_name, req.world_size, req.block_size, req.use_mla, layout, now
            )
            self.register_layout(req.model_name, req.world_size, layout)
            return self._register_reply()

    def unregister(self, instance_id: int) -> None:
        """Drop a registration; its pending SHM writes are *admitted*, its reads released."""
        with self._lock:
            now = self._now()
            reg = self._registrations.pop(instance_id, None)
            if reg is None:
                log.info("no registered non-GPU context for instance ID %d", instance_id)
                return
            for tkey in [k for k in self._pending_writes if k[0] == instance_id]:
                self._finish_write(self._pending_writes.pop(tkey), now)
            for tkey in [k for k in self._pending_reads if k[0] == instance_id]:
                self._finish_read(self._pending_reads.pop(tkey), 1, now)
            self._unregister_layout(reg.model_name, reg.world_size)

    def prepare_store(self, key: ServerKey, instance_id: int) -> dict[str, Any]:
        """Reserve slots for the chunks not cached yet (SHM); ``{"context": {}}`` on pickle."""
        with self._lock:
            now = self._now()
            reg = self._registration(instance_id, now)
            if self.mode == "pickle":
                self._session(key.request_id, now)
                return {"context": {}}
            ids = self._resolve_transfer_ids(key, now)
            reserved = self._reserve_write(ids, reg.layout, now)
            slots: list[dict[str, Any]] = []
            indices: list[int] = []
            taken: list[ObjectId] = []
            for idx, oid in enumerate(ids):
                obj = reserved.get(oid)
                if obj is None:
                    continue
                slots.append(self._slot(obj))
                indices.append(idx)
                taken.append(oid)
            if not taken:
                return {"context": {"slots": [], "chunk_indices": []}}
            self._pending_writes[(instance_id, key.ident)] = taken
            return {"context": {"slots": slots, "chunk_indices": indices}}

    def commit_store_shm(self, key: ServerKey, instance_id: int) -> bool:
        """``commit_store`` with empty data: admit the pending reservation (False if none)."""
        with self._lock:
            now = self._now()
            self._registration(instance_id, now)
            self._session(key.request_id, now)
            if self.mode != "shm":
                raise BadRequest("empty commit_store data on a pickle server")
            taken = self._pending_writes.pop((instance_id, key.ident), None)
            if taken is None:
                return False
            self._finish_write(taken, now)
            return True

    def commit_store_pickle(self, key: ServerKey, instance_id: int, data: bytes) -> bool:
        """``commit_store`` with a pickled list of chunk tensors (restricted unpickling).

        Blocking (decodes and copies); call it from a worker thread. Returns whether every
        reserved chunk was written; chunks already cached are not reserved, so True when
        all exist. Raises (no reply) on a payload that is not plain tensors.
        """
        with self._lock:
            now = self._now()
            reg = self._registration(instance_id, now)
            self._session(key.request_id, now)
            ids = self._resolve_transfer_ids(key, now)
        chunks = decode_tensor_list(data)
        with self._lock:
            now = self._now()
            reserved = self._reserve_write(ids, reg.layout, now)
            plan: list[tuple[ObjectId, torch.Tensor, torch.Tensor]] = []
            for idx, oid in enumerate(ids):
                obj = reserved.get(oid)
                if obj is None:
                    continue
                if idx >= len(chunks):
                    log.error("pickle store is missing chunk %d (%d chunks)", idx, len(chunks))
                    continue
                if tuple(chunks[idx].shape) != obj.layout.shape:
                    log.error(
                        "pickle store chunk %d has shape %s, the object %s",
                        idx,
                        list(chunks[idx].shape),
                        list(obj.layout.shape),
                    )
                    continue
                view = self.arena.view(obj.offset, obj.layout.shape, obj.layout.dtype)
                plan.append((oid, view, chunks[idx]))
        written: list[ObjectId] = []
        try:
            for oid, view, chunk in plan:
                view.copy_(chunk)
                written.append(oid)
        finally:
            del plan
            with self._lock:
                self._finish_write(written, self._now())
        if len(written) != len(reserved):
            log.error("pickle store incomplete: %d reserved, %d written", len(reserved), len(written))
        return len(written) == len(reserved)

    def prepare_retrieve(self, key: ServerKey, instance_id: int) -> dict[str, Any]:
        """Hand out the read-locked chunks of ``[start, end)``.

        SHM: slot descriptors, recorded as a pending read until ``commit_retrieve``.
        Pickle: blocking (copies; call it from a worker thread) -- the pickled chunks, and
        one read lock per chunk is released. Any chunk missing or not read-locked:
        ``success: false`` (the locks of the found ones are released).
        """
        with self._lock:
            now = self._now()
            self._registration(instance_id, now)
            ids = self._resolve_transfer_ids(key, now)
            found = self._locked_objects(ids, now)
            if not found or len(found) != len(ids):
                self._finish_read([oid for oid, _ in found], 1, now)
                return {"success": False, "data": b"", "context": {}}
            if self.mode == "shm":
                self._pending_reads[(instance_id, key.ident)] = [oid for oid, _ in found]
                return {"success": True, "data": b"", "context": {"slots": [self._slot(o) for _, o in found]}}
            views = [self.arena.view(o.offset, o.layout.shape, o.layout.dtype) for _, o in found]
        try:
            try:
                data: bytes | bytearray = encode_tensor_list(views, msgpack_bin=False)
            except ValueError:  # a dtype without a legacy storage class (e.g. float8)
                data = pickle.dumps([v.clone() for v in views])
        finally:
            del views
            with self._lock:
                self._finish_read(ids, 1, self._now())
        return {"success": True, "data": data, "context": {}}

    def commit_retrieve(self, key: ServerKey, instance_id: int) -> bool:
        """Release the pending SHM read of ``(instance_id, key)`` (always True)."""
        with self._lock:
            now = self._now()
            self._registration(instance_id, now)
            self._session(key.request_id, now)
            if self.mode == "shm":
                self._finish_read(self._pending_reads.pop((instance_id, key.ident), []), 1, now)
            return True

    # ------------------------------------------------------------------ lookup / sessions

    def lookup(self, key: ServerKey) -> None:
        """Read-lock the longest resident prefix and record the hit length as a job."""
        with self._lock:
            now = self._now()
            self._sweep_sessions(now)
            if (key.model_name, key.world_size) not in self._layouts:
                log.error("no layout for model %s with world size %d", key.model_name, key.world_size)
                self._jobs[key.request_id] = 0
                return
            readers = key.require_num_kv_readers()
            hashes = self.hasher.chunk_hashes(key.token_ids, end=key.end)
            if not hashes:
                self._jobs[key.request_id] = 0
                return
            session = self._session(key.request_id, now)
            session.tokens = key.token_ids
            session.lookup_key = key
            session.hit_chunks = -1
            per_chunk = [self._object_ids(key, [h]) for h in hashes]
            hit = 0
            for ids in per_chunk:
                if not all(oid in self._resident for oid in ids):
                    break
                hit += 1
            for ids in per_chunk[:hit]:
                self._reserve_read(ids, readers, now)
            self._jobs[key.request_id] = hit

    def query_prefetch_status(self, request_id: str) -> int:
        """The hit length in chunks, exactly once; 0 for an unknown or consumed id."""
        with self._lock:
            now = self._now()
            hit = self._jobs.pop(request_id, None)
            if hit is None:
                log.info("prefetch job for request %s not found (consumed or unknown)", request_id)
                return 0
            self._session(request_id, now).hit_chunks = hit
            return hit

    def free_lookup_locks(self, key: ServerKey) -> None:
        """Release the lookup's read locks on the chunks of ``[start, end)`` it locked."""
        with self._lock:
            now = self._now()
            if key.start >= key.end:
                return
            session = self._session(key.request_id, now)
            if session.hit_chunks < 0:
                job = self._jobs.pop(key.request_id, None)
                if job is not None:
                    session.hit_chunks = job
            hit = session.hit_chunks
            if hit < 0:
                log.info("free_lookup_locks for %s without a lookup result", key.request_id)
                return
            hashes = self.hasher.chunk_hashes(key.token_ids, start=key.start, end=key.end)
            if not hashes:
                return
            if (key.model_name, key.world_size) not in self._layouts:
                raise BadRequest(f"no layout registered for {key.model_name!r}")
            start_chunk = key.start // self.chunk_size
            end_chunk = start_chunk + len(hashes)
            lo, hi = max(0, start_chunk), min(hit, end_chunk)
            if lo >= hi:
                return
            ids = self._object_ids(key, hashes[lo - start_chunk : hi - start_chunk])
            if not ids:
                return
            self._finish_read(ids, key.require_num_kv_readers(), now)

    def end_session(self, request_id: str) -> None:
        """Remove the session and LRU-touch its chunks (locks and jobs are not touched)."""
        with self._lock:
            now = self._now()
            self._sweep_sessions(now)
            session = self._sessions.pop(request_id, None)
            if session is None:
                log.debug("session %s not found", request_id)
                return
            lk = session.lookup_key
            if lk is None:
                return
            hashes = session.get_hashes(self.hasher, 0)
            if (lk.model_name, lk.world_size) not in self._layouts:
                raise BadRequest(f"no layout registered for {lk.model_name!r}")
            self._touch(self._object_ids(lk.without_worker(), hashes))

    # ------------------------------------------------------------------ management

    def ping(self, instance_id: int | None) -> bool:
        with self._lock:
            if instance_id is not None:
                reg = self._registrations.get(instance_id)
                if reg is not None:
                    reg.last_seen = self._now()
                    reg.pinged = True
            return True

    def clear(self, force: bool) -> None:
        """Drop cached objects: unlocked ones and expired reservations, or all if ``force``."""
        with self._lock:
            now = self._now()
            for table in (self._resident, self._staging):
                for oid, obj in list(table.items()):
                    if force or not obj.locked(now):
                        del table[oid]
                        self._free(obj)

    # ------------------------------------------------------------------ observability

    def status(self) -> dict[str, Any]:
        """Counts for ``/status`` (sessions and jobs exact at the time of the call)."""
        with self._lock:
            now = self._now()
            self._sweep_sessions(now)
            read_locked = sum(1 for o in self._resident.values() if o.locked(now))
            write_locked = sum(1 for o in self._staging.values() if o.locked(now))
            staging_bytes = sum(align_up(o.layout.nbytes) for o in self._staging.values())
            total = self._alloc.size // ALIGN * ALIGN
            used = total - self._alloc.free_bytes
            return {
                "active_sessions": len(self._sessions),
                "active_prefetch_jobs": len(self._jobs),
                "l1_manager": {
                    "is_healthy": not self.closed,
                    "total_object_count": len(self._resident) + len(self._staging),
                    "write_locked_count": write_locked,
                    "read_locked_count": read_locked,
                    "temporary_count": 0,
                    "staging_object_count": len(self._staging),
                    "staging_bytes": staging_bytes,
                    "memory_used_bytes": used,
                    "memory_total_bytes": total,
                    "memory_configured_bytes": self.arena.size,
                    "capacity_bytes_by_backend": {"dram": self.arena.size},
                    "memory_usage_ratio": used / total if total else 0.0,
                    "write_ttl_seconds": self.write_ttl,
                    "read_ttl_seconds": self.read_lock_ttl,
                },
                "l1_usage": [used, total],
                "registrations": {
                    iid: {
                        "model_name": r.model_name,
                        "world_size": r.world_size,
                        "block_size": r.block_size,
                        "use_mla": r.use_mla,
                    }
                    for iid, r in self._registrations.items()
                },
                "resident_objects": len(self._resident),
                "pending_shm_writes": len(self._pending_writes),
                "pending_shm_reads": len(self._pending_reads),
                "evictions": self.evictions,
                "layouts": sorted(f"{m}/{ws}" for m, ws in self._layouts),
            }
