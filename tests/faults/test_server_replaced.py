"""A server replaced behind a connection that stays up: the client talks
through forwarders (tests/faults/forwarders.py) that keep its ZMQ and HTTP connections
up while the real server behind them is killed and restarted on the same ports, so the
client never sees a disconnect. The first store and retrieve after the restart must
succeed (the client sees the new server's identity and registers again first); an
operation in flight during the swap succeeds (re-run once on the new server) or fails
with :class:`~lmcache_async.ServerReplacedError`, within its deadline, and never leaves a
reservation behind.

The restart tests print the time from "the server answers its healthcheck again" to the
first successful store + retrieve (``-s`` shows it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import lmcache_async as lmc
from tests.faults.forwarders import HttpForwarder, ZmqForwarder
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, peek, random_kv, unique_model

pytestmark = pytest.mark.anyio

CS = 16
#: Deadline of each operation: before the fix the first operation after the restart
#: waited all of it on the stale registration and failed.
OP_TIMEOUT = 5.0


@pytest.fixture
def forwarded() -> Iterator[Any]:
    """A factory: forwarders in front of a server, closed at teardown."""
    made: list[Any] = []

    def make(srv: Any) -> tuple[ZmqForwarder, HttpForwarder]:
        zf = ZmqForwarder(srv.url).start()
        made.append(zf)
        hf = HttpForwarder(srv.http_url).start()
        made.append(hf)
        return zf, hf

    yield make
    for f in reversed(made):
        f.close()


def _client(zf: ZmqForwarder, hf: HttpForwarder, timeout: float) -> lmc.AsyncClient:
    # ping_interval 30: the keep-alive's periodic /config check never runs within the
    # test, so what is tested is the detection before and during operations.
    return lmc.AsyncClient(
        zf.url, hf.url, unique_model("replaced"), geometry=SMALL_GEOMETRY, timeout=timeout, ping_interval=30
    )


def _kill(srv: Any) -> None:
    """SIGKILL the server (its pid only), then let stop() reap it and unlink its pool."""
    pid = srv.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    srv.stop()


async def _reads_back_and_holds_no_lock(
    c: lmc.AsyncClient, srv: Any, kv: torch.Tensor, tokens: list[int]
) -> None:
    """``tokens`` read back bitwise; once the client's cleanups are in, the server holds
    no write reservation and no read lock."""
    got = await c.retrieve(tokens)
    assert got is not None and torch.equal(got, kv)
    assert await c.drain(10)
    l1 = srv.status()["storage_manager"]["l1_manager"]
    assert (l1["write_locked_count"], l1["read_locked_count"]) == (0, 0)


@pytest.mark.parametrize("generation", ["0.5.6", "0.5.7"])
async def test_first_store_and_retrieve_after_a_hidden_restart_succeed(
    fresh_real_server: Any, forwarded: Any, generation: str
) -> None:
    """Each transport on a server of its own, side by side: the servers are killed and
    started again together (a start is ~3 s, mostly lmcache's imports), and no client
    operation runs while either is starting (each has OP_TIMEOUT)."""
    servers = fresh_real_server.together(
        *({"mode": mode, "generation": generation, "chunk_size": CS} for mode in ("shm", "pickle"))
    )
    killed, up = asyncio.Barrier(len(servers)), asyncio.Barrier(len(servers))

    async def replace_and_reuse(srv: Any) -> None:
        mode = srv.mode
        zf, hf = forwarded(srv)
        async with _client(zf, hf, OP_TIMEOUT) as c:
            tokens = fresh_tokens(2 * CS)
            kv = random_kv(SMALL_GEOMETRY, len(tokens))
            assert await c.store(kv, tokens) is True
            got = await c.retrieve(tokens)
            assert got is not None and torch.equal(got, kv)
            old_server = srv.config()["mp"]["instance_id"]
            old_id = c.instance_id

            await killed.wait()  # both clients are done with the old servers
            await asyncio.to_thread(_kill, srv)
            await asyncio.to_thread(srv.start)
            await up.wait()  # both healthy again
            healthy = time.monotonic()
            assert srv.config()["mp"]["instance_id"] != old_server
            assert peek(c).conn.generation == 0  # the client saw no disconnect

            tokens2 = fresh_tokens(2 * CS)
            kv2 = random_kv(SMALL_GEOMETRY, len(tokens2))
            assert await c.store(kv2, tokens2) is True  # the first operation after the restart
            got2 = await c.retrieve(tokens2)
            first_success = time.monotonic()
            assert got2 is not None and torch.equal(got2, kv2)
            assert c.transfer == mode
            assert await c.retrieve(tokens) is None  # the new server lost the old prompt
            # Registered again under a fresh id: nothing sent under the old one can act on
            # the new server.
            assert c.instance_id != old_id
            print(
                f"\n[replaced {generation}/{mode}] healthy again -> first store + retrieve: "
                f"{first_success - healthy:.3f}s"
            )

    await asyncio.gather(*(replace_and_reuse(srv) for srv in servers))
    assert [srv.mode for srv in servers] == ["shm", "pickle"]


@pytest.mark.parametrize(("generation", "mode"), [("0.5.6", "shm"), ("0.5.6", "pickle"), ("0.5.7", "shm")])
async def test_an_operation_in_flight_during_the_swap_succeeds_or_says_so(
    fresh_real_server: Any, forwarded: Any, generation: str, mode: str
) -> None:
    """A store and a retrieve, each in flight on a server of its own (the same
    configuration), side by side: the servers are swapped together."""
    servers = fresh_real_server.together(
        *({"mode": mode, "generation": generation, "chunk_size": CS} for _ in range(2))
    )
    stopped, up = asyncio.Barrier(len(servers)), asyncio.Barrier(len(servers))
    deadline = 20.0

    async def swap_under(srv: Any, operation: str) -> None:
        zf, hf = forwarded(srv)
        async with _client(zf, hf, deadline) as c:
            tokens = fresh_tokens(2 * CS)
            kv = random_kv(SMALL_GEOMETRY, len(tokens))
            if operation == "retrieve":
                assert await c.store(kv, tokens) is True
            await stopped.wait()  # both clients are registered and idle
            pid = srv.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)  # the operation's first request goes unanswered
            start = time.monotonic()
            task = asyncio.create_task(c.store(kv, tokens) if operation == "store" else c.retrieve(tokens))
            await asyncio.sleep(0.3)
            assert not task.done()
            await asyncio.to_thread(_kill, srv)
            await asyncio.to_thread(srv.start)
            healthy = time.monotonic()
            try:
                result: Any = await task
            except lmc.ServerReplacedError as exc:
                result = exc
            done = time.monotonic()
            elapsed = done - start
            assert elapsed < deadline
            print(
                f"\n[in flight {generation}/{mode}/{operation}] {type(result).__name__} after "
                f"{elapsed:.3f}s ({done - healthy:.3f}s after healthy again)"
            )
            if operation == "store":
                assert result is True or isinstance(result, lmc.ServerReplacedError)
            else:
                assert result is None or isinstance(
                    result, lmc.ServerReplacedError
                )  # the new server is empty
            await up.wait()  # both swapped: no server is starting now
            # Nothing half-done on the new server: no write reservation, no read lock; the
            # prompt is storable and reads back bitwise.
            if result is not True:
                assert await c.store(kv, tokens) is True
            await _reads_back_and_holds_no_lock(c, srv, kv, tokens)

    await asyncio.gather(swap_under(servers[0], "store"), swap_under(servers[1], "retrieve"))


async def test_an_operation_replaced_twice_fails_with_the_typed_error(
    fresh_real_server: Any, forwarded: Any
) -> None:
    """The forwarder holds the client's requests while the server behind it is restarted:
    the watch sees the new server and the store runs again (its registration held too);
    told of a second replacement then (as the watch would be), the store cannot run again
    and raises ServerReplacedError, before its deadline. The held requests, delivered to
    the new server afterwards, act on nothing (they carry retired ids)."""
    srv = fresh_real_server("shm", chunk_size=CS)
    zf, hf = forwarded(srv)
    deadline = 20.0
    async with _client(zf, hf, deadline) as c:
        tokens = fresh_tokens(2 * CS)
        kv = random_kv(SMALL_GEOMETRY, len(tokens))
        zf.hold.set()
        start = time.monotonic()
        first_id = c.instance_id
        task = asyncio.create_task(c.store(kv, tokens))
        await asyncio.sleep(0.3)
        assert peek(c).conn.in_flight == 1  # its prepare_store, held
        await asyncio.to_thread(_kill, srv)
        await asyncio.to_thread(srv.start)
        lock = peek(c).registration_lock
        assert lock is not None
        end = time.monotonic() + 10
        while not (c.instance_id != first_id and lock.locked() and peek(c).conn.in_flight == 1):
            assert time.monotonic() < end, "the store was not run again"  # registering, held
            await asyncio.sleep(0.01)
        assert peek(c).watch.replacements == 1
        peek(c).report_replaced("another-server")
        with pytest.raises(
            lmc.ServerReplacedError, match=r"^store: .* was replaced .*\(again, after running it once more\)$"
        ):
            await task
        assert time.monotonic() - start < deadline
        zf.hold.clear()
        # The next operation checks the server, registers afresh and works.
        assert await c.store(kv, tokens) is True
        await _reads_back_and_holds_no_lock(c, srv, kv, tokens)


async def test_a_busy_client_never_checks_the_server_identity(real_server_shm: Any, forwarded: Any) -> None:
    """The hot path: operations back to back (replies never silent for a second) make no
    identity check, so no HTTP request; after a second of silence, one operation makes one.
    Nothing is replaced here: the session's server will do (a model and tokens of its own)."""
    zf, hf = forwarded(real_server_shm)
    async with _client(zf, hf, 10.0) as c:
        tokens = fresh_tokens(2 * CS)
        kv = random_kv(SMALL_GEOMETRY, len(tokens))
        assert await c.store(kv, tokens) is True
        # A quiet period longer than any one operation can take on a loaded machine: the
        # burst must make no check at all; then a shorter one, for the check after silence.
        peek(c).watch.quiet = 5.0
        checks = peek(c).watch.checks
        for _ in range(100):
            assert await c.lookup(tokens) == 2 * CS
            got = await c.retrieve(tokens)
            assert got is not None and torch.equal(got, kv)
        assert peek(c).watch.checks == checks
        peek(c).watch.quiet = 0.5
        await asyncio.sleep(0.7)
        assert await c.lookup(tokens) == 2 * CS
        assert peek(c).watch.checks == checks + 1
