"""Streaming requests on the client's ZMQ connection: one request, many replies, one item
per ``ack`` (``subscribe_kv_events``); the connection's reply table routes a stream's
replies to its :class:`ReplyStream` (docs/internals/design.md, section "KV events: a
stream on the connection").
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from typing import Any

import zmq

from lmcache_async._protocol.wire import Op, Reply, encode_request, op_name, packb
from lmcache_async._transport.connection import Connection
from lmcache_async._transport.pending import PendingTable
from lmcache_async.errors import LMCacheConnectionError, ProtocolError

__all__ = ["ReplyStream", "open_stream", "open_streams"]

log = logging.getLogger(__name__)


class ReplyStream:
    """The replies of one streaming request, in arrival order.

    :meth:`next` hands them out; :meth:`ack` grants the server credit for the next;
    :meth:`cancel` ends the stream on the server. It ends with the server's frameless
    reply (:meth:`next` returns ``None``) or with the connection's loss or close
    (:meth:`next` raises it). An item beyond the credit granted (the first item needs
    none) ends it with a :class:`~lmcache_async.errors.ProtocolError` and cancels it on
    the server: at most one item is ever buffered.
    """

    def __init__(self, conn: Connection, uid: int, op: Op) -> None:
        self._conn = conn
        self.uid = uid
        self.op = op
        self._uid_frame = packb(uid)
        self._items: collections.deque[Reply] = collections.deque()
        self._error: BaseException | None = None
        self.ended = False  # the frameless end arrived, or the stream failed
        self._waiter: asyncio.Future[None] | None = None
        self._credit = 1  # items the server may send now: the first, then one per ack
        self._cancel_sent = False
        self._end_heard: asyncio.Future[None] | None = None  # see farewell()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def accept(self, reply: Reply, table: PendingTable) -> bool:
        """A reply for this stream's uid (from the connection's reply table): kept, or
        dropped (and counted) when it echoes another operation."""
        if reply.op != self.op.wire:
            table.dropped_mismatch += 1
            log.warning("dropping stream item %d: op %r echoed for %s", reply.uid, reply.op, op_name(self.op))
            return False
        if reply.payload is None:  # the frameless end of the stream
            table.streams.pop(self.uid, None)
            self.ended = True
            if self._end_heard is not None and not self._end_heard.done():
                self._end_heard.set_result(None)
        elif self._end_heard is not None:  # closed: nothing more is wanted
            return False
        elif self._credit <= 0:
            self.fail(
                ProtocolError(
                    f"{op_name(self.op)}: the server sent a stream item without credit "
                    "(it must wait for an ack after each item); the stream is cancelled"
                )
            )
            self.cancel()
            return False
        else:
            self._credit -= 1
            self._items.append(reply)
        self._wake()
        return True

    def fail(self, exc: BaseException) -> None:
        """End the stream with ``exc`` (the connection was lost or closed)."""
        if not self.ended:
            self.ended = True
            self._error = exc
        self._wake()

    async def next(self) -> Reply | None:
        """The next item, or ``None`` once the server ended the stream.

        Waits without a deadline (an idle stream sends nothing): the caller bounds it.

        Raises:
            LMCacheConnectionError: the connection was lost (or its reader stopped).
            ClientClosedError: the connection was closed.

        Cancellation: nothing is consumed; the stream stays open.
        """
        while True:
            if self._items:
                return self._items.popleft()
            if self.ended:
                if self._error is not None:
                    raise self._error
                return None
            assert self._conn._loop is not None
            self._waiter = self._conn._loop.create_future()
            await self._waiter

    def ack(self) -> bool:
        """Grant the server credit for the next item; False when it could not be sent
        (the connection is down: the stream is then failed by the loss anyway), or the
        stream has ended."""
        if self.ended:
            return False
        self._credit += 1
        return self._control(b"ack")

    def cancel(self) -> bool:
        """Ask the server to end the stream (it answers with the frameless end, which is
        dropped: the stream is forgotten here at once); False when it could not be sent
        (disconnected or closed: the server's stream ends with the lost peer, or by its
        liveness reaper)."""
        if self._end_heard is None:  # (else closing: its end is still to be heard)
            self._conn._table.streams.pop(self.uid, None)
        if not self.ended:
            self.ended = True
            self._wake()
        if self._cancel_sent:
            return True
        self._cancel_sent = self._control(b"cancel")
        return self._cancel_sent

    def farewell(self, *, hear_end: bool) -> asyncio.Future[None] | None:
        """Send ``cancel`` as the connection closes (the stream failed here already; no
        event loop needed) if it is still connected. With ``hear_end``, returns a future
        done when the server's end of the stream arrives (the stream is routed its replies
        again for that); else, or when nothing was sent, ``None``."""
        conn = self._conn
        if self._cancel_sent or conn._sock is None or not conn.connected:
            return None
        try:
            conn._sock.send_multipart([self._uid_frame, b"", b"cancel"], zmq.NOBLOCK)
        except zmq.ZMQError:  # not ready (nothing queued) or gone
            return None
        self._cancel_sent = True
        if not hear_end or conn._loop is None or not conn._reader_alive:
            return None
        self._end_heard = conn._loop.create_future()
        conn._table.streams[self.uid] = self
        return self._end_heard

    def _control(self, action: bytes) -> bool:
        conn = self._conn
        if not conn.usable:
            return False
        try:
            return conn._send([self._uid_frame, b"", action], self.op)
        except LMCacheConnectionError:
            return False


async def open_stream(
    conn: Connection, op: Op, args: Sequence[Any] = (), *, timeout: float | None
) -> ReplyStream:
    """Send a streaming request on ``conn``; its items arrive on the returned stream.

    ``timeout`` bounds the send only (a peer not yet ready); the items have no deadline.

    Raises:
        LMCacheConnectionError: not connected, or not ready in time (nothing sent).
        ClientClosedError: the connection is closed.

    Cancellation (while waiting for the peer to be ready): the request is not sent and
    the stream is forgotten.
    """
    conn._check_sendable(op)
    start = time.monotonic()
    table = conn._table
    stream = ReplyStream(conn, table.next_uid(), op)
    table.streams[stream.uid] = stream
    sent = False
    try:
        frames = encode_request(stream.uid, op, args, conn.wire)
        if not conn._send(frames, op):
            await conn._send_when_ready(frames, op, start, timeout)
        sent = True
        return stream
    finally:
        if not sent:
            table.streams.pop(stream.uid, None)


def open_streams(conn: Connection) -> int:
    """Streaming requests open on ``conn``."""
    return len(conn._table.streams)
