"""The blocking client: :class:`Client`, a thin facade over :class:`~lmcache_async.AsyncClient`.

There is one implementation, the asyncio one. :class:`Client` runs it on a private event
loop that lives on a daemon thread, ``lmcache-async-loop``, shared (and reference-counted)
by every :class:`Client` of the process::

    caller thread(s)                      lmcache-async-loop (daemon)
    ----------------                      ---------------------------
    client.store(kv, tokens)  ──submit──▶  task: await AsyncClient.store(...)
       waits on a lock (Done)   ◀─done──  (owns the ZMQ socket, the aiohttp
       (bounded, Ctrl-C aware)              session, the SHM mapping)

* The :class:`~lmcache_async.AsyncClient` is constructed, opened, used and closed only on
  that loop, so it works the same in a script, in a Jupyter cell (whose own loop is
  already running), inside ``asyncio.run(...)`` and from any number of threads at once.
* A blocking call made *from the loop thread itself* (e.g. from a callback or coroutine
  running there) would wait for itself forever; it raises
  :class:`~lmcache_async.LoopThreadCallError` (a :class:`SyncUsageError`) at once.
* The caller's wait is bounded by the operation's ``timeout`` plus the client's
  ``cleanup_grace``. The operation itself gives up after ``timeout`` and raises
  :class:`~lmcache_async.LMCacheTimeoutError`; the facade's bound only fires if the loop
  is stuck, and also raises :class:`~lmcache_async.LMCacheTimeoutError`. (The bulk
  methods have per-item deadlines only: the caller waits as long as the batch runs.)
* ``KeyboardInterrupt`` (Ctrl-C, a Jupyter kernel interrupt) while waiting cancels the
  task on the loop, waits at most ``cleanup_grace`` seconds for the cancellation to be
  processed, then re-raises. The async client finishes the server side of a cancelled
  operation on its own (prefetch status consumed, locks freed, session ended, a reserved
  store completed). A second Ctrl-C stops that short wait.
* After ``os.fork()`` the child has no loop thread: an inherited :class:`Client` raises
  :class:`~lmcache_async.ForkedSyncClientError` (a :class:`SyncUsageError` and a
  :class:`~lmcache_async.ForkedClientError`; its ``close()`` is a no-op there); a new
  :class:`Client` in the child starts a loop thread of its own.
* ``timeout`` arguments are checked (as ``AsyncClient`` checks them) in the calling
  thread, before anything is submitted to the loop.
* Closing is explicit (``close()`` or ``with``). A client that is garbage-collected
  unclosed, or still open at interpreter exit, is closed by a :func:`weakref.finalize`
  callback with a :class:`ResourceWarning`; there is no ``__del__``. A collected client
  is closed in the background (the collecting thread never blocks); at exit the closes
  are waited for (bounded) before the loop thread stops.
* The loop thread starts with the first client and exits after it has been idle (no
  client open) for ``IDLE_LINGER`` seconds; there is never more than one.

The waiting thread wakes every ``WAIT_SLICE`` seconds, so an interrupt that is only
flagged (``_thread.interrupt_main()``, or a SIGINT delivered to another thread) is also
noticed promptly; a real SIGINT to the waiting main thread is handled at once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Final, TypeVar, Unpack

from lmcache_async._base.timeouts import DefaultType, check_timeout, resolve_timeout
from lmcache_async._blocking.loop_thread import (
    CLOSE_EXTRA,
    EXIT_WAIT,
    INTERRUPT_CLOSE,
    LOOP_THREAD_NAME,
    LoopCall,
    LoopThread,
    bounded_aclose,
    refuse_on_loop_thread,
    tls,
)
from lmcache_async._blocking.sync_methods import SyncMethods
from lmcache_async.client import AsyncClient, ClientOptions
from lmcache_async.errors import ClientClosedError, ForkedSyncClientError, LMCacheTimeoutError

__all__ = ["LOOP_THREAD_NAME", "Client"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Twin:
    """How the blocking twin of one :class:`~lmcache_async.AsyncClient` method differs
    from it (a :data:`_FACADE` row; ``tools/gen_sync_client.py`` writes the twin).

    Attributes:
        bound: the caller waits at most the call's ``timeout`` plus ``cleanup_grace``
            (False: as long as it runs, for a batch whose ``timeout`` is per item).
        cuda: the arguments (tensors or devices) whose current CUDA streams, in the
            caller's thread, the call is ordered after (``()``: the current GPU's, or the
            resolved ``device``'s when given; ``None``: none).
        device: the ``device=`` argument resolved in the caller's thread (``"cuda"`` is
            the caller's current GPU, not the loop thread's).
        note: a sentence the twin's docstring adds to the async method's.
    """

    bound: bool = True
    cuda: tuple[str, ...] | None = None
    device: str | None = None
    note: str = ""


#: How the blocking twin of a public ``AsyncClient`` method differs from it, for the
#: methods whose twin is not the default ``_Twin()``: the one table the generator
#: (``tools/gen_sync_client.py``, checked by ``make lint``) reads, with ``AsyncClient``'s
#: signatures and docstrings, to write :mod:`lmcache_async._blocking.sync_methods`.
_FACADE: Final = {
    "retrieve": _Twin(
        cuda=("out", "device"),
        device="device",
        note="A CUDA ``out``/``device`` is ordered after this thread's current stream, captured "
        "before the call is handed over; on timeout or KeyboardInterrupt nothing more is copied "
        "into ``out`` once the call has returned, except a large copy already running.",
    ),
    "store": _Twin(
        cuda=("kv",),
        note="A CUDA ``kv`` is read as seen from this thread's current stream when the call is "
        "made; a store whose slots were reserved is completed on the loop after a timeout or "
        "KeyboardInterrupt: ``kv`` must not be modified until then.",
    ),
    "noop": _Twin(note="The time is measured on the loop, without the facade's own hand-over."),
    "remap_many": _Twin(bound=False),
    "store_many": _Twin(bound=False, cuda=()),
    "retrieve_many": _Twin(bound=False, cuda=(), device="device"),
    "compose_many": _Twin(bound=False),
    "kv_events": _Twin(
        bound=False,
        note="Each step waits for the next event without a deadline (an idle server sends nothing); "
        "bad arguments raise at the first step, before anything is sent.",
    ),
}


async def _step(it: AsyncIterator[T]) -> tuple[bool, T | None]:
    """The next item of ``it`` (True, item), or (False, None) at its end."""
    try:
        return True, await anext(it)
    except StopAsyncIteration:
        return False, None


def _bound(timeout: float | None, grace: float) -> float | None:
    """The facade's wait for an operation with the (checked) deadline ``timeout``."""
    return None if timeout is None else timeout + grace


