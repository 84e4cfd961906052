"""The pickle transport's payload (``pickle.dumps(list_of_cpu_tensors)``), encoded with one
copy and decoded safely (docs/internals/design.md, section "Transfers").

Decoding never runs arbitrary code: restricted unpicklers admit only the globals plain
tensors need, every length and memo index is checked against the bytes present before any
unpickler runs, and every rebuilt tensor is checked against its storage's bounds; anything
else raises :class:`UnsafePayloadError`.
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

from lmcache_async._base.host_copy import copy_host
from lmcache_async._protocol.wire import MAX_BIN
from lmcache_async.errors import LayoutMismatchError, ProtocolError, UnsafePayloadError

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
            stages through pinned memory, :mod:`lmcache_async._engine.cuda.copies`).

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
_FRAME: Final = 0x95
_BYTES_OPS: Final = frozenset(b"CB\x8e")  # SHORT_BINBYTES, BINBYTES, BINBYTES8
_PERSISTENT_OPS: Final = frozenset(b"PQ")  # PERSID, BINPERSID
_TWO_LINES: Final = frozenset(b"ci")
_MAX_LINE: Final = 4096
#: Opcodes one tensor may take in the outer pickle (torch's own: ~45, ours: <= ~120).
_OPS_PER_TENSOR: Final = 256  # the longest text argument (a global's name, a decimal int)


def _scan_pickle(
    data: memoryview,
    pos: int = 0,
    max_ops: int | None = None,
    spans: list[tuple[int, int, int]] | None = None,
) -> int:
    """Walk the opcodes of the pickle at ``data[pos:]`` without building anything;
    return the position after its STOP.

    With ``spans``, append ``(opcode position, argument position, length)`` for every
    bytes opcode (``SHORT_BINBYTES``/``BINBYTES``/``BINBYTES8``) and ``(position, -1, 9)``
    for every ``FRAME``, and refuse persistent ids (what :func:`_detach_blobs` needs).

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
            if spans is not None and code in _BYTES_OPS:
                spans.append((pos - width - 1, pos, n))
            pos += n
        elif spans is not None and code in _PERSISTENT_OPS:
            raise UnsafePayloadError("persistent ids are not allowed in the outer pickle")
        elif code in _FIXED:
            width = _FIXED[code]
            if spans is not None and code == _FRAME:
                spans.append((pos - 1, -1, 1 + width))
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


