"""A process whose first clients fail inside ``Connection.open()`` after their ZMQ sockets
exist (``connect`` refused by the socket), then collects its garbage and opens working
clients (tests/faults/test_failed_open.py runs it in a subprocess under a deadline: sockets
left open by a failed open once hung the thread that collected their context).

    python tests/faults/failed_open_script.py

Prints one ``name=value`` line per check and ``OK`` at the end.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import time
from typing import Any

import torch
import zmq

import lmcache_async as lmc
from lmcache_async.testing import EmbeddedServer

GEOMETRY = lmc.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=16)


def _refuse(self: zmq.Socket[Any], addr: str) -> None:
    raise zmq.ZMQError(errno.EINVAL)


def _sockets() -> int:
    return sum(issubclass(type(o), zmq.Socket) and not o.closed for o in gc.get_objects())


async def _async_client(url: str, http_url: str, ticks: list[int]) -> None:
    async def tick() -> None:
        while True:
            ticks[0] += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    try:
        gc.collect()  # on this loop's thread, as the collector may run it anywhere
        async with lmc.AsyncClient(url, http_url, "m", geometry=GEOMETRY, timeout=10) as client:
            assert await client.lookup(list(range(16))) == 0
        await asyncio.sleep(0.2)
    finally:
        ticker.cancel()


async def _failing_async(url: str, http_url: str) -> str:
    try:
        await lmc.AsyncClient(url, http_url, "m", geometry=GEOMETRY, timeout=10).open()
    except lmc.LMCacheConnectionError as exc:
        return str(exc)
    raise AssertionError("open() succeeded with connect() refused")


def main() -> None:
    with EmbeddedServer().start_in_thread() as srv:
        before = _sockets()
        real_connect = zmq.Socket.connect
        zmq.Socket.connect = _refuse  # type: ignore[method-assign,assignment]
        try:
            for _ in range(3):
                try:
                    lmc.Client(srv.url, srv.http_url, "m", geometry=GEOMETRY, timeout=10)
                except lmc.LMCacheConnectionError as exc:
                    print(f"sync_error={exc}", flush=True)
                print(f"async_error={asyncio.run(_failing_async(srv.url, srv.http_url))}", flush=True)
        finally:
            zmq.Socket.connect = real_connect  # type: ignore[method-assign]
        start = time.monotonic()
        gc.collect()
        print(f"sockets_left={_sockets() - before}", flush=True)
        print(f"collect_s={time.monotonic() - start:.3f}", flush=True)
        ticks = [0]
        asyncio.run(_async_client(srv.url, srv.http_url, ticks))
        print(f"ticks={ticks[0]}", flush=True)
        start = time.monotonic()
        with lmc.Client(srv.url, srv.http_url, "m", geometry=GEOMETRY, timeout=10) as client:
            print(f"sync_lookup={client.lookup(list(range(16)))}", flush=True)
        print(f"sync_open_s={time.monotonic() - start:.3f}", flush=True)
    print("OK", flush=True)


if __name__ == "__main__":
    main()
