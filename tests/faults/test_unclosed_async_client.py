"""An AsyncClient that is never closed, or closed from another event loop, releases its
sockets and HTTP session (and, where its loop still runs, its registration on
the server), with a warning that names it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

import lmcache_async as lmc
from lmcache_async.testing import EmbeddedServer

GEOMETRY = lmc.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=16)
TOKENS = list(range(16))


def _open_sockets() -> int:
    """ZMQ sockets open in this process (a client has two: its DEALER and its monitor's;
    the context is the process's, never terminated)."""
    gc.collect()
    return sum(issubclass(type(o), zmq.Socket) and not o.closed for o in gc.get_objects())


def _registered(srv: Any) -> list[int]:
    ids: list[int] = srv.status()["registered_non_cuda_instance_ids"]
    return ids


def _never_closed(url: str) -> str:
    return (
        f"<lmcache_async.AsyncClient 'm' at {url}> was never closed; closing it now "
        "(use 'async with AsyncClient(...)' or 'await client.aclose()')"
    )


@pytest.fixture
def server() -> Any:
    with EmbeddedServer().start_in_thread() as srv:
        yield srv


async def _drop_open_clients(srv: Any, n: int) -> list[int]:
    ids = []
    for _ in range(n):
        client = await lmc.connect(srv.url, srv.http_url, "m", geometry=GEOMETRY, timeout=10)
        assert await client.lookup(TOKENS) == 0
        ids.append(client.instance_id)
    del client
    return ids


def test_clients_dropped_unclosed_on_a_running_loop_are_closed_and_unregistered(server: Any) -> None:
    sockets = _open_sockets()

    async def main() -> None:
        tasks = len(asyncio.all_tasks())
        with pytest.warns(ResourceWarning) as caught:  # noqa: PT031 - the drops and the collection
            ids = await _drop_open_clients(server, 5)  # each dropped when the next is made
            gc.collect()
        assert [str(w.message) for w in caught] == [_never_closed(server.url)] * 5
        assert len(set(ids)) == 5
        async with asyncio.timeout(10):
            while _registered(server) or len(asyncio.all_tasks()) > tasks:
                await asyncio.sleep(0.01)

    asyncio.run(main())
    assert _open_sockets() == sockets


def test_a_client_collected_after_its_loop_closed_releases_its_socket_with_a_warning(server: Any) -> None:
    sockets = _open_sockets()
    holder: list[lmc.AsyncClient] = []

    async def main() -> None:
        holder.append(await lmc.connect(server.url, server.http_url, "m", geometry=GEOMETRY, timeout=10))

    asyncio.run(main())
    assert _open_sockets() == sockets + 2
    with pytest.warns(ResourceWarning) as caught:  # noqa: PT031 - the drop and the collection
        holder.clear()
        gc.collect()
    # One warning: the HTTP keep-alive socket of the closed loop was closed, not left to
    # its transport's collection (which warns "unclosed transport").
    assert [str(w.message) for w in caught] == [_never_closed(server.url)]
    assert _open_sockets() == sockets


def test_a_client_left_open_by_an_ended_asyncio_run_can_be_closed_from_another(server: Any) -> None:
    sockets = _open_sockets()

    async def open_it() -> lmc.AsyncClient:
        return await lmc.connect(server.url, server.http_url, "m", geometry=GEOMETRY, timeout=10)

    client = asyncio.run(open_it())
    assert _registered(server) == [client.instance_id]
    message = (
        f"{client!r} was opened on an event loop that is closed: closing it here releases its socket "
        "and HTTP session, but cannot unregister it from the server, which drops the registration "
        "when it expires"
    )
    with pytest.warns(RuntimeWarning, match=f"^{re.escape(message)}$"):
        asyncio.run(client.aclose())
    assert client.closed
    assert _open_sockets() == sockets
    asyncio.run(client.aclose())  # idempotent, silent
    with pytest.raises(lmc.ClientClosedError):
        asyncio.run(client.lookup(TOKENS))
    # The registration is the server's to expire; a client of the same model works at once.
    assert asyncio.run(_lookup_with_a_new_client(server)) == 0


async def _lookup_with_a_new_client(srv: Any) -> int:
    async with lmc.AsyncClient(srv.url, srv.http_url, "m", geometry=GEOMETRY, timeout=10) as client:
        return await client.lookup(TOKENS)


def test_closing_from_another_loop_while_the_owner_loop_runs_closes_it_there(server: Any) -> None:
    sockets = _open_sockets()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        client = asyncio.run_coroutine_threadsafe(
            lmc.connect(server.url, server.http_url, "m", geometry=GEOMETRY, timeout=10), loop
        ).result(30)
        assert _registered(server) == [client.instance_id]
        with _no_warnings():
            asyncio.run(client.aclose())  # on this thread's own loop
        assert client.closed
        assert _registered(server) == []  # unregistered: the close ran on the owner loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert _open_sockets() == sockets


@contextlib.contextmanager
def _no_warnings() -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert [str(w.message) for w in caught] == []


def test_clients_dropped_unclosed_leave_no_registration_on_the_real_server(real_server_shm: Any) -> None:
    srv = real_server_shm
    before = set(_registered(srv))

    async def main() -> list[int]:
        with pytest.warns(ResourceWarning) as caught:  # noqa: PT031 - the drops and the collection
            ids = await _drop_open_clients(srv, 3)
            gc.collect()
        assert [str(w.message) for w in caught] == [_never_closed(srv.url)] * 3
        async with asyncio.timeout(20):
            while set(_registered(srv)) & set(ids):
                await asyncio.sleep(0.02)
        return ids

    asyncio.run(main())
    assert set(_registered(srv)) <= before
