"""CUDA tensors in and out: stream ordering, a pinned SHM pool, chunked async copies
(docs/internals/design.md, section "CUDA tensors").

Imported only when a call sees a CUDA tensor (or a CUDA ``device=``). A store reads the
tensor as seen from the caller's current stream when the call starts (:func:`caller_mark`,
:func:`bind_caller_order`); a retrieve into ``out=`` runs after the caller's pending work on
``out`` and is host-synchronised before the call returns. The event loop never blocks on
the GPU; ``commit_store`` / ``commit_retrieve`` are sent only after the copies are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeVar

import torch

from lmcache_async._protocol.payload.inline import encode_inline as _encode_inline
from lmcache_async.errors import TransferError

if TYPE_CHECKING:
    from lmcache_async._protocol.wire import WireGeneration
    from lmcache_async._transport.shm import ShmPool

__all__ = [
    "Mark",
    "bind_caller_order",
    "caller_mark",
    "caller_order",
    "empty",
    "encode_inline",
    "pin_pool",
    "pinned",
    "resolve_device",
    "to_device",
    "to_host",
    "unpin_pool",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: cudaHostRegisterPortable: pinned for every CUDA context of the process.
_REGISTER_PORTABLE: Final = 1
#: Copy streams per device; chunks alternate between them.
_STREAMS_PER_DEVICE: Final = 2


@dataclass(frozen=True, slots=True)
class Mark:
    """The caller's stream on one device and an event recorded on it at call time."""

    device: torch.device
    stream: torch.cuda.Stream
    event: torch.cuda.Event


#: Marks captured by an outer call (the facade, a bulk job) for the calls it makes.
_ORDER: contextvars.ContextVar[dict[int, Mark] | None] = contextvars.ContextVar(
    "lmcache_async_cuda_order", default=None
)


def resolve_device(device: object) -> torch.device:
    """Validate a ``device=`` argument: a CUDA device that exists, or the CPU.

    Raises:
        ValueError: not a device, not CPU/CUDA, or a CUDA device that is not there.
    """
    try:
        dev = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from exc
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device must be the CPU or a CUDA device, got {dev}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {dev} requested but CUDA is not available")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device {dev} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return torch.device("cuda", index)


def _event() -> torch.cuda.Event:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _capture(device: torch.device) -> Mark:
    dev = torch.device("cuda", _index(device))
    stream = torch.cuda.current_stream(dev)
    event = _event()
    event.record(stream)
    return Mark(dev, stream, event)


def caller_mark(device: torch.device) -> Mark:
    """The ordering point for a copy on ``device``: the mark captured by an enclosing
    facade or bulk call, else an event recorded now on this thread's current stream.

    Call it in the caller's thread before any ``await``.
    """
    marks = _ORDER.get()
    index = _index(device)
    if marks is not None and index in marks:
        return marks[index]
    return _capture(torch.device("cuda", index))


def _capture_all(devices: Sequence[torch.device] | None) -> dict[int, Mark]:
    if devices is None:
        # The current GPU only: recording on every GPU would create a CUDA context (and
        # spend its memory) on GPUs the program never uses. A tensor on another GPU is
        # ordered on that GPU's current stream when its own call starts.
        devices = [torch.device("cuda", torch.cuda.current_device())]
    return {_index(d): _capture(d) for d in devices}


@contextlib.contextmanager
def caller_order(devices: Sequence[torch.device] | None = None) -> Iterator[None]:
    """Capture the current streams of ``devices`` (the current GPU's when None) now, for
    every call made inside the block, including tasks created in it (they copy the
    context). Marks captured by an enclosing call (the blocking facade's, taken in the
    calling thread) are kept: this thread's streams may not be the caller's."""
    outer = _ORDER.get()
    marks = _capture_all(devices)
    if outer is not None:
        marks.update(outer)
    token = _ORDER.set(marks)
    try:
        yield
    finally:
        _ORDER.reset(token)


def bind_caller_order(
    factory: Callable[[], Coroutine[Any, Any, T]], devices: Sequence[torch.device] | None
) -> Callable[[], Coroutine[Any, Any, T]]:
    """For the blocking facade: capture the calling thread's current streams now and
    return a factory whose coroutine (created later on the loop thread) runs with them."""
    marks = _capture_all(devices)

    def bound() -> Coroutine[Any, Any, T]:
        async def run() -> T:
            token = _ORDER.set(marks)
            try:
                return await factory()
            finally:
                _ORDER.reset(token)

        return run()

    return bound