# Open clients, for the exit hook (a WeakSet: it never keeps a dropped client alive).
_live: weakref.WeakSet[Client] = weakref.WeakSet()


def _finalize(aclient: AsyncClient, lt: LoopThread, pid: int, desc: str) -> None:
    """weakref.finalize callback of a Client dropped (or still open at exit) unclosed."""
    if os.getpid() != pid:
        return  # inherited across fork: the parent owns the server-side state
    try:
        warnings.warn(
            f"{desc} was never closed; closing it now (call close() or use 'with Client(...)')",
            ResourceWarning,
            stacklevel=2,
        )
    finally:
        # At exit the close is bounded (it must end before the exit hook stops the loop,
        # so that socket and session are closed quietly).
        bound = EXIT_WAIT - 0.5 if _exiting else None
        lt.close_in_background(aclient, bound)  # holds its own reference until the close is done
        lt.release()


_exiting = False


def _at_exit() -> None:
    """Close clients left open (with a ResourceWarning), then stop the loop thread."""
    global _exiting
    _exiting = True
    for client in list(_live):
        client._finalizer()
    lt = LoopThread.current()
    if lt is None or not lt.alive():
        return
    # Bounded (a hung server must not hold the exit for cleanup_grace + unregister): what
    # is not done by then expires on the server (sessions, locks, the registration).
    deadline = time.monotonic() + EXIT_WAIT
    pending = [call for call in list(lt.background) if not call.done.is_set()]
    if pending:
        log.warning(
            "lmcache-async: at exit, waiting up to %.0f s for %d client close(s) "
            "(operation cleanups, unregister)",
            EXIT_WAIT,
            len(pending),
        )
    for call in pending:
        call.done.wait(max(deadline - time.monotonic(), 0.0))
    lt.shutdown(max(deadline - time.monotonic(), 0.1))


def _after_fork_in_child() -> None:
    LoopThread.reset_after_fork()
    tls.__dict__.clear()
    for client in list(_live):
        client._finalizer.detach()
    _live.clear()


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)


