"""Checks of a caller's tensor that shape and dtype alone do not cover.

A tensor of the right shape and dtype can still be impossible to copy: a ``meta`` tensor
has no data, a sparse or other non-strided layout has no slot-shaped view, a tensor on a
device other than the CPU or CUDA may not copy into host memory. Such a tensor would
only fail during the copy into reserved SHM slots, after the server reserved them: these
checks run before anything is sent.
"""

from __future__ import annotations

import torch

__all__ = ["check_tensor_storage"]

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