def empty(shape: Sequence[int], dtype: torch.dtype, mark: Mark) -> tuple[torch.Tensor, Mark]:
    """A new tensor on ``mark.device``, allocated on the caller's stream (so the caller's
    later use and freeing of it is ordered as for its own tensors), and the mark the
    copies into it must wait on (recorded after the allocation)."""
    with torch.cuda.stream(mark.stream):
        tensor = torch.empty(tuple(shape), dtype=dtype, device=mark.device)
        event = _event()
        event.record(mark.stream)
    return tensor, Mark(mark.device, mark.stream, event)


# ---------------------------------------------------------------- streams and buffers


class _DeviceState:
    """Copy streams and a pinned staging buffer of one device (process-wide)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.streams = [torch.cuda.Stream(device) for _ in range(_STREAMS_PER_DEVICE)]  # type: ignore[no-untyped-call]
        self.staging: torch.Tensor | None = None
        self.staging_lock = threading.Lock()

    def staging_buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two pinned byte buffers of at least ``nbytes`` each (hold ``staging_lock``)."""
        need = 2 * _round_up(nbytes, 4096)
        if self.staging is None or self.staging.numel() < need:
            self.staging = None
            self.staging = torch.empty(need, dtype=torch.uint8, pin_memory=True)
        half = self.staging.numel() // 2
        return self.staging[:half], self.staging[half:]


_STATE_LOCK: Final = threading.Lock()
_STATES: dict[int, _DeviceState] = {}
_STATES_PID = os.getpid()


def _state(device: torch.device) -> _DeviceState:
    global _STATES_PID
    index = _index(device)
    with _STATE_LOCK:
        if os.getpid() != _STATES_PID:  # after fork: the parent's streams are not ours
            _STATES.clear()
            _STATES_PID = os.getpid()
        st = _STATES.get(index)
        if st is None:
            st = _STATES[index] = _DeviceState(torch.device("cuda", index))
        return st


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


# ---------------------------------------------------------------- the pinned pool


def _host_register(address: int, nbytes: int) -> int:
    """cudaHostRegister through torch's runtime bindings; the CUDA error code."""
    return int(_cudart().cudaHostRegister(address, nbytes, _REGISTER_PORTABLE))


def _host_unregister(address: int) -> int:
    return int(_cudart().cudaHostUnregister(address))


@dataclass(slots=True)
class _Pin:
    """Whether one pool's mapping is registered as pinned CUDA memory: None until the
    first CUDA copy asks (:func:`pin_pool`), then True or False; ``lock`` serializes
    the registration and the unregistration."""

    pinned: bool | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


#: The pin state of each pool a CUDA copy has used (a pool the client dropped drops out).
_PINS: Final[weakref.WeakKeyDictionary[ShmPool, _Pin]] = weakref.WeakKeyDictionary()
_PINS_LOCK: Final = threading.Lock()


def _pin(pool: ShmPool) -> _Pin:
    with _PINS_LOCK:
        pin = _PINS.get(pool)
        if pin is None:
            pin = _PINS[pool] = _Pin()
        return pin


def pinned(pool: ShmPool) -> bool | None:
    """Whether ``pool`` is registered as pinned memory: None until the first CUDA copy
    asks (:func:`pin_pool`), then True or False (False again once it is unregistered)."""
    with _PINS_LOCK:
        pin = _PINS.get(pool)
    return None if pin is None else pin.pinned


def pin_pool(pool: ShmPool) -> bool:
    """Register ``pool``'s mapping as pinned memory, once (blocking: run it in a thread).

    Returns whether the pool is pinned. A failed registration is logged once as a
    warning; copies then use the pool as pageable memory.
    """
    pin = _pin(pool)
    with pin.lock:
        if pin.pinned is not None:
            return pin.pinned
        if os.environ.get("LMCACHE_ASYNC_PIN_SHM", "1") == "0":
            pin.pinned = False
            log.info("LMCACHE_ASYNC_PIN_SHM=0: the SHM pool %s is not pinned", pool.name)
            return False
        address, nbytes = pool.address_range()
        rc = _host_register(address, nbytes)
        pin.pinned = rc == 0
        if rc == 0:
            pool.call_before_close(_unpin_before_unmap)
        if rc:
            _cudart()  # keep the runtime initialised for the fallback copies
            log.warning(
                "cannot pin the SHM pool %s for CUDA copies (cudaHostRegister error %d); "
                "copies to and from the GPU use pageable memory and run slower",
                pool.name,
                rc,
            )
        return pin.pinned


