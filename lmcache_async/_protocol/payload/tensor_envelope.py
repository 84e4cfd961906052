"""The 0.5.7 inline transport's payload: a msgpack ``TensorEnvelope``, both ways
(docs/internals/design.md, section "Transfers").

Encoding copies each tensor once into the ZMQ frame. Decoding checks every length against
the limits, the expected layout and the bytes present before anything is allocated: any
input either decodes to exactly ``count`` tensors of ``shape`` x ``dtype`` (zero-copy views)
or raises :class:`~lmcache_async.errors.ProtocolError`.
"""

from __future__ import annotations

import math
import struct
import warnings
from collections.abc import Callable, Sequence
from typing import Final

import torch

from lmcache_async._base.host_copy import copy_host
from lmcache_async._protocol.wire import MAX_BIN
from lmcache_async.errors import LayoutMismatchError, ProtocolError

__all__ = [
    "ENVELOPE_VERSION",
    "MAX_RANK",
    "MAX_TENSORS",
    "MAX_TENSOR_BYTES",
    "MAX_TOTAL_BYTES",
    "decode_tensor_envelope",
    "encode_tensor_envelope",
]

ENVELOPE_VERSION: Final = 1
MAX_TENSORS: Final = 65536
MAX_RANK: Final = 16
MAX_TENSOR_BYTES: Final = 2 * 1024**3
MAX_TOTAL_BYTES: Final = 16 * 1024**3
#: The server's allowance for the non-data bytes of one tensor frame.
_MAX_META_PER_TENSOR: Final = 1024
#: No key or dtype name of the schema is longer; a longer string is hostile.
_MAX_STR: Final = 64

#: Every dtype name torch knows (what the server's ``DTYPES`` table holds).
_DTYPES: Final[dict[str, torch.dtype]] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- encoding


def _str(s: str) -> bytes:
    raw = s.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw  # fixstr


