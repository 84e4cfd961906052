"""ServerWatch (lmcache_async/_transport/replacement.py) on its own: when it checks the server's
identity, what a check reports, and the background watch (no server needed)."""

from __future__ import annotations

import asyncio
import time

import pytest

from lmcache_async._transport.replacement import ServerWatch
from lmcache_async.errors import LMCacheConnectionError, LMCacheTimeoutError

pytestmark = pytest.mark.anyio


class _Conn:
    def __init__(self) -> None:
        self.last_reply = time.monotonic()
        self.in_flight = 0


class _Server:
    """The identity source: a value, an error, or a fetch that never ends."""

    def __init__(self) -> None:
        self.identity: object = "a"
        self.error: Exception | None = None
        self.hang = False
        self.fetches = 0

    async def fetch(self, timeout: float) -> object:
        self.fetches += 1
        if self.hang:
            await asyncio.sleep(3600)
        if self.error is not None:
            raise self.error
        return self.identity


def _setup(**kw: float) -> tuple[_Conn, _Server, ServerWatch, list[object]]:
    """A connection, a server of identity "a", a watch that knows "a", and the list of
    new identities the watch reported."""
    conn, server = _Conn(), _Server()
    known: list[object] = ["a"]
    seen: list[object] = []

    def replaced(identity: object) -> None:
        seen.append(identity)
        known[0] = identity

    return conn, server, ServerWatch(conn, server.fetch, lambda: known[0], replaced, **kw), seen


async def test_due_only_after_silence_and_not_again_right_after_a_check() -> None:
    conn, server, w, seen = _setup(quiet=0.2)
    assert not w.due()
    await asyncio.sleep(0.25)
    assert w.due()
    conn.last_reply = time.monotonic()  # a reply: not silent any more
    assert not w.due()
    await asyncio.sleep(0.25)
    assert w.due()
    assert await w.check() is False  # same identity
    assert not w.due()  # checked just now
    assert (server.fetches, w.checks, w.replacements, seen) == (1, 1, 0, [])


async def test_a_new_identity_is_reported_once_even_to_concurrent_checks() -> None:
    _conn, server, w, seen = _setup()
    server.identity = "b"
    results = await asyncio.gather(w.check(), w.check(), w.check())
    assert sorted(results) == [False, False, True]
    assert seen == ["b"]
    assert (w.checks, w.replacements) == (3, 1)
    assert await w.check() is False


async def test_a_failed_or_slow_fetch_raises_and_check_quietly_says_not_replaced() -> None:
    _conn, server, w, seen = _setup(check_timeout=0.1)
    server.error = LMCacheConnectionError("GET /config failed: refused")
    with pytest.raises(LMCacheConnectionError, match="refused"):
        await w.check()
    assert await w.check_quietly(1.0) is False
    server.error = None
    server.hang = True
    start = time.monotonic()
    with pytest.raises(LMCacheTimeoutError, match="server identity check"):
        await w.check(5.0)  # bounded by check_timeout, not the 5 s given
    assert time.monotonic() - start < 1.0
    assert await w.check_quietly(0.05) is False
    assert await w.check_quietly(0.0) is False  # no time left: no fetch at all
    assert (server.fetches, seen) == (4, [])


async def test_the_background_watch_checks_only_while_requests_wait_in_silence() -> None:
    conn, server, w, seen = _setup(quiet=0.1, poll=0.02)
    task = asyncio.create_task(w.run())
    try:
        await asyncio.sleep(0.3)
        assert server.fetches == 0  # silent, but nothing in flight
        conn.in_flight = 1
        server.identity = "b"
        end = time.monotonic() + 5
        while not seen:
            assert time.monotonic() < end, "the watch did not see the new identity"
            await asyncio.sleep(0.01)
        assert seen == ["b"]
        server.error = LMCacheConnectionError("down")  # errors do not stop the watch
        fetches = server.fetches
        await asyncio.sleep(0.4)
        assert server.fetches > fetches
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