def _unpin_before_unmap(pool: ShmPool) -> None:
    pin = _pin(pool)
    with pin.lock:
        if pin.pinned:
            unpin_pool(pool)
            pin.pinned = False


def unpin_pool(pool: ShmPool) -> None:
    """Unregister ``pool`` (before it is unmapped), after the copy streams are idle."""
    address, _ = pool.address_range()
    with _STATE_LOCK:
        states = list(_STATES.values())
    for st in states:
        for s in st.streams:
            s.synchronize()
    rc = _host_unregister(address)
    if rc:
        log.warning("cudaHostUnregister of the SHM pool %s failed (error %d)", pool.name, rc)


async def _ensure_pinned(pool: ShmPool | None) -> None:
    if pool is not None and pinned(pool) is None:
        await asyncio.to_thread(pin_pool, pool)


# ---------------------------------------------------------------- copies


def _launch(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], mark: Mark, keep_alive: Sequence[torch.Tensor]
) -> list[torch.cuda.Event]:
    """Enqueue ``dst.copy_(src)`` for every pair on the copy streams (alternating), after
    ``mark``; return one event per stream, recorded after this call's copies (other calls
    may share the streams). Does not wait: with pinned host memory on the host side every
    copy is asynchronous, so this may run on the event loop's thread."""
    st = _state(mark.device)
    with torch.no_grad(), torch.cuda.device(mark.device):
        for s in st.streams:
            s.wait_event(mark.event)
            for t in keep_alive:  # a caller freeing its tensor meanwhile cannot recycle it
                t.record_stream(s)
        for i, (dst, src) in enumerate(pairs):
            with torch.cuda.stream(st.streams[i % len(st.streams)]):
                dst.copy_(src, non_blocking=True)
        done = [_event() for _ in st.streams]
        for e, s in zip(done, st.streams, strict=True):
            e.record(s)
    return done


def _wait_copies(done: Sequence[torch.cuda.Event]) -> None:
    """Block until the copies behind ``done`` have finished (a worker thread's job)."""
    try:
        for e in done:
            e.synchronize()
    except RuntimeError as exc:
        raise TransferError(f"a CUDA copy failed: {exc}") from exc


def _run_copies(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], mark: Mark, keep_alive: Sequence[torch.Tensor]
) -> None:
    """:func:`_launch` and wait until all are done, in a worker thread (the path of a
    pool that is not pinned: a copy to or from pageable memory blocks its thread)."""
    try:
        done = _launch(pairs, mark, keep_alive)
    except RuntimeError as exc:
        raise TransferError(f"a CUDA copy failed: {exc}") from exc
    _wait_copies(done)


async def _copy(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    mark: Mark,
    keep_alive: Sequence[torch.Tensor],
    pool: ShmPool | None,
) -> None:
    """Copy ``pairs`` between the GPU and slots of ``pool``, complete on return.

    With the pool pinned, the copies are enqueued right here on the event loop's thread
    (asynchronous: the first chunk crosses the link while the next ones are enqueued, and
    no thread hand-off delays it) and only the wait runs in a worker thread. Otherwise
    the whole copy runs in a worker thread.

    Cancellation: the copies run to their end before ``CancelledError`` is re-raised, so
    no slot is read or written by a copy that outlives its operation's step.
    """
    if pool is not None and pinned(pool):
        try:
            done = _launch(pairs, mark, keep_alive)
        except RuntimeError as exc:
            raise TransferError(f"a CUDA copy failed: {exc}") from exc
        fut = asyncio.ensure_future(asyncio.to_thread(_wait_copies, done))
    else:
        fut = asyncio.ensure_future(asyncio.to_thread(_run_copies, pairs, mark, keep_alive))
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("a CUDA copy failed after its task was cancelled: %r", fut.exception())
        raise


async def to_host(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], mark: Mark, pool: ShmPool | None
) -> None:
    """Copy CUDA sources into host destinations (SHM slot views of ``pool``), ordered
    after ``mark``, complete on return.

    Cancellation: the copy runs to its end before ``CancelledError`` is re-raised (a
    store whose slots were reserved is always completed).
    """
    await _ensure_pinned(pool)
    await _copy(pairs, mark, _storages_of(src for _, src in pairs), pool)