def _uint(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    if n < 2**8:
        return b"\xcc" + bytes([n])
    if n < 2**16:
        return b"\xcd" + struct.pack(">H", n)
    if n < 2**32:
        return b"\xce" + struct.pack(">I", n)
    return b"\xcf" + struct.pack(">Q", n)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 2**16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


def _bin_header(n: int) -> bytes:
    if n < 2**8:
        return b"\xc4" + bytes([n])
    if n < 2**16:
        return b"\xc5" + struct.pack(">H", n)
    return b"\xc6" + struct.pack(">I", n)


_ENVELOPE_HEAD: Final = b"\x82" + _str("version") + _uint(ENVELOPE_VERSION) + _str("tensors")
_DTYPE_KEY: Final = b"\x83" + _str("dtype")
_SHAPE_KEY: Final = _str("shape")
_DATA_KEY: Final = _str("data")


def _copy_into_frame(buf: bytearray, offset: int, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` (any device, any strides) into ``buf[offset:]`` as contiguous
    little-endian data. The one copy a store over the inline transport makes."""
    dst = torch.frombuffer(buf, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
    copy_host(dst.view(tensor.shape), tensor)


def encode_tensor_envelope(
    tensors: Sequence[torch.Tensor],
    *,
    msgpack_bin: bool = True,
    copy: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> bytearray:
    """Encode ``tensors`` as the server's ``TensorEnvelope``, copying each tensor once.

    Args:
        tensors: tensors of any device and strides; each is written contiguous.
        msgpack_bin: prefix the msgpack bin header so the result is a ready ZMQ frame
            (the ``bytes`` argument of ``commit_store``).
        copy: ``copy(i, dst, src)`` writes tensor ``i`` into ``dst`` (a flat CPU view of
            the frame) instead of ``dst.view(src.shape).copy_(src)`` (the CUDA path
            stages through pinned memory, :mod:`lmcache_async._engine.cuda.copies`).

    Raises:
        ValueError: more than 65536 tensors, a rank above 16, a tensor above 2 GiB, more
            than 16 GiB in all, or a frame above the 4 GiB msgpack limit.
    """
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"the tensor envelope holds at most {MAX_TENSORS} tensors, got {len(tensors)}")
    heads: list[bytes] = []
    total_data = 0
    size = len(_ENVELOPE_HEAD) + len(_array_header(len(tensors)))
    for t in tensors:
        if t.dim() > MAX_RANK:
            raise ValueError(f"the tensor envelope allows rank <= {MAX_RANK}, got {t.dim()}")
        nbytes = t.numel() * t.element_size()
        if nbytes > MAX_TENSOR_BYTES:
            raise ValueError(f"a tensor of {nbytes} bytes exceeds the envelope's 2 GiB limit")
        total_data += nbytes
        if total_data > MAX_TOTAL_BYTES:
            raise ValueError("the tensors exceed the envelope's 16 GiB limit")
        head = (
            _DTYPE_KEY
            + _str(_dtype_name(t.dtype))
            + _SHAPE_KEY
            + _array_header(t.dim())
            + b"".join(_uint(d) for d in t.shape)
            + _DATA_KEY
            + _bin_header(nbytes)
        )
        heads.append(head)
        size += len(head) + nbytes
    if msgpack_bin and size > MAX_BIN:
        raise ValueError(f"an envelope of {size} bytes exceeds the 4 GiB frame limit")
    prefix = 5 if msgpack_bin else 0
    buf = bytearray(prefix + size)
    if msgpack_bin:
        buf[:5] = b"\xc6" + struct.pack(">I", size)  # bin32: valid msgpack for any length
    pos = prefix
    for part in (_ENVELOPE_HEAD, _array_header(len(tensors))):
        buf[pos : pos + len(part)] = part
        pos += len(part)
    for i, (t, head) in enumerate(zip(tensors, heads, strict=True)):
        buf[pos : pos + len(head)] = head
        pos += len(head)
        if t.numel():
            if copy is None:
                _copy_into_frame(buf, pos, t)
            else:
                dst = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=pos)
                copy(i, dst, t)
                del dst
        pos += t.numel() * t.element_size()
    assert pos == len(buf)
    return buf


# --------------------------------------------------------------------------- decoding


_UINT_WIDTHS: Final = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_INT_WIDTHS: Final = {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}


class _Reader:
    """A bounds-checked msgpack reader over one buffer (only the forms the schema uses)."""

    __slots__ = ("data", "pos")

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def _take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.data):
            raise ProtocolError(f"tensor envelope truncated at byte {self.pos} (needs {n} more)")
        view = self.data[self.pos : end]
        self.pos = end
        return view

    def _byte(self) -> int:
        return self._take(1)[0]

    def _be(self, n: int) -> int:
        return int.from_bytes(self._take(n), "big")

    def map_len(self, what: str) -> int:
        b = self._byte()
        if 0x80 <= b <= 0x8F:
            return b & 0x0F
        if b == 0xDE:
            return self._be(2)
        if b == 0xDF:
            return self._be(4)
        raise ProtocolError(f"tensor envelope: {what} must be a map (byte 0x{b:02x})")

    def array_len(self, what: str) -> int:
        b = self._byte()
        if 0x90 <= b <= 0x9F:
            return b & 0x0F
        if b == 0xDC:
            return self._be(2)
        if b == 0xDD:
            return self._be(4)
        raise ProtocolError(f"tensor envelope: {what} must be an array (byte 0x{b:02x})")

    def string(self, what: str) -> str:
        b = self._byte()
        if 0xA0 <= b <= 0xBF:
            n = b & 0x1F
        elif b == 0xD9:
            n = self._be(1)
        elif b == 0xDA:
            n = self._be(2)
        elif b == 0xDB:
            n = self._be(4)
        else:
            raise ProtocolError(f"tensor envelope: {what} must be a str (byte 0x{b:02x})")
        if n > _MAX_STR:
            raise ProtocolError(f"tensor envelope: {what} of {n} bytes is too long")
        try:
            return bytes(self._take(n)).decode()
        except UnicodeDecodeError:
            raise ProtocolError(f"tensor envelope: {what} is not UTF-8") from None

    def uint(self, what: str) -> int:
        b = self._byte()
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            raise ProtocolError(f"tensor envelope: {what} is negative ({b - 0x100})")
        if b in _UINT_WIDTHS:
            return self._be(_UINT_WIDTHS[b])
        if b in _INT_WIDTHS:  # a signed form is fine for a value that is not negative
            value = int.from_bytes(self._take(_INT_WIDTHS[b]), "big", signed=True)
            if value < 0:
                raise ProtocolError(f"tensor envelope: {what} is negative ({value})")
            return value
        raise ProtocolError(f"tensor envelope: {what} must be a non-negative int (byte 0x{b:02x})")

    def bin_span(self, what: str) -> tuple[int, int]:
        b = self._byte()
        if b == 0xC4:
            n = self._be(1)
        elif b == 0xC5:
            n = self._be(2)
        elif b == 0xC6:
            n = self._be(4)
        else:
            raise ProtocolError(f"tensor envelope: {what} must be bin (byte 0x{b:02x})")
        start = self.pos
        if n > MAX_TENSOR_BYTES:
            raise ProtocolError(f"tensor envelope: {what} of {n} bytes exceeds the 2 GiB limit")
        self._take(n)  # bounds check only; the bytes stay where they are
        return start, n


def decode_tensor_envelope(
    data: bytes | bytearray | memoryview,
    *,
    count: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Decode a ``TensorEnvelope`` of exactly ``count`` tensors of ``shape`` x ``dtype``.

    The returned tensors are read-only views into ``data`` (copy them out; do not write).

    Raises:
        ProtocolError: malformed msgpack, a wrong version, unknown or missing fields, a
            count, dtype, shape or byte length other than expected, a limit exceeded, or
            trailing bytes. Checked before anything is allocated.
    """
    if not 0 <= count <= MAX_TENSORS:
        raise ValueError(f"count must be in [0, {MAX_TENSORS}], got {count}")
    view = memoryview(data).cast("B")
    if len(view) > MAX_TOTAL_BYTES + _MAX_META_PER_TENSOR * count:
        raise ProtocolError(f"tensor envelope of {len(view)} bytes exceeds the wire-format limit")
    want_dtype = _dtype_name(dtype)
    want_bytes = math.prod(shape) * dtype.itemsize
    reader = _Reader(view)
    n = reader.map_len("the envelope")
    if n != 2:
        raise ProtocolError(f"tensor envelope has {n} fields, expected version and tensors")
    spans: list[tuple[int, int]] | None = None
    version_seen = False
    for _ in range(2):
        key = reader.string("a field name")
        if key == "version" and not version_seen:
            version = reader.uint("version")
            if version != ENVELOPE_VERSION:
                raise ProtocolError(
                    f"tensor envelope version {version} (this client reads {ENVELOPE_VERSION})"
                )
            version_seen = True
        elif key == "tensors" and spans is None:
            spans = _read_frames(reader, count, shape, want_dtype, want_bytes)
        else:
            raise ProtocolError(f"tensor envelope: unexpected field {key!r}")
    if reader.pos != len(view):
        raise ProtocolError(f"tensor envelope has {len(view) - reader.pos} trailing bytes")
    assert spans is not None
    return _views(data, spans, shape, dtype)


def _read_frames(
    reader: _Reader, count: int, shape: tuple[int, ...], want_dtype: str, want_bytes: int
) -> list[tuple[int, int]]:
    n = reader.array_len("tensors")
    if n > MAX_TENSORS:
        raise ProtocolError(f"tensor envelope holds {n} tensors (limit {MAX_TENSORS})")
    if n != count:
        raise ProtocolError(f"tensor envelope holds {n} tensors, expected {count}")
    spans: list[tuple[int, int]] = []
    total = 0
    for i in range(n):
        m = reader.map_len(f"tensor {i}")
        if m != 3:
            raise ProtocolError(f"tensor envelope: tensor {i} has {m} fields, expected dtype, shape, data")
        seen: set[str] = set()
        span: tuple[int, int] | None = None
        for _ in range(3):
            key = reader.string("a field name")
            if key in seen:
                raise ProtocolError(f"tensor envelope: tensor {i} repeats field {key!r}")
            seen.add(key)
            if key == "dtype":
                name = reader.string("dtype")
                if name not in _DTYPES:
                    raise ProtocolError(f"tensor envelope: tensor {i} has unsupported dtype {name!r}")
                if name != want_dtype:
                    raise LayoutMismatchError(f"tensor envelope: tensor {i} dtype", name, want_dtype)
            elif key == "shape":
                rank = reader.array_len("shape")
                if rank > MAX_RANK:
                    raise ProtocolError(f"tensor envelope: tensor {i} has rank {rank} (limit {MAX_RANK})")
                got = tuple(reader.uint("a dimension") for _ in range(rank))
                if got != shape:
                    raise LayoutMismatchError(
                        f"tensor envelope: tensor {i} shape", str(list(got)), str(list(shape))
                    )
            elif key == "data":
                span = reader.bin_span("data")
                if span[1] != want_bytes:
                    raise ProtocolError(
                        f"tensor envelope: tensor {i} holds {span[1]} bytes, expected {want_bytes}"
                    )
                total += span[1]
                if total > MAX_TOTAL_BYTES:
                    raise ProtocolError("tensor envelope exceeds the 16 GiB limit")
            else:
                raise ProtocolError(f"tensor envelope: tensor {i} has unexpected field {key!r}")
        assert span is not None
        spans.append(span)
    return spans


def _views(
    data: bytes | bytearray | memoryview,
    spans: list[tuple[int, int]],
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Zero-copy tensors over the checked spans of ``data`` (read-only by contract)."""
    out: list[torch.Tensor] = []
    with warnings.catch_warnings():
        # frombuffer warns on an immutable buffer; these views are only read from.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        for start, n in spans:
            if n == 0:
                out.append(torch.empty(shape, dtype=dtype))
                continue
            raw = torch.frombuffer(data, dtype=torch.uint8, count=n, offset=start)
            out.append(raw.view(dtype).view(shape))
    return out
