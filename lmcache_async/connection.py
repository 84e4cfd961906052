"""The transport: one ZMQ DEALER socket multiplexing many concurrent requests.

Design (see docs/design.md):

* one ``zmq.asyncio`` DEALER per connection, created on the loop that uses it;
* a single reader task is the only caller of ``recv``; it routes each reply to the
  future registered under its uid in :class:`PendingTable`;
* every request registers its future **before** sending; a done-callback removes the
  entry on every outcome (reply, timeout, cancellation, connection loss), so nothing
  leaks and a late reply finds no entry and is dropped (and counted);
* uids increase monotonically and are never reused on a connection;
* a reply whose echoed op differs from the request's is dropped and counted;
* a socket monitor watches for disconnects: in-flight calls fail at once with
  :class:`~lmcache_async.errors.LMCacheConnectionError` instead of waiting out their
  deadlines, and :attr:`Connection.generation` increases when the peer comes back so
  the client knows to re-register.

The server never sends error replies, so every call has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from lmcache_async.errors import (
    ClientClosedError,
    LMCacheConnectionError,
    LMCacheTimeoutError,
    ProtocolError,
)
from lmcache_async.wire import GEN_0_5_6, Op, Reply, WireGeneration, decode_reply, encode_request, op_name

__all__ = ["Connection", "PendingTable"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_MS = 5000
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1000


@dataclass
class _Entry:
    future: asyncio.Future[Reply]
    op: Op


class PendingTable:
    """In-flight requests keyed by uid (pure bookkeeping; no I/O).

    Attributes:
        dropped_unknown: replies whose uid had no entry (late, duplicate, foreign).
        dropped_mismatch: replies whose echoed op differed from the request's.
    """

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._uids = itertools.count()
        self.dropped_unknown = 0
        self.dropped_mismatch = 0

    def __len__(self) -> int:
        return len(self._entries)

    def register(self, op: Op, loop: asyncio.AbstractEventLoop) -> tuple[int, asyncio.Future[Reply]]:
        """Allocate a fresh uid and a future; the entry is removed when the future is done."""
        uid = next(self._uids)
        fut: asyncio.Future[Reply] = loop.create_future()
        self._entries[uid] = _Entry(fut, op)
        fut.add_done_callback(functools.partial(self._forget, uid))
        return uid, fut

    def _forget(self, uid: int, _fut: object) -> None:
        self._entries.pop(uid, None)

    def resolve(self, reply: Reply) -> bool:
        """Route a reply; returns False (and counts it) if it was dropped."""
        entry = self._entries.get(reply.uid)
        if entry is None or entry.future.done():
            self.dropped_unknown += 1
            return False
        if reply.op != int(entry.op) and reply.op != op_name(entry.op):
            self.dropped_mismatch += 1
            log.warning("dropping reply %d: op %r echoed for %s", reply.uid, reply.op, op_name(entry.op))
            return False
        entry.future.set_result(reply)
        return True

    def fail_all(self, exc_factory: Any) -> int:
        """Fail every in-flight future with ``exc_factory(op)``; returns how many."""
        entries = list(self._entries.values())
        for entry in entries:
            if not entry.future.done():
                entry.future.set_exception(exc_factory(entry.op))
        return len(entries)


class Connection:
    """A DEALER connection to an LMCache MP server.

    Create with :meth:`open` on the loop that will use it. All methods must be called on
    that loop.
    """

    def __init__(self, url: str, wire: WireGeneration = GEN_0_5_6) -> None:
        self.url = url
        #: The server generation's wire: which trailing argument frames requests get.
        self.wire = wire
        self.generation = 0  # increases each time the peer (re)connects after a loss
        self.connected = False
        self._table = PendingTable()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ever_connected = False

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Create the socket and start the reader and monitor tasks (does not wait for
        the TCP connection: zmq connects in the background and queues sends)."""
        self._loop = asyncio.get_running_loop()
        try:
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sock.connect(self.url)
        except zmq.ZMQError as exc:
            raise LMCacheConnectionError(f"cannot open a ZMQ connection to {self.url}: {exc}") from exc
        self._ctx, self._sock, self._monitor = ctx, sock, monitor
        self.connected = True  # optimistic until the monitor reports a disconnect
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"lmcache-reader {self.url}"),
            asyncio.create_task(self._monitor_loop(), name=f"lmcache-monitor {self.url}"),
        ]

    async def close(self) -> None:
        """Fail in-flight calls with ClientClosedError, stop the tasks, close the socket
        (linger 0). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._table.fail_all(lambda op: ClientClosedError(f"{op_name(op)}: the connection was closed"))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._sock is not None:
            with contextlib.suppress(Exception):
                self._sock.disable_monitor()
            self._sock.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # never blocks: every socket is closed first
        self._sock = self._monitor = self._ctx = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        return len(self._table)

    @property
    def dropped(self) -> tuple[int, int]:
        """(replies with an unknown uid, replies with a mismatched op) dropped so far."""
        return self._table.dropped_unknown, self._table.dropped_mismatch

    # ------------------------------------------------------------------ calls

    async def call(self, op: Op, args: Sequence[Any] = (), *, timeout: float | None) -> Reply:
        """Send one request and wait for its reply.

        Args:
            op: the operation.
            args: its arguments (Python values or :class:`~lmcache_async.wire.PreEncoded`).
            timeout: seconds until the call fails; ``None`` waits forever.

        Raises:
            LMCacheTimeoutError: no reply in time (also a ``TimeoutError``); the request
                may still be executed by the server.
            LMCacheConnectionError: the connection was lost while waiting.
            ClientClosedError: the connection is closed.

        Cancellation: the entry is removed; a later reply is dropped.
        """
        if self._closed or self._sock is None or self._loop is None:
            raise ClientClosedError(f"{op_name(op)}: the connection is closed")
        uid, fut = self._table.register(op, self._loop)
        start = time.monotonic()
        try:
            frames = encode_request(uid, op, args, self.wire)
            async with asyncio.timeout(timeout):
                await self._send(frames, op)
                return await fut
        except TimeoutError:
            raise LMCacheTimeoutError(op_name(op), time.monotonic() - start, uid) from None
        finally:
            if not fut.done():
                fut.cancel()

    async def _send(self, frames: list[Any], op: Op) -> None:
        assert self._sock is not None
        try:
            await self._sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:
            raise LMCacheConnectionError(f"{op_name(op)}: send failed: {exc}") from exc

    # ------------------------------------------------------------------ tasks

    async def _read_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if self._closed:
                    return
                log.error("ZMQ receive failed on %s: %s", self.url, exc)
                self._table.fail_all(
                    lambda op, exc=exc: LMCacheConnectionError(f"{op_name(op)}: receive failed: {exc}")
                )
                await asyncio.sleep(0.05)
                continue
            try:
                reply = decode_reply([f.buffer for f in frames])
            except ProtocolError as exc:
                log.warning("dropping malformed reply from %s: %s", self.url, exc)
                self._table.dropped_unknown += 1
                continue
            if reply.payload is not None and len(frames[2].buffer) < 65536:
                reply = Reply(reply.uid, reply.op, frames[2].bytes)
            self._table.resolve(reply)

    async def _monitor_loop(self) -> None:
        assert self._monitor is not None
        while True:
            msg = await self._monitor.recv_multipart()
            event = parse_monitor_message(msg)["event"]
            if event == zmq.EVENT_CONNECTED:
                if self._ever_connected:
                    self.generation += 1
                    log.info("reconnected to %s (generation %d)", self.url, self.generation)
                self._ever_connected = True
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                n = self._table.fail_all(
                    lambda op: LMCacheConnectionError(f"{op_name(op)}: connection to {self.url} lost")
                )
                log.warning("disconnected from %s; failed %d in-flight calls", self.url, n)
