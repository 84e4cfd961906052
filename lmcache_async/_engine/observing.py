"""Running an operation under its observers (:mod:`lmcache_async.observe`): the record's
start and end, its outcome, its parent (a context variable: the bulk job or pickle remap
the caller's task is running, inherited by the tasks it starts), and the observers'
exceptions kept from the caller."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence, Sized
from contextvars import ContextVar
from typing import TYPE_CHECKING, TypeVar

from lmcache_async import observe
from lmcache_async._engine.ops.calls import compose_record
from lmcache_async.errors import LMCacheTimeoutError
from lmcache_async.observe import Observer, Operation

if TYPE_CHECKING:
    from lmcache_async.results import ComposeResult

__all__ = [
    "current",
    "endpoint",
    "finish_batch",
    "finish_compose_result",
    "observed",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The operation the current task runs for (the parent of those it starts).
_current: ContextVar[Operation | None] = ContextVar("lmcache_async_operation", default=None)


def current() -> Operation | None:
    """The operation the current task runs for, if any."""
    return _current.get()


async def observed(
    observers: Sequence[Observer],
    op: Operation,
    run: Callable[[], Awaitable[T]],
    finish: Callable[[Operation, T], None],
) -> T:
    """Await ``run()`` as the observed operation ``op``: observers told of its start, then
    ``finish(op, result)`` fills in its result's facts (or the outcome says the error),
    its duration is set and observers are told of its end.

    Cancellation and timeout: the record ends with outcome ``"cancelled"`` or
    ``"timeout"`` and the exception propagates unchanged.
    """
    parent = _current.get()
    if parent is not None:
        op.parent = parent
        parent.children += 1
    for obs in observers:
        began = time.perf_counter()
        try:
            op.state[obs] = obs.operation_started(op)
        except Exception as exc:
            took = time.perf_counter() - began  # the observer's time, not our logging's
            _failed(obs, "start", op, exc)
        else:
            took = time.perf_counter() - began
        _timed(obs, "operation_started", took)
    token = _current.set(op)
    start = time.perf_counter()
    try:
        result = await run()
    except LMCacheTimeoutError:
        op.outcome, op.error_type = "timeout", "LMCacheTimeoutError"
        raise
    except asyncio.CancelledError:
        op.outcome, op.error_type = "cancelled", "CancelledError"
        raise
    except BaseException as exc:
        op.outcome, op.error_type = "error", type(exc).__qualname__
        raise
    else:
        finish(op, result)
        if op.outcome is None:
            op.outcome = "ok"
    finally:
        _current.reset(token)
        op.duration = time.perf_counter() - start
        if parent is not None and parent.name.endswith("_many"):
            parent.tokens_asked += op.tokens_asked
            parent.tokens_hit += op.tokens_hit
            parent.tokens_stored += op.tokens_stored
            parent.chunks += op.chunks
            parent.bytes_moved += op.bytes_moved
        elif parent is not None:  # a pickle remap: its retrieve and its store move the bytes
            parent.bytes_moved += op.bytes_moved
        for obs in observers:
            began = time.perf_counter()
            try:
                obs.operation_ended(op)
            except Exception as exc:
                took = time.perf_counter() - began
                _failed(obs, "end", op, exc)
            else:
                took = time.perf_counter() - began
            _timed(obs, "operation_ended", took)
    return result


def _failed(obs: Observer, where: str, op: Operation, exc: Exception) -> None:
    """Count a callback's failure; log the observer's first with its traceback."""
    count = observe._failures.get(obs, 0) + 1
    observe._failures[obs] = count
    if count == 1:
        log.warning(
            "observer %r failed at the %s of %s: %r (its later failures are counted, not "
            "logged: lmcache_async.observe.observer_failures)",
            obs,
            where,
            op.name,
            exc,
            exc_info=exc,
        )
    else:
        log.debug("observer %r failed at the %s of %s (failure %d): %r", obs, where, op.name, count, exc)


def _timed(obs: Observer, callback: str, seconds: float) -> None:
    """Warn once per observer of a callback slower than ``SLOW_CALLBACK_S``."""
    if seconds > observe.SLOW_CALLBACK_S and obs not in observe._slow_warned:
        observe._slow_warned.add(obs)
        log.warning(
            "observer %r is slow: its %s took %.1f ms, over the %.0f ms threshold "
            "(lmcache_async.observe.SLOW_CALLBACK_S); callbacks run on the event loop and "
            "must not block (warned once per observer)",
            obs,
            callback,
            seconds * 1e3,
            observe.SLOW_CALLBACK_S * 1e3,
        )


# ---------------------------------------------------------------------- what results say


def endpoint(url: str) -> tuple[str, int | None]:
    """``(server.address, server.port)`` of a checked ZMQ endpoint (``ipc://path``: the
    path and ``None``)."""
    scheme, _, rest = url.partition("://")
    if scheme == "ipc":
        return rest, None
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def finish_batch(op: Operation, result: Sized) -> None:
    op.items = len(result)


def finish_compose_result(op: Operation, r: ComposeResult) -> None:
    """The record of a composition on the inline transport, from its result."""
    compose_record(
        op,
        [p.tokens for p in r.parts],
        [p.tokens if p.hit else 0 for p in r.parts],
        r.stored_tokens,
        r.stored_new,
    )
