"""How an operation runs: in a task of its own, under deadlines.

:func:`run_detached` runs an operation's body in a task that outlives a caller who timed
out or was cancelled (the body finishes its server-side cleanup, abandoned), with the
shared :class:`OpState`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from lmcache_async._base.deadline import check_left
from lmcache_async._base.tasks import Expired, expire
from lmcache_async.errors import LMCacheTimeoutError

if TYPE_CHECKING:
    from lmcache_async.observe import Operation

__all__ = ["OpState", "run_detached"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class OpState:
    """Shared state between a caller and the task running its operation.

    Attributes:
        deadline: when the task must be done (the caller's deadline plus cleanup grace).
        caller_deadline: when the caller stops waiting (``None``: never).
        abandoned: the caller left (timed out or cancelled).
        record: the operation's observed record (``None``: no observers), where the
            sequence notes its request ids and the bytes it moves.
    """

    __slots__ = ("abandoned", "caller_deadline", "deadline", "record")

    def __init__(self, deadline: float | None, caller_deadline: float | None = None) -> None:
        self.deadline = deadline
        self.caller_deadline = caller_deadline if caller_deadline is not None else deadline
        self.abandoned = False
        self.record: Operation | None = None

    def clock(self) -> int:
        """Now (``time.time_ns()``) where the record notes phases, else 0 (see :meth:`phase`)."""
        record = self.record
        return time.time_ns() if record is not None and record.phases is not None else 0

    def phase(self, name: str, start: int) -> None:
        """Note phase ``name`` from ``start`` (a :meth:`clock` value; 0: not noted) to now."""
        if start and self.record is not None and self.record.phases is not None:
            self.record.phases.append((name, start, time.time_ns()))

    def moved(self, nbytes: int) -> None:
        """Note ``nbytes`` of KV copied to or from the server (for observers)."""
        if self.record is not None:
            self.record.bytes_moved += nbytes

    def remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(self.deadline - time.monotonic(), 0.0)


async def run_detached(
    name: str,
    timeout: float | None,
    cleanup_grace: float,
    body: Callable[[OpState], Awaitable[T]],
    track: Callable[[asyncio.Task[Any]], None] | None = None,
    record: Operation | None = None,
) -> T:
    """Run ``body`` in a task of its own and wait for it under ``timeout``.

    The task's deadline is ``timeout + cleanup_grace``. ``track`` is given the task (the
    client keeps a set of them, to wait for their cleanup on close). ``record``: the
    observed record the body's :class:`OpState` carries.

    Raises:
        LMCacheTimeoutError: ``timeout`` passed; the task goes on, abandoned, to clean up.
            ``timeout=0``: at once, and ``body`` is never started.

    Cancellation: the task is marked abandoned and goes on to clean up; the caller's
    ``CancelledError`` propagates.
    """
    start = time.monotonic()
    check_left(timeout, name)  # a deadline already passed: the body never runs, nothing is sent
    op = OpState(
        None if timeout is None else start + timeout + cleanup_grace,
        None if timeout is None else start + timeout,
    )
    op.record = record
    task = asyncio.ensure_future(body(op))
    if track is not None:
        track(task)
    # The caller waits on a future of its own, never on the task: cancelling or timing
    # out the caller leaves the task running (abandoned) to clean up.
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def finished(_task: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    task.add_done_callback(finished)
    timer = None if timeout is None else loop.call_later(timeout, expire, waiter)
    try:
        await waiter
    except Expired:
        op.abandoned = True
        raise LMCacheTimeoutError(name, time.monotonic() - start) from None
    except asyncio.CancelledError:
        op.abandoned = True
        raise
    finally:
        if timer is not None:
            timer.cancel()
    return task.result()
