"""Detect a server replaced behind a connection that stayed up (a proxy kept the TCP
connection while the server restarted): the server's ``/config`` ``mp.instance_id`` is
compared with the registered one, never per operation, only after :data:`QUIET_S` seconds
without a reply and every :data:`POLL_S` seconds while requests wait in such silence
(docs/internals/design.md, section "A server replaced behind the connection").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final, Protocol

from lmcache_async._base.deadline import async_timeout
from lmcache_async.errors import LMCacheError, LMCacheTimeoutError

__all__ = ["CHECK_TIMEOUT_S", "POLL_S", "QUIET_S", "ServerWatch"]

log = logging.getLogger(__name__)

_monotonic = time.monotonic

#: Seconds without a reply after which the server's identity is checked before an
#: operation, and while requests wait.
QUIET_S: Final = 1.0
#: How often the background watch looks for requests waiting in such silence.
POLL_S: Final = 0.5
#: Longest wait for ``/config`` in one check.
CHECK_TIMEOUT_S: Final = 2.0


class _Conn(Protocol):
    @property
    def last_reply(self) -> float: ...

    @property
    def in_flight(self) -> int: ...


class ServerWatch:
    """Compares the server's identity with the one registered with, after silence.

    Args:
        conn: the connection (its :attr:`last_reply` and :attr:`in_flight`).
        fetch_identity: fetches the server's identity now (``/config`` ``mp.instance_id``),
            under a timeout; raises :class:`~lmcache_async.errors.LMCacheError` when it
            cannot (the server is down, HTTP error).
        known_identity: the identity of the server registered with.
        on_replaced: called (synchronously, at once) with the new identity when it differs.
    """

    def __init__(
        self,
        conn: _Conn,
        fetch_identity: Callable[[float], Awaitable[object]],
        known_identity: Callable[[], object],
        on_replaced: Callable[[object], None],
        *,
        quiet: float = QUIET_S,
        poll: float = POLL_S,
        check_timeout: float = CHECK_TIMEOUT_S,
    ) -> None:
        self._conn = conn
        self._fetch = fetch_identity
        self._known = known_identity
        self._on_replaced = on_replaced
        self.quiet = quiet
        self.poll = poll
        self.check_timeout = check_timeout
        self._verified = time.monotonic()  # when the identity was last seen unchanged
        #: Checks made and replacements seen (for tests and diagnostics).
        self.checks = 0
        self.replacements = 0

    def due(self) -> bool:
        """Whether the connection was silent long enough that the identity is checked
        (no reply, and no check, for :attr:`quiet` seconds). Costs one clock read."""
        now = _monotonic()
        return now - self._conn.last_reply > self.quiet and now - self._verified > self.quiet

    async def check(self, timeout: float | None = None) -> bool:
        """Fetch the identity and compare; True when the server was replaced (and
        ``on_replaced`` was called). Concurrent checks share the fetch (the client's
        metadata fetches are shared) and only the first one seeing a new identity
        reports it (``on_replaced`` makes it the known one).

        Raises:
            LMCacheError: the identity could not be fetched in time.
        """
        limit = self.check_timeout if timeout is None else min(timeout, self.check_timeout)
        self.checks += 1
        try:
            async with async_timeout(limit):
                identity = await self._fetch(limit)
        except TimeoutError:
            raise LMCacheTimeoutError("server identity check (GET /config)", limit) from None
        if identity == self._known():
            self._verified = time.monotonic()
            return False
        self.replacements += 1
        self._verified = time.monotonic()
        self._on_replaced(identity)
        return True

    async def check_quietly(self, timeout: float | None) -> bool:
        """:meth:`check`, with a failure to fetch logged and taken as "not replaced"
        (the operation goes ahead; the background watch keeps looking while it waits)."""
        if timeout is not None and timeout <= 0:
            return False
        try:
            return await self.check(timeout)
        except LMCacheError as exc:
            log.debug("server identity check failed: %s", exc)
            return False

    async def run(self) -> None:
        """The background watch: every :attr:`poll` seconds, while requests are in flight
        in silence, check the identity. Runs until cancelled."""
        while True:
            await asyncio.sleep(self.poll)
            if self._conn.in_flight and self.due():
                with contextlib.suppress(LMCacheError):
                    await self.check()
