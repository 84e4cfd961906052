"""The wire dialects of the embedded server: one schema per LMCache server generation.

The real server decodes every argument frame with msgspec against the type its handler
declares (``msgspec.msgpack.decode(frame, type=T)``; a whole argument declared exactly
``int`` or ``bool`` is decoded untyped and coerced with ``int()``/``bool()``), and answers
nothing when that fails. The embedded server does the same, with the Structs below that
mirror the real server's types field for field:

* ``"0.5.6"``: keys carry ``token_ids`` (an array of ints); the inline (non-SHM) payload
  of ``commit_store`` / ``prepare_retrieve`` is a pickled list of tensors (decoded here
  with the restricted unpickler, never ``pickle.loads``).
* ``"0.5.7"`` (the 0.5.7rc3 server): keys carry ``token_bytes`` (big-endian uint32 per
  token; a key with only ``token_ids`` is rejected), the inline payload is the msgpack
  :class:`TensorEnvelope` (typed, unknown fields forbidden, checked against the
  registered layout before anything is stored), ``prepare_store`` takes a third frame
  ``skipped_chunks`` and ``free_lookup_locks`` a third frame ``extra_ranges``.

:data:`ARGUMENTS` is the arity table: per generation, per operation name, the declared
type of each argument frame. The real server requires exactly that many frames.

This module repeats, on purpose, facts the client keeps in :mod:`lmcache_async._protocol.wire` (the
key and envelope schemas, the legacy operation ids, the argument counts): the embedded
server is an independent oracle, written from the real server's source and not from the
client's, so that one bug cannot pass both sides. ``tests/unit/test_op_table.py`` proves
that the two operation tables agree (every id and every generation's arity).
"""

from __future__ import annotations

import array
import math
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal

import msgspec
import torch

from lmcache_async._protocol.payload.pickle_tensors import decode_tensor_list, encode_tensor_list

__all__ = [
    "ARGUMENTS",
    "GENERATIONS",
    "LEGACY_OPERATION_IDS",
    "LMC_VERSIONS",
    "BadRequest",
    "Key056",
    "Key057",
    "Register056",
    "Register057",
    "ServerGeneration",
    "TensorEnvelope",
    "TensorFrame",
    "check_generation",
    "decode_argument",
    "decode_envelope",
    "decode_operation",
    "encode_envelope",
    "operation_name",
    "pack_token_ids",
]

#: A server generation whose wire the embedded server speaks.
ServerGeneration = Literal["0.5.6", "0.5.7"]
GENERATIONS: Final[tuple[ServerGeneration, ...]] = ("0.5.6", "0.5.7")
#: What ``GET /lmc_version`` answers (the real servers' strings).
LMC_VERSIONS: Final[dict[ServerGeneration, str]] = {"0.5.6": "0.5.6", "0.5.7": "0.5.7rc3.dev0"}

#: Bytes per packed token id (big-endian uint32), 0.5.7's ``token_bytes``.
TOKEN_STRIDE: Final = 4
#: ``cache_salt`` rules of the real key's ``__post_init__``.
SALT_FORBIDDEN: Final = frozenset("@/\\\x00")
SALT_MAX_LEN: Final = 128

#: Limits of the 0.5.7 inline tensor envelope (``transfer_context/tensor_wire.py``).
ENVELOPE_MAX_TENSORS: Final = 65536
ENVELOPE_MAX_RANK: Final = 16
ENVELOPE_MAX_TENSOR_BYTES: Final = 2 * 1024**3
ENVELOPE_MAX_TOTAL_BYTES: Final = 16 * 1024**3
ENVELOPE_MAX_METADATA_BYTES_PER_TENSOR: Final = 1024
ENVELOPE_VERSION: Final = 1


class BadRequest(ValueError):
    """A request the real server would reject (it never replies to it)."""


def check_generation(generation: str) -> ServerGeneration:
    """``generation`` if it is one of :data:`GENERATIONS`, else ValueError."""
    for g in GENERATIONS:
        if generation == g:
            return g
    raise ValueError(f"unknown server generation {generation!r}; known: {', '.join(GENERATIONS)}")


def _check_salt(salt: str) -> None:
    bad = SALT_FORBIDDEN & set(salt)
    if bad:
        raise ValueError(f"cache_salt must not contain {sorted(bad)!r} (got {salt!r})")
    if len(salt) > SALT_MAX_LEN:
        raise ValueError(f"cache_salt exceeds max length {SALT_MAX_LEN} (got {len(salt)})")


