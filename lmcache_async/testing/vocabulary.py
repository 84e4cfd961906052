"""The embedded server's vocabulary: what differs between the generations' cache engines
(:class:`Semantics`), the key every request names (:class:`ServerKey`), chunk hashing
(:class:`ChunkHasher`), a registered layout (:class:`LayoutSpec`), the inline payload's
codec types, and what an engine still holds (:class:`Leftovers`). No state, no I/O:
:mod:`lmcache_async.testing.engine` is the state machine over them.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal, Protocol

import torch

from lmcache_async.testing.dialect import BadRequest, Key056, Key057

__all__ = [
    "SEMANTICS_056",
    "SEMANTICS_057",
    "SKIP_LOAD_CONFIG",
    "TOKEN_STRIDE",
    "ChunkHasher",
    "InlineChunk",
    "InlineDecoder",
    "InlineEncoder",
    "LayoutSpec",
    "Leftovers",
    "Mode",
    "ObjectId",
    "Semantics",
    "ServerKey",
    "kv_rank",
]

Mode = Literal["shm", "pickle"]
#: ``(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)``
ObjectId = tuple[bytes, str, int, int, str]
TOKEN_STRIDE: Final = 4


@dataclass(frozen=True, slots=True)
class Semantics:
    """What differs between the generations' cache engines (no wire format in here).

    Attributes:
        lookup_from_start: ``lookup`` honours ``key.start`` (0.5.7): the chunks below it
            count as hits but are neither read-locked nor checked; 0.5.6 ignores it.
        free_floor_and_extra_ranges: ``free_lookup_locks`` releases nothing below the
            lookup's own ``start`` and takes ``extra_ranges`` (0.5.7).
        skip_load: ``request_configs["lmcache.skip_load"]`` turns a lookup into a miss
            with no locks (0.5.7's default load policy).
        release_unwritten_inline: an incomplete inline store releases (and drops) the
            reservations it did not fill (0.5.7); 0.5.6 leaves them staged until the TTL.
        null_block_id: sent in the register reply (0.5.7); None: not sent (0.5.6).
    """

    lookup_from_start: bool
    free_floor_and_extra_ranges: bool
    skip_load: bool
    release_unwritten_inline: bool
    null_block_id: int | None


SEMANTICS_056: Final = Semantics(False, False, False, False, None)
SEMANTICS_057: Final = Semantics(True, True, True, True, 0)
#: The request_configs flag 0.5.7's default load policy honours.
SKIP_LOAD_CONFIG: Final = "lmcache.skip_load"


@dataclass(frozen=True, slots=True)
class ServerKey:
    """``IPCCacheServerKey`` as the engine uses it, whatever the dialect it came in.

    ``tokens`` are packed (big-endian uint32 per token, 0.5.7's ``token_bytes``): what
    both generations hash. ``ident`` is what the real key compares by (request id,
    configs and reader count are not part of it).
    """

    model_name: str
    world_size: int
    worker_id: int | None
    tokens: bytes
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    request_configs: Mapping[str, Any] | None = None
    num_kv_readers: int = 0

    @classmethod
    def from_wire(cls, key: Key056 | Key057) -> ServerKey:
        """The engine's key of a decoded wire key (BadRequest: a token outside uint32)."""
        return cls(
            key.model_name,
            key.world_size,
            key.worker_id,
            key.packed_tokens(),
            key.start,
            key.end,
            key.request_id,
            key.cache_salt,
            key.request_configs,
            key.num_kv_readers,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_STRIDE

    @property
    def ident(self) -> tuple[Any, ...]:
        return (
            self.model_name,
            self.world_size,
            self.worker_id,
            self.tokens,
            self.start,
            self.end,
            self.cache_salt,
        )

    def without_worker(self) -> ServerKey:
        return replace(self, worker_id=None)

    def require_num_kv_readers(self) -> int:
        if self.num_kv_readers < 1:
            raise BadRequest(
                f"num_kv_readers={self.num_kv_readers}: this server requires clients that "
                "send IPCCacheServerKey.num_kv_readers"
            )
        return self.num_kv_readers


# --------------------------------------------------------------------------- hashing


def kv_rank(world_size: int, worker_id: int) -> int:
    """The real server's kv rank of one worker."""
    return (world_size << 24) | (worker_id << 16) | (world_size << 8) | worker_id


class ChunkHasher:
    """Chained prefix hashes over whole chunks of packed tokens (blake2b-256)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.none_hash = self._digest(struct.pack(">qI", 0, 0))

    @staticmethod
    def _digest(data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=32).digest()

    def hash_chunk(self, packed: bytes, prefix: bytes) -> bytes:
        """The hash of one chunk's packed tokens chained after ``prefix``."""
        return self._digest(prefix + packed)

    def chunk_hashes(self, packed: bytes, start: int = 0, end: int | None = None) -> list[bytes]:
        """Hashes of the complete chunks of ``tokens[:end]`` whose first token is ``>= start``."""
        out: list[bytes] = []
        prefix = self.none_hash
        n = len(packed) // TOKEN_STRIDE
        effective = n if end is None else min(n, end)
        complete = effective - effective % self.chunk_size
        step = self.chunk_size * TOKEN_STRIDE
        for i in range(0, complete, self.chunk_size):
            at = i * TOKEN_STRIDE
            prefix = self.hash_chunk(packed[at : at + step], prefix)
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


#: A chunk handed to an inline (non-SHM) commit: a decoded tensor (0.5.6's pickle, whose
#: dtype ``copy_`` converts) or the validated raw bytes of one object (0.5.7's envelope).
InlineChunk = torch.Tensor | memoryview
#: Decodes an inline commit payload for ``(object layout, number of chunks)``; raises
#: (any exception: the server answers nothing) on a payload it refuses.
InlineDecoder = Callable[[LayoutSpec, int], Sequence[InlineChunk]]


class InlineEncoder(Protocol):
    """Encodes the read-locked chunks of an inline retrieve, given as tensor views and as
    raw bytes of the pool (called outside the engine lock; both stay valid during the call)."""

    def __call__(self, views: Sequence[torch.Tensor], raw: Sequence[memoryview]) -> bytes | bytearray: ...


@dataclass(frozen=True, slots=True)
class Leftovers:
    """What an engine still holds (see :meth:`CacheEngine.leftovers`); all zero = clean."""

    sessions: int
    prefetch_jobs: int
    read_locked_objects: int
    pending_shm_writes: int
    pending_shm_reads: int
    write_reservations: int

    def is_clean(self) -> bool:
        return not any(
            (
                self.sessions,
                self.prefetch_jobs,
                self.read_locked_objects,
                self.pending_shm_writes,
                self.pending_shm_reads,
                self.write_reservations,
            )
        )
