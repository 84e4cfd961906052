"""The blocking client's runtime: one event loop on a daemon thread, and the hand-over of
calls to it (see :mod:`lmcache_async.sync_client` for what the facade promises).

:class:`LoopThread` is the process's loop thread (at most one, reference-counted by the
open clients, retired when idle); :class:`LoopCall` is one call handed over to it and
waited for by the caller (bounded, Ctrl-C aware). Nothing here knows what a client is:
the facade submits coroutines and closes clients through :meth:`LoopThread.submit` and
:meth:`LoopThread.close_in_background`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import selectors
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, Final, Generic, Protocol, TypeVar

from lmcache_async._base import trace as _trace
from lmcache_async.errors import ClientClosedError, LMCacheTimeoutError, LoopThreadCallError

__all__ = [
    "CLOSE_EXTRA",
    "EXIT_WAIT",
    "INTERRUPT_CLOSE",
    "LOOP_THREAD_NAME",
    "Closable",
    "LoopCall",
    "LoopThread",
    "bounded_aclose",
    "ready",
    "refuse_on_loop_thread",
    "tls",
]

log = logging.getLogger(__name__)


class Closable(Protocol):
    """What :meth:`LoopThread.close_in_background` closes (an ``AsyncClient``)."""

    async def aclose(self) -> None: ...


T = TypeVar("T")

#: Name of the event-loop thread (at most one per process).
LOOP_THREAD_NAME: Final = "lmcache-async-loop"
#: A waiting caller wakes this often (s) to notice a flagged KeyboardInterrupt.
WAIT_SLICE: Final = 0.1
#: Seconds the loop thread stays alive with no open client (read at each release).
IDLE_LINGER = 30.0
#: ``aclose()`` beyond ``cleanup_grace``: unregister (2 s) and closing socket/session.
CLOSE_EXTRA: Final = 10.0
#: Longest wait for a retiring loop thread to finish.
JOIN_TIMEOUT: Final = 10.0
#: Longest wait at interpreter exit for clients left open to close.
EXIT_WAIT: Final = 3.0
#: Longest wait for the close of a client whose ``with`` block is left by a
#: KeyboardInterrupt (Ctrl-C) or SystemExit: the close is then cancelled, which still
#: closes socket and session (operations still cleaning up against a hung server are
#: cancelled, the unregister is skipped; what they held expires on the server).
INTERRUPT_CLOSE: Final = 1.5


async def bounded_aclose(aclient: Closable, bound: float) -> None:
    """``aclient.aclose()``, cancelled after ``bound`` seconds (it then still closes
    socket and session, without waiting for cleanups or the unregister)."""
    try:
        async with asyncio.timeout(bound):
            await aclient.aclose()
    except TimeoutError:
        log.warning(
            "lmcache-async: the close of %r did not finish within %.1f s (a server that does not "
            "answer?); socket and session closed, cleanups left to expire on the server",
            aclient,
            bound,
        )


tls = threading.local()


async def ready(value: T) -> T:
    """``value``, as a coroutine's result: what the facade's portal hands the loop for an
    object made there without awaiting (an async generator)."""
    return value


def on_loop_thread() -> bool:
    return bool(getattr(tls, "is_loop_thread", False))


def refuse_on_loop_thread(what: str) -> None:
    if on_loop_thread():
        raise LoopThreadCallError(
            f"{what} blocks, and it was called from the lmcache-async event-loop thread it "
            "would wait for (a deadlock); from code running on an event loop use "
            "AsyncClient and 'await' instead"
        )


class Done:
    """A one-shot flag a thread can wait on: ``threading.Event``'s ``set``/``is_set``/
    ``wait`` on a bare lock (held until set), without the Condition behind an Event,
    whose Python-level waiter bookkeeping cost the facade ~25 µs per hand-over.
    Set once, by the loop thread; any number of threads may wait."""

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        if not self._flag:
            self._flag = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False after ``timeout`` seconds (``None``: no limit)."""
        if self._flag:
            return True
        if self._lock.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            self._lock.release()  # the next waiter (if any) passes too
            return True
        return self._flag