# --------------------------------------------------------------------------- keys


class BlockAllocation(msgspec.Struct, forbid_unknown_fields=True):
    """One record of ``report_block_allocation``."""

    req_id: str
    new_block_ids: list[int]
    new_token_ids: list[int]


class Key056(msgspec.Struct):
    """0.5.6's ``IPCCacheServerKey`` (decoded from a map; unknown fields ignored)."""

    model_name: str
    world_size: int
    worker_id: int | None
    token_ids: list[int]
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    request_configs: dict[str, Any] | None = None
    num_kv_readers: int = 0

    def __post_init__(self) -> None:
        _check_salt(self.cache_salt)

    def packed_tokens(self) -> bytes:
        """The tokens as 0.5.7's wire bytes (what both generations hash)."""
        return pack_token_ids(self.token_ids)


class Key057(msgspec.Struct):
    """0.5.7's ``IPCCacheServerKey``: ``token_bytes`` replaced ``token_ids``."""

    model_name: str
    world_size: int
    worker_id: int | None
    token_bytes: bytes
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    request_configs: dict[str, Any] | None = None
    num_kv_readers: int = 0

    def __post_init__(self) -> None:
        if len(self.token_bytes) % TOKEN_STRIDE:
            raise ValueError(
                f"token_bytes of {len(self.token_bytes)} byte(s) is not a whole number "
                f"of {TOKEN_STRIDE}-byte token ids"
            )
        _check_salt(self.cache_salt)

    def packed_tokens(self) -> bytes:
        return self.token_bytes


def pack_token_ids(tokens: Sequence[int]) -> bytes:
    """Big-endian uint32 per token, in one bulk conversion (no per-token Python loop).

    Raises:
        BadRequest: a token outside ``[0, 2**32)`` (the real server's hasher raises there).
    """
    try:
        words = array.array("I", tokens)
    except OverflowError as exc:
        raise BadRequest(f"token ids must fit uint32: {exc}") from None
    if words.itemsize != TOKEN_STRIDE:  # pragma: no cover - every Linux/macOS build has 4
        raise RuntimeError("array('I') is not 4 bytes on this platform")
    if sys.byteorder == "little":
        words.byteswap()
    return words.tobytes()


# --------------------------------------------------------------------------- registration


class Register056(msgspec.Struct):
    """0.5.6's ``RegisterEngineDrivenContextPayload``."""

    instance_id: int
    model_name: str
    world_size: int
    block_size: int
    num_layers: int
    hidden_dim_size: int
    dtype_str: str
    use_mla: bool
    num_physical_slots: int | None = None


class GroupLayout057(msgspec.Struct):
    """0.5.7's ``GroupLayout`` (one LMCache group of a hybrid-KV registration)."""

    num_layers: int
    hidden_dim_size: int
    dtype_str: str
    tokens_per_block: int
    window_tokens: int = 0
    kv_size: int = 0
    window_chunks: int = 0
    recurrent: bool = False


class Register057(Register056):
    """0.5.7's payload: adds ``group_layouts`` (empty for single-group registrations)."""

    group_layouts: list[GroupLayout057] = []


# --------------------------------------------------------------------------- 0.5.7 inline envelope

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class TensorFrame(msgspec.Struct, forbid_unknown_fields=True):
    """One tensor of the 0.5.7 inline envelope: metadata and raw little-endian bytes."""

    dtype: str
    shape: Annotated[tuple[_NonNegative, ...], msgspec.Meta(max_length=ENVELOPE_MAX_RANK)]
    data: Annotated[memoryview, msgspec.Meta(max_length=ENVELOPE_MAX_TENSOR_BYTES)]