async def to_device(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    mark: Mark,
    pool: ShmPool | None,
    *,
    staged: bool = False,
) -> None:
    """Copy host sources into CUDA destinations, after ``mark``, complete on return.

    ``pool``: the sources are views of this SHM pool (pinned first). ``staged``: the
    sources are pageable buffers (an inline reply: pickle or tensor envelope); they go through a reused pinned
    staging buffer, two chunks in flight.

    Cancellation: a copy from the pool runs to its end before ``CancelledError`` is
    re-raised (the read locks on its slots are released only after it); a staged copy
    runs on in its worker thread.
    """
    await _ensure_pinned(pool)
    targets = _storages_of(dst for dst, _ in pairs)
    if staged:
        await asyncio.to_thread(_staged_to_device, pairs, mark, targets)
    else:
        await _copy(pairs, mark, targets, pool)


def _storages_of(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per distinct CUDA storage among ``tensors`` (for ``record_stream``)."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        if t.is_cuda:
            seen.setdefault(t.untyped_storage().data_ptr(), t)
    return list(seen.values())


def _staged_to_device(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], mark: Mark, keep_alive: Sequence[torch.Tensor]
) -> None:
    st = _state(mark.device)
    if not pairs:
        return
    nbytes = max(src.numel() * src.element_size() for _, src in pairs)
    stream = st.streams[0]
    try:
        with st.staging_lock, torch.no_grad(), torch.cuda.device(mark.device):
            bufs = st.staging_buffers(nbytes)
            done = [_event(), _event()]
            used = [False, False]
            stream.wait_event(mark.event)
            for t in keep_alive:
                t.record_stream(stream)
            for i, (dst, src) in enumerate(pairs):
                k = i % 2
                if used[k]:
                    done[k].synchronize()  # the H2D that read this buffer has finished
                stage = _as(bufs[k], src)
                stage.copy_(src)  # host memcpy into pinned memory
                with torch.cuda.stream(stream):
                    dst.copy_(stage, non_blocking=True)
                    done[k].record(stream)
                used[k] = True
            finished = _event()
            finished.record(stream)
            finished.synchronize()
    except RuntimeError as exc:
        raise TransferError(f"a CUDA copy failed: {exc}") from exc


def _as(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A contiguous view of the byte buffer ``buf`` with ``like``'s shape and dtype."""
    n = like.numel() * like.element_size()
    return buf[:n].view(like.dtype).view(like.shape)


class _StagedReader:
    """Device-to-host through two pinned buffers: chunk i+1 crosses PCIe while chunk i
    is copied into the inline frame (a pickle or a tensor envelope)."""

    def __init__(self, tensors: Sequence[torch.Tensor], mark: Mark, st: _DeviceState) -> None:
        self.tensors = tensors
        self.stream = st.streams[0]
        nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
        self.bufs = st.staging_buffers(nbytes)
        self.done = [_event(), _event()]
        self.stream.wait_event(mark.event)
        for t in _storages_of(tensors):
            t.record_stream(self.stream)
        self.enqueued = 0

    def _enqueue(self, j: int) -> None:
        t = self.tensors[j]
        with torch.cuda.stream(self.stream):
            _as(self.bufs[j % 2], t).copy_(t, non_blocking=True)
            self.done[j % 2].record(self.stream)
        self.enqueued = j + 1

    def copy(self, i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Buffer (i+1)%2 was last read by copy(i-1), which has returned: free to refill.
        while self.enqueued <= min(i + 1, len(self.tensors) - 1):
            self._enqueue(self.enqueued)
        self.done[i % 2].synchronize()
        dst.copy_(_as(self.bufs[i % 2], src).view(dst.shape))


def _encode_staged(wire: WireGeneration, tensors: Sequence[torch.Tensor], mark: Mark) -> bytearray:
    st = _state(mark.device)
    try:
        with st.staging_lock, torch.no_grad(), torch.cuda.device(mark.device):
            reader = _StagedReader(tensors, mark, st)
            return _encode_inline(wire, tensors, copy=reader.copy)
    except RuntimeError as exc:
        raise TransferError(f"a CUDA copy failed: {exc}") from exc


async def encode_inline(wire: WireGeneration, tensors: Sequence[torch.Tensor], mark: Mark) -> bytearray:
    """The inline transport's frame for CUDA ``tensors`` in ``wire``'s payload (a pickle
    for 0.5.6, a msgpack tensor envelope for 0.5.7: see
    :func:`lmcache_async._protocol.payload.inline.encode_inline`), staged through a reused pinned
    buffer, ordered after ``mark``.

    Cancellation: the encoding runs on in its worker thread; its result is dropped.
    """
    return await asyncio.to_thread(_encode_staged, wire, tensors, mark)
