"""Checks of a caller's tensor that shape and dtype alone do not cover.

A tensor of the right shape and dtype can still be impossible to copy: a ``meta`` tensor
has no data, a sparse or other non-strided layout has no slot-shaped view, a tensor on a
device other than the CPU or CUDA may not copy into host memory. Such a tensor would
only fail during the copy into reserved SHM slots, after the server reserved them: these
checks run before anything is sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmcache_async.geometry import KVGeometry

__all__ = ["check_kv", "check_out", "check_tensor_storage"]

#: Devices whose tensors copy into (and out of) host memory with ``Tensor.copy_``.
COPYABLE_DEVICES = frozenset({"cpu", "cuda"})


def check_tensor_storage(t: torch.Tensor, name: str, *, writable: bool = False) -> None:
    """Raise ``ValueError`` unless ``t`` is a dense, strided tensor with data, on the CPU
    or a CUDA device; when ``writable`` (an ``out=`` tensor), also unless its elements
    occupy distinct memory (no zero stride, as :meth:`torch.Tensor.expand` makes)."""
    if t.is_meta or t.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (it has no data)")
    if t.layout is not torch.strided:
        raise ValueError(f"{name} has layout {t.layout}; only dense (torch.strided) tensors can be copied")
    if t.is_nested:
        raise ValueError(f"{name} is a nested tensor; only dense tensors can be copied")
    if t.is_quantized:
        raise ValueError(f"{name} is a quantized tensor; only dense tensors can be copied")
    if t.device.type not in COPYABLE_DEVICES:
        raise ValueError(f"{name} is on device {t.device}; only CPU and CUDA tensors are supported")
    if writable:
        overlapping = [
            d
            for d, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True))
            if size > 1 and stride == 0
        ]
        if overlapping:
            raise ValueError(
                f"{name} has stride 0 on dimension {overlapping[0]} (an expanded view): its "
                "elements share memory and cannot be written; pass a tensor of its own"
            )


def check_kv(geom: KVGeometry, kv: object, toks: list[int]) -> tuple[torch.Tensor, list[int]]:
    """``kv`` checked for a store under ``toks``, and the tokens it covers: a tensor of
    the geometry's shape and dtype, on memory a copy can read, covering ``toks[:T]``
    (``toks`` may be longer, never shorter; ``TypeError``/``ValueError``)."""
    if isinstance(kv, torch.Tensor) and kv.dim() == len(geom.kv_shape(0)):
        covered = kv.shape[geom.token_axis]  # the KV may cover a prefix of tokens
        if len(toks) < covered:
            raise ValueError(
                f"kv covers {covered} tokens but tokens has {len(toks)}: tokens may be longer "
                "than the KV (it is stored under tokens[:T]), never shorter"
            )
        toks = toks[:covered]
    num_tokens = len(toks)
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    want = geom.kv_shape(num_tokens)
    if kv.dim() != len(want):
        raise ValueError(
            f"kv must have {len(want)} dimensions {list(geom.kv_shape(-1))!s} "
            f"(T = tokens), got shape {list(kv.shape)}"
        )
    if tuple(kv.shape) != want:
        raise ValueError(f"kv has shape {list(kv.shape)}, expected {list(want)} for {num_tokens} tokens")
    if kv.dtype != geom.dtype:
        raise TypeError(f"kv has dtype {kv.dtype}, the geometry says {geom.dtype}")
    check_tensor_storage(kv, "kv")
    return kv, toks


def check_out(geom: KVGeometry, out: object, end: int) -> None:
    """``out=`` of a retrieve of ``end`` tokens checked: the geometry's shape (its token
    axis may be longer) and dtype, writable (``TypeError``/``ValueError``)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    want = list(geom.kv_shape(end))
    got = list(out.shape)
    ax = geom.token_axis
    if len(got) != len(want) or got[:ax] + got[ax + 1 :] != want[:ax] + want[ax + 1 :] or got[ax] < end:
        raise ValueError(f"out has shape {got}, expected {want} (token axis may be longer)")
    if out.dtype != geom.dtype:
        raise TypeError(f"out has dtype {out.dtype}, the geometry says {geom.dtype}")
    check_tensor_storage(out, "out", writable=True)
