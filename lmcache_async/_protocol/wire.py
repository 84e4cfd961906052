"""The LMCache MP wire protocol, sans-IO: pure functions and frozen dataclasses (no sockets,
no event loop, no torch), used by the client's connection and the embedded server.

A request is ``[uid, op, *args]``, each frame msgpack; a reply echoes the uid and op frames
and carries one payload frame or none. The server never sends error replies, so every
check the server would do silently is done here, loudly, before anything is sent. Every
difference between server generations is data in a :class:`WireGeneration`
(docs/internals/design.md, section "Server generations: data, not branches").
"""

from __future__ import annotations

import array
import enum
import logging
import math
import operator
import re
import struct
import sys
import warnings
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

import msgpack
import msgspec

from lmcache_async.errors import (
    LayoutMismatchError,
    ProtocolError,
    UnknownServerVersionWarning,
    UnsupportedServerVersionError,
)

log = logging.getLogger(__name__)

__all__ = [
    "GENERATIONS",
    "GEN_0_5_6",
    "GEN_0_5_7",
    "MAX_BIN",
    "MAX_SALT_LEN",
    "MAX_TOKEN",
    "MAX_TOKENS",
    "CacheKey",
    "Op",
    "PreEncoded",
    "RegisterPayload",
    "Reply",
    "SlotDescriptor",
    "WireGeneration",
    "bin_header",
    "decode_reply",
    "encode_request",
    "generation_for_version",
    "op_name",
    "pack_token_bytes",
    "packb",
    "parse_prepare_retrieve",
    "parse_prepare_store",
    "parse_register_response",
    "unpackb",
    "validate_cache_salt",
    "validate_model_name",
    "validate_request_configs",
    "validate_tokens",
]

MAX_TOKEN: Final = 2**32  # token ids are hashed as uint32
#: The most token ids one token list may have (2**22 = 4,194,304), in every operation of
#: the library and the command line alike: a longer list is refused, before it is walked,
#: with a ValueError naming this bound. 2**22 ids are about 150 MB as a list and their
#: conversion holds the event loop for about a second; without a bound,
#: ``lookup(range(2**40))`` never returned and froze every other call of the process.
MAX_TOKENS: Final = 1 << 22
MAX_SALT_LEN: Final = 128
MAX_BIN: Final = 2**32 - 1  # msgpack bin32
_BAD_SALT_CHARS: Final = ("@", "/", "\\", "\x00")