class WakingSelector(selectors.DefaultSelector):
    """The loop thread's selector: it wakes the callers whose calls finished during a
    loop iteration right before the loop blocks (and releases the GIL) in ``select``.

    A caller woken at once (from inside a callback) finds the GIL still held by the loop
    thread for the rest of the iteration and sleeps a second time until the loop thread
    drops it: two thread wake-ups instead of one (``python -m benchmarks.suite.bench_facade``
    times one hand-over and the two-thread floor).
    """

    def __init__(self) -> None:
        super().__init__()
        self.to_wake: list[Done] = []

    def wake_all(self) -> None:
        if _trace.hook is not None:
            _trace.hook("wake")
        to_wake, self.to_wake = self.to_wake, []
        for event in to_wake:
            event.set()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self.to_wake:
            self.wake_all()
        return super().select(timeout)


def new_loop() -> tuple[asyncio.AbstractEventLoop, WakingSelector | None]:
    if hasattr(selectors, "EpollSelector") or hasattr(selectors, "KqueueSelector"):
        selector = WakingSelector()
        return asyncio.SelectorEventLoop(selector), selector
    return asyncio.new_event_loop(), None  # pragma: no cover - Windows' proactor


class LoopCall(Generic[T]):
    """One coroutine run on the loop thread on behalf of a waiting (or absent) caller."""

    __slots__ = (
        "_callbacks", "_cancelled", "_exc", "_factory", "_finished", "_result", "_waker",
        "done", "loop", "task",
    )  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        factory: Callable[[], Coroutine[Any, Any, T]],
        waker: WakingSelector | None = None,
    ) -> None:
        self.loop = loop
        self._waker = waker
        #: Set (on the loop thread) once the call has finished: ``done`` follows when the
        #: loop thread next blocks (:class:`WakingSelector`), or at once without a waker.
        self._finished = False
        self.done = Done()
        self.task: asyncio.Task[None] | None = None
        self._factory: Callable[[], Coroutine[Any, Any, T]] | None = factory
        self._result: T | None = None
        self._exc: BaseException | None = None
        self._cancelled = False
        self._callbacks: list[Callable[[], None]] = []

    # -- on the loop thread
    def _start(self) -> None:
        if _trace.hook is not None:
            _trace.hook("start")
        factory, self._factory = self._factory, None
        assert factory is not None
        try:
            coro = factory()  # the coroutine is created here, on the loop thread
        except BaseException as exc:  # e.g. the factory itself raised
            self._exc = exc
            self._finish()
            return
        self.task = self.loop.create_task(self._run(coro))
        self.task.add_done_callback(lambda task: self._cancelled_before_start(task, coro))

    def _cancelled_before_start(self, task: asyncio.Task[None], coro: Coroutine[Any, Any, T]) -> None:
        # A task cancelled before its first step never entered _run's body: close the
        # call's coroutine (never started: no "never awaited" warning) and finish here.
        if not self._finished:
            coro.close()
            self._cancelled = True
            self._finish()

    async def _run(self, coro: Coroutine[Any, Any, T]) -> None:
        """Await ``coro`` and record its outcome from inside the task's last step: the
        caller is woken one loop iteration sooner than by a done-callback (which asyncio
        schedules for the next iteration). A cancelled or interrupted call still ends
        its task the same way (cancelled, or raising)."""
        try:
            self._result = await coro
        except asyncio.CancelledError:
            self._cancelled = True
            self._finish()
            raise
        except Exception as exc:
            self._exc = exc
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: the loop stops on them
            self._exc = exc
            self._finish()
            raise
        self._finish()

    def _finish(self) -> None:
        if _trace.hook is not None:
            _trace.hook("finish")
        self._finished = True
        if self._waker is None:
            self.done.set()
        else:
            self._waker.to_wake.append(self.done)
        for callback in self._callbacks:
            try:
                callback()
            except Exception:  # pragma: no cover - a bug in our own callbacks
                log.exception("lmcache-async: callback of a finished call failed")

    def _cancel_on_loop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    # -- on any thread
    def cancel(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to cancel
            self.loop.call_soon_threadsafe(self._cancel_on_loop)

    def abandon(self, on_success: Callable[[T], object]) -> None:
        """Cancel, and hand the result to ``on_success`` (on the loop) should the task
        succeed anyway (it finished already, or it finishes before the cancel lands)."""

        def on_loop() -> None:
            def deliver() -> None:
                if self.succeeded():
                    on_success(self._result)  # type: ignore[arg-type]

            if self._finished:
                deliver()
            else:
                self._callbacks.append(deliver)
                self._cancel_on_loop()

        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to hand over
            self.loop.call_soon_threadsafe(on_loop)

    def succeeded(self) -> bool:
        return self._finished and not self._cancelled and self._exc is None

    def outcome(self) -> T:
        if self._exc is not None:
            exc = self._exc
            try:
                raise exc
            finally:
                del exc
        if self._cancelled:
            raise ClientClosedError("the operation was cancelled on the event loop (is it shutting down?)")
        return self._result  # type: ignore[return-value]

    def wait(self, name: str, bound: float | None, grace: float) -> T:
        """Block until done; ``bound`` seconds at most (``None``: as long as it takes).

        KeyboardInterrupt: cancel the task, wait up to ``grace`` for it, re-raise.
        Bound expired: cancel the task, wait up to ``grace``, raise LMCacheTimeoutError.
        """
        start = time.monotonic()
        deadline = None if bound is None else start + bound
        try:
            while True:
                if deadline is None:
                    slice_ = WAIT_SLICE
                else:
                    slice_ = min(WAIT_SLICE, deadline - time.monotonic())
                    if slice_ <= 0:
                        break
                if self.done.wait(slice_):
                    return self.outcome()
        except KeyboardInterrupt:
            self.cancel()
            self.done.wait(grace)
            raise
        self.cancel()
        self.done.wait(grace)
        if self.succeeded():  # it made it after all
            return self.outcome()
        raise LMCacheTimeoutError(name, time.monotonic() - start)


class LoopThread:
    """An asyncio loop running on a daemon thread; one per process, shared and ref-counted."""

    # Reentrant: a client collected (finalized) inside a critical section releases its
    # reference on the same thread. Replaced in a forked child.
    _lock: ClassVar[threading.RLock] = threading.RLock()
    _current: ClassVar[LoopThread | None] = None
    _retiring: ClassVar[LoopThread | None] = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.refs = 0
        self.background: set[LoopCall[Any]] = set()
        self._idle_gen = 0
        self.loop, self._waker = new_loop()
        self.thread = threading.Thread(target=self._main, name=LOOP_THREAD_NAME, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        tls.is_loop_thread = True
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                tasks = asyncio.all_tasks(loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.wait(tasks, timeout=JOIN_TIMEOUT))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(asyncio.wait_for(loop.shutdown_default_executor(), JOIN_TIMEOUT))
            except BaseException:  # pragma: no cover - best effort at shutdown
                log.debug("lmcache-async: loop shutdown was not clean", exc_info=True)
            finally:
                asyncio.set_event_loop(None)
                if self._waker is not None:
                    self._waker.wake_all()  # calls that finished in the loop's last iteration
                loop.close()

    def __repr__(self) -> str:
        return f"<LoopThread {self.thread.name} refs={self.refs} alive={self.alive()}>"

    def alive(self) -> bool:
        return self.pid == os.getpid() and self.thread.is_alive() and not self.loop.is_closed()

    # ------------------------------------------------------------ sharing

    @classmethod
    def current(cls) -> LoopThread | None:
        """The process's loop thread, or ``None`` while none runs (none started yet, or
        the last one retired); takes no reference."""
        return cls._current

    @classmethod
    def reset_after_fork(cls) -> None:
        """Forget the parent's loop thread in a forked child (call it first thing there).

        The child has none of the parent's threads: the shared lock may be held by one of
        them forever, and the current and retiring threads are the parent's. A fresh lock
        and no loop thread let the child start its own on first use.
        """
        cls._lock = threading.RLock()
        cls._current = None
        cls._retiring = None

    @classmethod
    def acquire(cls) -> LoopThread:
        """The process's loop thread (started if needed), with one more reference."""
        while True:
            with cls._lock:
                lt = cls._current
                if lt is not None and lt.alive():
                    lt.refs += 1
                    return lt
                retiring = cls._retiring
                if retiring is None or not retiring.alive():
                    cls._retiring = None
                    lt = cls._current = cls()
                    lt.refs = 1
                    return lt
            # A retiring thread is still finishing; never run two (join outside the lock).
            retiring.thread.join(JOIN_TIMEOUT)
            if retiring.thread.is_alive():
                log.warning("lmcache-async: the idle event-loop thread did not exit; starting another")
                with cls._lock:
                    if cls._retiring is retiring:
                        cls._retiring = None

    def release(self) -> None:
        """Drop one reference; at zero the thread exits after ``IDLE_LINGER`` idle seconds."""
        with LoopThread._lock:
            if self.pid != os.getpid():
                return
            self.refs -= 1
            if self.refs > 0:
                return
            self._idle_gen += 1
            gen = self._idle_gen
        with contextlib.suppress(RuntimeError):  # the loop is closed already
            self.loop.call_soon_threadsafe(self._arm_idle, gen)

    def _arm_idle(self, gen: int) -> None:
        self.loop.call_later(IDLE_LINGER, self._retire_if_idle, gen)

    def _retire_if_idle(self, gen: int) -> None:
        cls = LoopThread
        with cls._lock:
            if self.refs or gen != self._idle_gen or cls._current is not self:
                return
            cls._current = None
            cls._retiring = self
        self.loop.stop()

    # ------------------------------------------------------------ running

    def submit(
        self,
        factory: Callable[[], Coroutine[Any, Any, T]],
        on_done: Callable[[], None] | None = None,
    ) -> LoopCall[T]:
        """Schedule ``factory()`` as a task on the loop (the coroutine is created there);
        ``on_done`` runs on the loop once it has finished (registered before it starts)."""
        if _trace.hook is not None:
            _trace.hook("submit")
        call = LoopCall(self.loop, factory, self._waker)
        if on_done is not None:
            call._callbacks.append(on_done)
        if not self.alive():
            raise ClientClosedError("the lmcache-async event-loop thread has stopped")
        try:
            self.loop.call_soon_threadsafe(call._start)
        except RuntimeError as exc:
            raise ClientClosedError("the lmcache-async event-loop thread has stopped") from exc
        return call

    def close_in_background(self, aclient: Closable, bound: float | None = None) -> LoopCall[None] | None:
        """Schedule ``aclient.aclose()`` without waiting (holds a reference until done);
        with ``bound``, the close is cancelled after that many seconds."""
        with LoopThread._lock:
            if not self.alive():
                return None
            self.refs += 1
        holder: list[LoopCall[None]] = []

        def finished() -> None:  # on the loop thread
            for call in holder:
                self.background.discard(call)
            self.release()

        try:
            if bound is None:
                call = self.submit(aclient.aclose, on_done=finished)
            else:
                call = self.submit(lambda: bounded_aclose(aclient, bound), on_done=finished)
        except ClientClosedError:
            self.release()
            return None
        holder.append(call)
        self.background.add(call)
        if call._finished:  # it finished before it was added (finished is set first)
            self.background.discard(call)
        return call

    def shutdown(self, timeout: float) -> None:
        """Stop the loop and join the thread (interpreter exit)."""
        with LoopThread._lock:
            if LoopThread._current is self:
                LoopThread._current = None
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:
            return
        self.thread.join(timeout)
