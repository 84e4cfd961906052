"""Sans-IO: the table of a connection's in-flight requests, keyed by uid.

Every request registers its future here **before** it is sent; a reply is routed to the
future of its uid (:meth:`PendingTable.resolve`), a reply with no entry is dropped and
counted, and a caller that stops waiting may watch for its late reply
(:meth:`PendingTable.linger`). No sockets, no event loop of its own: the transport
(:mod:`lmcache_async._transport.connection`) drives it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmcache_async._protocol.wire import Op, Reply, op_name

__all__ = ["OnLate", "PendingTable"]

#: Given, when a call stops waiting for a request it sent, the future of its late reply
#: (see :meth:`PendingTable.linger`).
OnLate = Callable[["asyncio.Future[None]"], None]

# The transport's logger: the dropped-reply warning has always come from it.
log = logging.getLogger("lmcache_async._transport.connection")


@dataclass
class _Entry:
    future: asyncio.Future[Reply]
    op: Op


class PendingTable:
    """In-flight requests keyed by uid (pure bookkeeping; no I/O).

    Attributes:
        dropped_unknown: replies whose uid had no entry (late, duplicate, foreign).
        dropped_mismatch: replies whose echoed op differed from the request's.
        late_heard: late replies (counted in ``dropped_unknown`` too) whose arrival was
            told to a waiter (:meth:`linger`).
    """

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._late: dict[int, tuple[Op, asyncio.Future[None]]] = {}  # uid: op, arrival
        self.streams: dict[int, Any] = {}  # uid: its _reply_stream.ReplyStream (many replies)
        self._uids = itertools.count()
        self.dropped_unknown = 0
        self.dropped_mismatch = 0
        self.late_heard = 0

    def __len__(self) -> int:
        return len(self._entries)

    def register(self, op: Op, loop: asyncio.AbstractEventLoop) -> tuple[int, asyncio.Future[Reply]]:
        """Allocate a fresh uid and a future. The entry leaves the table when a reply is
        routed to it or :meth:`fail_all` fails it; a caller that stops waiting otherwise
        (timeout, cancellation) calls :meth:`discard`."""
        uid = next(self._uids)
        fut: asyncio.Future[Reply] = loop.create_future()
        self._entries[uid] = _Entry(fut, op)
        return uid, fut

    def discard(self, uid: int) -> None:
        """Forget ``uid`` (its caller stopped waiting); a later reply is dropped."""
        self._entries.pop(uid, None)

    def linger(self, uid: int, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None] | None:
        """Forget ``uid`` as :meth:`discard` does, but watch for its late reply: the
        returned future is done when it arrives (the reply itself is dropped and counted),
        fails as the in-flight calls do in :meth:`fail_all`, and is forgotten once its
        waiter cancels it. ``None`` when the reply already came, or the call already failed
        (its entry is gone)."""
        entry = self._entries.pop(uid, None)
        if entry is None:
            return None
        late: asyncio.Future[None] = loop.create_future()
        self._late[uid] = (entry.op, late)
        late.add_done_callback(functools.partial(self._late_done, uid))
        return late

    def _late_done(self, uid: int, late: asyncio.Future[None]) -> None:
        self._late.pop(uid, None)
        if not late.cancelled():
            late.exception()  # retrieved: its waiter may have left

    @property
    def lingering(self) -> int:
        """Late replies still watched for (:meth:`linger`)."""
        return len(self._late)

    def resolve(self, reply: Reply) -> bool:
        """Route a reply; returns False (and counts it) if it was dropped."""
        if self.streams and (stream := self.streams.get(reply.uid)) is not None:
            return bool(stream.accept(reply, self))
        entry = self._entries.get(reply.uid)
        if entry is None:
            self.dropped_unknown += 1
            if self._late:
                self._late_arrived(reply)
            return False
        if entry.future.done():  # its caller stopped waiting a moment ago: not late
            del self._entries[reply.uid]
            self.dropped_unknown += 1
            return False
        if reply.op != int(entry.op) and reply.op != op_name(entry.op):
            self.dropped_mismatch += 1
            log.warning("dropping reply %d: op %r echoed for %s", reply.uid, reply.op, op_name(entry.op))
            return False
        del self._entries[reply.uid]
        entry.future.set_result(reply)
        return True

    def _late_arrived(self, reply: Reply) -> None:
        watched = self._late.get(reply.uid)
        if watched is None:
            return
        op, late = watched
        if reply.op != int(op) and reply.op != op_name(op):
            return  # not its reply
        del self._late[reply.uid]
        if not late.done():
            self.late_heard += 1
            late.set_result(None)

    def fail_all(self, exc_factory: Any) -> int:
        """Fail every in-flight future (and open stream) with ``exc_factory(op)`` and
        empty the table; returns how many. The late replies watched for (:meth:`linger`)
        fail too (not counted): none can come any more."""
        entries, streams = list(self._entries.values()), list(self.streams.values())
        lates = list(self._late.values())
        self._entries.clear()
        self.streams.clear()
        self._late.clear()
        for op, late in lates:
            if not late.done():
                late.set_exception(exc_factory(op))
        for entry in entries:
            if not entry.future.done():
                entry.future.set_exception(exc_factory(entry.op))
        for stream in streams:
            stream.fail(exc_factory(stream.op))
        return len(entries) + len(streams)

    def next_uid(self) -> int:
        return next(self._uids)