class Op(enum.IntEnum):
    """The operations this client sends: one row each, the one table of their facts.

    A row reads ``NAME = (id, name, arity, phase)``:

    * ``id``: the frozen legacy id the op frame carries (the 0.5.6 compatibility table;
      the server routes by name and looks an int up there). A **negative** id marks a
      string-only operation (one with no legacy id, such as ``subscribe_kv_events``): a
      local number, unique and never sent, whose op frame carries its name;
    * ``name``: the server's handler name (:attr:`wire_name`; what :func:`op_name` says);
    * ``arity``: the 0.5.6 argument frames (:attr:`arity`; the server rejects any other
      count; a generation may append more, :attr:`WireGeneration.trailing_args`);
    * ``phase``: the :attr:`lmcache_async.observe.Operation.phases` label of its requests
      (:attr:`phase`; ``None``: its name).

    A member is its id as an int (``int(op)``, ``Op(8)``); :attr:`wire` is what its op
    frame carries, :meth:`from_wire` finds one by id or name. Adding an operation is one row. The
    embedded server keeps its own table (``lmcache_async.testing.dialect``: an
    independent oracle); a unit test proves the two agree.
    """

    _value_: int
    #: The server's name of the operation.
    wire_name: str
    #: Argument frames on the 0.5.6 wire.
    arity: int
    #: The label of its requests in an observed operation's phases.
    phase: str

    def __new__(cls, legacy_id: int, wire_name: str, arity: int, phase: str | None = None) -> Op:
        member = int.__new__(cls, legacy_id)
        member._value_ = legacy_id
        member.wire_name = wire_name
        member.arity = arity
        member.phase = wire_name if phase is None else phase
        return member

    REGISTER_KV_CACHE = (1, "register_kv_cache", 7)
    UNREGISTER_KV_CACHE = (2, "unregister_kv_cache", 1)
    LOOKUP = (8, "lookup", 2)
    QUERY_PREFETCH_STATUS = (9, "query_prefetch_status", 1, "prefetch wait")
    WAIT_PREFETCH_STATUS = (10, "wait_prefetch_status", 2, "prefetch wait")
    FREE_LOOKUP_LOCKS = (12, "free_lookup_locks", 2)
    END_SESSION = (13, "end_session", 1)
    REGISTER_ENGINE_DRIVEN = (14, "register_kv_cache_engine_driven_context", 1)
    UNREGISTER_ENGINE_DRIVEN = (15, "unregister_kv_cache_engine_driven_context", 1)
    PREPARE_STORE = (16, "prepare_store", 2, "prepare")
    COMMIT_STORE = (17, "commit_store", 3, "commit")
    PREPARE_RETRIEVE = (18, "prepare_retrieve", 2, "prepare")
    COMMIT_RETRIEVE = (19, "commit_retrieve", 2, "commit")
    CLEAR = (20, "clear", 1)
    GET_CHUNK_SIZE = (21, "get_chunk_size", 0)
    PING = (22, "ping", 1)
    REPORT_BLOCK_ALLOCATION = (23, "report_block_allocation", 3)
    NOOP = (24, "noop", 0)
    GET_EXPERIMENTAL = (32, "get_experimental", 0)
    # string-only (no legacy id): instance_id, model_name, cursor, max_events; streaming
    SUBSCRIBE_KV_EVENTS = (-1, "subscribe_kv_events", 4)

    @property
    def wire(self) -> int | str:
        """What the op frame carries: the legacy id, or the name of a string-only operation."""
        return self.wire_name if self._value_ < 0 else self._value_

    @classmethod
    def from_wire(cls, value: int | str) -> Op:
        """The operation an op frame's value names: a legacy id or a server name.

        Raises:
            ValueError: no operation of this client has this id or name.
        """
        op = _OPS_BY_WIRE.get(value) if isinstance(value, int | str) and not isinstance(value, bool) else None
        if op is None:
            raise ValueError(f"no operation has the id or name {value!r}")
        return op


_OPS_BY_WIRE: Final[dict[int | str, Op]] = {k: op for op in Op for k in (op.wire, op.wire_name)}


def pack_token_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as the 0.5.7 key's ``token_bytes``: one big-endian uint32 per token.

    ``tokens`` must already be validated (:func:`validate_tokens`).
    """
    words = array.array("I", tokens)
    if words.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte 'I'
        return struct.pack(f">{len(tokens)}I", *tokens)
    if sys.byteorder == "little":
        words.byteswap()
    return words.tobytes()


@dataclass(frozen=True, slots=True)
class WireGeneration:
    """What differs on the wire between LMCache server generations, as data.

    Attributes:
        name: the generation, e.g. ``"0.5.6"``.
        key_tokens: how a cache key carries its tokens: ``"token_ids"`` (an array of
            ints) or ``"token_bytes"`` (bin, one big-endian uint32 per token).
        trailing_args: per operation, the argument frames this generation appends after
            the 0.5.6 ones (their "nothing" values: one empty tuple per new argument).
        inline_payload: the tensor payload of the transport without shared memory:
            ``"pickle"`` (a pickled list of tensors) or ``"tensor_envelope"`` (msgpack).
        chunk_size_from: where the live chunk size is read: ``"config"`` (``/config``
            ``mp.chunk_size``) or ``"status"`` (``/status`` ``chunk_size``; the server
            may round the configured minimum up, and ``get_chunk_size`` would freeze it).
    """

    name: str
    key_tokens: Literal["token_ids", "token_bytes"]
    trailing_args: Mapping[Op, tuple[Any, ...]]
    inline_payload: Literal["pickle", "tensor_envelope"]
    chunk_size_from: Literal["config", "status"]

    def arity(self, op: Op) -> int:
        """Number of argument frames ``op`` takes on this generation."""
        return op.arity + len(self.trailing_args.get(op, ()))

    def request_args(self, op: Op, args: Sequence[Any]) -> tuple[Any, ...]:
        """``op``'s argument values on this generation: ``args`` (the 0.5.6 arguments)
        with the trailing ones this generation requires appended; ``args`` that already
        have this generation's arity are returned as they are.

        Raises ``ValueError`` for any other count (the server would drop the request).
        """
        if len(args) == op.arity:
            args = (*args, *self.trailing_args.get(op, ()))
        if len(args) != self.arity(op):
            raise ValueError(
                f"{op_name(op)} takes {self.arity(op)} argument frames, "
                f"got {len(args)} (the {self.name} wire)"
            )
        return tuple(args)

    def encode_tokens(self, tokens: Sequence[int]) -> list[int] | bytes:
        """The value of the key's token field (``tokens`` already validated)."""
        if self.key_tokens == "token_bytes":
            return pack_token_bytes(tokens)
        return tokens if isinstance(tokens, list) else list(tokens)

    def key_prefix(self, key: Mapping[str, Any], end: int) -> dict[str, Any]:
        """A copy of the wire ``key`` map cut to its first ``end`` tokens (``end`` too)."""
        tokens = key[self.key_tokens]
        cut = tokens[: 4 * end] if self.key_tokens == "token_bytes" else tokens[:end]
        return dict(key, end=end, **{self.key_tokens: cut})

    def __repr__(self) -> str:
        return f"<WireGeneration {self.name}>"


