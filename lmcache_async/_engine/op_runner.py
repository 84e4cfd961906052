"""How :class:`~lmcache_async.AsyncClient` runs its operations: :class:`OperationRunner`,
which the client holds, runs each operation in a task of its own over the session
(observed when the client has observers), tracks the operation tasks and the background
replies, and gates the bulk jobs. The client hands it the check of its lifecycle (open,
on its loop) as a callable. Nothing here is public.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence, Sized
from typing import Any, TypeVar

from lmcache_async import observe
from lmcache_async._engine import observing as observing
from lmcache_async._engine.cuda.hooks import caller_order
from lmcache_async._engine.ops.calls import Call
from lmcache_async._engine.runner import OpState, run_detached
from lmcache_async._engine.session import Session

__all__ = ["OperationRunner", "check_iterable", "client_observers", "weakly"]

log = logging.getLogger("lmcache_async.client")

T = TypeVar("T")
SizedT = TypeVar("SizedT", bound=Sized)


def weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` (bound, no arguments) called through a weak reference to its object, so
    that holding it does not keep the object alive; a no-op once the object is gone."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


class OperationRunner:
    """The operation runner of one client.

    Args:
        model_name: the client's model (for the records).
        endpoint: server.address and server.port of the records.
        observers: told of each operation (``None``: none, and nothing is recorded).
        check: the client's lifecycle check, called before an operation starts (raises
            when the client is not open or is used from another loop).

    :attr:`session` is set by the client once it has made its session (the session takes
    :meth:`weak_tracker` first).
    """

    session: Session

    def __init__(
        self,
        model_name: str,
        endpoint: tuple[str, int | None],
        observers: tuple[observe.Observer, ...] | None,
        check: Callable[[], None],
    ) -> None:
        self.model_name = model_name
        self.endpoint = endpoint
        self.observers = observers
        #: An observer asks for the phases of each operation.
        self.phases = any(observe.wants_phases(o) for o in observers or ())
        self.check = check
        self.ops: set[asyncio.Future[Any]] = set()  # operation tasks and cleanup replies
        self.posted: set[asyncio.Future[Any]] = set()  # cleanup replies awaited in the background

    @property
    def in_flight(self) -> int:
        """Operations running now (background cleanup replies not counted)."""
        return max(len(self.ops) - len(self.posted), 0)

    async def run(self, call: Call[T], timeout: float | None) -> T:
        """Run ``call`` over the session in a task of its own (see
        :func:`~lmcache_async._engine.runner.run_detached`), re-registering first if needed
        (:meth:`Session.run <lmcache_async._engine.session.Session.run>`). With observers, it is
        an observed operation (its record: the call's ``name``, ``asked``, ``salt``; its
        result told to the call's ``finish``)."""
        self.check()
        session = self.session
        name = call.name

        def run(op: OpState) -> Awaitable[T]:
            return session.run(call, op)

        if self.observers is None:
            return await run_detached(name, timeout, session.cleanup_grace, run, self.track)
        record = self.record(name, call.asked, call.salt)
        return await observing.observed(
            self.observers,
            record,
            lambda: run_detached(name, timeout, session.cleanup_grace, run, self.track, record),
            call.finish,
        )

    def record(self, name: str, asked: int = 0, salt: str = "") -> observe.Operation:
        """A new observed record of operation ``name`` (the client is open)."""
        s = self.session
        address, port = self.endpoint
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
            phases=[] if self.phases else None,
        )

    async def observe(
        self,
        name: str,
        run: Callable[[], Awaitable[T]],
        finish: Callable[[observe.Operation, T], None],
        asked: int = 0,
        salt: str = "",
    ) -> T:
        """``await run()`` as observed operation ``name`` (a bulk job, a pickle remap):
        the parent of the operations it runs."""
        if self.observers is None:
            return await run()
        return await observing.observed(self.observers, self.record(name, asked, salt), run, finish)

    async def job(self, name: str, run: Callable[[], Awaitable[SizedT]], ordered: bool = False) -> SizedT:
        """Bulk job ``name`` as an observed operation (the parent of its items'; its result's
        length is the record's item count); with ``ordered``, GPU tensors are ordered after
        the caller's current streams, now. The caller has checked the job's options."""
        self.check()
        if not ordered:
            return await self.observe(name, run, observing.finish_batch)
        with caller_order():
            return await self.observe(name, run, observing.finish_batch)

    def track_posted(self, fut: asyncio.Future[Any]) -> None:
        self.posted.add(fut)
        fut.add_done_callback(self.posted.discard)
        self.track(fut)

    def track(self, task: asyncio.Future[Any]) -> None:
        self.ops.add(task)
        task.add_done_callback(self._op_done)

    def _op_done(self, task: asyncio.Future[Any]) -> None:
        self.ops.discard(task)
        if not task.cancelled():
            exc = task.exception()  # mark retrieved: the caller may have left
            if exc is not None:
                log.debug("operation task ended with %r", exc)

    def forget(self) -> None:
        """In a forked child: drop the parent's tasks and replies (never touched)."""
        self.ops = set()
        self.posted = set()

    def weak_tracker(self) -> Callable[[asyncio.Future[Any]], None]:
        """:meth:`track_posted` through a weak reference (a no-op once the runner is
        collected): the session's background replies never keep a dropped client alive."""
        ref = weakref.ref(self)

        def track(fut: asyncio.Future[Any]) -> None:
            alive = ref()
            if alive is not None:
                alive.track_posted(fut)

        return track


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


def check_iterable(value: object, name: str) -> None:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of items, got {type(value).__name__}")
