"""A backlog the client made itself must not cost the server's sessions or locks (QA-4 N1).

Thousands of concurrent lookups on one client queue far more requests than
``max_in_flight`` lets out. Each lookup's cleanups (``free_lookup_locks``, ``end_session``)
used to wait for a place behind every lookup queued after it, ran out of their
``cleanup_grace`` before they were even sent, and were dropped: the real server kept the
sessions (and read locks) until its own TTLs. Taking the next free place before new
requests was not enough on a loaded machine (a slow server kept some waiting past a grace
of 1 s: 28 sessions and 2 read locks left). Cleanups now never wait for a place: each is
sent at once, so none is dropped unsent, whatever the backlog or the machine's load.

The test prints (``-s``) the number of calls, the time they took and the sessions left.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import lmcache_async as lmc
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, random_kv, unique_model

pytestmark = pytest.mark.anyio

CS = 16
#: Concurrent lookups on one client. On the code before the fix, 6,000 with the default
#: max_in_flight (1024) and cleanup_grace (10 s) left 5,810 sessions and 2 read locks on a
#: loaded 2-vCPU machine (39 s), none on a quiet one (7 s): each lookup's cleanups waited
#: behind the lookups queued after it, for longer than the cleanup grace when loaded.
CALLS = 6_000
MAX_IN_FLIGHT = 64
CLEANUP_GRACE = 1.0


def _leftovers(srv: Any, wait: float = 0.0) -> tuple[int, int, int]:
    """(sessions, read locks, write reservations) the server holds once none is left, or
    after ``wait`` seconds: a cleanup whose reply came after its grace was still sent, and
    a loaded server may run it a moment after the client stopped waiting."""
    end = time.monotonic() + wait
    while True:
        st = srv.status()
        l1 = st["storage_manager"]["l1_manager"]
        left = st["active_sessions"], l1["read_locked_count"], l1["write_locked_count"]
        if left == (0, 0, 0) or time.monotonic() >= end:
            return left
        time.sleep(0.1)


@pytest.mark.parametrize("generation", ["0.5.6", "0.5.7"])
async def test_thousands_of_concurrent_lookups_leave_no_session_or_lock(
    fresh_real_server: Any, generation: str
) -> None:
    srv = fresh_real_server(mode="shm", generation=generation, chunk_size=CS)
    tokens = fresh_tokens(2 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    # A small max_in_flight and cleanup_grace make the test independent of the machine's
    # speed: before the fix a cleanup waited behind thousands of queued requests (seconds
    # on any machine), now behind at most MAX_IN_FLIGHT (milliseconds).
    async with lmc.AsyncClient(
        srv.url,
        srv.http_url,
        unique_model("backlog"),
        geometry=SMALL_GEOMETRY,
        max_in_flight=MAX_IN_FLIGHT,
        cleanup_grace=CLEANUP_GRACE,
        timeout=120,
    ) as c:
        assert await c.store(kv, tokens) is True
        assert await c.drain(10)  # the store's end_session is answered in the background
        assert _leftovers(srv) == (0, 0, 0)
        start = time.monotonic()
        hits = await asyncio.gather(*(c.lookup(tokens) for _ in range(CALLS)), return_exceptions=True)
        took = time.monotonic() - start
        assert await c.drain(30)
        left = _leftovers(srv, 10.0)
        print(
            f"\n{CALLS} concurrent lookups in {took:.1f} s; sessions, read locks, reservations left: {left}"
        )
        assert hits == [2 * CS] * CALLS
        assert left == (0, 0, 0)
        # The server is not behind either: the next store and retrieve work at once.
        more = fresh_tokens(2 * CS)
        more_kv = random_kv(SMALL_GEOMETRY, len(more))
        assert await c.store(more_kv, more, timeout=10) is True
        got = await c.retrieve(more, timeout=10)
        assert got is not None and got.equal(more_kv)
        assert await c.drain(10)
        assert _leftovers(srv) == (0, 0, 0)