#: lmcache 0.5.6: token_ids arrays, pickle payloads, the original argument frames.
GEN_0_5_6: Final = WireGeneration(
    name="0.5.6",
    key_tokens="token_ids",
    trailing_args={},
    inline_payload="pickle",
    chunk_size_from="config",
)
#: lmcache 0.5.7: packed token_bytes, the msgpack tensor envelope, ``prepare_store``
#: takes ``skipped_chunks`` (empty: a single-group registration) and
#: ``free_lookup_locks`` takes ``extra_ranges`` (empty: no abandoned lookups).
GEN_0_5_7: Final = WireGeneration(
    name="0.5.7",
    key_tokens="token_bytes",
    trailing_args={Op.PREPARE_STORE: ((),), Op.FREE_LOOKUP_LOCKS: ((),)},
    inline_payload="tensor_envelope",
    chunk_size_from="status",
)
GENERATIONS: Final = {g.name: g for g in (GEN_0_5_6, GEN_0_5_7)}

_VERSION_RE: Final = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(.*)$")


def generation_for_version(version: str) -> WireGeneration:
    """The wire generation for a server reporting ``version`` on ``/lmc_version``.

    ``0.5.6`` (and its post/dev builds) -> :data:`GEN_0_5_6`; ``0.5.7`` and its
    pre-releases (``0.5.7rc3.dev0``) -> :data:`GEN_0_5_7`. A newer version is talked to
    with the newest generation known, with an :class:`UnknownServerVersionWarning`
    (best effort: its wire may have changed again).

    Raises:
        UnsupportedServerVersionError: an older version, or one that does not parse.
    """
    m = _VERSION_RE.match(version.strip()) if isinstance(version, str) else None
    if m is None:
        raise UnsupportedServerVersionError(version, "it is not a version number")
    triple = (int(m[1]), int(m[2]), int(m[3]))
    if triple < (0, 5, 6):
        raise UnsupportedServerVersionError(version, "this client speaks lmcache 0.5.6 and 0.5.7")
    if triple == (0, 5, 6):
        return GEN_0_5_6
    if triple == (0, 5, 7):
        return GEN_0_5_7
    message = (
        f"LMCache server version {version!r} is newer than any this client knows "
        f"(0.5.6, 0.5.7); talking to it as {GEN_0_5_7.name} (best effort)"
    )
    log.warning("%s", message)
    warnings.warn(message, UnknownServerVersionWarning, stacklevel=2)
    return GEN_0_5_7


def op_name(op: int | str) -> str:
    """Return the server's name of an operation given as :class:`Op`, legacy id or name."""
    if isinstance(op, Op):  # a string-only operation's legacy id is no id on the wire
        return op.wire_name
    if isinstance(op, str):
        return op
    try:
        return Op.from_wire(op).wire_name
    except ValueError:
        return f"op#{op}"


_encode: Final = msgspec.msgpack.Encoder().encode


