"""Sans-IO: the typed KV events and the decoding and validation of the server's event
batches; published by :mod:`lmcache_async.events`, which says what the events can see.

The server (0.5.6 and 0.5.7) streams a *batch* per credit over the string-only
streaming RPC ``subscribe_kv_events(instance_id, model_name, cursor, max_events)``; a
batch is ``{enabled, incarnation, next_cursor, lost, events}`` and each event a record
``{seq, kind, medium, model_name, block_hashes, parent_block_hash, token_ids}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from lmcache_async.errors import ProtocolError

__all__ = [
    "MAX_BATCH_HASHES",
    "MAX_EVENTS_LIMIT",
    "KVEvent",
    "KVEventBatch",
    "RemovedEvent",
    "Resync",
    "StoredEvent",
    "batch_size_limit",
    "decode_batch",
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
        cursor: a cursor to resume from in a later stream (``kv_events(cursor=...,
            incarnation=...)``) that skips nothing after this item: the position just
            before the first record that follows it.
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


#: The most chunk hashes the ``removed`` records of one batch may carry together (an L1
#: event removes at most what L1 holds; this bounds the memory and the decoding time a
#: batch can cost: about 0.2 s of the event loop at the limit).
MAX_BATCH_HASHES: Final = 1 << 20
#: The largest cursor, sequence number or incarnation (the server's are int64).
_INT64_MAX: Final = 2**63 - 1

_Hash = Annotated[bytes, Meta(min_length=32, max_length=32)]
_Seq = Annotated[int, Meta(ge=1, le=_INT64_MAX)]
_Cursor = Annotated[int, Meta(ge=0, le=_INT64_MAX)]


def _batch_decoder(max_events: int, chunk_size: int) -> msgspec.msgpack.Decoder[Any]:
    """A typed decoder of one batch: msgspec checks every array's length at its header,
    so a batch of more records (or a record of more tokens) than asked for is refused
    before any of it is built."""

    tokens = Annotated[list[Annotated[int, Meta(ge=0, lt=2**32)]], Meta(max_length=chunk_size)]
    record = msgspec.defstruct(
        "KVEventRecord",
        [
            ("seq", _Seq),
            ("kind", Literal["stored", "removed"]),
            ("model_name", str),
            ("block_hashes", Annotated[list[_Hash], Meta(max_length=MAX_BATCH_HASHES)]),
            ("parent_block_hash", _Hash | None, None),
            ("token_ids", tokens, []),
            ("medium", str, "CPU"),
        ],
    )
    batch = msgspec.defstruct(
        "KVEventBatch",
        [
            ("enabled", bool),
            ("incarnation", Annotated[int, Meta(ge=0, le=_INT64_MAX)]),
            ("next_cursor", _Cursor),
            ("lost", bool),
            ("events", Annotated[list[record], Meta(max_length=max_events)]),  # type: ignore[valid-type]
        ],
    )
    return msgspec.msgpack.Decoder(batch)


_decoders: dict[tuple[int, int], msgspec.msgpack.Decoder[Any]] = {}


def batch_size_limit(max_events: int, chunk_size: int, model_name: str) -> int:
    """The most bytes a batch of at most ``max_events`` records may take: every record a
    ``stored`` one of ``chunk_size`` tokens (each token at its widest encoding), plus
    :data:`MAX_BATCH_HASHES` hashes of ``removed`` records."""
    stored = 256 + len(model_name.encode()) + 9 * chunk_size
    return 256 + max_events * stored + 34 * MAX_BATCH_HASHES


def decode_batch(
    payload: bytes | memoryview, *, model_name: str, cursor: int, max_events: int, chunk_size: int
) -> KVEventBatch:
    """Decode and check one batch of the subscription to ``model_name`` that asked for
    the records after ``cursor``, at most ``max_events`` a batch, of a server whose chunk
    size is ``chunk_size``.

    The size is checked before anything is decoded (:func:`batch_size_limit`), the
    lengths of the arrays at their headers.

    Raises:
        ProtocolError: malformed, or not what was asked: more than ``max_events`` records,
            a ``stored`` record without exactly one hash and ``chunk_size`` token ids, a
            hash that is not 32 bytes, a sequence number or cursor out of range or out
            of order, a record of another model, more than :data:`MAX_BATCH_HASHES`
            hashes.
    """
    limit = batch_size_limit(max_events, chunk_size, model_name)
    if len(payload) > limit:
        raise ProtocolError(
            f"KV event batch of {len(payload)} bytes: more than the {limit} a batch of at most "
            f"{max_events} records can take"
        )
    decoder = _decoders.get((max_events, chunk_size))
    if decoder is None:
        if len(_decoders) >= 64:
            _decoders.clear()
        decoder = _decoders[max_events, chunk_size] = _batch_decoder(max_events, chunk_size)
    try:
        raw = decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"KV event batch: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"KV event batch: malformed msgpack ({exc})") from None
    if not raw.enabled:
        return KVEventBatch(False, raw.incarnation, raw.next_cursor, raw.lost, ())
    if not raw.lost and raw.next_cursor < cursor:
        raise ProtocolError(
            f"KV event batch: next_cursor {raw.next_cursor} is before the cursor {cursor} asked"
        )
    events: list[StoredEvent | RemovedEvent] = []
    previous, hashes = cursor, 0
    for r in raw.events:
        if not previous < r.seq <= raw.next_cursor:
            raise ProtocolError(
                f"KV event: seq {r.seq} is out of order (after {previous}, next_cursor {raw.next_cursor})"
            )
        previous = r.seq
        if r.model_name != model_name:
            raise ProtocolError(f"KV event {r.seq}: a record of model {r.model_name!r}, not {model_name!r}")
        if r.kind == "stored":
            if len(r.block_hashes) != 1:
                raise ProtocolError(
                    f"KV event {r.seq}: a stored record carries one hash, got {len(r.block_hashes)}"
                )
            if len(r.token_ids) != chunk_size:
                raise ProtocolError(
                    f"KV event {r.seq}: a stored record carries {chunk_size} token ids (the chunk size), "
                    f"got {len(r.token_ids)}"
                )
            events.append(
                StoredEvent(
                    r.seq, model_name, r.block_hashes[0], r.parent_block_hash, tuple(r.token_ids),
                    r.medium, raw.incarnation,
                )
            )  # fmt: skip
        else:
            hashes += len(r.block_hashes)
            if hashes > MAX_BATCH_HASHES:
                raise ProtocolError(f"KV event batch: more than {MAX_BATCH_HASHES} removed hashes")
            events.append(RemovedEvent(r.seq, model_name, tuple(r.block_hashes), r.medium, raw.incarnation))
    return KVEventBatch(True, raw.incarnation, raw.next_cursor, raw.lost, tuple(events))
