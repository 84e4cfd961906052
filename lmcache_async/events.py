"""KV events of an LMCache MP server: the typed items of ``AsyncClient.kv_events()``
(sans-IO: parsing and validation only; the stream itself is
:mod:`lmcache_async._event_stream`).

The server (0.5.6 and 0.5.7) streams a *batch* per credit over the string-only
streaming RPC ``subscribe_kv_events(instance_id, model_name, cursor, max_events)``; a
batch is ``{enabled, incarnation, next_cursor, lost, events}`` and each event a record
``{seq, kind, medium, model_name, block_hashes, parent_block_hash, token_ids}``.

What the events can see (docs/guides/routing.md has the whole list):

* ``stored`` only for chunks written by the lmcache-driven (vLLM GPU) path: stores made
  by clients (``AsyncClient.store``, the SDK) publish nothing;
* ``removed`` for every L1 removal: eviction, a freed temporary prefetch copy,
  ``DELETE /cache/objects``, ``clear``;
* L1 only (no L2), one model per subscription, no cache salt, no rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from lmcache_async.errors import ProtocolError

__all__ = [
    "MAX_EVENTS_LIMIT",
    "KVEvent",
    "KVEventBatch",
    "RemovedEvent",
    "Resync",
    "StoredEvent",
    "parse_batch",
    "validate_cursor",
    "validate_max_events",
]

#: The most records a batch may carry (the server answers nothing outside 1..1024).
MAX_EVENTS_LIMIT: Final = 1024


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """A chunk became resident in the server's L1 (lmcache-driven stores only).

    Attributes:
        seq: the record's sequence number (per server incarnation, from 1).
        model_name: the model it was stored for.
        block_hash: its chunk hash (:func:`lmcache_async.hashing.chunk_hashes`).
        parent_hash: the previous chunk's hash, ``None`` for a sequence's first chunk.
        token_ids: the chunk's ``chunk_size`` tokens.
        medium: always ``"CPU"`` (the server's L1, whatever its backend).
        incarnation: the server incarnation that reported it.
    """

    seq: int
    model_name: str
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    medium: str
    incarnation: int

    kind: Literal["stored"] = "stored"


@dataclass(frozen=True, slots=True)
class RemovedEvent:
    """Chunks left the server's L1 (eviction, delete, ``clear``, a freed prefetch copy).

    A removal under one rank or salt is reported even while another still holds the
    same tokens (the record carries neither).
    """

    seq: int
    model_name: str
    block_hashes: tuple[bytes, ...]
    medium: str
    incarnation: int

    kind: Literal["removed"] = "removed"


@dataclass(frozen=True, slots=True)
class Resync:
    """Events were missed: drop what was derived from this server's earlier events.

    Attributes:
        reason: ``"lost"`` (the cursor fell out of the server's bounded log, or the
            server dropped events upstream) or ``"restarted"`` (a new server
            incarnation: its cache starts empty, its sequence numbers from 1).
        incarnation: the server incarnation the events that follow come from.
        previous_incarnation: the one before (``None`` for ``"lost"``, or when unknown).
        cursor: the cursor the stream resumes from.
    """

    reason: Literal["lost", "restarted"]
    incarnation: int
    previous_incarnation: int | None
    cursor: int

    kind: Literal["resync"] = "resync"


KVEvent = StoredEvent | RemovedEvent | Resync


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One batch as the server sent it (already type-checked)."""

    enabled: bool
    incarnation: int
    next_cursor: int
    lost: bool
    events: tuple[StoredEvent | RemovedEvent, ...]


def validate_max_events(max_events: object) -> int:
    """``max_events`` as the server accepts it: an int in ``1..1024`` (it answers any
    other value with silence, so it is refused here, before anything is sent)."""
    if isinstance(max_events, bool) or not isinstance(max_events, int):
        raise TypeError(f"max_events must be an int, got {type(max_events).__name__}")
    if not 1 <= max_events <= MAX_EVENTS_LIMIT:
        raise ValueError(f"max_events must be in 1..{MAX_EVENTS_LIMIT}, got {max_events}")
    return max_events


def validate_cursor(cursor: object) -> int:
    """A cursor: an int in ``[0, 2**63)`` (0: everything the server still holds)."""
    if isinstance(cursor, bool) or not isinstance(cursor, int):
        raise TypeError(f"cursor must be an int, got {type(cursor).__name__}")
    if not 0 <= cursor < 2**63:
        raise ValueError(f"cursor must be in [0, 2**63), got {cursor}")
    return cursor


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"KV event batch: {name} must be an int, got {value!r}")
    return value


def _hash(value: object, name: str) -> bytes:
    if not isinstance(value, bytes):
        raise ProtocolError(f"KV event: {name} must be bin, got {type(value).__name__}")
    return value


def _record(obj: object, incarnation: int) -> StoredEvent | RemovedEvent:
    if not isinstance(obj, dict):
        raise ProtocolError("KV event: a record must be a map")
    kind = obj.get("kind")
    seq = _int(obj.get("seq"), "seq")
    model = obj.get("model_name")
    medium = obj.get("medium", "CPU")
    if not isinstance(model, str) or not isinstance(medium, str):
        raise ProtocolError("KV event: model_name and medium must be str")
    hashes = obj.get("block_hashes")
    if not isinstance(hashes, list):
        raise ProtocolError("KV event: block_hashes must be an array")
    if kind == "removed":
        return RemovedEvent(seq, model, tuple(_hash(h, "block_hashes") for h in hashes), medium, incarnation)
    if kind == "stored":
        if len(hashes) != 1:
            raise ProtocolError(f"KV event: a stored record carries one hash, got {len(hashes)}")
        parent = obj.get("parent_block_hash")
        tokens = obj.get("token_ids")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ProtocolError("KV event: token_ids must be an array of ints")
        return StoredEvent(
            seq,
            model,
            _hash(hashes[0], "block_hashes"),
            None if parent is None else _hash(parent, "parent_block_hash"),
            tuple(tokens),
            medium,
            incarnation,
        )
    raise ProtocolError(f"KV event: unknown kind {kind!r}")


def parse_batch(obj: Any) -> KVEventBatch:
    """Check and convert one decoded batch map.

    Raises:
        ProtocolError: a missing field, a wrong type or an unknown record kind.
    """
    if not isinstance(obj, dict):
        raise ProtocolError(f"KV event batch must be a map, got {type(obj).__name__}")
    enabled = obj.get("enabled")
    lost = obj.get("lost")
    if not isinstance(enabled, bool) or not isinstance(lost, bool):
        raise ProtocolError("KV event batch: enabled and lost must be bools")
    incarnation = _int(obj.get("incarnation"), "incarnation")
    next_cursor = _int(obj.get("next_cursor"), "next_cursor")
    events = obj.get("events")
    if not isinstance(events, list):
        raise ProtocolError("KV event batch: events must be an array")
    return KVEventBatch(
        enabled, incarnation, next_cursor, lost, tuple(_record(e, incarnation) for e in events)
    )