def packb(obj: Any) -> bytes:
    """msgpack-encode ``obj`` as the server's msgspec does (bytes as bin, str as str,
    the smallest int encoding, floats as float64): the same bytes as
    ``msgpack.packb(obj, use_bin_type=True)`` for every value a request carries, made by
    a reused msgspec encoder."""
    return _encode(obj)


def unpackb(data: bytes | bytearray | memoryview) -> Any:
    """Decode one msgpack value; raises :class:`ProtocolError` on malformed input."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed msgpack payload ({type(exc).__name__}: {exc})") from exc


def bin_header(n: int) -> bytes:
    """The msgpack header of a bin value of ``n`` bytes (for building frames in place)."""
    if n < 0 or n > MAX_BIN:
        raise ValueError(f"a msgpack bin holds at most {MAX_BIN} bytes, got {n}")
    if n < 2**8:
        return b"\xc4" + struct.pack(">B", n)
    if n < 2**16:
        return b"\xc5" + struct.pack(">H", n)
    return b"\xc6" + struct.pack(">I", n)


@dataclass(frozen=True, slots=True)
class PreEncoded:
    """An argument frame that is already msgpack-encoded (sent as is, never copied)."""

    frame: bytes | bytearray | memoryview


# --------------------------------------------------------------------------- validation


def validate_model_name(model_name: object) -> str:
    """Check a model name: a non-empty str without ``@``."""
    if not isinstance(model_name, str):
        raise TypeError(f"model_name must be a str, got {type(model_name).__name__}")
    if not model_name:
        raise ValueError("model_name must not be empty")
    if "@" in model_name:
        raise ValueError(f"model_name must not contain '@': {model_name!r}")
    return model_name


def validate_cache_salt(cache_salt: object, name: str = "cache_salt") -> str:
    """Check a cache salt: a str of at most 128 characters without ``@ / \\`` or NUL."""
    if not isinstance(cache_salt, str):
        raise TypeError(f"{name} must be a str, got {type(cache_salt).__name__}")
    if len(cache_salt) > MAX_SALT_LEN:
        raise ValueError(f"{name} must be at most {MAX_SALT_LEN} characters, got {len(cache_salt)}")
    for ch in _BAD_SALT_CHARS:
        if ch in cache_salt:
            raise ValueError(f"{name} must not contain {ch!r}: {cache_salt!r}")
    return cache_salt


#: What a token-id list converts to (msgspec: exact ints, no bools, in ``[0, 2**32)``).
_TOKEN_IDS: Final = list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN)]]
_convert: Final = msgspec.convert


def _check_length(tokens: Sized, name: str) -> None:
    """Refuse more than :data:`MAX_TOKENS` ids, from ``len()`` alone (nothing is walked)."""
    try:
        count = len(tokens)
    except OverflowError:  # range(2**70): its length is no Py_ssize_t
        count = None
    if count is None or count > MAX_TOKENS:
        shown = f"{count} tokens" if count is not None else "more tokens than fit in an index"
        raise ValueError(f"{name} has {shown}; at most {MAX_TOKENS} (2**22) are accepted")


def validate_tokens(tokens: object, name: str = "tokens") -> list[int]:
    """Return ``tokens`` as a list of ints, each in ``[0, 2**32)``.

    Accepts any sequence of ints (a list, a tuple, a ``range``, a 1-D integer tensor or
    array via ``tolist()``; numpy integers too) of at most :data:`MAX_TOKENS` ids.
    Refused: str, bytes, bytearray and memoryview (bytes are not token ids), bools
    (``True`` is not token 1), non-integers, and a longer sequence (from its ``len()``,
    before any id is read).
    """
    if isinstance(tokens, str | bytes | bytearray | memoryview) or tokens is None:
        raise TypeError(f"{name} must be a sequence of ints, got {type(tokens).__name__}")
    tolist = getattr(tokens, "tolist", None)
    if callable(tolist) and not isinstance(tokens, list | tuple):
        if getattr(tokens, "is_meta", False) is True:
            raise ValueError(f"{name} is a tensor on the 'meta' device, which holds no values")
        if getattr(tokens, "ndim", 1) != 1:
            raise ValueError(f"{name} must be one-dimensional")
        if isinstance(tokens, Sized):
            _check_length(tokens, name)
        tokens = tolist()
    if isinstance(tokens, Sized):
        _check_length(tokens, name)
    if isinstance(tokens, list | tuple):
        try:
            # C speed, one pass: a new list of exact ints in range (bools refused).
            return _convert(tokens, _TOKEN_IDS)
        except msgspec.ValidationError:
            pass  # numpy integers are accepted below; anything else is named there
    if not isinstance(tokens, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(tokens).__name__}")
    kinds = set(map(type, tokens))  # C speed; few distinct types
    if kinds <= {int}:
        try:
            # C speed: array('I') refuses anything outside [0, 2**32).
            return array.array("I", tokens).tolist()
        except OverflowError:
            pass
    out: list[int] = []
    for t in tokens:
        if isinstance(t, bool) or type(t).__name__ == "bool_":
            raise TypeError(f"{name} must contain ints, found bool")
        try:
            out.append(operator.index(t))  # ints, numpy integers, IntEnums
        except TypeError:
            raise TypeError(f"{name} must contain ints, found {type(t).__name__}") from None
    bad = next((t for t in out if t < 0 or t >= MAX_TOKEN), None)
    if bad is not None:
        raise ValueError(f"{name}: token id {bad} is outside [0, 2**32)")
    return out


def validate_request_configs(configs: object, name: str = "request_configs") -> dict[str, Any] | None:
    """Check LMCache request configs: ``None`` or a mapping with str keys whose values
    msgpack can encode; returns a plain dict copy (or ``None``)."""
    if configs is None:
        return None
    if not isinstance(configs, Mapping):
        raise TypeError(f"{name} must be a mapping or None, got {type(configs).__name__}")
    out = dict(configs)
    bad = next((k for k in out if not isinstance(k, str)), None)
    if bad is not None:
        raise TypeError(f"{name} keys must be str, got {type(bad).__name__}")
    try:
        packb(out)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"{name} must hold msgpack-encodable values: {exc}") from None
    return out


def _check_int(value: object, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# --------------------------------------------------------------------------- payload types


@dataclass(frozen=True, slots=True)
class CacheKey:
    """``IPCCacheServerKey``: which tokens of which model/rank/salt an operation is about.

    ``token_ids`` is the whole sequence from position 0; ``[start, end)`` the token range.
    Construction validates what the server would reject silently.
    """

    model_name: str
    world_size: int
    worker_id: int | None
    token_ids: Sequence[int]
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    request_configs: Mapping[str, Any] | None = None
    num_kv_readers: int = 1

    def __post_init__(self) -> None:
        validate_model_name(self.model_name)
        validate_cache_salt(self.cache_salt)
        _check_int(self.world_size, "world_size", 1)
        if self.worker_id is not None:
            _check_int(self.worker_id, "worker_id", 0)
        _check_int(self.start, "start", 0)
        _check_int(self.end, "end", 0)
        _check_int(self.num_kv_readers, "num_kv_readers", 1)
        if self.end > len(self.token_ids):
            raise ValueError(f"end ({self.end}) exceeds len(token_ids) ({len(self.token_ids)})")
        if self.start > self.end:
            raise ValueError(f"start ({self.start}) exceeds end ({self.end})")
        if not isinstance(self.request_id, str):
            raise TypeError("request_id must be a str")

    def check_aligned(self, chunk_size: int) -> None:
        """Raise ``ValueError`` unless start and end are multiples of ``chunk_size``."""
        if self.start % chunk_size or self.end % chunk_size:
            raise ValueError(
                f"range [{self.start}, {self.end}) is not aligned to the chunk size {chunk_size}"
            )

    def to_wire(self, generation: WireGeneration = GEN_0_5_6) -> dict[str, Any]:
        """The msgpack map, every field in declaration order, tokens as ``generation``
        carries them (``token_ids`` array on 0.5.6, ``token_bytes`` bin on 0.5.7)."""
        return {
            "model_name": self.model_name,
            "world_size": self.world_size,
            "worker_id": self.worker_id,
            generation.key_tokens: generation.encode_tokens(self.token_ids),
            "start": self.start,
            "end": self.end,
            "request_id": self.request_id,
            "cache_salt": self.cache_salt,
            "request_configs": dict(self.request_configs) if self.request_configs is not None else None,
            "num_kv_readers": self.num_kv_readers,
        }

    @classmethod
    def from_wire(cls, obj: object) -> CacheKey:
        """Decode a key map as the server does (any key order, unknown keys ignored).

        Raises :class:`ProtocolError` on a missing required field or a wrong type.
        """
        if not isinstance(obj, dict):
            raise ProtocolError("a cache key must be a map")
        try:
            tokens = obj["token_ids"]
            if not isinstance(tokens, list) or any(
                type(t) is not int or t < 0 or t >= MAX_TOKEN for t in tokens
            ):
                raise ProtocolError("token_ids must be an array of uint32")
            configs = obj.get("request_configs")
            if configs is not None and not isinstance(configs, dict):
                raise ProtocolError("request_configs must be a map or nil")
            return cls(
                model_name=_typed(obj["model_name"], str, "model_name"),
                world_size=_typed(obj["world_size"], int, "world_size"),
                worker_id=(None if obj["worker_id"] is None else _typed(obj["worker_id"], int, "worker_id")),
                token_ids=tokens,
                start=_typed(obj["start"], int, "start"),
                end=_typed(obj["end"], int, "end"),
                request_id=_typed(obj["request_id"], str, "request_id"),
                cache_salt=_typed(obj.get("cache_salt", ""), str, "cache_salt"),
                request_configs=configs,
                num_kv_readers=_typed(obj.get("num_kv_readers", 0), int, "num_kv_readers"),
            )
        except KeyError as exc:
            raise ProtocolError(f"cache key lacks required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"invalid cache key: {exc}") from exc


def _typed(value: Any, typ: type, name: str) -> Any:
    if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ProtocolError(f"{name} must be an int")
    if not isinstance(value, typ):
        raise ProtocolError(f"{name} must be a {typ.__name__}")
    return value


_DTYPE_NAMES: Final = frozenset(
    {
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
    }
)


@dataclass(frozen=True, slots=True)
class RegisterPayload:
    """``RegisterEngineDrivenContextPayload``: the geometry an engine-driven client brings."""

    instance_id: int
    model_name: str
    world_size: int
    block_size: int
    num_layers: int
    hidden_dim_size: int
    dtype_str: str
    use_mla: bool
    num_physical_slots: int | None = None

    def __post_init__(self) -> None:
        _check_int(self.instance_id, "instance_id", 0)
        if self.instance_id >= 2**63:
            raise ValueError("instance_id must be < 2**63")
        validate_model_name(self.model_name)
        for name in ("world_size", "block_size", "num_layers", "hidden_dim_size"):
            _check_int(getattr(self, name), name, 1)
        if self.num_physical_slots is not None:
            _check_int(self.num_physical_slots, "num_physical_slots", 1)
        if self.dtype_str not in _DTYPE_NAMES:
            raise ValueError(f"unsupported dtype_str {self.dtype_str!r}")
        if not isinstance(self.use_mla, bool):
            raise TypeError("use_mla must be a bool")

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map, every field in declaration order."""
        return {
            "instance_id": self.instance_id,
            "model_name": self.model_name,
            "world_size": self.world_size,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "hidden_dim_size": self.hidden_dim_size,
            "dtype_str": self.dtype_str,
            "use_mla": self.use_mla,
            "num_physical_slots": self.num_physical_slots,
        }

    @classmethod
    def from_wire(cls, obj: object) -> RegisterPayload:
        """Decode as the server does; :class:`ProtocolError` on bad input."""
        if not isinstance(obj, dict):
            raise ProtocolError("a register payload must be a map")
        try:
            slots = obj.get("num_physical_slots")
            return cls(
                instance_id=_typed(obj["instance_id"], int, "instance_id"),
                model_name=_typed(obj["model_name"], str, "model_name"),
                world_size=_typed(obj["world_size"], int, "world_size"),
                block_size=_typed(obj["block_size"], int, "block_size"),
                num_layers=_typed(obj["num_layers"], int, "num_layers"),
                hidden_dim_size=_typed(obj["hidden_dim_size"], int, "hidden_dim_size"),
                dtype_str=_typed(obj["dtype_str"], str, "dtype_str"),
                use_mla=_typed(obj["use_mla"], bool, "use_mla"),
                num_physical_slots=None if slots is None else _typed(slots, int, "num_physical_slots"),
            )
        except KeyError as exc:
            raise ProtocolError(f"register payload lacks field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"invalid register payload: {exc}") from exc


@dataclass(frozen=True, slots=True)
class SlotDescriptor:
    """An SHM slot: ``length`` bytes at ``offset`` in the pool, holding ``shape`` x ``dtype``."""

    offset: int
    length: int
    shape: tuple[int, ...]
    dtype: str

    def to_wire(self) -> dict[str, Any]:
        return {"offset": self.offset, "length": self.length, "shape": list(self.shape), "dtype": self.dtype}

    def check(self, pool_size: int, shape: tuple[int, ...], dtype: str, itemsize: int) -> None:
        """Raise :class:`ProtocolError` unless the slot lies inside the pool and matches
        (:class:`LayoutMismatchError` for another shape or dtype).

        A wrong or hostile server must never make the client touch memory outside the
        pool, so this runs before any view is made.
        """
        if self.dtype != dtype:
            raise LayoutMismatchError("slot dtype", repr(self.dtype), repr(dtype))
        if self.shape != shape:
            raise LayoutMismatchError("slot shape", str(list(self.shape)), str(list(shape)))
        if self.length != math.prod(shape) * itemsize:
            raise ProtocolError(f"slot length {self.length} does not match shape {list(shape)}")
        if self.offset < 0 or self.offset + self.length > pool_size:
            end = self.offset + self.length
            raise ProtocolError(f"slot [{self.offset}, {end}) lies outside the pool of {pool_size} bytes")
        if self.offset % itemsize:
            raise ProtocolError(f"slot offset {self.offset} is not aligned to {itemsize} bytes")

    @classmethod
    def from_wire(cls, obj: object) -> SlotDescriptor:
        if not isinstance(obj, dict):
            raise ProtocolError("a slot descriptor must be a map")
        try:
            offset, length, shape, dtype = obj["offset"], obj["length"], obj["shape"], obj["dtype"]
        except KeyError as exc:
            raise ProtocolError(f"slot descriptor lacks {exc.args[0]!r}") from None
        if (
            type(offset) is not int
            or type(length) is not int
            or not isinstance(shape, list)
            or not all(type(d) is int and d >= 0 for d in shape)
            or not isinstance(dtype, str)
        ):
            raise ProtocolError(f"malformed slot descriptor {obj!r}")
        return cls(offset, length, tuple(shape), dtype)


# --------------------------------------------------------------------------- frames


@dataclass(frozen=True, slots=True)
class Reply:
    """A decoded reply: the uid, the echoed op and the raw payload frame (or ``None``)."""

    uid: int
    op: int | str
    payload: bytes | memoryview | None = field(default=None)

    def value(self) -> Any:
        """The decoded payload, or ``None`` for a frameless reply.

        A ``prepare_retrieve`` reply that arrived as a view of its ZMQ frame (a large one:
        inline KV) is decoded with its ``data`` a view of that frame too (not copied).
        """
        payload = self.payload
        if payload is None:
            return None
        if type(payload) is memoryview and self.op in _PREPARE_RETRIEVE_OPS:
            return _prepare_retrieve_view(payload)
        return unpackb(payload)


class _PrepareRetrieveReply(msgspec.Struct):
    """The fields of a ``PrepareRetrieveResponse`` the client reads (others ignored)."""

    success: bool
    data: memoryview = msgspec.field(default_factory=lambda: memoryview(b""))
    context: dict[str, Any] = msgspec.field(default_factory=dict)


_PREPARE_RETRIEVE_DECODER: Final = msgspec.msgpack.Decoder(_PrepareRetrieveReply)
_PREPARE_RETRIEVE_OPS: Final = frozenset({Op.PREPARE_RETRIEVE.wire, Op.PREPARE_RETRIEVE.wire_name})


def _prepare_retrieve_view(payload: memoryview) -> Any:
    """``unpackb(payload)`` for a ``prepare_retrieve`` reply, its ``data`` a view of
    ``payload`` (msgspec decodes a bin into a ``memoryview`` of its input). A reply of
    another shape is decoded by :func:`unpackb` (and refused by its parser)."""
    try:
        r = _PREPARE_RETRIEVE_DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return unpackb(payload)
    return {"success": r.success, "data": r.data, "context": r.context}


def encode_request(
    uid: int, op: Op, args: Sequence[Any], generation: WireGeneration = GEN_0_5_6
) -> list[bytes | bytearray | memoryview]:
    """Build the frames of a request. ``args`` are Python values or :class:`PreEncoded`.

    ``args`` are the operation's 0.5.6 arguments, to which ``generation`` appends the
    trailing frames it requires (``generation.trailing_args``), or already all of
    ``generation``'s arguments.

    Raises ``ValueError`` if the argument count is neither (the server would silently
    drop the request).
    """
    if uid < 0:
        raise ValueError("uid must be non-negative")
    args = generation.request_args(op, args)
    frames: list[bytes | bytearray | memoryview] = [packb(uid), packb(op.wire)]
    for arg in args:
        frames.append(arg.frame if isinstance(arg, PreEncoded) else packb(arg))
    return frames


def _decode_op(frame: bytes | memoryview) -> int | str:
    op = unpackb(frame)
    if isinstance(op, bool) or not isinstance(op, int | str):
        raise ProtocolError(f"operation frame must be an int or str, got {type(op).__name__}")
    return op


def decode_reply(frames: Sequence[bytes | memoryview]) -> Reply:
    """Decode ``[uid, op]`` or ``[uid, op, payload]`` (client side).

    Raises :class:`ProtocolError` on any other shape, a non-int uid or a bad op frame.
    """
    if len(frames) not in (2, 3):
        raise ProtocolError(f"a reply has 2 or 3 frames, got {len(frames)}")
    uid = unpackb(frames[0])
    if isinstance(uid, bool) or not isinstance(uid, int):
        raise ProtocolError(f"reply uid must be an int, got {type(uid).__name__}")
    op = _decode_op(frames[1])
    return Reply(uid, op, frames[2] if len(frames) == 3 else None)


# --------------------------------------------------------------------------- replies


def parse_register_response(obj: object) -> tuple[str, int]:
    """``RegisterEngineDrivenContextResponse`` -> ``(shm_name, pool_size)``."""
    if not isinstance(obj, dict):
        raise ProtocolError("register reply must be a map")
    shm_name = obj.get("shm_name", "")
    pool_size = obj.get("pool_size", 0)
    if not isinstance(shm_name, str) or type(pool_size) is not int or pool_size < 0:
        raise ProtocolError(f"malformed register reply {obj!r}")
    return shm_name, pool_size


def parse_prepare_store(obj: object) -> tuple[list[SlotDescriptor], list[int]]:
    """``PrepareStoreResponse`` -> ``(slots, chunk_indices)`` (both empty on pickle)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("context"), dict):
        raise ProtocolError("prepare_store reply must be a map with a 'context' map")
    ctx = obj["context"]
    slots = [SlotDescriptor.from_wire(s) for s in _list(ctx.get("slots", []), "slots")]
    indices = _list(ctx.get("chunk_indices", []), "chunk_indices")
    if len(indices) != len(slots) or not all(type(i) is int and i >= 0 for i in indices):
        raise ProtocolError("prepare_store: chunk_indices do not match slots")
    if len(set(indices)) != len(indices):
        raise ProtocolError("prepare_store: duplicate chunk indices")
    return slots, indices


def parse_prepare_retrieve(obj: object) -> tuple[bool, bytes | memoryview, list[SlotDescriptor]]:
    """``PrepareRetrieveResponse`` -> ``(success, inline_data, slots)`` (the data a view of
    the reply's frame where :meth:`Reply.value` made it one)."""
    if not isinstance(obj, dict):
        raise ProtocolError("prepare_retrieve reply must be a map")
    success = obj.get("success")
    data = obj.get("data", b"")
    ctx = obj.get("context", {})
    if not isinstance(success, bool) or not isinstance(data, bytes | memoryview) or not isinstance(ctx, dict):
        raise ProtocolError("malformed prepare_retrieve reply")
    slots = [SlotDescriptor.from_wire(s) for s in _list(ctx.get("slots", []), "slots")]
    return success, data, slots


def _list(value: object, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProtocolError(f"{name} must be an array")
    return value