class TensorEnvelope(msgspec.Struct, forbid_unknown_fields=True):
    """The 0.5.7 inline payload ``{version: 1, tensors: [...]}`` (no pickle anywhere)."""

    version: Literal[1]
    tensors: Annotated[list[TensorFrame], msgspec.Meta(max_length=ENVELOPE_MAX_TENSORS)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def decode_envelope(
    payload: bytes | bytearray | memoryview, *, shape: tuple[int, ...], dtype: torch.dtype, count: int
) -> list[memoryview]:
    """Decode and validate a 0.5.7 inline envelope against the expected layout.

    Checks, before anything is allocated or stored: the payload's total size, the typed
    envelope (version 1, no unknown fields, rank <= 16, <= 2 GiB a tensor, <= 65536
    tensors), exactly ``count`` tensors, each of ``dtype`` and ``shape`` with exactly the
    matching byte length, and <= 16 GiB in all.

    Returns:
        The raw bytes of each tensor (views into ``payload``, no copy).

    Raises:
        BadRequest: anything above is violated (the server then answers nothing).
    """
    if not 0 <= count <= ENVELOPE_MAX_TENSORS:
        raise BadRequest(f"expected tensor count must be between 0 and {ENVELOPE_MAX_TENSORS}")
    if len(payload) > ENVELOPE_MAX_TOTAL_BYTES + ENVELOPE_MAX_METADATA_BYTES_PER_TENSOR * count:
        raise BadRequest("inline tensor envelope exceeds the wire-format limit")
    try:
        envelope = msgspec.msgpack.decode(payload, type=TensorEnvelope)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"not a valid inline tensor envelope: {exc}") from None
    if len(envelope.tensors) != count:
        raise BadRequest(f"inline tensor count mismatch: expected {count}, got {len(envelope.tensors)}")
    want_dtype = _dtype_name(dtype)
    want_bytes = math.prod(shape) * dtype.itemsize
    total = 0
    out: list[memoryview] = []
    for frame in envelope.tensors:
        if frame.dtype != want_dtype:
            raise BadRequest(f"inline tensor dtype mismatch: expected {want_dtype}, got {frame.dtype}")
        if frame.shape != shape:
            raise BadRequest(f"inline tensor shape mismatch: expected {shape}, got {frame.shape}")
        if len(frame.data) != want_bytes:
            raise BadRequest(
                f"inline tensor byte length mismatch: expected {want_bytes}, got {len(frame.data)}"
            )
        total += len(frame.data)
        if total > ENVELOPE_MAX_TOTAL_BYTES:
            raise BadRequest("inline tensor payload exceeds 16 GiB")
        out.append(frame.data)
    return out


def encode_envelope(chunks: Sequence[tuple[str, tuple[int, ...], memoryview]]) -> bytes:
    """Encode ``(dtype name, shape, raw bytes)`` chunks as a 0.5.7 inline envelope.

    Raises:
        ValueError: more than 65536 tensors, a rank above 16, a tensor above 2 GiB or
            more than 16 GiB in all (the real encoder's limits).
    """
    if len(chunks) > ENVELOPE_MAX_TENSORS:
        raise ValueError(f"inline tensor count exceeds {ENVELOPE_MAX_TENSORS}")
    total = 0
    frames: list[TensorFrame] = []
    for dtype, shape, data in chunks:
        if len(shape) > ENVELOPE_MAX_RANK:
            raise ValueError(f"inline tensor rank exceeds {ENVELOPE_MAX_RANK}")
        if len(data) > ENVELOPE_MAX_TENSOR_BYTES:
            raise ValueError("inline tensor exceeds 2 GiB")
        total += len(data)
        if total > ENVELOPE_MAX_TOTAL_BYTES:
            raise ValueError("inline tensor payload exceeds 16 GiB")
        frames.append(TensorFrame(dtype=dtype, shape=shape, data=data))
    return msgspec.msgpack.encode(TensorEnvelope(version=ENVELOPE_VERSION, tensors=frames))


def decode_pickled_chunks(data: bytes | bytearray | memoryview) -> list[torch.Tensor]:
    """0.5.6's inline payload: a pickled list of tensors, through the restricted unpickler
    (only plain tensors; anything else raises, and the server answers nothing)."""
    return decode_tensor_list(data)


def encode_pickled_chunks(views: Sequence[torch.Tensor]) -> bytes | bytearray:
    """0.5.6's inline retrieve payload: ``pickle.dumps(list[Tensor])``-compatible bytes."""
    return encode_tensor_list(views, msgpack_bin=False)


# --------------------------------------------------------------------------- operations

