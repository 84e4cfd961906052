"""Observing the client's operations: a typed callback protocol (the hook), and what it is
given (:class:`Operation`).

An :class:`Observer` is told when each operation starts and when it ends, with the facts
of the operation in one :class:`Operation` record, the way aiohttp's ``TraceConfig``
callbacks are told about requests::

    class Log:
        def operation_started(self, op: Operation) -> float:
            return time.monotonic()           # kept for this observer: op.state[self]

        def operation_ended(self, op: Operation) -> None:
            print(op.name, op.outcome, op.tokens_hit, op.duration, op.request_ids)

    client = AsyncClient(url, http_url, model, observers=[Log()])

The OpenTelemetry support (:mod:`lmcache_async.otel`) is one such observer. Observers are
given to one client (``observers=``), or to every client made afterwards with
:func:`add_observer`.

What is observed: ``lookup``, ``retrieve``, ``store``, ``remap`` and ``compose`` (one record
each), and the bulk jobs ``retrieve_many``, ``store_many``, ``remap_many`` and
``compose_many`` (one record for the job,
the *parent* of one record per operation its items run). A remap on the pickle transport
runs a retrieve and a store: they are its children. Arguments refused before anything is
sent (a ``ValueError`` for bad tokens) are not operations and are not observed.

Phases: an observer whose optional ``wants_phases`` attribute is true makes the client note the
phases of each operation in :attr:`Operation.phases` (a few clock reads per operation);
without one, nothing is noted.

Profiling the blocking client's hand-overs between threads: :func:`set_trace_hook`.

Privacy: a record holds no token ids and no cache salt; only counts, and the salt as a
short hash (:attr:`Operation.cache_salt_hash`).

Cost: a client without observers tests one attribute for ``None`` per operation, nothing
more. Both callbacks run on the event loop, in the caller's task (``operation_started``
before the first request is sent, ``operation_ended`` when the caller gets its result or
error); they must not block. An exception a callback raises never reaches the caller: an
observer's first failure is logged with its traceback (``WARNING``, logger
``lmcache_async._engine.observing``), its later ones at ``DEBUG`` only, and all are counted
(:func:`observer_failures`). A callback that takes longer than :data:`SLOW_CALLBACK_S`
(5 ms) gets one ``WARNING`` per observer, naming it.

Removal: :func:`remove_observer` undoes :func:`add_observer` (for clients made
afterwards); :func:`lmcache_async.otel.uninstrument` undoes ``instrument``.

Timeout and cancellation: the record ends when the caller stops waiting, with
:attr:`~Operation.outcome` ``"timeout"`` or ``"cancelled"``; the server-side cleanup the
operation goes on with in the background is not part of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from lmcache_async._base import trace as _trace

__all__ = [
    "SLOW_CALLBACK_S",
    "Observer",
    "Operation",
    "Outcome",
    "add_observer",
    "observer_failures",
    "observers",
    "remove_observer",
    "salt_hash",
    "set_trace_hook",
    "wants_phases",
]

#: Seconds: a callback slower than this gets one ``WARNING`` per observer.
SLOW_CALLBACK_S: float = 0.005

#: How an operation ended, as the caller saw it: ``"ok"`` (a result; a store or remap that
#: found everything cached included), ``"miss"`` (a lookup or retrieve found nothing,
#: a remap found no source), ``"error"`` (an exception other than the two below),
#: ``"timeout"`` (:class:`~lmcache_async.errors.LMCacheTimeoutError`), ``"cancelled"``
#: (the caller's task was cancelled).
Outcome = Literal["ok", "miss", "error", "timeout", "cancelled"]


@dataclass(slots=True, eq=False)
class Operation:
    """One operation, as observers see it.

    The fields above ``tokens_hit`` are known when it starts; the rest are filled in by
    the time :meth:`Observer.operation_ended` is called (counts stay 0, others ``None``,
    where the operation did not get that far).

    Attributes:
        name: ``"lookup"``, ``"retrieve"``, ``"store"``, ``"remap"``, ``"compose"``, or a bulk job
            (``"retrieve_many"``, ``"store_many"``, ``"remap_many"``, ``"compose_many"``).
        server_address: host of the server's ZMQ endpoint (``url``).
        server_port: its port (``None`` for an ``ipc://`` endpoint).
        model_name: the model whose KV it is.
        transport: ``"shm"`` or ``"pickle"``.
        server_generation: the wire generation, ``"0.5.6"`` or ``"0.5.7"``.
        chunk_size: tokens per chunk when it started.
        tokens_asked: tokens the caller gave (for a remap: the source's; for a bulk job:
            the sum over its children, filled in as they end).
        cache_salt_hash: 12 hex digits of the SHA-256 of the cache salt (``None`` for the
            empty salt; the salt itself is never recorded).
        parent: the bulk job (or pickle remap) this operation runs for, else ``None``.
        tokens_hit: tokens found cached (lookup, retrieve, remap's source).
        tokens_stored: tokens the store (or the remap's target) covers, whole chunks.
        chunks: chunks hit (lookup, retrieve, remap) or covered (store).
        bytes_moved: bytes of KV copied between the client and the server (a store:
            the chunks the server did not have; a retrieve: the KV returned).
        stored_new: whether a store or remap added a chunk.
        items: a bulk job's item count.
        request_ids: the server-side request ids (session ids) the operation used, in
            order: the server keys its sessions, its log lines and its own OpenTelemetry
            spans (attribute ``session_id``) by them, so they join the two sides.
        phases: ``(phase, start, end)`` of each step (``time.time_ns()``), in the order they
            ended: ``"lookup"``, ``"prefetch wait"``, ``"prepare"``, ``"copy"``,
            ``"commit"`` (the cleanup after the result runs in the background and is not
            one); ``None`` unless an observer of the client asks for them with a true
            ``wants_phases`` attribute.
        children: operations that ran with this one as their parent.
        duration: seconds from start to end, as the caller waited.
        outcome: how it ended (:data:`Outcome`).
        error_type: the exception's class name when ``outcome`` is not ok/miss.
        state: each observer's value returned by its ``operation_started``, keyed by the
            observer (aiohttp's ``trace_config_ctx``).
    """

    name: str
    server_address: str
    server_port: int | None
    model_name: str
    transport: str | None = None
    server_generation: str | None = None
    chunk_size: int | None = None
    tokens_asked: int = 0
    cache_salt_hash: str | None = None
    parent: Operation | None = None
    tokens_hit: int = 0
    tokens_stored: int = 0
    chunks: int = 0
    bytes_moved: int = 0
    stored_new: bool | None = None
    items: int | None = None
    request_ids: list[str] = field(default_factory=list)
    phases: list[tuple[str, int, int]] | None = None
    children: int = 0
    duration: float | None = None
    outcome: Outcome | None = None
    error_type: str | None = None
    state: dict[object, Any] = field(default_factory=dict)


class Observer(Protocol):
    """Told when an operation starts and ends (see the module's documentation).

    Both methods run on the event loop in the caller's task and must not block; what
    ``operation_started`` returns is kept in ``op.state[observer]`` for the end (and for
    the operation's children, which can read their parent's).

    An observer may also have a ``wants_phases`` attribute (optional, so not a member of
    the protocol: an observer without it still satisfies it and counts as ``False``): true
    makes the client note the phases of each operation in :attr:`Operation.phases` for
    every observer (see :func:`wants_phases`).
    """

    def operation_started(self, op: Operation) -> Any:
        """An operation starts (nothing sent yet)."""
        ...

    def operation_ended(self, op: Operation) -> None:
        """The operation ended: its counts, request ids, duration and outcome are filled in."""
        ...


_installed: tuple[Observer, ...] = ()


def add_observer(observer: Observer) -> None:
    """Give ``observer`` every client made from now on (in this process), besides its own.
    Adding one twice is a no-op."""
    global _installed
    if observer not in _installed:
        _installed = (*_installed, observer)


def remove_observer(observer: Observer) -> None:
    """Undo :func:`add_observer` for clients made from now on (a no-op if not added)."""
    global _installed
    _installed = tuple(o for o in _installed if o is not observer)


#: Failures counted per observer, and the observers warned of as slow (see the module).
_failures: dict[Any, int] = {}
_slow_warned: set[Any] = set()


def observer_failures(observer: Observer) -> int:
    """How many times ``observer``'s callbacks have raised in this process (0 if never).
    Only the first failure is logged at ``WARNING``; the later ones at ``DEBUG``."""
    return _failures.get(observer, 0)


def observers() -> tuple[Observer, ...]:
    """The observers :func:`add_observer` gave, in order."""
    return _installed


def wants_phases(observer: Observer) -> bool:
    """Whether ``observer`` asks for the phases (its optional ``wants_phases`` attribute,
    see :class:`Observer`; an object without the attribute does not)."""
    return bool(getattr(observer, "wants_phases", False))


def set_trace_hook(hook: Callable[[str], None] | None) -> None:
    """Have ``hook(point)`` called at each hand-over point a blocking call passes, for
    profiling (``benchmarks/suite/bench_facade.py --trace`` times the phases of a call with it);
    ``None`` turns it off. The points, in a call's order:

    * ``"submit"``: in the caller's thread, as the call is handed to the loop thread;
    * ``"start"``: on the loop thread, as the call's coroutine is created;
    * ``"send"`` / ``"sent"``: on the loop thread, around each request's send on the socket
      (any client's, the async ones' too);
    * ``"finish"``: on the loop thread, as the call is done;
    * ``"wake"``: on the loop thread, as it wakes the callers whose calls finished, before
      it waits for I/O again.

    The hook runs inline at these points: it must be fast and must not raise. One hook per
    process; a new one replaces the old.
    """
    _trace.hook = hook


def salt_hash(cache_salt: str) -> str | None:
    """The short hash recorded for ``cache_salt``: 12 hex digits of its SHA-256 (``None``
    for the empty salt)."""
    if not cache_salt:
        return None
    return hashlib.sha256(cache_salt.encode()).hexdigest()[:12]
