"""The tensor payload of the inline transport (no shared memory), per server generation.

lmcache 0.5.6 exchanges a pickled list of tensors (:mod:`lmcache_async._protocol.payload.pickle_tensors`),
0.5.7 a msgpack ``TensorEnvelope`` (:mod:`lmcache_async._protocol.payload.tensor_envelope`). Which one is
data in the :class:`~lmcache_async._protocol.wire.WireGeneration` (``inline_payload``); these two
functions are the only place that maps it to a codec, so operations never branch on the
server generation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import torch

from lmcache_async._protocol.payload.pickle_tensors import decode_tensor_list, encode_tensor_list
from lmcache_async._protocol.payload.tensor_envelope import decode_tensor_envelope, encode_tensor_envelope
from lmcache_async._protocol.wire import WireGeneration

__all__ = ["CopyHook", "decode_inline", "encode_inline"]

#: ``copy(i, dst, src)``: how tensor ``i`` is written into its flat CPU place in the frame.
CopyHook = Callable[[int, torch.Tensor, torch.Tensor], None]
_Encoder = Callable[[Sequence[torch.Tensor], CopyHook | None], bytearray]
_Decoder = Callable[[bytes | memoryview, int, tuple[int, ...], torch.dtype], list[torch.Tensor]]

_ENCODERS: Final[dict[str, _Encoder]] = {
    "pickle": lambda tensors, copy: encode_tensor_list(tensors, copy=copy),
    "tensor_envelope": lambda tensors, copy: encode_tensor_envelope(tensors, copy=copy),
}
_DECODERS: Final[dict[str, _Decoder]] = {
    "pickle": lambda data, n, shape, dtype: decode_tensor_list(data, count=n, shape=shape, dtype=dtype),
    "tensor_envelope": lambda data, n, shape, dtype: decode_tensor_envelope(
        data, count=n, shape=shape, dtype=dtype
    ),
}


def encode_inline(
    wire: WireGeneration, tensors: Sequence[torch.Tensor], *, copy: CopyHook | None = None
) -> bytearray:
    """``commit_store``'s data frame (msgpack bin header included) for ``tensors``,
    each copied once (by ``copy(i, dst, src)`` when given: the CUDA path stages
    through pinned memory, :func:`lmcache_async._engine.cuda.copies.encode_inline`).

    Raises:
        ValueError: a dtype the payload cannot carry, or a size limit exceeded.
    """
    return _ENCODERS[wire.inline_payload](tensors, copy)


def decode_inline(
    wire: WireGeneration, data: bytes | memoryview, *, count: int, shape: tuple[int, ...], dtype: torch.dtype
) -> list[torch.Tensor]:
    """The ``count`` tensors of ``shape`` x ``dtype`` in a ``prepare_retrieve`` payload.

    Never executes anything from ``data``; the tensors may be read-only views of it.

    Raises:
        ProtocolError (UnsafePayloadError for a hostile pickle): anything else.
    """
    return _DECODERS[wire.inline_payload](data, count, shape, dtype)
