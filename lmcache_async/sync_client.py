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
* ``timeout`` arguments are checked by :func:`lmcache_async._defaults.check_timeout` in
  the calling thread, before anything is submitted to the loop.
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
import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Unpack

import torch

from lmcache_async import _trace
from lmcache_async._cuda.hooks import caller_device, on_caller_streams
from lmcache_async._defaults import DEFAULT, DefaultType, check_timeout, resolve_timeout
from lmcache_async._loop_thread import (
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
from lmcache_async.client import AsyncClient, ClientOptions, ComposeResult, KVPart, RemapResult
from lmcache_async.errors import (
    ClientClosedError,
    ForkedSyncClientError,
    LMCacheTimeoutError,
    SyncUsageError,
)
from lmcache_async.geometry import KVGeometry

if TYPE_CHECKING:
    from lmcache_async.bulk import BatchProgress, BatchResult, ComposeItem, RemapPair, RetrieveItem, StoreItem
    from lmcache_async.rope import RopeSpec

__all__ = ["LOOP_THREAD_NAME", "Client", "SyncUsageError", "set_trace_hook"]

log = logging.getLogger(__name__)

T = TypeVar("T")


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


class Client:
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

    def _deadline(self, timeout: float | DefaultType | None) -> float | None:
        """The call's deadline: the client's for DEFAULT; ValueError if invalid."""
        return resolve_timeout(timeout, self._async.timeout)

    # ------------------------------------------------------------------ properties

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk (the server's ``--chunk-size``)."""
        self._check_process()
        return self._async.chunk_size

    @property
    def geometry(self) -> KVGeometry:
        """The KV layout in use (explicit, or derived from ``/status``)."""
        self._check_process()
        return self._async.geometry

    @property
    def transfer(self) -> Literal["shm", "pickle"]:
        """``"shm"`` or ``"pickle"``: how tensors travel."""
        self._check_process()
        return self._async.transfer

    @property
    def server_version(self) -> str:
        """The LMCache version the server reported at connect (``/lmc_version``)."""
        self._check_process()
        return self._async.server_version

    @property
    def wire_generation(self) -> str:
        """The wire generation in use, ``"0.5.6"`` or ``"0.5.7"``."""
        self._check_process()
        return self._async.wire_generation

    @property
    def instance_id(self) -> int:
        """The engine-driven registration id of this client (random, 63 bits)."""
        return self._async.instance_id

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
        return self._async.cleanup_grace

    @property
    def num_kv_readers(self) -> int:
        return self._async.num_kv_readers

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

    # ------------------------------------------------------------------ operations

    def lookup(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        request_configs: Mapping[str, Any] | None = None,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> int:
        """Length in tokens of the longest cached chunk-aligned prefix of ``tokens``.

        Blocking :meth:`AsyncClient.lookup`; timeout, KeyboardInterrupt and loop-thread
        behaviour as described in the class docstring.
        """
        deadline = self._deadline(timeout)
        return self._run(
            "lookup",
            _bound(deadline, self._grace),
            lambda: self._async.lookup(tokens, cache_salt, request_configs=request_configs, timeout=deadline),
        )

    def retrieve(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        out: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        request_configs: Mapping[str, Any] | None = None,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> torch.Tensor | None:
        """The KV of the longest cached chunk-aligned prefix of ``tokens``, or ``None``.

        Blocking :meth:`AsyncClient.retrieve` (``[2, L, T_hit, D]``, a view of ``out``
        when given, else on ``device``). On timeout or KeyboardInterrupt nothing more is
        copied into ``out`` once the call has returned, except a large copy already
        running in a worker thread, which finishes. A CUDA ``out``/``device`` is ordered
        after this thread's current stream, captured before the call is handed over
        (``device="cuda"`` is this thread's current GPU).
        """
        deadline = self._deadline(timeout)
        device = caller_device(device)
        return self._run(
            "retrieve",
            _bound(deadline, self._grace),
            on_caller_streams(
                lambda: self._async.retrieve(
                    tokens, cache_salt, out, device=device, request_configs=request_configs, timeout=deadline
                ),
                [out, device],
            ),
        )

    def store(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        request_configs: Mapping[str, Any] | None = None,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> bool:
        """Store ``kv`` (``[2, L, T, D]``; ``[L, T, D]`` for MLA) under ``tokens``.

        ``tokens`` may be longer than ``T`` (the KV is stored under ``tokens[:T]``), never
        shorter. Blocking :meth:`AsyncClient.store`: True if at least one chunk was added, False
        exactly when every chunk was already cached. On timeout or KeyboardInterrupt a
        store whose slots were reserved is still completed on the loop (all chunks or
        none); ``kv`` must not be modified until then. A CUDA ``kv`` is read as seen
        from this thread's current stream when the call is made.
        """
        deadline = self._deadline(timeout)
        return self._run(
            "store",
            _bound(deadline, self._grace),
            on_caller_streams(
                lambda: self._async.store(
                    kv, tokens, cache_salt, request_configs=request_configs, timeout=deadline
                ),
                [kv],
            ),
        )

    def remap(
        self,
        source_tokens: Sequence[int],
        target_tokens: Sequence[int],
        cache_salt: str = "",
        target_cache_salt: str | None = None,
        *,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> RemapResult:
        """Retrieve the KV of ``source_tokens`` and store it under ``target_tokens``.

        Blocking :meth:`AsyncClient.remap`; the deadline covers both halves.
        """
        deadline = self._deadline(timeout)
        return self._run(
            "remap",
            _bound(deadline, self._grace),
            lambda: self._async.remap(
                source_tokens, target_tokens, cache_salt, target_cache_salt, timeout=deadline
            ),
        )

    def compose(
        self,
        target_tokens: Sequence[int],
        parts: Sequence[KVPart],
        *,
        rope: RopeSpec | None = None,
        cache_salt: str = "",
        timeout: float | DefaultType | None = DEFAULT,
    ) -> ComposeResult:
        """Store under ``target_tokens`` the KV of cached ranges placed one after another,
        shifted keys rotated: blocking :meth:`AsyncClient.compose`; one deadline covers
        the retrieves and the store."""
        deadline = self._deadline(timeout)
        return self._run(
            "compose",
            _bound(deadline, self._grace),
            lambda: self._async.compose(
                target_tokens, parts, rope=rope, cache_salt=cache_salt, timeout=deadline
            ),
        )

    def noop(self, *, timeout: float | DefaultType | None = DEFAULT) -> float:
        """Round-trip a ``noop``; returns the server round-trip time in seconds (as
        measured on the loop, without the facade's own hand-over)."""
        deadline = self._deadline(timeout)
        return self._run("noop", _bound(deadline, self._grace), lambda: self._async.noop(timeout=deadline))

    def status(
        self, *, max_age: float | None = None, timeout: float | DefaultType | None = DEFAULT
    ) -> dict[str, Any]:
        """The server's ``/status`` document (cached for ``metadata_ttl`` seconds).

        The caller waits at most ``timeout`` (default: the client's) plus ``cleanup_grace``.
        """
        deadline = self._deadline(timeout)
        return self._run(
            "status",
            _bound(deadline, self._grace),
            lambda: self._async.status(max_age=max_age, timeout=deadline),
        )

    def config(
        self, *, max_age: float | None = None, timeout: float | DefaultType | None = DEFAULT
    ) -> dict[str, Any]:
        """The server's ``/config`` document (cached for ``metadata_ttl`` seconds).

        The caller waits at most ``timeout`` (default: the client's) plus ``cleanup_grace``.
        """
        deadline = self._deadline(timeout)
        return self._run(
            "config",
            _bound(deadline, self._grace),
            lambda: self._async.config(max_age=max_age, timeout=deadline),
        )

    def drain(self, timeout: float | DefaultType | None = DEFAULT) -> bool:
        """Wait until operations abandoned by a timeout or an interrupt have finished their
        server-side cleanup; True when none is left, False if ``timeout`` passed first."""
        deadline = self._deadline(timeout)
        return self._run("drain", _bound(deadline, self._grace), lambda: self._async.drain(deadline))

    # ---- bulk operations (lmcache_async.bulk): wrap each AsyncClient bulk method here ----
    # A batch has no overall deadline (``timeout`` is per item, and every item is bounded
    # by it), so the caller waits as long as the batch runs; Ctrl-C cancels the batch.
    # ``items`` is consumed and ``progress`` is called on the event-loop thread: neither
    # may block (a blocking Client call from them raises SyncUsageError).

    def remap_many(
        self,
        pairs: Iterable[RemapPair | Sequence[Any]],
        *,
        concurrency: int = 8,
        max_bytes_in_flight: int = 1 << 30,
        progress: Callable[[BatchProgress], object] | None = None,
        return_exceptions: bool = True,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> BatchResult:
        """Remap many (source, target) pairs concurrently: blocking
        :meth:`AsyncClient.remap_many` (see :func:`lmcache_async.bulk.remap_many`).

        KeyboardInterrupt cancels the batch: every in-flight item releases its server
        session, locks and reservations on the loop; then it is re-raised.
        """
        deadline = self._deadline(timeout)
        return self._run(
            "remap_many",
            None,
            lambda: self._async.remap_many(
                pairs,
                concurrency=concurrency,
                max_bytes_in_flight=max_bytes_in_flight,
                progress=progress,
                return_exceptions=return_exceptions,
                timeout=deadline,
            ),
        )

    def compose_many(
        self,
        items: Iterable[ComposeItem | Sequence[Any]],
        *,
        rope: RopeSpec | None = None,
        concurrency: int = 8,
        max_bytes_in_flight: int = 1 << 30,
        progress: Callable[[BatchProgress], object] | None = None,
        return_exceptions: bool = True,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> BatchResult:
        """Many compositions concurrently: blocking :meth:`AsyncClient.compose_many`.
        KeyboardInterrupt: as for :meth:`remap_many`."""
        deadline = self._deadline(timeout)
        return self._run(
            "compose_many",
            None,
            lambda: self._async.compose_many(
                items,
                rope=rope,
                concurrency=concurrency,
                max_bytes_in_flight=max_bytes_in_flight,
                progress=progress,
                return_exceptions=return_exceptions,
                timeout=deadline,
            ),
        )

    def store_many(
        self,
        items: Iterable[StoreItem | Sequence[Any]],
        *,
        concurrency: int = 8,
        max_bytes_in_flight: int = 1 << 30,
        progress: Callable[[BatchProgress], object] | None = None,
        return_exceptions: bool = True,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> BatchResult:
        """Store many ``(kv, tokens[, cache_salt])`` items concurrently: blocking
        :meth:`AsyncClient.store_many`. KeyboardInterrupt: as for :meth:`remap_many`."""
        deadline = self._deadline(timeout)
        return self._run(
            "store_many",
            None,
            on_caller_streams(
                lambda: self._async.store_many(
                    items,
                    concurrency=concurrency,
                    max_bytes_in_flight=max_bytes_in_flight,
                    progress=progress,
                    return_exceptions=return_exceptions,
                    timeout=deadline,
                ),
                None,
            ),
        )

    def retrieve_many(
        self,
        token_lists: Iterable[RetrieveItem | Sequence[Any]],
        *,
        concurrency: int = 8,
        max_bytes_in_flight: int = 1 << 30,
        progress: Callable[[BatchProgress], object] | None = None,
        return_exceptions: bool = True,
        timeout: float | DefaultType | None = DEFAULT,
        device: torch.device | str | None = None,
    ) -> BatchResult:
        """Retrieve many prompts concurrently: blocking :meth:`AsyncClient.retrieve_many`.
        KeyboardInterrupt: as for :meth:`remap_many`."""
        deadline = self._deadline(timeout)
        return self._run(
            "retrieve_many",
            None,
            on_caller_streams(
                lambda: self._async.retrieve_many(
                    token_lists,
                    concurrency=concurrency,
                    max_bytes_in_flight=max_bytes_in_flight,
                    progress=progress,
                    return_exceptions=return_exceptions,
                    timeout=deadline,
                    device=caller_device(device),
                ),
                None if device is None else [caller_device(device)],
            ),
        )

    # ---- end of bulk operations ----