_STORAGE_DTYPE: Final[dict[str, torch.dtype]] = {
    **{name: dtype for dtype, name in _STORAGE_CLASS.items()},
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


def _storage_dtype(module: str, name: str) -> torch.dtype:
    if module != "torch" or name not in _STORAGE_DTYPE:
        raise UnsafePayloadError(f"storage blob references {module}.{name}, which is not a storage class")
    return _STORAGE_DTYPE[name]


class _ViewReader:
    """A file over a memoryview for the unpickler: the small pickles in front of a
    storage blob's data are read from it without copying the blob."""

    __slots__ = ("_view", "pos")

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self.pos = 0

    def read(self, n: int | None = -1) -> bytes:
        stop = len(self._view) if n is None or n < 0 else min(len(self._view), self.pos + n)
        out = bytes(self._view[self.pos : stop])
        self.pos = max(stop, self.pos)
        return out

    def readinto(self, buf: Any) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def readline(self, size: int | None = -1) -> bytes:
        limit = len(self._view) if size is None or size < 0 else min(len(self._view), self.pos + size)
        chunk = bytes(self._view[self.pos : min(limit, self.pos + _MAX_LINE + 1)])
        nl = chunk.find(b"\n")
        line = chunk if nl < 0 else chunk[: nl + 1]
        self.pos += len(line)
        return line


class _BlobHeadReader(pickle.Unpickler):
    """Reads one of the small pickles in front of a legacy storage blob's data; the
    only globals it admits are torch's storage classes, the only persistent id the
    storage's (recorded in :attr:`pid`)."""

    pid: tuple[torch.dtype, str, int] | None = None

    def find_class(self, module: str, name: str) -> Any:
        return _storage_dtype(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if (
            not isinstance(pid, tuple)
            or len(pid) not in (5, 6)
            or pid[0] != "storage"
            or not isinstance(pid[1], torch.dtype)
            or not isinstance(pid[2], str)
            or type(pid[4]) is not int
            or pid[4] < 0
            or (len(pid) == 6 and pid[5] is not None)
            or self.pid is not None
        ):
            raise UnsafePayloadError("storage blob has a malformed persistent id")
        self.pid = (pid[1], pid[2], pid[4])
        return _PID_SEEN


_PID_SEEN: Final = object()


def _load_storage(blob: object) -> Any:
    """``torch.storage._load_from_bytes(blob)`` for a legacy ``torch.save`` of one storage:
    parsed here (five small pickles, the int64 element count, the raw bytes) rather than
    by ``torch.load``, so the data is never copied: the storage is a view of ``blob``
    where ``blob`` is writable memory (the received frame), else a copy of it."""
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise UnsafePayloadError("storage blob must be bytes")
    view = memoryview(blob).cast("B")
    f = _ViewReader(view)
    heads: list[Any] = []
    pid: tuple[torch.dtype, str, int] | None = None
    for _ in range(5):  # magic, protocol, system info, the storage (a persistent id), the keys
        _scan_pickle(view, f.pos)
        reader = _BlobHeadReader(f)
        try:
            heads.append(reader.load())
        except UnsafePayloadError:
            raise
        except Exception as exc:
            raise UnsafePayloadError(f"malformed storage blob: {type(exc).__name__}: {exc}") from exc
        if reader.pid is not None:
            if pid is not None:
                raise UnsafePayloadError("storage blob holds more than one storage")
            pid = reader.pid
    magic, protocol, info, obj, keys = heads
    if magic != _MAGIC or protocol != _LEGACY_PROTOCOL:
        raise UnsafePayloadError("storage blob is not a legacy torch.save stream")
    if not isinstance(info, dict) or info.get("little_endian") is not True:
        raise UnsafePayloadError("storage blob is not little-endian")
    if pid is None or obj is not _PID_SEEN or keys != [pid[1]]:
        raise UnsafePayloadError("storage blob must hold exactly one storage")
    dtype, _key, numel = pid
    pos = f.pos
    nbytes = numel * dtype.itemsize
    if nbytes + 8 > len(view) - pos:  # the int64 count, then the data
        raise UnsafePayloadError(f"storage blob claims {nbytes} bytes of data but holds {len(view) - pos}")
    if int.from_bytes(view[pos : pos + 8], "little", signed=True) != numel:
        raise UnsafePayloadError("storage blob's element count does not match its storage")
    pos += 8
    if nbytes == 0:
        untyped = torch.empty(0, dtype=torch.uint8).untyped_storage()
    else:
        data = view[pos : pos + nbytes]
        if data.readonly:  # bytes: never hand out tensors over immutable memory
            data = memoryview(bytearray(data))
        untyped = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    return torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)  # type: ignore[no-untyped-call]


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
    def __init__(self, file: Any, blobs: Sequence[memoryview]) -> None:
        super().__init__(file)
        self._blobs = blobs

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePayloadError(
                f"pickle payload references {module}.{name}, which is not allowed "
                "(only plain tensors are accepted)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        # Only the blobs _detach_blobs took out (the payload's own persistent ids were
        # refused when it was scanned).
        if type(pid) is int and 0 <= pid < len(self._blobs):
            return self._blobs[pid]
        raise UnsafePayloadError("persistent ids are not allowed in the outer pickle")


def _detach_blobs(data: memoryview, max_ops: int | None) -> tuple[bytes, list[memoryview]]:
    """Scan the outer pickle (as :func:`_scan_pickle`) and take its bytes objects out.

    Returns the pickle with every bytes opcode replaced by ``BININT i, BINPERSID`` (and
    its ``FRAME`` opcodes dropped, as the lengths change), and the views of ``data`` that
    :meth:`_RestrictedUnpickler.persistent_load` hands back for them: the unpickler never
    copies a storage blob.
    """
    spans: list[tuple[int, int, int]] = []
    _scan_pickle(data, max_ops=max_ops, spans=spans)
    if not spans:
        return bytes(data), []
    parts: list[bytes] = []
    blobs: list[memoryview] = []
    pos = 0
    for at, arg, n in spans:
        parts.append(bytes(data[pos:at]))
        if arg < 0:  # a FRAME opcode: dropped
            pos = at + n
            continue
        parts.append(b"J" + struct.pack("<i", len(blobs)) + b"Q")  # BININT i, BINPERSID
        blobs.append(data[arg : arg + n])
        pos = arg + n
    parts.append(bytes(data[pos:]))
    return b"".join(parts), blobs


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
        ProtocolError: the decoded list does not match ``count``; its subclass
            :class:`~lmcache_async.errors.LayoutMismatchError`: a tensor of another ``shape`` or
            ``dtype``.
    """
    try:
        small, blobs = _detach_blobs(
            memoryview(data).cast("B"), None if count is None else _OPS_PER_TENSOR * count + 64
        )
        obj = _RestrictedUnpickler(io.BytesIO(small), blobs).load()
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
            raise LayoutMismatchError("tensor shape", str(list(t.shape)), str(list(shape)))
        if dtype is not None and t.dtype != dtype:
            raise LayoutMismatchError("tensor dtype", str(t.dtype), str(dtype))
    return obj


assert sys.byteorder == "little", "the pickle transport is little-endian"
