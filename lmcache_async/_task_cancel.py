"""Cancel a task and wait for it, without swallowing the waiter's own cancellation.

``task.cancel(); with contextlib.suppress(BaseException): await task`` cannot tell the
task's ``CancelledError`` from one aimed at the waiter: a closer cancelled while it waits
returns normally, with ``cancelling()`` left at 1. :func:`cancel_and_wait` waits with
:func:`asyncio.wait`, which never raises the task's outcome, so a ``CancelledError`` it
raises is the waiter's own and propagates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

__all__ = ["cancel_and_wait"]

log = logging.getLogger(__name__)


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
