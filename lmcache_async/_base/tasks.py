"""Task helpers below every tier: the deadline signal a timer sets on a future, and how
tasks are stopped and waited for.

:class:`Expired` / :func:`expire` are the one deadline signal a timer sets on a future;
:func:`wait_all` waits for a live set of tasks.

Cancel a task and wait for it, without swallowing the waiter's own cancellation:

``task.cancel(); with contextlib.suppress(BaseException): await task`` cannot tell the
task's ``CancelledError`` from one aimed at the waiter: a closer cancelled while it waits
returns normally, with ``cancelling()`` left at 1. :func:`cancel_and_wait` waits with
:func:`asyncio.wait`, which never raises the task's outcome, so a ``CancelledError`` it
raises is the waiter's own and propagates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["Expired", "cancel_and_wait", "expire", "wait_all"]

log = logging.getLogger(__name__)


class Expired(Exception):
    """A deadline passed (set on a waiting future by its timer; never seen by callers)."""


def expire(fut: asyncio.Future[Any]) -> None:
    """The timer's callback: fail ``fut`` with :class:`Expired` unless it is done."""
    if not fut.done():
        fut.set_exception(Expired())


async def cancel_and_wait(
    tasks: asyncio.Future[Any] | Iterable[asyncio.Future[Any]], what: str = "task"
) -> None:
    """Cancel ``tasks`` and wait until they are done; their errors are logged at debug
    level (they were being stopped), never raised.

    Cancellation: the waiter's ``CancelledError`` propagates at once (the tasks were
    already told to stop and finish on their own).
    """
    pending = {tasks} if isinstance(tasks, asyncio.Future) else set(tasks)
    if not pending:
        return
    for task in pending:
        task.cancel()
    await asyncio.wait(pending)
    for task in pending:
        if not task.cancelled() and task.exception() is not None:
            log.debug("%s ended with %r while being stopped", what, task.exception())


async def wait_all(futures: set[asyncio.Future[Any]], timeout: float | None) -> bool:
    """Wait until ``futures`` (a live set: done ones leave it, follow-ups join it) is
    empty; False if ``timeout`` passed first."""
    end = None if timeout is None else time.monotonic() + timeout
    settled = False
    while True:
        pending = {f for f in futures if not f.done()}
        if not pending:
            if settled:
                return True
            settled = True
            await asyncio.sleep(0)  # done-callbacks may still post follow-ups
            continue
        settled = False
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            return False
        await asyncio.wait(pending, timeout=left)
