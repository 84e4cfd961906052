"""``aclose()`` while ``open()`` runs (issue 40 item 5, QA-5 M5): both calls end promptly,
``open()`` either finished first ("ok") or raises ``ClientClosedError``, and nothing is
left: no task, no thread, no descriptor, no registration on the server, no future whose
exception nobody retrieved. A ``Fleet`` with one server down fails naming that server and
closes the clients still opening the same way (QA-5 m3).

On the embedded server and the real 0.5.6 server (SHM)."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import re
import socket
import threading
from collections import Counter
from typing import Any

import pytest

import lmcache_async as lmc
from lmcache_async.fleet import Fleet
from tests.helpers import SMALL_GEOMETRY, unique_model

pytestmark = pytest.mark.anyio

ITERATIONS = 40


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _other_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


def _dead_port() -> int:
    """A port nothing listens on (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _registered(srv: Any) -> set[int]:
    return set(srv.status()["registered_non_cuda_instance_ids"])


async def _settle() -> None:
    """Let callbacks scheduled by the closes run, then collect: an unretrieved future's
    exception is reported to the loop's handler when it is collected."""
    for _ in range(3):
        await asyncio.sleep(0.01)
    gc.collect()
    await asyncio.sleep(0)


async def _baseline(srv: Any, model: str) -> tuple[list[dict[str, Any]], int, int, int]:
    """Report the loop's unhandled exceptions into the list returned, warm up (the loop's
    resolver thread, the ZMQ context's threads) with one client, then the baseline of
    descriptors, threads and tasks."""
    reported: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    async with lmc.AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=10):
        pass
    await _settle()
    return reported, _fds(), threading.active_count(), len(_other_tasks())


async def _close_during_open(srv: Any) -> None:
    model = unique_model("close-during-open")
    reported, fds, threads, tasks = await _baseline(srv, model)
    rng = random.Random(40)
    outcomes: Counter[str] = Counter()
    ids: set[int] = set()
    for i in range(ITERATIONS):
        client = lmc.AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=10)
        opening = asyncio.create_task(client.open())
        if i == ITERATIONS - 1:
            await asyncio.wait({opening}, timeout=10)  # once, the open finishes first
        else:
            await asyncio.sleep(rng.uniform(0, 0.008))
        ids.add(client._session.instance_id)
        async with asyncio.timeout(5):  # never hangs
            await client.aclose()
        assert opening.done(), "open() still runs after aclose() returned"
        exc = None if opening.cancelled() else opening.exception()
        if opening.cancelled():
            outcomes["CancelledError"] += 1
        elif exc is None:
            outcomes["ok"] += 1
        else:
            outcomes[type(exc).__name__] += 1
            if isinstance(exc, lmc.ClientClosedError):
                assert str(exc) in (
                    "the client was closed while it was opening",
                    "open() on a client that is closed",
                ), str(exc)
        assert client.closed
    assert set(outcomes) == {"ok", "ClientClosedError"}, outcomes
    await _settle()
    assert len(_other_tasks()) == tasks, [t.get_name() for t in _other_tasks()]
    assert threading.active_count() == threads
    assert _fds() == fds
    assert ids & _registered(srv) == set()
    assert reported == []


async def test_aclose_during_open_on_the_embedded_server(embedded_server_shm: Any) -> None:
    await _close_during_open(embedded_server_shm)


async def test_aclose_during_open_on_the_real_server(real_server_shm: Any) -> None:
    await _close_during_open(real_server_shm)


async def test_a_fleet_with_a_server_down_names_it_and_leaves_nothing(real_server_shm: Any) -> None:
    srv = real_server_shm
    dead = (f"tcp://127.0.0.1:{_dead_port()}", f"http://127.0.0.1:{_dead_port()}")
    model = unique_model("fleet-down")
    reported, fds, threads, tasks = await _baseline(srv, model)
    ids: set[int] = set()
    message = re.escape(
        f"fleet server 1 ({dead[0]}, {dead[1]}) cannot be opened, and a Fleet opens only with every "
        "server up: "
    )
    for _ in range(10):
        fleet = Fleet([(srv.url, srv.http_url), dead], model, geometry=SMALL_GEOMETRY, timeout=10)
        ids.add(fleet.clients[0]._session.instance_id)
        with pytest.raises(lmc.LMCacheConnectionError, match=f"^{message}") as info:
            async with asyncio.timeout(10):
                await fleet.open()
        assert type(info.value) is lmc.LMCacheConnectionError
        assert isinstance(info.value.__cause__, lmc.LMCacheConnectionError)
        assert [c.closed for c in fleet.clients] == [True, True]
    await _settle()
    assert len(_other_tasks()) == tasks, [t.get_name() for t in _other_tasks()]
    assert threading.active_count() == threads
    assert _fds() == fds
    assert ids & _registered(srv) == set()
    assert reported == []
