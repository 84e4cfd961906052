"""Recovery after a server restart and fast failure while it is down, against the
real LMCache servers (0.5.6 and 0.5.7rc3) and a refused endpoint.

The restart tests print the time from "the server answers its healthcheck again" to the
first successful operation; they assert only outcomes (no timing asserts): the first
operation after the restart succeeds (no timeout on a stale registration), calls made
while the server is down fail with a connection error (never a timeout), and the SHM pool
of the new server is mapped (the data read back is bitwise the data stored).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

import lmcache_async as lmc
from harness.real_server import free_loopback_port
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, peek, random_kv, unique_model

pytestmark = pytest.mark.anyio

CS = 16


@pytest.mark.parametrize("generation", ["0.5.6", "0.5.7"])
async def test_first_operation_after_a_restart_succeeds(fresh_real_server: Any, generation: str) -> None:
    """Each transport on a server of its own, side by side: the servers start, stop and
    start again together (a start is ~3 s, mostly lmcache's imports; a stop ~1.5 s, idle),
    and no client operation runs while either is starting."""
    servers = fresh_real_server.together(
        *({"mode": mode, "generation": generation, "chunk_size": CS} for mode in ("shm", "pickle"))
    )
    down, up = asyncio.Barrier(len(servers)), asyncio.Barrier(len(servers))

    async def restart_and_reuse(srv: Any) -> None:
        mode = srv.mode
        async with lmc.AsyncClient(
            srv.url, srv.http_url, unique_model("restart"), geometry=SMALL_GEOMETRY, timeout=30
        ) as c:
            tokens = fresh_tokens(2 * CS)
            kv = random_kv(SMALL_GEOMETRY, len(tokens))
            assert await c.store(kv, tokens) is True
            first_id = peek(c).registered_id
            await asyncio.to_thread(srv.stop)
            # Down: a call fails with a connection error, not after its 30 s deadline.
            with pytest.raises(lmc.LMCacheConnectionError, match="not connected to|connection to .* lost"):
                await c.retrieve(tokens)
            await down.wait()
            await asyncio.to_thread(srv.start)
            await up.wait()  # both healthy again
            healthy = time.monotonic()
            # The restarted server lost everything; the first operation just works.
            assert await c.retrieve(tokens) is None
            first_success = time.monotonic()
            assert await c.store(kv, tokens) is True
            got = await c.retrieve(tokens)
            assert got is not None and torch.equal(got, kv)
            assert c.transfer == mode
            assert peek(c).registered_id == first_id  # registered again under the same id
            print(
                f"\n[recovery {generation}/{mode}] healthy again -> first success: "
                f"{first_success - healthy:.3f}s"
            )

    await asyncio.gather(*(restart_and_reuse(srv) for srv in servers))
    assert [srv.mode for srv in servers] == ["shm", "pickle"]


async def test_new_chunk_size_after_a_restart(fresh_real_server: Any) -> None:
    """The first operation after a restart with another chunk size is aligned
    with the new size (it used to time out, aligned with the stale one)."""
    srv = fresh_real_server("shm", chunk_size=CS)
    async with lmc.AsyncClient(
        srv.url, srv.http_url, unique_model("chunk"), geometry=SMALL_GEOMETRY, timeout=30
    ) as c:
        assert c.chunk_size == CS
        await asyncio.to_thread(srv.stop)
        srv._chunk_size = 2 * CS  # same ports and SHM name, another --chunk-size
        await asyncio.to_thread(srv.start)
        tokens = fresh_tokens(3 * CS)  # 1.5 new chunks: only the first 32 tokens are whole
        kv = random_kv(SMALL_GEOMETRY, len(tokens))
        assert await c.store(kv, tokens) is True
        assert c.chunk_size == 2 * CS
        got = await c.retrieve(tokens)
        assert got is not None and torch.equal(got, kv[:, :, : 2 * CS])
        assert await c.lookup(tokens) == 2 * CS


async def test_a_refused_zmq_endpoint_says_so(real_server_shm: Any) -> None:
    """The HTTP endpoint answers, nothing listens on the ZMQ port."""
    port = free_loopback_port()
    start = time.monotonic()
    with pytest.raises(
        lmc.LMCacheConnectionError, match=rf"cannot connect to tcp://127.0.0.1:{port}: connection refused"
    ):
        await lmc.connect(
            f"tcp://127.0.0.1:{port}",
            real_server_shm.http_url,
            unique_model(),
            geometry=SMALL_GEOMETRY,
            timeout=60,
        )
    print(f"\n[refused] reported after {time.monotonic() - start:.3f}s")


async def test_http_and_zmq_endpoints_of_different_servers_are_refused(
    real_server_shm: Any, real_server_pickle: Any, fresh_real_server: Any
) -> None:
    """The HTTP endpoint of one server and the ZMQ endpoint of another."""
    other_chunk = fresh_real_server("pickle", chunk_size=2 * CS)
    cases = [
        (
            real_server_shm.url,
            real_server_pickle.http_url,
            "the ZMQ endpoint serves the SHM pool 'lmcache_l1_pool_",
        ),
        (
            real_server_pickle.url,
            real_server_shm.http_url,
            "the ZMQ endpoint serves the SHM pool '' \\(0 bytes\\)",
        ),
        (
            other_chunk.url,
            real_server_pickle.http_url,
            "the ZMQ endpoint has chunk size 32, the HTTP endpoint's /config 16",
        ),
    ]
    for url, http_url, message in cases:
        with pytest.raises(lmc.ServerError, match="are not the same LMCache server: " + message):
            await lmc.connect(url, http_url, unique_model("mixed"), geometry=SMALL_GEOMETRY, timeout=30)
    # Correctly configured clients are unaffected.
    for srv in (real_server_shm, real_server_pickle, other_chunk):
        async with lmc.AsyncClient(
            srv.url, srv.http_url, unique_model(), geometry=SMALL_GEOMETRY, timeout=30
        ) as c:
            assert await c.lookup(fresh_tokens(2 * CS)) == 0
