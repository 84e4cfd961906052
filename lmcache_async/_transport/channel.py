"""The channel of the client's ZMQ connection (:class:`ConnectionChannel`), beside
:class:`~lmcache_async._transport.connection.Connection`: what the operations
(:mod:`lmcache_async._engine.ops`) send their requests through, retired when the server behind the
connection is found replaced."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from lmcache_async._protocol.wire import Op, op_name
from lmcache_async._transport.connection import Connection
from lmcache_async._transport.pending import OnLate
from lmcache_async.errors import ServerReplacedError

__all__ = ["ConnectionChannel", "replaced_message"]


class ConnectionChannel:
    """The channel (:class:`~lmcache_async._engine.ops.PostingChannel`) of a ZMQ connection, for
    the operations of one server: when that server is found replaced, the channel is
    retired (a new one serves the new server) and its operations' requests fail at once
    with :class:`~lmcache_async.errors.ServerReplacedError`, cleanups included (nothing of
    theirs exists there)."""

    __slots__ = ("_conn", "retired")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.retired = False

    @property
    def usable(self) -> bool:
        return not self.retired and self._conn.usable

    async def call(self, opcode: Op, args: Sequence[Any], timeout: float | None) -> Any:
        if self.retired:
            raise ServerReplacedError(replaced_message(opcode, self._conn.url))
        reply = await self._conn.call(opcode, args, timeout=timeout)
        return reply.value()

    async def call_urgent(self, opcode: Op, args: Sequence[Any], timeout: float | None) -> Any:
        """:meth:`call` for a cleanup: sent at once, even with ``max_in_flight`` requests
        in flight (see :meth:`~lmcache_async._transport.connection.Connection.call`)."""
        if self.retired:
            raise ServerReplacedError(replaced_message(opcode, self._conn.url))
        reply = await self._conn.call(opcode, args, timeout=timeout, urgent=True)
        return reply.value()

    async def call_noting_late(
        self, opcode: Op, args: Sequence[Any], timeout: float | None, on_late: OnLate, *, urgent: bool = False
    ) -> Any:
        """:meth:`call` (``urgent``: :meth:`call_urgent`) whose late reply, when it stops
        waiting after sending, is watched for: ``on_late`` gets its future (see
        :meth:`~lmcache_async._transport.connection.Connection.call`)."""
        if self.retired:
            raise ServerReplacedError(replaced_message(opcode, self._conn.url))
        reply = await self._conn.call(opcode, args, timeout=timeout, urgent=urgent, on_late=on_late)
        return reply.value()

    def post_noting_late(
        self, opcode: Op, args: Sequence[Any], timeout: float | None, on_late: OnLate
    ) -> asyncio.Future[Any] | None:
        """:meth:`post` whose late reply is watched for, as :meth:`call_noting_late`'s."""
        if self.retired:
            return None
        return self._conn.send_nowait(opcode, args, timeout=timeout, on_late=on_late)

    def post(self, opcode: Op, args: Sequence[Any], timeout: float | None) -> asyncio.Future[Any] | None:
        """Send a request now and return the future of its reply (a
        :class:`~lmcache_async._protocol.wire.Reply`) without waiting; ``None`` when it cannot be
        sent at once (see :meth:`~lmcache_async._transport.connection.Connection.send_nowait`)."""
        if self.retired:
            return None
        return self._conn.send_nowait(opcode, args, timeout=timeout)


def replaced_message(opcode: Op, url: str) -> str:
    return (
        f"{op_name(opcode)}: the LMCache server behind {url} was replaced (a new server instance, "
        "with no visible disconnect); the client registers with the new one"
    )
