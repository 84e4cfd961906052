"""The half of :class:`~lmcache_async.AsyncClient` that is not its public API: the
operation runner (each operation in a task of its own, over the session, observed when the
client has observers), the tracking of operation tasks and background replies, and the
tensor checks the operations share; the release of a client collected unclosed.

:class:`ClientCore` is :class:`~lmcache_async.AsyncClient`'s base; the client sets the
attributes it declares (``__init__``) and keeps the lifecycle (``_require_open``,
``_check_loop``). Nothing here is public.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lmcache_async import _observing as observing, bulk, observe
from lmcache_async._cuda.hooks import caller_order
from lmcache_async._defaults import DefaultType, resolve_timeout
from lmcache_async._ops import Operations
from lmcache_async._runner import OpState, run_detached
from lmcache_async._session import Session
from lmcache_async._tensor_checks import check_tensor_storage

if TYPE_CHECKING:
    from lmcache_async.bulk import BatchOptions, BatchResult
    from lmcache_async.geometry import KVGeometry
    from lmcache_async.results import ComposeResult

__all__ = [
    "EXIT_UNREGISTER_WAIT",
    "ClientCore",
    "align",
    "check_iterable",
    "check_kv",
    "check_out",
    "client_observers",
    "collected_open",
    "finish_compose",
    "running_loop",
    "weak_tracker",
]

log = logging.getLogger("lmcache_async.client")

T = TypeVar("T")


#: At interpreter exit, how long the release of a client collected unclosed waits for the
#: unregister's reply (the process would end before its socket sent it otherwise).
EXIT_UNREGISTER_WAIT = 0.5


def _release_collected(
    loop: asyncio.AbstractEventLoop, session: Session, wait: float, done: threading.Event
) -> None:
    """Release a collected client's session (on its loop's thread, or with its loop not
    running): background tasks cancelled, the unregister sent (its reply waited for at
    most ``wait`` seconds), socket and HTTP session closed. Synchronous: nothing waits for
    a loop that may never run again."""
    try:
        session.release_locally(loop, unregister=True, unregister_wait=wait)
    finally:
        done.set()


def collected_open(loop: asyncio.AbstractEventLoop, session: Session, desc: str, pid: int) -> None:
    """``weakref.finalize`` callback of an :class:`~lmcache_async.AsyncClient` collected
    while open (or still open at interpreter exit): a :class:`ResourceWarning`, then the
    release, at once (:func:`_release_collected`: nothing is awaited, no event loop needs
    to run again).

    It runs on whichever thread collects the client. On the client's loop's thread, or
    with that loop not running, it releases here; with the loop running in another thread
    (whose reader may be using the socket) it hands the release to that thread. At
    interpreter exit the unregister's reply is waited for (at most
    :data:`EXIT_UNREGISTER_WAIT` seconds; a hand-over, that and a second more). A release
    handed to a loop that stops first is done by the connection's own finalizer when it is
    collected (the socket; the HTTP session is then aiohttp's to warn about)."""
    if os.getpid() != pid:
        return  # inherited across fork: the parent owns the socket and the registration
    warnings.warn(
        f"{desc} was never closed; closing it now (use 'async with AsyncClient(...)' or "
        "'await client.aclose()')",
        ResourceWarning,
        stacklevel=2,
    )
    # At exit (threading has shut down: atexit handlers, weakref's among them, run next).
    exiting = sys.is_finalizing() or not threading.main_thread().is_alive()
    wait = EXIT_UNREGISTER_WAIT if exiting else 0.0
    done = threading.Event()
    if loop.is_running() and running_loop() is not loop:
        try:
            loop.call_soon_threadsafe(_release_collected, loop, session, wait, done)
        except RuntimeError:  # the loop closed meanwhile
            pass
        else:
            if exiting:
                done.wait(wait + 1.0)
            return
    _release_collected(loop, session, wait, done)


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class ClientCore:
    """The operation runner and the checks under :class:`~lmcache_async.AsyncClient`."""

    model_name: str
    timeout: float | None
    _session: Session
    #: Told of each operation (``None``: none, and nothing is recorded).
    _observers: tuple[observe.Observer, ...] | None
    #: An observer asks for the phases of each operation.
    _phases: bool
    #: server.address and server.port of the records.
    _endpoint: tuple[str, int | None]
    _ops: set[asyncio.Future[Any]]  # operation tasks and cleanup replies
    _posted: set[asyncio.Future[Any]]  # cleanup replies awaited in the background

    if TYPE_CHECKING:  # the client's lifecycle (lmcache_async.client)

        @property
        def cleanup_grace(self) -> float: ...

        def _require_open(self) -> None: ...

        def _check_loop(self) -> None: ...

    async def _run(
        self,
        name: str,
        timeout: float | None,
        body: Callable[[Operations, OpState], Awaitable[T]],
        finish: Callable[[observe.Operation, T], None] | None = None,
        asked: int = 0,
        salt: str = "",
    ) -> T:
        """Run ``body`` over this client's operations in a task of its own (see
        :func:`~lmcache_async._runner.run_detached`), re-registering first if needed
        (:meth:`Session.run <lmcache_async._session.Session.run>`).
        With observers, it is an observed operation: ``finish`` fills in what its result
        says, ``asked`` and ``salt`` are its tokens asked and cache salt."""
        self._require_open()
        self._check_loop()

        session = self._session

        def run(op: OpState) -> Awaitable[T]:
            return session.run(name, op, body)

        if self._observers is None or finish is None:
            return await run_detached(name, timeout, self.cleanup_grace, run, self._track)
        record = self._record(name, asked, salt)
        return await observing.observed(
            self._observers,
            record,
            lambda: run_detached(name, timeout, self.cleanup_grace, run, self._track, record),
            finish,
        )

    def _record(self, name: str, asked: int = 0, salt: str = "") -> observe.Operation:
        """A new observed record of operation ``name`` (the client is open)."""
        s = self._session
        address, port = self._endpoint
        return observe.Operation(
            name,
            address,
            port,
            self.model_name,
            s.transfer,
            s.wire.name,
            s.chunk_size,
            asked,
            observe.salt_hash(salt),
            phases=[] if self._phases else None,
        )

    async def _observe(
        self,
        name: str,
        run: Callable[[], Awaitable[T]],
        finish: Callable[[observe.Operation, T], None],
        asked: int = 0,
        salt: str = "",
    ) -> T:
        """``await run()`` as observed operation ``name`` (a bulk job, a pickle remap):
        the parent of the operations it runs."""
        if self._observers is None:
            return await run()
        return await observing.observed(self._observers, self._record(name, asked, salt), run, finish)

    def _track_posted(self, fut: asyncio.Future[Any]) -> None:
        self._posted.add(fut)
        fut.add_done_callback(self._posted.discard)
        self._track(fut)

    def _track(self, task: asyncio.Future[Any]) -> None:
        self._ops.add(task)
        task.add_done_callback(self._op_done)

    def _op_done(self, task: asyncio.Future[Any]) -> None:
        self._ops.discard(task)
        if not task.cancelled():
            exc = task.exception()  # mark retrieved: the caller may have left
            if exc is not None:
                log.debug("operation task ended with %r", exc)

    def _aligned(self, n: int) -> int:
        return n // self._session.chunk_size * self._session.chunk_size

    async def _job(
        self,
        name: str,
        options: BatchOptions,
        run: Callable[[], Awaitable[BatchResult]],
        ordered: bool = False,
    ) -> BatchResult:
        """Bulk job ``name`` as an observed operation (the parent of its items'); with
        ``ordered``, GPU tensors are ordered after the caller's current streams, now."""
        bulk.check_options(name, options)
        self._require_open()
        self._check_loop()
        if not ordered:
            return await self._observe(name, run, observing.finish_batch)
        with caller_order():
            return await self._observe(name, run, observing.finish_batch)

    def _timeout(self, timeout: float | DefaultType | None) -> float | None:
        return resolve_timeout(timeout, self.timeout)


def client_observers(given: Sequence[observe.Observer]) -> tuple[observe.Observer, ...] | None:
    """The client's observers: ``given`` and those :func:`~lmcache_async.observe.add_observer`
    gave; ``None`` when none."""
    if isinstance(given, str) or not isinstance(given, Sequence):
        raise TypeError(f"observers must be a sequence of observers, got {type(given).__name__}")
    found = [*given]
    for o in found:
        if not callable(getattr(o, "operation_started", None)) or not callable(
            getattr(o, "operation_ended", None)
        ):
            raise TypeError(
                "an observer needs operation_started(op) and operation_ended(op) methods, "
                f"got {type(o).__name__}"
            )
    found.extend(o for o in observe.observers() if o not in found)
    return tuple(found) or None


def align(n: int, chunk_size: int) -> int:
    """``n`` rounded down to whole chunks."""
    return n // chunk_size * chunk_size


def check_iterable(value: object, name: str) -> None:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of items, got {type(value).__name__}")


def weak_tracker(client: ClientCore) -> Callable[[asyncio.Future[Any]], None]:
    """``client._track_posted`` through a weak reference (a no-op once it is collected)."""
    ref = weakref.ref(client)

    def track(fut: asyncio.Future[Any]) -> None:
        alive = ref()
        if alive is not None:
            alive._track_posted(fut)

    return track


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


def finish_compose(o: observe.Operation, r: ComposeResult) -> None:
    """The record of a composition on the inline transport, from its result."""
    observing.finish_compose(
        o,
        [p.tokens for p in r.parts],
        [p.tokens if p.hit else 0 for p in r.parts],
        r.stored_tokens,
        r.stored_new,
    )