#: The frozen legacy operation ids (the same table in both generations; id 11 is retired).
LEGACY_OPERATION_IDS: Final[dict[str, int]] = {
    "register_kv_cache": 1,
    "unregister_kv_cache": 2,
    "register_q_cache": 3,
    "unregister_q_cache": 4,
    "store_q": 5,
    "store": 6,
    "retrieve": 7,
    "lookup": 8,
    "query_prefetch_status": 9,
    "wait_prefetch_status": 10,
    "free_lookup_locks": 12,
    "end_session": 13,
    "register_kv_cache_engine_driven_context": 14,
    "unregister_kv_cache_engine_driven_context": 15,
    "prepare_store": 16,
    "commit_store": 17,
    "prepare_retrieve": 18,
    "commit_retrieve": 19,
    "clear": 20,
    "get_chunk_size": 21,
    "ping": 22,
    "report_block_allocation": 23,
    "noop": 24,
    "cb_register_rope": 25,
    "cb_unregister_rope": 26,
    "cb_retrieve_pre_computed": 27,
    "cb_unified_lookup": 28,
    "p2p_lookup_and_lock": 29,
    "p2p_query_lookup_results": 30,
    "p2p_unlock_objects": 31,
    "get_experimental": 32,
    "cb_protocol_handshake": 33,
}
_OPERATIONS_BY_ID: Final = {i: name for name, i in LEGACY_OPERATION_IDS.items()}


def operation_name(op: int | str) -> str:
    """The operation name of an op frame's value (a legacy id or a name).

    Raises:
        BadRequest: an unknown legacy id, or neither an int nor a str.
    """
    if isinstance(op, str):
        return op
    if isinstance(op, bool) or not isinstance(op, int):
        raise BadRequest(f"invalid operation identifier {op!r}")
    try:
        return _OPERATIONS_BY_ID[int(op)]
    except KeyError:
        raise BadRequest(f"unknown legacy operation id {int(op)}") from None


def decode_operation(frame: bytes | bytearray | memoryview) -> str:
    """The operation name of an op frame (BadRequest as :func:`operation_name`, or not msgpack)."""
    try:
        value = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"undecodable operation frame: {exc}") from None
    return operation_name(value)


# --------------------------------------------------------------------------- arity table

#: Per generation and operation name: the declared type of each argument frame, in order.
#: ``int``/``bool`` arguments are decoded untyped and coerced (as the real server does).
ARGUMENTS: Final[dict[ServerGeneration, dict[str, tuple[Any, ...]]]] = {
    "0.5.6": {
        "register_kv_cache_engine_driven_context": (Register056,),
        "unregister_kv_cache_engine_driven_context": (int,),
        "prepare_store": (Key056, int),
        "commit_store": (Key056, int, bytes),
        "prepare_retrieve": (Key056, int),
        "commit_retrieve": (Key056, int),
        "lookup": (Key056, int),
        "query_prefetch_status": (str,),
        "wait_prefetch_status": (str, float),
        "free_lookup_locks": (Key056, int),
        "end_session": (str,),
        "clear": (bool,),
        "ping": (int | None,),
        "get_chunk_size": (),
        "noop": (),
        "get_experimental": (),
        "report_block_allocation": (int, str, list[BlockAllocation]),
    },
    "0.5.7": {
        "register_kv_cache_engine_driven_context": (Register057,),
        "unregister_kv_cache_engine_driven_context": (int,),
        "prepare_store": (Key057, int, tuple[tuple[int, ...], ...]),
        "commit_store": (Key057, int, bytes),
        "prepare_retrieve": (Key057, int),
        "commit_retrieve": (Key057, int),
        "lookup": (Key057, int),
        "query_prefetch_status": (str,),
        "wait_prefetch_status": (str, float),
        "free_lookup_locks": (Key057, int, tuple[tuple[int, int], ...]),
        "end_session": (str,),
        "clear": (bool,),
        "ping": (int | None,),
        "get_chunk_size": (),
        "noop": (),
        "get_experimental": (),
        "report_block_allocation": (int, str, list[BlockAllocation]),
    },
}


def decode_argument(frame: bytes | bytearray | memoryview, declared: Any) -> Any:
    """Decode one argument frame as the real server does (see the module docstring).

    Raises:
        BadRequest: undecodable or of the wrong type (including a failing ``__post_init__``).
    """
    try:
        if declared is int or declared is bool:
            return declared(msgspec.msgpack.decode(frame))
        return msgspec.msgpack.decode(frame, type=declared)
    except (msgspec.DecodeError, TypeError, ValueError, OverflowError) as exc:
        name = getattr(declared, "__name__", declared)
        raise BadRequest(f"cannot decode a {name} argument: {exc}") from None