class Client(SyncMethods):
    """A blocking client of one LMCache MP server for one model.

    The same methods, arguments and return values as :class:`~lmcache_async.AsyncClient`,
    without ``await``; ``close()`` instead of ``aclose()``. The constructor connects (like
    the official SDK's ``connect``); :meth:`connect` is the same as a classmethod. Use it
    as a context manager or call :meth:`close`::

        with Client("tcp://localhost:5555", "http://localhost:8080", "my-model",
                    geometry=KVGeometry(32, 8, 128)) as client:
            client.store(kv, tokens)
            kv = client.retrieve(tokens)

    Safe to share between threads: concurrent calls run concurrently on the loop thread.
    For the arguments see :class:`~lmcache_async.AsyncClient`.

    Every blocking method:

    * **timeout** -- the operation has the deadline ``timeout`` (default: the client's);
      past it :class:`~lmcache_async.LMCacheTimeoutError` (also a ``TimeoutError``) is
      raised and the operation cleans up on the server by itself. The caller never waits
      longer than ``timeout + cleanup_grace``; ``timeout=None`` waits as long as it takes.
      An invalid ``timeout`` (negative, ``nan``, not a number) raises ``ValueError`` at
      once, in the calling thread.
    * **KeyboardInterrupt** while waiting -- the operation is cancelled on the loop, which
      releases its server-side session, locks and reservations by itself (a store whose
      slots were reserved is completed); the facade waits at most ``cleanup_grace`` for
      the cancellation, then re-raises ``KeyboardInterrupt``.
    * **from the loop thread** (code running on the client's own event loop) -- raises
      :class:`~lmcache_async.LoopThreadCallError` (a :class:`SyncUsageError`) at once
      instead of deadlocking.
    * **after fork** -- a client inherited by a child process raises
      :class:`~lmcache_async.ForkedSyncClientError` (a :class:`SyncUsageError`); create a
      new one in the child.
    * **after close** -- raises :class:`~lmcache_async.ClientClosedError`.
    * **bulk methods** -- a batch has no overall deadline (``timeout`` is per item), so the
      caller waits as long as it runs; Ctrl-C cancels it. ``items`` is consumed and
      ``progress`` is called on the event-loop thread: neither may block.

    The methods and properties are generated from :class:`~lmcache_async.AsyncClient`'s
    (``tools/gen_sync_client.py``, the rows of :data:`FACADE`).

    Raises (constructor): as :meth:`AsyncClient.open`; ``KeyboardInterrupt`` during the
    connect closes whatever was opened.
    """

    def __init__(
        self,
        url: str = "tcp://localhost:5555",
        http_url: str = "http://localhost:8080",
        model_name: str = "",
        **options: Unpack[ClientOptions],
    ) -> None:
        self._pid = os.getpid()
        self._closed = True  # until opened
        refuse_on_loop_thread("Client()")
        # Made here, so that every argument is checked in the calling thread before anything
        # reaches the loop (the constructor does no I/O); opened on the loop.
        unopened = AsyncClient(url, http_url, model_name, **options)
        timeout = unopened.timeout
        self._grace = unopened.cleanup_grace

        async def open_client() -> AsyncClient:
            await unopened.open()
            return unopened

        lt = LoopThread.acquire()
        call: LoopCall[AsyncClient] | None = None
        try:
            call = lt.submit(open_client)
            aclient = call.wait("open", _bound(timeout, self._grace), self._grace)
        except BaseException:
            if call is not None:  # interrupted: whatever opens after all is closed again
                call.abandon(lt.close_in_background)
            lt.release()
            raise
        self._lt = lt
        self._async = aclient
        self._closed = False
        self._finalizer = weakref.finalize(
            self, _finalize, aclient, lt, self._pid, f"<lmcache_async.Client {model_name!r} at {url}>"
        )
        _live.add(self)

    @classmethod
    def connect(
        cls,
        url: str = "tcp://localhost:5555",
        http_url: str = "http://localhost:8080",
        model_name: str = "",
        **options: Unpack[ClientOptions],
    ) -> Client:
        """Create and open a :class:`Client` (the same as calling the class)."""
        return cls(url, http_url, model_name, **options)

    # ------------------------------------------------------------------ plumbing

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise ForkedSyncClientError(
                f"this Client was created in process {self._pid}, before a fork; it cannot "
                "be used in the child (its event-loop thread did not survive the fork): "
                "create a new Client in this process",
                self._pid,
            )

    def _run(self, name: str, bound: float | None, factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
        self._check_process()
        refuse_on_loop_thread(f"Client.{name}()")
        if self._closed:
            raise ClientClosedError("the client is closed")
        return self._lt.submit(factory).wait(name, bound, self._grace)

    def _iterate(
        self, name: str, bound: float | None, start: Callable[[], Coroutine[Any, Any, AsyncIterator[T]]]
    ) -> Iterator[T]:
        """The blocking iterator over the async iterator ``start()`` makes on the loop (made
        now, so that bad arguments raise here): each step waits for the next item (at most
        ``bound`` seconds); leaving the iteration early (``break``, an exception, the
        iterator collected) closes the async iterator on the loop, waiting at most
        ``cleanup_grace``. KeyboardInterrupt during a step cancels that step, as for a call."""
        return self._steps(name, bound, self._run(name, bound, start))

    def _steps(self, name: str, bound: float | None, it: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                more, item = self._run(name, bound, lambda: _step(it))
                if not more:
                    return
                yield item  # type: ignore[misc]  # more: an item
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None and os.getpid() == self._pid:
                with contextlib.suppress(ClientClosedError, LMCacheTimeoutError):
                    self._lt.submit(aclose).wait(f"{name} close", self._grace, self._grace)

    def _deadline(self, timeout: float | DefaultType | None) -> float | None:
        """The call's deadline: the client's for DEFAULT; ValueError if invalid."""
        return resolve_timeout(timeout, self._async.timeout)

    def _bound(self, deadline: float | None) -> float | None:
        """The facade's wait for an operation with the (checked) deadline ``deadline``."""
        return _bound(deadline, self._grace)

    # ------------------------------------------------------------------ properties
    # (the AsyncClient's are generated, in SyncMethods; these are the client's own)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (or the client was finalized)."""
        return self._closed or self._async.closed

    @property
    def url(self) -> str:
        return self._async.url

    @property
    def http_url(self) -> str:
        return self._async.http_url

    @property
    def model_name(self) -> str:
        return self._async.model_name

    @property
    def timeout(self) -> float | None:
        """Default deadline (s) of every operation; settable (``None``: no deadline)."""
        return self._async.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._async.timeout = check_timeout(value)

    @property
    def cleanup_grace(self) -> float:
        """Extra seconds an abandoned operation may spend cleaning up (read-only here)."""
        return self._async.cleanup_grace

    def __repr__(self) -> str:
        inner = repr(self._async) if hasattr(self, "_async") else "<not opened>"
        return f"<Client {inner}>"

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Client:
        self._check_process()
        if self._closed:
            raise ClientClosedError("the client is closed")
        return self

    def __exit__(self, *exc: object) -> None:
        exc_type = exc[0] if exc else None
        if isinstance(exc_type, type) and not issubclass(exc_type, Exception):
            # Ctrl-C (or SystemExit) out of the block: the user wants out; a server that
            # hangs must not hold the exit for cleanup_grace + the unregister.
            self._close(INTERRUPT_CLOSE)
        else:
            self.close()

    def close(self) -> None:
        """Close the client (as :meth:`AsyncClient.aclose`): refuse new calls, let
        abandoned operations finish their cleanup (bounded by ``cleanup_grace``),
        unregister, close socket and session.

        Idempotent; returns at once if another thread is already closing it. Waits at
        most ``cleanup_grace + 10`` seconds (then logs a warning and returns).
        KeyboardInterrupt cancels the close, which still closes socket and session on
        the loop, and is re-raised. In a child process that inherited the client
        (fork) it only marks the client closed. From the loop thread: LoopThreadCallError.

        A ``with`` block left by ``KeyboardInterrupt`` (Ctrl-C) or ``SystemExit`` closes
        with a bound instead: at most 1.5 s (``INTERRUPT_CLOSE``), after which the close
        is cancelled, which still closes socket and session (cleanups of interrupted
        operations against a server that does not answer, and the unregister, are left
        to expire on the server).
        """
        self._close(None)

    def _close(self, bound: float | None) -> None:
        if os.getpid() != self._pid:
            self._closed = True
            return
        refuse_on_loop_thread("Client.close()")
        if self._finalizer.detach() is None:
            return  # already closed (or being closed by another thread)
        _live.discard(self)
        self._closed = True
        lt = self._lt
        try:
            if bound is None:
                lt.submit(self._async.aclose).wait("close", self._grace + CLOSE_EXTRA, self._grace)
            else:
                aclient = self._async
                lt.submit(lambda: bounded_aclose(aclient, bound)).wait("close", bound + 1.0, 1.0)
        except LMCacheTimeoutError:
            log.warning("lmcache-async: closing %r took too long; left to the event loop", self)
        except ClientClosedError:
            pass  # the loop thread is gone: so are the socket and the session
        finally:
            lt.release()
