"""The transport: one ZMQ DEALER socket, driven by the event loop, multiplexing many
concurrent requests by uid (docs/internals/design.md, section "The transport").

Every request registers its future before it is sent and has a deadline (the server never
sends error replies); a late reply finds no entry and is dropped. The loop must be a
selector loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
import time
import weakref
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.backend
from zmq.utils.monitor import parse_monitor_message

from lmcache_async._base import trace as _trace
from lmcache_async._base.deadline import async_timeout, check_left, zmq_poll_ms
from lmcache_async._base.tasks import Expired, cancel_and_wait, expire
from lmcache_async._base.zmq_context import monitor_address, process_context
from lmcache_async._protocol.urls import check_zmq_url, is_ip_address
from lmcache_async._protocol.wire import (
    GEN_0_5_6,
    Op,
    Reply,
    WireGeneration,
    decode_reply,
    encode_request,
    op_name,
)
from lmcache_async._transport.pending import OnLate, PendingTable
from lmcache_async.errors import (
    ClientClosedError,
    LMCacheConnectionError,
    LMCacheTimeoutError,
    ProtocolError,
)

__all__ = ["Connection", "OnLate", "PendingTable", "check_zmq_url"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_MS = 5000
#: How long :meth:`Connection.open` waits for the first TCP connection at most.
CONNECT_WAIT_S = 10.0
#: Once connection attempts were refused, how long open() keeps trying before it says so.
REFUSED_WAIT_S = 1.5
#: Default bound on requests in flight per connection (a call beyond it waits).
DEFAULT_MAX_IN_FLIGHT = 1024
#: How long an operation started while disconnected waits for the reconnection (a server
#: that is healthy again is reconnected to within RECONNECT_IVL_MAX_MS).
RECONNECT_WAIT_S = 1.5
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1000
#: How long a socket closed after a last request (:meth:`Connection.abandon`) keeps
#: trying to send it, in libzmq's I/O thread (nothing waits for it).
FAREWELL_LINGER_MS = 1000
#: Replies routed per readable callback before the loop gets a turn (fairness).
READ_BATCH = 256
#: Frames up to this size are sent and received as copies (cheaper than a zero-copy
#: ``zmq.Frame`` for small frames); larger ones (inline KV payloads) are not copied.
COPY_THRESHOLD = 65536

# The socket's own send/recv/get, called with int flags, not pyzmq's ``send_multipart`` /
# ``recv_multipart`` wrappers (docs/internals/design.md, section "The transport").
_zsend = zmq.backend.Socket.send
_zrecv = zmq.backend.Socket.recv
_zget = zmq.backend.Socket.get
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_RCVMORE = int(zmq.RCVMORE)
_monotonic = time.monotonic


def _release(sock: zmq.Socket[Any] | None, monitor: zmq.Socket[Any] | None, linger: int = 0) -> None:
    """Close the DEALER (its monitor stopped first) and the monitor's socket. Never blocks
    (closing a socket does not, whatever its linger; only a context's ``term()`` would,
    and the process context is never terminated: :mod:`lmcache_async._base.zmq_context`).
    Safe from a finalizer on any thread once nothing else uses the sockets."""
    if sock is not None:
        with contextlib.suppress(Exception):  # closed already
            sock.disable_monitor()
        sock.close(linger=linger)
    if monitor is not None:
        monitor.close(linger=0)


def _release_unclosed(pid: int, sock: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> None:
    """The finalizer of a :class:`Connection` collected unclosed (in its own process only:
    a forked child must not touch the parent's sockets)."""
    if os.getpid() == pid:
        _release(sock, monitor)


class Connection:
    """A DEALER connection to an LMCache MP server.

    Create with :meth:`open` on the loop that will use it. All methods must be called on
    that loop.
    """

    def __init__(
        self, url: str, wire: WireGeneration = GEN_0_5_6, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self._host = check_zmq_url(url)
        self.url = url
        #: Most requests in flight at once; further calls wait (under their deadlines).
        self.max_in_flight = max_in_flight
        self._busy = 0  # calls holding a place (registered, or about to be)
        self._place_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        #: The server generation's wire: which trailing argument frames requests get.
        self.wire = wire
        self.generation = 0  # increases each time the peer (re)connects after a loss
        self.connected = False
        self._table = PendingTable()
        self._ctx: zmq.Context[Any] | None = None  # the process context, while open
        self._sockets_finalizer: weakref.finalize[Any, Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._fds: list[int] = []  # descriptors watched with loop.add_reader
        self._drain_scheduled = False
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ever_connected = False
        self._reader_alive = False
        self._refused = 0
        self._first_connect: asyncio.Event | None = None
        #: Set each time the peer comes back after a loss (the client re-registers at once).
        self.reconnected: asyncio.Event | None = None
        #: ``time.monotonic()`` when a reply last arrived (or the connection was made).
        self.last_reply = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    async def open(self, timeout: float | None = None) -> None:
        """Create the socket, watch it and its monitor on the running loop, and wait for
        the TCP connection (at most ``min(timeout, CONNECT_WAIT_S)`` seconds).

        Raises:
            LMCacheConnectionError: the host name cannot be resolved, the endpoint
                refused the connection ("refused", within about :data:`REFUSED_WAIT_S`
                seconds), or no connection was made in time. The socket, its monitor and
                the ZMQ context are closed again.
            ClientClosedError: :meth:`close` ran meanwhile (nothing is left open).

        Cancellation: the socket, its monitor and the context are closed again.
        """
        self._loop = asyncio.get_running_loop()
        self._first_connect = asyncio.Event()
        self.reconnected = asyncio.Event()
        await self._resolve(timeout)
        if self._closed:  # close() ran while the host was resolved: make nothing
            raise ClientClosedError(f"cannot connect to {self.url}: the connection was closed")
        ctx = process_context()
        sock: zmq.Socket[Any] | None = None
        monitor: zmq.Socket[Any] | None = None
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            # Queue only to a connected peer: nothing sent while the server is down is
            # replayed on the server that comes back.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            monitor = sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED,
                monitor_address(),
            )
            sock.connect(self.url)
        except BaseException as exc:
            _release(sock, monitor)
            if isinstance(exc, zmq.ZMQError):
                raise LMCacheConnectionError(f"cannot open a ZMQ connection to {self.url}: {exc}") from exc
            raise
        self._ctx, self._sock, self._monitor = ctx, sock, monitor
        # A connection collected unclosed (its loop gone before its client's close ran)
        # closes its sockets then: no event loop needed. Not at exit (the process's end
        # closes them; the clients' own exit closes need them until then).
        self._sockets_finalizer = weakref.finalize(self, _release_unclosed, os.getpid(), sock, monitor)
        self._sockets_finalizer.atexit = False
        try:
            self._watch(sock, self._on_readable)
            self._watch(monitor, self._on_monitor)
        except (NotImplementedError, RuntimeError) as exc:
            await self.close()
            raise LMCacheConnectionError(
                f"this event loop cannot watch a ZMQ socket ({exc!r}); lmcache_async needs a "
                "selector event loop (the default on Linux and macOS, or uvloop)"
            ) from exc
        reader = asyncio.create_task(self._reader(), name=f"lmcache-reader {self.url}")
        self._reader_alive = True
        self._loop.call_soon(self._on_monitor)  # events queued before the watch began
        reader.add_done_callback(self._reader_stopped)
        self._tasks = [reader]
        try:
            await self._wait_first_connect(timeout)
        except BaseException:
            await self.close()
            raise

    async def _resolve(self, timeout: float | None) -> None:
        """Resolve the host before any socket exists: ZMQ would retry an unknown host
        forever, which :meth:`open` could only report as "no connection"."""
        if not self._host or is_ip_address(self._host):
            return
        assert self._loop is not None
        limit = CONNECT_WAIT_S if timeout is None else min(timeout, CONNECT_WAIT_S)
        try:
            async with async_timeout(limit):
                await self._loop.getaddrinfo(self._host, None, type=socket.SOCK_STREAM)
        except TimeoutError:
            raise LMCacheConnectionError(
                f"cannot connect to {self.url}: the host {self._host!r} was not resolved within {limit:.1f}s"
            ) from None
        except OSError as exc:
            raise LMCacheConnectionError(
                f"cannot connect to {self.url}: the host {self._host!r} cannot be resolved "
                f"({exc.strerror or exc})"
            ) from exc

    async def _wait_first_connect(self, timeout: float | None) -> None:
        assert self._first_connect is not None
        limit = CONNECT_WAIT_S if timeout is None else min(timeout, CONNECT_WAIT_S)
        start = time.monotonic()
        while not self._first_connect.is_set():
            if self._closed:
                raise ClientClosedError(f"cannot connect to {self.url}: the connection was closed")
            waited = time.monotonic() - start
            if self._refused and waited >= min(REFUSED_WAIT_S, limit):
                raise LMCacheConnectionError(
                    f"cannot connect to {self.url}: connection refused ({self._refused} attempts in "
                    f"{waited:.1f}s; is the server's ZMQ port right?)"
                )
            if waited >= limit:
                raise LMCacheConnectionError(
                    f"cannot connect to {self.url}: no connection after {waited:.1f}s"
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await self._first_connect.wait()

    async def wait_usable(self, timeout: float | None) -> None:
        """Return at once when connected; otherwise wait for the reconnection at most
        ``min(timeout, RECONNECT_WAIT_S)`` seconds.

        Raises:
            ClientClosedError: the connection is closed.
            LMCacheConnectionError: still not connected (the server is down), or the
                reader stopped.
        """
        limit = RECONNECT_WAIT_S if timeout is None else min(timeout, RECONNECT_WAIT_S)
        end = time.monotonic() + limit
        while True:
            if self._closed:
                raise ClientClosedError("the connection is closed")
            if not self._reader_alive:
                raise LMCacheConnectionError("the connection's reader stopped (event loop closing?)")
            if self.connected:
                return
            if time.monotonic() >= end:
                raise LMCacheConnectionError(
                    f"not connected to {self.url} (the server is down or restarting; "
                    f"no reconnection within {limit:.1f}s)"
                )
            await asyncio.sleep(0.01)

    def _reader_stopped(self, task: asyncio.Task[None]) -> None:
        """The reader ended (cancelled at loop shutdown, or a bug): nobody will read
        another reply, so fail every pending call now and refuse new ones."""
        self._reader_alive = False
        if not task.cancelled() and task.exception() is not None:
            log.error("the ZMQ reader of %s failed: %r", self.url, task.exception())
        self._table.fail_all(
            lambda op: LMCacheConnectionError(f"{op_name(op)}: the connection's reader stopped")
        )

    async def close(self, stream_wait: float = 1.0) -> None:
        """Fail in-flight calls with ClientClosedError, cancel the open streams on the
        server (while connected; their ends awaited at most ``stream_wait`` seconds, then
        left to the socket's linger), stop the tasks, close the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        streams = list(self._table.streams.values())
        self._table.fail_all(lambda op: ClientClosedError(f"{op_name(op)}: the connection was closed"))
        ends = [end for st in streams if (end := st.farewell(hear_end=True)) is not None]
        tasks, self._tasks = self._tasks, []
        try:
            if ends:
                await asyncio.wait(ends, timeout=stream_wait)
            await cancel_and_wait(tasks, "a connection task")
        finally:  # also when the closer is cancelled: the socket is closed all the same
            unanswered = [end.cancel() for end in ends if not end.done()]
            self._unwatch()
            self._release_sockets(FAREWELL_LINGER_MS if unanswered else 0)

    def abandon(self, farewell: tuple[Op, Sequence[Any]] | None = None, farewell_wait: float = 0.0) -> None:
        """Close the socket and its monitor now, without awaiting anything: for a
        connection whose event loop is closed or not running (a client closed from another
        loop, or collected unclosed), or from the loop's own thread (a client collected
        there). Must not be called from another thread while the loop runs. Idempotent.

        ``farewell``: one last request (the unregister of a collected client), sent if the
        peer is connected and ready, its reply not awaited; the socket then lingers up to
        :data:`FAREWELL_LINGER_MS` for it in libzmq's I/O thread (the close itself does not
        wait). With ``farewell_wait`` (interpreter exit: the process would end before the
        I/O thread sent it) the reply is waited for, at most that many seconds, blocking.

        Calls still pending are failed with :class:`ClientClosedError` where their loop can
        still take the news; the tasks are cancelled where it can run them.
        """
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        streams = list(self._table.streams.values())
        if loop is not None and not loop.is_closed():
            self._table.fail_all(lambda op: ClientClosedError(f"{op_name(op)}: the connection was closed"))
            for task in self._tasks:
                task.cancel()
        self._tasks = []
        self._unwatch()
        for stream in streams:
            stream.farewell(hear_end=False)  # cancelled on the server, if still connected
        linger = FAREWELL_LINGER_MS if streams else 0
        if farewell is not None and self._sock is not None and self.connected:
            op, args = farewell
            frames = encode_request(next(self._table._uids), op, args, self.wire)
            last = len(frames) - 1
            try:
                for i, frame in enumerate(frames):
                    _zsend(self._sock, frame, _NOBLOCK if i == last else _SNDMORE_NOBLOCK, True, False)
                linger = FAREWELL_LINGER_MS
            except zmq.ZMQError as exc:  # not ready (zmq.Again: nothing was queued) or gone
                log.debug("%s not sent on %s: %s", op_name(op), self.url, exc)
            else:
                if farewell_wait > 0:
                    self._wait_reply_blocking(frames[0], farewell_wait)
        self._release_sockets(linger)

    def _wait_reply_blocking(self, uid_frame: Any, wait_s: float) -> None:
        """Block (no event loop) until the reply whose uid frame is ``uid_frame`` arrives,
        at most ``wait_s`` seconds; other replies are dropped."""
        sock = self._sock
        assert sock is not None
        end = time.monotonic() + wait_s
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        with contextlib.suppress(zmq.ZMQError):
            while (left := end - time.monotonic()) > 0:
                if not poller.poll(zmq_poll_ms(left)):
                    return
                with contextlib.suppress(zmq.Again):
                    if sock.recv_multipart(zmq.NOBLOCK)[0] == bytes(uid_frame):
                        return

    def _release_sockets(self, linger: int = 0) -> None:
        if self._sockets_finalizer is not None:
            self._sockets_finalizer.detach()
            self._sockets_finalizer = None
        _release(self._sock, self._monitor, linger)
        self._sock = self._monitor = self._ctx = None

    def drop_inherited(self) -> None:
        """In a forked child: forget the parent's socket, monitor and context without
        closing them or touching the event loop's selector (the child may share its
        epoll descriptor with the parent; libzmq's own close is already a no-op in
        another pid). They are marked as shadows, so garbage collection does not close
        them either."""
        self._closed = True
        self._reader_alive = False
        if self._sockets_finalizer is not None:
            self._sockets_finalizer.detach()
            self._sockets_finalizer = None
        for obj in (self._sock, self._monitor, self._ctx):
            if obj is not None:
                with contextlib.suppress(AttributeError, TypeError):
                    obj._shadow = True
        self._sock = self._monitor = self._ctx = None
        self._fds = []
        self._tasks = []
        self._table = PendingTable()

    def fail_pending(self, exc_factory: Any) -> int:
        """Fail every request in flight with ``exc_factory(op)`` (their replies, if any
        come, are dropped); returns how many."""
        return self._table.fail_all(exc_factory)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def usable(self) -> bool:
        """Whether a call can be sent now (open, connected, reader running)."""
        return not self._closed and self.connected and self._reader_alive

    @property
    def in_flight(self) -> int:
        return len(self._table)

    @property
    def dropped(self) -> tuple[int, int]:
        """(replies with an unknown uid, replies with a mismatched op) dropped so far."""
        return self._table.dropped_unknown, self._table.dropped_mismatch

    @property
    def late(self) -> tuple[int, int]:
        """(late replies told to a waiter so far, late replies still watched for): see
        ``on_late`` in :meth:`call`."""
        return self._table.late_heard, self._table.lingering

    # ------------------------------------------------------------------ calls

    async def call(
        self,
        op: Op,
        args: Sequence[Any] = (),
        *,
        timeout: float | None,
        urgent: bool = False,
        on_late: OnLate | None = None,
    ) -> Reply:
        """Send one request and wait for its reply.

        Args:
            op: the operation.
            args: its arguments (Python values or :class:`~lmcache_async._protocol.wire.PreEncoded`).
            timeout: seconds until the call fails; ``None`` waits forever.
            urgent: a cleanup (``free_lookup_locks``, ``end_session``, ...): it is sent at
                once, even with ``max_in_flight`` requests in flight (it still holds a
                place, so new calls wait for it). A backlog of new requests (thousands of
                concurrent operations on one client, a server slowed by load) never
                holds back, past their deadline, the requests that end the server
                sessions and release the locks of the operations already admitted:
                cleanups are never dropped for want of a place.
            on_late: when the call stops waiting (timeout, cancellation) after its
                request was sent, ``on_late`` is given the future of its late reply
                (:meth:`PendingTable.linger`); its caller must cancel that future once it
                stops waiting for it.

        Raises:
            LMCacheTimeoutError: no reply in time (also a ``TimeoutError``); the request
                may still be executed by the server. ``timeout <= 0`` (not urgent): at
                once, nothing sent.
            LMCacheConnectionError: the connection was lost while waiting.
            ClientClosedError: the connection is closed.

        Backpressure: at most ``max_in_flight`` requests are in flight; a call beyond that
        waits for a free place, under its deadline (a timeout then names no request id:
        nothing was sent), in arrival order; urgent calls never wait.

        Cancellation: the entry is removed; a later reply is dropped.
        """
        self._check_sendable(op)
        if not urgent:  # a deadline already passed: nothing is sent (an urgent cleanup still goes)
            check_left(timeout, op_name(op))
        start = time.monotonic()
        if self._must_wait(urgent):
            await self._wait_for_place(op, start, timeout)
            try:
                self._check_sendable(op)  # the connection may have changed meanwhile
            except BaseException:
                self._release_place()
                raise
        else:
            self._busy += 1
        assert self._loop is not None
        uid: int | None = None
        fut: asyncio.Future[Reply] | None = None
        timer: asyncio.TimerHandle | None = None
        sent = False
        try:
            uid, fut = self._table.register(op, self._loop)
            frames = encode_request(uid, op, args, self.wire)
            if not self._send(frames, op):
                await self._send_when_ready(frames, op, start, timeout)
            sent = True
            if timeout is not None:
                timer = self._loop.call_later(timeout - (time.monotonic() - start), expire, fut)
            return await fut
        except Expired:
            raise LMCacheTimeoutError(op_name(op), time.monotonic() - start, uid) from None
        finally:
            if timer is not None:
                timer.cancel()
            late = None
            if uid is not None:
                if on_late is not None and sent:
                    late = self._table.linger(uid, self._loop)
                else:
                    self._table.discard(uid)
            if fut is not None and not fut.done():
                fut.cancel()
            self._release_place()
            if late is not None:
                assert on_late is not None
                on_late(late)

    def send_nowait(
        self, op: Op, args: Sequence[Any], *, timeout: float | None, on_late: OnLate | None = None
    ) -> asyncio.Future[Reply] | None:
        """Send one request now and return the future of its reply, without waiting.

        Returns ``None`` (nothing sent) when it cannot go out at once: not connected, the
        reader stopped, or ``max_in_flight`` requests are in flight (the caller then uses
        :meth:`call`). The future fails with :class:`LMCacheTimeoutError` after
        ``timeout`` seconds (``None``: never), with :class:`LMCacheConnectionError` on a lost connection
        and with :class:`ClientClosedError` on close; cancelling it discards the reply.
        ``on_late``: as for :meth:`call`, when the future times out or is cancelled.
        """
        if not self.usable or self._must_wait(False):
            return None
        assert self._loop is not None
        start = time.monotonic()
        uid, fut = self._table.register(op, self._loop)
        try:
            sent = self._send(encode_request(uid, op, args, self.wire), op)
        except LMCacheConnectionError:
            sent = False
        if not sent:
            self._table.discard(uid)
            fut.cancel()
            return None
        self._busy += 1
        timer = None
        if timeout is not None:
            timer = self._loop.call_later(timeout, self._expire_posted, fut, op, uid, start)
        fut.add_done_callback(functools.partial(self._posted_done, timer, uid, on_late))
        return fut

    @staticmethod
    def _expire_posted(fut: asyncio.Future[Reply], op: Op, uid: int, start: float) -> None:
        if not fut.done():
            fut.set_exception(LMCacheTimeoutError(op_name(op), time.monotonic() - start, uid))

    def _posted_done(
        self, timer: asyncio.TimerHandle | None, uid: int, on_late: OnLate | None, fut: asyncio.Future[Reply]
    ) -> None:
        if timer is not None:
            timer.cancel()
        late = None
        if on_late is not None:
            assert self._loop is not None
            late = self._table.linger(uid, self._loop)
        else:
            self._table.discard(uid)
        self._release_place()
        if not fut.cancelled():
            fut.exception()  # retrieved: nobody may be waiting for it
        if late is not None:
            assert on_late is not None
            on_late(late)

    def _must_wait(self, urgent: bool) -> bool:
        """Whether a new call must wait for a place (none is free, or others wait first);
        an urgent one never does."""
        if urgent:
            return False
        return self._busy >= self.max_in_flight or bool(self._place_waiters)

    async def _wait_for_place(self, op: Op, start: float, timeout: float | None) -> None:
        """Wait (under the call's deadline) until fewer than ``max_in_flight`` calls hold
        a place, then take one; first come, first served.

        Raises:
            LMCacheTimeoutError: the deadline passed first (nothing was sent).

        Cancellation: the place, if it was just handed over, goes to the next waiter.
        """
        assert self._loop is not None
        waiter: asyncio.Future[None] = self._loop.create_future()
        waiters = self._place_waiters
        waiters.append(waiter)
        try:
            remaining = None if timeout is None else timeout - (time.monotonic() - start)
            async with async_timeout(remaining):
                await waiter
        except TimeoutError:
            raise LMCacheTimeoutError(op_name(op), time.monotonic() - start, None) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # handed a place but leaving
                self._release_place()
            raise
        finally:
            with contextlib.suppress(ValueError):
                waiters.remove(waiter)

    def _release_place(self) -> None:
        """Give a place back: to the first waiter still waiting, else to the pool (always
        to the pool while urgent calls hold more than ``max_in_flight`` places)."""
        if self._busy <= self.max_in_flight:
            waiters = self._place_waiters
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the place passes on: _busy is unchanged
                    return
        self._busy -= 1

    def _check_sendable(self, op: Op) -> None:
        if self._closed or self._sock is None or self._loop is None:
            raise ClientClosedError(f"{op_name(op)}: the connection is closed")
        if not self._reader_alive:
            raise LMCacheConnectionError(
                f"{op_name(op)}: the connection's reader stopped (event loop closing?)"
            )
        if not self.connected:
            raise LMCacheConnectionError(
                f"{op_name(op)}: not connected to {self.url} (the server is down or restarting)"
            )

    def _send(self, frames: list[Any], op: Op) -> bool:
        """Queue ``frames`` on the socket without blocking (a multipart message is queued
        whole or not at all); False when the socket has no ready peer (``ZMQ_IMMEDIATE``:
        nothing was queued).

        Raises:
            LMCacheConnectionError: the send failed.
        """
        sock = self._sock
        assert sock is not None and self._loop is not None
        last = len(frames) - 1
        if _trace.hook is not None:
            _trace.hook("send")
        try:
            # All or nothing: once libzmq took the first part of a message it takes the rest.
            for i, frame in enumerate(frames):
                copy = type(frame) is bytes and len(frame) < COPY_THRESHOLD
                _zsend(sock, frame, _NOBLOCK if i == last else _SNDMORE_NOBLOCK, copy, False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise LMCacheConnectionError(f"{op_name(op)}: send failed: {exc}") from exc
        if _trace.hook is not None:
            _trace.hook("sent")
        # A send may consume the descriptor's edge (libzmq processes its commands then):
        # look for replies once more on the next loop turn.
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._on_readable)
        return True

    async def _send_when_ready(self, frames: list[Any], op: Op, start: float, timeout: float | None) -> None:
        """The peer is not ready (the TCP connection is up but its handshake is not done,
        or it is down): retry every millisecond while connected, at most
        ``min(timeout, RECONNECT_WAIT_S)`` seconds from ``start``.

        Raises:
            LMCacheConnectionError: not connected, or still not ready in time (nothing
                was queued).
        """
        limit = RECONNECT_WAIT_S if timeout is None else min(timeout, RECONNECT_WAIT_S)
        while True:
            self._check_sendable(op)
            if time.monotonic() - start >= limit:
                raise LMCacheConnectionError(
                    f"{op_name(op)}: {self.url} is connected but not ready for requests "
                    f"after {limit:.1f}s (nothing was sent)"
                )
            await asyncio.sleep(0.001)
            self._check_sendable(op)  # close() may have run meanwhile
            if self._send(frames, op):
                return

    def _watch(self, sock: zmq.Socket[Any], callback: Any) -> None:
        assert self._loop is not None
        fd = sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._loop.add_reader(fd, callback)
        self._fds.append(fd)

    def _unwatch(self) -> None:
        fds, self._fds = self._fds, []
        if self._loop is None or self._loop.is_closed():
            return
        for fd in fds:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(fd)

    async def _reader(self) -> None:
        """Stands for the readable callbacks: runs until cancelled (close, or the loop
        shutting down), then stops watching the descriptors."""
        assert self._loop is not None
        try:
            await self._loop.create_future()
        finally:
            self._unwatch()

    def _on_readable(self) -> None:
        """Route every reply that has arrived (at most :data:`READ_BATCH` per turn)."""
        self._drain_scheduled = False
        sock = self._sock
        if sock is None or not self._reader_alive:
            return
        for i in range(READ_BATCH):
            try:
                frames: list[Any] = [_zrecv(sock, _NOBLOCK, True, False)]
                while _zget(sock, _RCVMORE):
                    # uid and op (tiny) as bytes; a payload as a Frame (not copied)
                    frames.append(_zrecv(sock, _NOBLOCK, len(frames) < 2, False))
            except zmq.Again:
                if i:
                    self.last_reply = _monotonic()
                return
            except zmq.ZMQError as exc:
                if self._closed:
                    return
                log.error("ZMQ receive failed on %s: %s", self.url, exc)
                self._table.fail_all(
                    lambda op, exc=exc: LMCacheConnectionError(f"{op_name(op)}: receive failed: {exc}")
                )
                return
            self._route(frames)
        self.last_reply = _monotonic()
        if not self._drain_scheduled:  # more may be waiting: another turn
            self._drain_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._on_readable)

    def _route(self, frames: list[Any]) -> None:
        """Decode and route one reply: ``frames`` are bytes, the third on a ``zmq.Frame``
        (a small payload is taken as bytes; a large one stays a view of the frame)."""
        parts = [f if type(f) is bytes else f.buffer for f in frames]
        try:
            reply = decode_reply(parts)
        except ProtocolError as exc:
            log.warning("dropping malformed reply from %s: %s", self.url, exc)
            self._table.dropped_unknown += 1
            return
        if reply.payload is not None and type(frames[2]) is not bytes and len(parts[2]) < COPY_THRESHOLD:
            reply = Reply(reply.uid, reply.op, frames[2].bytes)
        self._table.resolve(reply)

    def _on_monitor(self) -> None:
        monitor = self._monitor
        while monitor is not None and not self._closed:
            try:
                msg = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                log.debug("the socket monitor of %s failed: %s", self.url, exc)
                return
            self._on_event(parse_monitor_message(msg)["event"])

    def _on_event(self, event: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
            self.last_reply = time.monotonic()
            if self._ever_connected:
                self.generation += 1
                log.warning("reconnected to %s (generation %d)", self.url, self.generation)
                assert self.reconnected is not None
                self.reconnected.set()
            self._ever_connected = True
            assert self._first_connect is not None
            self._first_connect.set()
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self._refused += 1
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            n = self._table.fail_all(
                lambda op: LMCacheConnectionError(f"{op_name(op)}: connection to {self.url} lost")
            )
            log.warning("disconnected from %s; failed %d in-flight calls", self.url, n)
