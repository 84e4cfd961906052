"""The client's entry points into the CUDA path, cheap when no GPU is involved: each
function decides from a tensor's (or a ``device=``'s) device whether the call touches a
GPU, and only then imports :mod:`lmcache_async._engine.cuda.copies`, lazily; this is the
only module that imports it (docs/internals/design.md, section "CUDA tensors").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import torch

from lmcache_async._base.host_copy import empty_host

if TYPE_CHECKING:
    from lmcache_async._engine.cuda.copies import Mark
    from lmcache_async._protocol.wire import WireGeneration
    from lmcache_async._transport.shm import ShmPool

__all__ = [
    "caller_device",
    "caller_order",
    "encode_inline",
    "kv_mark",
    "new_target",
    "on_caller_streams",
    "target_mark",
    "to_device",
    "to_host",
]

T = TypeVar("T")


def kv_mark(t: torch.Tensor) -> Mark | None:
    """The caller's stream ordering point for a CUDA tensor (None on the CPU).

    Call it in the caller's context before any ``await``.
    """
    if not t.is_cuda:
        return None
    from lmcache_async._engine.cuda import copies as cuda

    return cuda.caller_mark(t.device)


def target_mark(out: torch.Tensor | None, device: object) -> Mark | None:
    """Validate ``device=`` against ``out``; the ordering point when the KV goes to a GPU
    (None when it goes to the CPU).

    Raises:
        ValueError: ``device`` is not a device, not the CPU or an existing CUDA device,
            or not ``out``'s device.
    """
    if device is not None:
        try:
            dev = torch.device(device)  # type: ignore[call-overload]
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from exc
        if dev.type != "cpu":
            from lmcache_async._engine.cuda import copies as cuda

            dev = cuda.resolve_device(dev)
        if out is not None and out.device != dev:
            raise ValueError(f"out is on {out.device}, device= says {dev}")
        if out is None:
            return None if dev.type == "cpu" else cuda.caller_mark(dev)
    return None if out is None else kv_mark(out)


def new_target(
    shape: tuple[int, ...], dtype: torch.dtype, mark: Mark | None
) -> tuple[torch.Tensor, Mark | None]:
    """A tensor for a retrieve without ``out``: on the CPU, or on ``mark``'s GPU (with the
    mark the copies into it wait on)."""
    if mark is None:
        return empty_host(shape, dtype), None
    from lmcache_async._engine.cuda import copies as cuda

    return cuda.empty(shape, dtype, mark)


@contextlib.contextmanager
def caller_order() -> Iterator[None]:
    """Capture the current GPU's current stream for the calls made in the block (a bulk
    job's items), when CUDA is in use; nothing otherwise."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        yield
        return
    from lmcache_async._engine.cuda import copies as cuda

    with cuda.caller_order():
        yield


def on_caller_streams(
    factory: Callable[[], Coroutine[Any, Any, T]], tensors: Sequence[object] | None
) -> Callable[[], Coroutine[Any, Any, T]]:
    """For the blocking facade: capture this (the calling) thread's current streams of the
    CUDA tensors or devices in ``tensors`` (the current GPU's when None and CUDA is in use)
    before the call is handed to the loop thread, whose own current stream is unrelated
    (:func:`lmcache_async._engine.cuda.copies.bind_caller_order`). CPU only: ``factory`` unchanged."""
    if tensors is None:
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return factory
        devices = None
    else:
        devices = [t.device if isinstance(t, torch.Tensor) else t for t in tensors if _on_gpu(t)]
        if not devices:
            return factory
    from lmcache_async._engine.cuda import copies as cuda

    return cuda.bind_caller_order(factory, devices)


def _on_gpu(t: object) -> TypeGuard[torch.Tensor | torch.device]:
    return (isinstance(t, torch.Tensor) and t.is_cuda) or (isinstance(t, torch.device) and t.type == "cuda")


def caller_device(device: object) -> Any:
    """``device=`` of a facade call with the calling thread's current GPU filled in
    (``"cuda"`` means the caller's current GPU, not the loop thread's)."""
    if device is None or isinstance(device, int):
        return device
    try:
        dev = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        return device  # AsyncClient.retrieve raises the ValueError
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def to_host(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], mark: Mark, pool: ShmPool | None
) -> Coroutine[Any, Any, None]:
    """:func:`lmcache_async._engine.cuda.copies.to_host` (CUDA sources into host destinations, after
    ``mark``): the coroutine, not yet started."""
    from lmcache_async._engine.cuda import copies as cuda

    return cuda.to_host(pairs, mark, pool)


def to_device(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], mark: Mark, pool: ShmPool | None, *, staged: bool
) -> Coroutine[Any, Any, None]:
    """:func:`lmcache_async._engine.cuda.copies.to_device` (host sources into CUDA destinations,
    after ``mark``): the coroutine, not yet started."""
    from lmcache_async._engine.cuda import copies as cuda

    return cuda.to_device(pairs, mark, pool, staged=staged)


def encode_inline(
    wire: WireGeneration, tensors: Sequence[torch.Tensor], mark: Mark
) -> Coroutine[Any, Any, bytearray]:
    """:func:`lmcache_async._engine.cuda.copies.encode_inline` (the inline frame of CUDA tensors,
    staged through pinned memory): the coroutine, not yet started."""
    from lmcache_async._engine.cuda import copies as cuda

    return cuda.encode_inline(wire, tensors, mark)
