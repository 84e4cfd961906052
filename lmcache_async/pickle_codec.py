"""The pickle transport's payload, encoded with one copy and decoded safely.

On a server without shared memory, ``commit_store`` carries and ``prepare_retrieve``
returns ``pickle.dumps(list_of_cpu_tensors)``. The layout of one tensor in that pickle is
``torch._utils._rebuild_tensor_v2(torch.storage._load_from_bytes(blob), 0, size, stride,
False, OrderedDict())`` where ``blob`` is a legacy (non-zip) ``torch.save`` of the storage:
five small pickles (magic number, protocol version 1001, system info, one persistent id
naming the storage class / key / device / element count, the list of keys) followed by
an int64 element count and the raw little-endian bytes.

Encoding (:func:`encode_tensor_list`) writes exactly that byte stream by hand into one
pre-sized buffer, copying each tensor's data once, straight from its (possibly strided,
possibly CUDA) source, and leaves room in front for the msgpack bin header so the buffer
is the ZMQ frame itself. Any pickle reader, including the server's unrestricted
``pickle.loads``, reads it as a list of tensors.

Decoding (:func:`decode_tensor_list`) never runs arbitrary code: a restricted unpickler
admits only the globals plain tensors need (``_rebuild_tensor_v2``/``v3``,
``_load_from_bytes``, ``collections.OrderedDict``, ``torch.<dtype>``), storage blobs are
loaded with ``torch.load(..., weights_only=True)``, and every rebuilt tensor is checked
against its storage's bounds. Anything else raises :class:`UnsafePayloadError`.

Before any unpickler runs, every length and memo index the payload claims is checked
against the bytes actually present (:func:`_scan_pickle`; CPython's unpickler allocates a
counted ``bytes`` before reading it and grows its memo to any index it is given), and a
storage blob's element counts against the bytes it carries, so a few hostile bytes
cannot make the client allocate gigabytes.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import pickletools
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from lmcache_async.errors import ProtocolError, UnsafePayloadError
from lmcache_async.host_copy import copy_host
from lmcache_async.wire import MAX_BIN

__all__ = ["decode_tensor_list", "encode_tensor_list"]

_MAGIC: Final = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL: Final = 1001
_SYS_INFO: Final = {
    "protocol_version": _LEGACY_PROTOCOL,
    "little_endian": True,
    "type_sizes": {"short": 2, "int": 4, "long": 4},
}
_STORAGE_CLASS: Final[dict[torch.dtype, str]] = {
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.float32: "FloatStorage",
    torch.float64: "DoubleStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.int16: "ShortStorage",
    torch.int32: "IntStorage",
    torch.int64: "LongStorage",
}
_ALIGN: Final = 64

# The constant head of every storage blob: magic, protocol version, system info.
_BLOB_HEAD: Final = (
    pickle.dumps(_MAGIC, protocol=2)
    + pickle.dumps(_LEGACY_PROTOCOL, protocol=2)
    + pickle.dumps(_SYS_INFO, protocol=2)
)


def _short_unicode(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def _pickle_int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])  # BININT1
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)  # BININT2
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)  # BININT
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def _pickle_int_tuple(values: Sequence[int]) -> bytes:
    return b"(" + b"".join(_pickle_int(v) for v in values) + b"t"  # MARK ... TUPLE


def _blob_meta(dtype: torch.dtype, numel: int, key: str) -> bytes:
    """Pickles (4) and (5) of the legacy stream, then the int64 element count."""
    cls = _STORAGE_CLASS[dtype]
    # (4): PROTO 2, MARK, 'storage', GLOBAL torch.<cls>, key, 'cpu', numel, None, TUPLE,
    # BINPERSID, STOP
    persid = (
        b"\x80\x02("
        + b"X\x07\x00\x00\x00storage"
        + b"ctorch\n"
        + cls.encode()
        + b"\n"
        + b"X"
        + struct.pack("<I", len(key))
        + key.encode()
        + b"X\x03\x00\x00\x00cpu"
        + _pickle_int(numel)
        + b"NtQ."
    )
    keys = pickle.dumps([key], protocol=2)
    return persid + keys + struct.pack("<q", numel)


_TENSOR_HEAD: Final = b"ctorch._utils\n_rebuild_tensor_v2\n(ctorch.storage\n_load_from_bytes\n"
_HOOKS: Final = b"ccollections\nOrderedDict\n)R"  # OrderedDict()


def encode_tensor_list(
    tensors: Sequence[torch.Tensor],
    *,
    msgpack_bin: bool = True,
    copy: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> bytearray:
    """Encode ``tensors`` as ``pickle.dumps(list_of_tensors)`` would, copying each once.

    Args:
        tensors: tensors of a dtype with a legacy storage class (fp16/bf16/fp32/... );
            any device and strides. Each is written as a contiguous CPU tensor.
        msgpack_bin: prefix the msgpack bin header so the result is a ready ZMQ frame.
        copy: ``copy(i, dst, src)`` writes tensor ``i`` into ``dst`` (a flat CPU view of
            the frame) instead of ``dst.view(src.shape).copy_(src)`` (the CUDA path
            stages through pinned memory, :mod:`lmcache_async.cuda`).

    Raises:
        ValueError: an unsupported dtype, or more than 4 GiB in one frame.
    """
    metas: list[tuple[bytes, bytes, int]] = []  # (bytes before the data, tail, nbytes)
    total = 4  # PROTO 4, EMPTY_LIST, MARK
    for i, t in enumerate(tensors):
        if t.dtype not in _STORAGE_CLASS:
            raise ValueError(f"cannot pickle dtype {t.dtype} for the pickle transport")
        numel = t.numel()
        nbytes = numel * t.element_size()
        meta = _blob_meta(t.dtype, numel, str(i))
        blob_len = len(_BLOB_HEAD) + len(meta) + nbytes
        rest = b"\x8e" + struct.pack("<Q", blob_len) + _BLOB_HEAD + meta  # BINBYTES8 blob
        stride = [math.prod(t.shape[d + 1 :]) for d in range(t.dim())]
        tail = (
            b"\x85R"  # TUPLE1 REDUCE -> storage
            + b"K\x00"  # storage offset 0
            + _pickle_int_tuple(list(t.shape))
            + _pickle_int_tuple(stride)
            + b"\x89"  # requires_grad False
            + _HOOKS
            + b"tR"  # TUPLE REDUCE -> tensor
        )
        metas.append((rest, tail, nbytes))
        total += len(_TENSOR_HEAD) + _ALIGN + len(rest) + nbytes + len(tail)
    total += 2  # APPENDS, STOP
    prefix = 5 if msgpack_bin else 0
    buf = bytearray(prefix + total)
    pos = prefix
    buf[pos : pos + 4] = b"\x80\x04]("
    pos += 4
    for i, (t, (rest, tail, nbytes)) in enumerate(zip(tensors, metas, strict=True)):
        buf[pos : pos + len(_TENSOR_HEAD)] = _TENSOR_HEAD
        pos += len(_TENSOR_HEAD)
        # MEMOIZE opcodes are harmless: they pad so the raw data lands 64-byte aligned.
        pad = (-(pos + len(rest))) % _ALIGN
        buf[pos : pos + pad] = b"\x94" * pad
        pos += pad
        buf[pos : pos + len(rest)] = rest
        pos += len(rest)
        if nbytes:
            dst = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=pos)
            if copy is None:
                copy_host(dst.view(t.shape), t)
            else:
                copy(i, dst, t)
            del dst
        pos += nbytes
        buf[pos : pos + len(tail)] = tail
        pos += len(tail)
    buf[pos : pos + 2] = b"e."
    pos += 2
    del buf[pos:]
    if msgpack_bin:
        n = pos - prefix
        if n > MAX_BIN:
            raise ValueError(f"pickle payload of {n} bytes exceeds the 4 GiB frame limit")
        # Always the bin32 form (valid msgpack for any length), so the data offsets
        # computed above stay aligned.
        buf[:5] = b"\xc6" + struct.pack(">I", n)
    return buf


# --------------------------------------------------------------------------- decoding

_DTYPE_GLOBALS: Final = {
    name: getattr(torch, name)
    for name in (
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "float8_e4m3fn",
        "float8_e5m2",
        "uint16",
        "uint32",
        "uint64",
    )
    if hasattr(torch, name)
}


def _codecs_encode(text: object, encoding: object = "utf-8") -> bytes:
    # Protocol-2 pickles spell bytes as _codecs.encode(str, "latin1").
    if not isinstance(text, str) or encoding != "latin1":
        raise UnsafePayloadError("_codecs.encode is allowed only as protocol 2's latin1 bytes")
    return text.encode("latin1")


# Opcodes whose argument is counted: the width of the little-endian length before it
# (signed for the 4-byte string forms, as pickle reads them).
_COUNTED: Final[dict[int, tuple[int, bool]]] = {
    op.code.encode("latin1")[0]: width
    for op in pickletools.opcodes
    if op.arg is not None and op.arg.n < -1
    for width in [{-2: (1, False), -3: (4, True), -4: (4, False), -5: (8, False)}[op.arg.n]]
}
_FIXED: Final[dict[int, int]] = {
    op.code.encode("latin1")[0]: (0 if op.arg is None else op.arg.n)
    for op in pickletools.opcodes
    if op.arg is None or op.arg.n >= 0
}
_TO_NEWLINE: Final = frozenset(
    op.code.encode("latin1")[0] for op in pickletools.opcodes if op.arg is not None and op.arg.n == -1
)
_PUT, _BINPUT, _LONG_BINPUT, _STOP = b"p"[0], b"q"[0], b"r"[0], b"."[0]
_TWO_LINES: Final = frozenset(b"ci")
_MAX_LINE: Final = 4096
#: Opcodes one tensor may take in the outer pickle (torch's own: ~45, ours: <= ~120).
_OPS_PER_TENSOR: Final = 256  # the longest text argument (a global's name, a decimal int)


def _scan_pickle(data: memoryview, pos: int = 0, max_ops: int | None = None) -> int:
    """Walk the opcodes of the pickle at ``data[pos:]`` without building anything;
    return the position after its STOP.

    Raises :class:`UnsafePayloadError` for an unknown opcode, a counted argument longer
    than the bytes left, or a memo index beyond the opcodes seen (each of which would
    make CPython's unpickler allocate what the payload claims before reading it), or
    more than ``max_ops`` opcodes (one byte each can build an object of ~70 bytes).
    """
    end = len(data)
    seen = 0
    while pos < end:
        code = data[pos]
        pos += 1
        seen += 1
        if max_ops is not None and seen > max_ops:
            raise UnsafePayloadError(f"pickle payload has more than {max_ops} opcodes")
        if code in _COUNTED:
            width, signed = _COUNTED[code]
            if pos + width > end:
                break
            n = int.from_bytes(data[pos : pos + width], "little", signed=signed)
            pos += width
            if n < 0 or n > end - pos:
                raise UnsafePayloadError(
                    f"pickle payload claims {n} bytes at byte {pos} but holds {end - pos}"
                )
            pos += n
        elif code in _FIXED:
            width = _FIXED[code]
            if code in (_BINPUT, _LONG_BINPUT) and pos + width <= end:
                index = int.from_bytes(data[pos : pos + width], "little")
                if index > seen:
                    raise UnsafePayloadError(f"pickle memo index {index} is out of range")
            pos += width
            if code == _STOP:
                return pos
        elif code in _TO_NEWLINE:
            for _ in range(2 if code in _TWO_LINES else 1):  # GLOBAL/INST: module, name
                nl = bytes(data[pos : pos + _MAX_LINE]).find(b"\n")
                if nl < 0:
                    raise UnsafePayloadError(f"malformed pickle payload: no end of line after byte {pos}")
                if code == _PUT:
                    text = bytes(data[pos : pos + nl])
                    if not text.isdigit() or int(text) > seen:
                        raise UnsafePayloadError("pickle memo index is out of range")
                pos += nl + 1
        else:
            raise UnsafePayloadError(
                f"malformed pickle payload: unknown opcode 0x{code:02x} at byte {pos - 1}"
            )
    raise UnsafePayloadError("malformed pickle payload: truncated (no STOP)")


_STORAGE_ITEMSIZE: Final[dict[str, int]] = {
    **{name: dtype.itemsize for dtype, name in _STORAGE_CLASS.items()},
    "BoolStorage": 1,
    "ComplexFloatStorage": 8,
    "ComplexDoubleStorage": 16,
}


def _storage_itemsize(module: str, name: str) -> int:
    if module != "torch" or name not in _STORAGE_ITEMSIZE:
        raise UnsafePayloadError(f"storage blob references {module}.{name}, which is not a storage class")
    return _STORAGE_ITEMSIZE[name]


class _BlobHeadReader(pickle.Unpickler):
    """Reads the small pickles in front of a legacy storage blob, only to add up the
    bytes its persistent ids claim (torch allocates them before reading the data)."""

    claimed: int = 0

    def find_class(self, module: str, name: str) -> Any:
        return _storage_itemsize(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if (
            not isinstance(pid, tuple)
            or len(pid) < 5
            or pid[0] != "storage"
            or type(pid[1]) is not int
            or type(pid[4]) is not int
            or pid[4] < 0
        ):
            raise UnsafePayloadError("storage blob has a malformed persistent id")
        self.claimed += pid[1] * pid[4]
        return None


def _check_blob_claims(blob: bytes | bytearray) -> None:
    """Raise :class:`UnsafePayloadError` unless the storages a legacy ``torch.save`` blob
    declares fit in the bytes it carries (checked before torch allocates them)."""
    view = memoryview(blob)
    f = io.BytesIO(blob)
    claimed = 0
    for _ in range(5):  # magic, protocol, system info, the object, the storage keys
        _scan_pickle(view, f.tell())
        reader = _BlobHeadReader(f)
        try:
            reader.load()
        except UnsafePayloadError:
            raise
        except Exception as exc:
            raise UnsafePayloadError(f"malformed storage blob: {type(exc).__name__}: {exc}") from exc
        claimed += reader.claimed
    if claimed > len(blob) - f.tell():
        raise UnsafePayloadError(
            f"storage blob claims {claimed} bytes of data but holds {len(blob) - f.tell()}"
        )


def _load_storage(blob: object) -> Any:
    if not isinstance(blob, bytes | bytearray):
        raise UnsafePayloadError("storage blob must be bytes")
    _check_blob_claims(blob)
    try:
        return torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as exc:
        raise UnsafePayloadError(f"storage blob refused by torch.load(weights_only=True): {exc}") from exc


def _check_rebuild(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any) -> None:
    if not isinstance(storage, torch.TypedStorage | torch.UntypedStorage):
        raise UnsafePayloadError("tensor storage is not a torch storage")
    if type(offset) is not int or offset < 0:
        raise UnsafePayloadError("bad storage offset")
    for name, seq in (("size", size), ("stride", stride)):
        if not isinstance(seq, tuple) or not all(type(v) is int and v >= 0 for v in seq):
            raise UnsafePayloadError(f"bad tensor {name}")
    if len(size) != len(stride):
        raise UnsafePayloadError("size and stride differ in length")
    if requires_grad is not False or not isinstance(hooks, collections.OrderedDict) or hooks:
        raise UnsafePayloadError("tensor with gradient state or hooks")
    numel: int = storage._size() if isinstance(storage, torch.TypedStorage) else storage.nbytes()  # type: ignore[no-untyped-call]
    if all(size):
        extent = offset + sum((s - 1) * st for s, st in zip(size, stride, strict=True)) + 1
        if extent > numel:
            raise UnsafePayloadError("tensor view exceeds its storage")


def _rebuild_v2(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any = None
) -> torch.Tensor:
    _check_rebuild(storage, offset, size, stride, requires_grad, hooks)
    if metadata is not None:
        raise UnsafePayloadError("tensor metadata is not allowed")
    t: torch.Tensor = torch._utils._rebuild_tensor_v2(  # type: ignore[no-untyped-call]
        storage, offset, size, stride, False, hooks
    )
    return t


def _rebuild_v3(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> torch.Tensor:
    if not isinstance(dtype, torch.dtype) or not isinstance(storage, torch.UntypedStorage):
        raise UnsafePayloadError("bad _rebuild_tensor_v3 arguments")
    if metadata is not None:
        raise UnsafePayloadError("tensor metadata is not allowed")
    if not isinstance(offset, int) or not isinstance(size, tuple) or not isinstance(stride, tuple):
        raise UnsafePayloadError("bad _rebuild_tensor_v3 arguments")
    typed = torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)  # type: ignore[no-untyped-call]
    _check_rebuild(typed, offset, size, stride, requires_grad, hooks)
    t: torch.Tensor = torch._utils._rebuild_tensor_v3(  # type: ignore[no-untyped-call]
        storage, offset, size, stride, False, hooks, dtype
    )
    return t


_ALLOWED: Final[dict[tuple[str, str], Any]] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_codecs", "encode"): _codecs_encode,
    **{("torch", name): dt for name, dt in _DTYPE_GLOBALS.items()},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePayloadError(
                f"pickle payload references {module}.{name}, which is not allowed "
                "(only plain tensors are accepted)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePayloadError("persistent ids are not allowed in the outer pickle")


def decode_tensor_list(
    data: bytes | bytearray | memoryview,
    *,
    count: int | None = None,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Decode a pickled list of tensors without executing anything else.

    Args:
        data: the pickle bytes.
        count, shape, dtype: when given, every tensor must match (else ProtocolError).

    Raises:
        UnsafePayloadError: the payload references a disallowed global or is malformed.
        ProtocolError: the decoded list does not match ``count``/``shape``/``dtype``.
    """
    try:
        _scan_pickle(
            memoryview(data).cast("B"), max_ops=None if count is None else _OPS_PER_TENSOR * count + 64
        )
        obj = _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafePayloadError:
        raise
    except Exception as exc:
        raise UnsafePayloadError(f"malformed pickle payload: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, list) or not all(isinstance(t, torch.Tensor) for t in obj):
        raise UnsafePayloadError("pickle payload is not a list of tensors")
    if count is not None and len(obj) != count:
        raise ProtocolError(f"expected {count} tensors, got {len(obj)}")
    for t in obj:
        if shape is not None and tuple(t.shape) != shape:
            raise ProtocolError(f"tensor shape {list(t.shape)} != expected {list(shape)}")
        if dtype is not None and t.dtype != dtype:
            raise ProtocolError(f"tensor dtype {t.dtype} != expected {dtype}")
    return obj


assert sys.byteorder == "little", "the pickle transport is little-endian"
