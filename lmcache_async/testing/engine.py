"""The embedded server's cache engine: the state machine behind every operation, no I/O.

It models the parts of the LMCache MP server an engine-driven client can observe, for
either generation (:class:`Semantics`: what 0.5.7 changed; no wire format in here -- the
dialects decode requests into :class:`ServerKey` and registration Structs, and hand the
inline payload codec in as a function). docs/guides/testing-your-code.md lists what differs:

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
* **Tokens** are kept packed (big-endian uint32, 0.5.7's ``token_bytes``) and hashed
  per chunk slice: no per-token Python work.

Every public method takes the engine lock; methods that copy tensor data do the copy
outside it. A method raises (any exception) exactly where the real server's handler
would raise, and the server then sends no reply.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_async.testing.dialect import BadRequest, Register056, Register057
from lmcache_async.testing.pool import ALIGN, Arena, SlotAllocator, align_up
from lmcache_async.testing.vocabulary import (
    SEMANTICS_056,
    SKIP_LOAD_CONFIG,
    TOKEN_STRIDE,
    ChunkHasher,
    InlineChunk,
    InlineDecoder,
    InlineEncoder,
    LayoutSpec,
    Leftovers,
    Mode,
    ObjectId,
    Semantics,
    ServerKey,
    kv_rank,
)

__all__ = ["CacheEngine"]

log = logging.getLogger(__name__)


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
    tokens: bytes = b""  # packed
    hashes: list[bytes] = field(default_factory=list)
    lookup_key: ServerKey | None = None
    hit_chunks: int = -1

    def get_hashes(self, hasher: ChunkHasher, start: int, end: int | None = None) -> list[bytes]:
        """The session's cached chain, extended as needed (never invalidated)."""
        cs = hasher.chunk_size
        n = len(self.tokens) // TOKEN_STRIDE
        if start % cs:
            raise BadRequest(f"start ({start}) must be a multiple of chunk_size ({cs})")
        if end is not None and end > n:
            raise BadRequest(f"end ({end}) exceeds the session's {n} tokens")
        if end is None:
            end = n - n % cs
        if end % cs:
            raise BadRequest(f"end ({end}) must be a multiple of chunk_size ({cs})")
        end_chunk = end // cs
        step = cs * TOKEN_STRIDE
        while len(self.hashes) < end_chunk:
            at = len(self.hashes) * step
            prefix = self.hashes[-1] if self.hashes else hasher.none_hash
            self.hashes.append(hasher.hash_chunk(self.tokens[at : at + step], prefix))
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
        semantics: the generation's behaviour (:data:`SEMANTICS_056` by default).
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
        semantics: Semantics = SEMANTICS_056,
    ) -> None:
        self.chunk_size = chunk_size
        self.mode: Mode = mode
        self.semantics = semantics
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
        session.tokens = key.tokens
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
        reply: dict[str, Any] = {
            "shm_name": self.shm_name if self.mode == "shm" else "",
            "pool_size": self.pool_size,
        }
        if self.semantics.null_block_id is not None:
            reply["null_block_id"] = self.semantics.null_block_id
        return reply

    def register(self, req: Register056 | Register057) -> dict[str, Any]:
        """``register_kv_cache_engine_driven_context``: a known id only refreshes liveness.

        Multi-group (hybrid-KV) registrations (0.5.7's ``group_layouts``) are not
        modelled: a payload with any group layout is refused (no reply).
        """
        with self._lock:
            now = self._now()
            existing = self._registrations.get(req.instance_id)
            if existing is not None:
                existing.last_seen = now
                return self._register_reply()
            if isinstance(req, Register057) and req.group_layouts:
                raise BadRequest("the embedded server serves single-group registrations only")
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

    def prepare_store(
        self, key: ServerKey, instance_id: int, skipped_chunks: Sequence[Sequence[int]] = ()
    ) -> dict[str, Any]:
        """Reserve slots for the chunks not cached yet (SHM); ``{"context": {}}`` on pickle.

        ``skipped_chunks`` (0.5.7): one entry per registered group, only multi-group
        registrations send it; any for a single-group one is refused (as the real server).
        """
        with self._lock:
            now = self._now()
            reg = self._registration(instance_id, now)
            if skipped_chunks:
                raise BadRequest(f"skipped_chunks has {len(skipped_chunks)} groups for 0 registered groups")
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

    def commit_store_inline(self, key: ServerKey, instance_id: int, decode: InlineDecoder) -> bool:
        """``commit_store`` with inline data (the dialect's ``decode`` turns it into chunks).

        Blocking (decodes and copies); call it from a worker thread. ``decode`` runs
        before anything is reserved and may refuse the payload (then this raises and the
        server answers nothing). Returns whether every reserved chunk was written; chunks
        already cached are not reserved, so True when all exist. A chunk missing or of
        another shape is not written (False); with ``release_unwritten_inline`` its
        reservation is dropped at once, else it stays staged until the write TTL.
        """
        with self._lock:
            now = self._now()
            reg = self._registration(instance_id, now)
            self._session(key.request_id, now)
            ids = self._resolve_transfer_ids(key, now)
        chunks = decode(reg.layout, len(ids))
        with self._lock:
            now = self._now()
            reserved = self._reserve_write(ids, reg.layout, now)
            plan: list[tuple[ObjectId, _Obj, InlineChunk]] = []
            for idx, oid in enumerate(ids):
                obj = reserved.get(oid)
                if obj is None:
                    continue
                if idx >= len(chunks):
                    log.error("inline store is missing chunk %d (%d chunks)", idx, len(chunks))
                    continue
                chunk = chunks[idx]
                if isinstance(chunk, torch.Tensor) and tuple(chunk.shape) != obj.layout.shape:
                    log.error(
                        "inline store chunk %d has shape %s, the object %s",
                        idx,
                        list(chunk.shape),
                        list(obj.layout.shape),
                    )
                    continue
                plan.append((oid, obj, chunk))
        written: list[ObjectId] = []
        try:
            for oid, obj, chunk in plan:
                if isinstance(chunk, torch.Tensor):
                    self.arena.view(obj.offset, obj.layout.shape, obj.layout.dtype).copy_(chunk)
                else:
                    self.arena.write(obj.offset, chunk)
                written.append(oid)
        finally:
            del plan
            with self._lock:
                self._finish_write(written, self._now())
                if self.semantics.release_unwritten_inline:
                    done = set(written)
                    self._drop_staged([oid for oid in reserved if oid not in done])
        if len(written) != len(reserved):
            log.error("inline store incomplete: %d reserved, %d written", len(reserved), len(written))
        return len(written) == len(reserved)

    def _drop_staged(self, ids: Iterable[ObjectId]) -> None:
        for oid in ids:
            staged = self._staging.pop(oid, None)
            if staged is not None:
                self._free(staged)

    def prepare_retrieve(
        self, key: ServerKey, instance_id: int, encode: InlineEncoder | None = None
    ) -> dict[str, Any]:
        """Hand out the read-locked chunks of ``[start, end)``.

        SHM: slot descriptors, recorded as a pending read until ``commit_retrieve``.
        Inline: blocking (``encode`` copies; call it from a worker thread) -- the
        dialect's encoding of the chunks, and one read lock per chunk is released. Any
        chunk missing or not read-locked: ``success: false`` (the locks of the found
        ones are released).
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
            if encode is None:
                raise BadRequest("an inline retrieve needs the dialect's encoder")
            objs = [o for _, o in found]
        try:
            with self.arena.raw() as pool:
                views = [self.arena.view(o.offset, o.layout.shape, o.layout.dtype) for o in objs]
                raw = [pool[o.offset : o.offset + o.layout.nbytes] for o in objs]
                try:
                    data = encode(views, raw)
                finally:
                    for r in raw:
                        r.release()
                    del views
        finally:
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
        """Read-lock the longest resident prefix and record the hit length as a job.

        With ``lookup_from_start`` (0.5.7) the chunks below ``key.start`` count as hits
        without being checked or locked (only LRU-touched), and with ``skip_load`` a
        request whose ``request_configs`` set ``lmcache.skip_load`` is a miss with no locks.
        """
        with self._lock:
            now = self._now()
            self._sweep_sessions(now)
            if (key.model_name, key.world_size) not in self._layouts:
                log.error("no layout for model %s with world size %d", key.model_name, key.world_size)
                self._jobs[key.request_id] = 0
                return
            readers = key.require_num_kv_readers()
            hashes = self.hasher.chunk_hashes(key.tokens, end=key.end)
            if not hashes:
                self._jobs[key.request_id] = 0
                return
            session = self._session(key.request_id, now)
            session.tokens = key.tokens
            session.lookup_key = key
            session.hit_chunks = -1
            configs = key.request_configs or {}
            if self.semantics.skip_load and configs.get(SKIP_LOAD_CONFIG, False):
                self._jobs[key.request_id] = 0
                return
            first = 0
            if self.semantics.lookup_from_start:
                first = min(max(0, key.start // self.chunk_size), len(hashes))
                self._touch(self._object_ids(key.without_worker(), hashes[:first]))
            per_chunk = [self._object_ids(key, [h]) for h in hashes[first:]]
            hit = 0
            for ids in per_chunk:
                if not all(oid in self._resident for oid in ids):
                    break
                hit += 1
            for ids in per_chunk[:hit]:
                self._reserve_read(ids, readers, now)
            self._jobs[key.request_id] = first + hit

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

    def free_lookup_locks(self, key: ServerKey, extra_ranges: Sequence[tuple[int, int]] = ()) -> None:
        """Release the lookup's read locks on the chunks of ``[start, end)`` it locked.

        With ``free_floor_and_extra_ranges`` (0.5.7) nothing below the lookup's own
        ``start`` is released (it was never locked), and each ``(start, end)`` of
        ``extra_ranges`` -- locks left by the request's earlier, abandoned lookups, ``end``
        being that lookup's hit boundary -- is released as well.
        """
        with self._lock:
            now = self._now()
            if key.start >= key.end and not extra_ranges:
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
            readers = key.require_num_kv_readers()
            start = key.start
            if self.semantics.free_floor_and_extra_ranges and session.lookup_key is not None:
                start = max(start, session.lookup_key.start)
            ids = self._locked_range(key, start, key.end, hit) if start < key.end else []
            for range_start, range_end in extra_ranges:
                if range_start < range_end:
                    ids += self._locked_range(key, range_start, range_end, range_end // self.chunk_size)
            if ids:
                self._finish_read(ids, readers, now)

    def _locked_range(self, key: ServerKey, start: int, end: int, hit: int) -> list[ObjectId]:
        """The object ids a lookup with ``hit`` chunks locked within ``[start, end)``."""
        hashes = self.hasher.chunk_hashes(key.tokens, start=start, end=end)
        if not hashes:
            return []
        if (key.model_name, key.world_size) not in self._layouts:
            raise BadRequest(f"no layout registered for {key.model_name!r}")
        start_chunk = start // self.chunk_size
        end_chunk = start_chunk + len(hashes)
        lo, hi = max(0, start_chunk), min(hit, end_chunk)
        if lo >= hi:
            return []
        return self._object_ids(key, hashes[lo - start_chunk : hi - start_chunk])

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

    def leftovers(self) -> Leftovers:
        """What this engine still holds for clients: live sessions, unconsumed prefetch
        jobs, read-locked objects, pending SHM transfers and live write reservations.

        After every operation has run to completion (or been cleaned up), all counts are
        zero: :meth:`Leftovers.is_clean`. Expired locks and sessions are not counted.
        """
        with self._lock:
            now = self._now()
            self._sweep_sessions(now)
            return Leftovers(
                sessions=len(self._sessions),
                prefetch_jobs=len(self._jobs),
                read_locked_objects=sum(1 for o in self._resident.values() if o.locked(now)),
                pending_shm_writes=len(self._pending_writes),
                pending_shm_reads=len(self._pending_reads),
                write_reservations=sum(1 for o in self._staging.values() if o.locked(now)),
            )

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
