"""AsyncClient's contract, on every server configuration of ``SERVER_CONFIGS`` (the real
LMCache 0.5.6 and 0.5.7rc3 servers and the embedded server speaking either generation, each
over SHM and pickle): bitwise round trips of each dtype, chunk alignment and prefix hits,
``False`` for an already cached store, salt isolation, ``retrieve(out=)``, ``remap``, bad
arguments refused before anything is sent, constructor checks, an unregistered model and an
unreachable server, 256 concurrent mixed operations, timeouts and cancellations that leave
no session, prefetch job or read lock behind, ``end_session`` posted in the background and
waited for by ``drain()``/``aclose()``, and a closed client refusing calls. On the real
0.5.6 server (SHM and pickle): a geometry read from ``/status`` agrees with an explicit one,
and KV is read bitwise across this client, an inference engine's path and the official SDK.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch

import lmcache_async as lmc
from lmcache_async import AsyncClient, KVGeometry
from lmcache_async._protocol.wire import Op
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, peek, random_kv, unique_model

pytestmark = pytest.mark.anyio

CS = 16


async def wait_for_baseline(
    client: AsyncClient, sessions: int, jobs: int, deadline: float = 30.0
) -> dict[str, Any]:
    """Wait until the client's abandoned operations finished their cleanup, then poll
    /status until the session and prefetch-job counts are back to a baseline."""
    end = time.monotonic() + deadline
    while peek(client).in_flight_ops and time.monotonic() < end:
        await asyncio.sleep(0.05)
    while True:
        st = await client.status(max_age=0)
        if (st["active_sessions"], st["active_prefetch_jobs"]) == (sessions, jobs) or time.monotonic() > end:
            return st
        await asyncio.sleep(0.05)


async def counts(client: AsyncClient) -> tuple[int, int]:
    st = await client.status(max_age=0)
    return st["active_sessions"], st["active_prefetch_jobs"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
async def test_round_trip_is_bitwise(server: Any, dtype: torch.dtype) -> None:
    geometry = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=4, dtype=dtype, block_size=16)
    async with AsyncClient(server.url, server.http_url, unique_model(), geometry=geometry, timeout=30) as c:
        assert c.chunk_size == CS
        assert c.transfer == server.mode
        tokens = fresh_tokens(3 * CS + 5)
        kv = random_kv(geometry, len(tokens))
        assert await c.lookup(tokens) == 0
        assert await c.retrieve(tokens) is None
        assert await c.store(kv, tokens) is True
        got = await c.retrieve(tokens)
        assert got is not None
        assert got.dtype == dtype
        assert got.shape == (2, 3, 3 * CS, 8)
        assert torch.equal(got, kv[:, :, : 3 * CS])  # the partial tail chunk is ignored
        assert await c.lookup(tokens) == 3 * CS


async def test_restore_returns_false_and_sends_only_new_chunks(client: AsyncClient) -> None:
    tokens = fresh_tokens(4 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    assert await client.store(kv[:, :, : 2 * CS], tokens[: 2 * CS]) is True
    assert await client.store(kv[:, :, : 2 * CS], tokens[: 2 * CS]) is False
    # Extending the prefix stores just the two new chunks; the result is the full prefix.
    assert await client.store(kv, tokens) is True
    assert await client.store(kv, tokens) is False
    got = await client.retrieve(tokens)
    assert got is not None
    assert torch.equal(got, kv)
    assert await client.store(kv[:, :, :5], tokens[:5]) is False  # no whole chunk


async def test_salt_isolation(client: AsyncClient) -> None:
    tokens = fresh_tokens(2 * CS)
    kv_a = random_kv(SMALL_GEOMETRY, len(tokens))
    kv_b = random_kv(SMALL_GEOMETRY, len(tokens))
    assert await client.store(kv_a, tokens, cache_salt="alice") is True
    assert await client.retrieve(tokens) is None
    assert await client.retrieve(tokens, cache_salt="bob") is None
    assert await client.lookup(tokens, cache_salt="bob") == 0
    assert await client.store(kv_b, tokens, cache_salt="bob") is True
    got_a = await client.retrieve(tokens, cache_salt="alice")
    got_b = await client.retrieve(tokens, cache_salt="bob")
    assert got_a is not None and torch.equal(got_a, kv_a)
    assert got_b is not None and torch.equal(got_b, kv_b)


async def test_prefix_retrieve_and_divergent_suffix(client: AsyncClient) -> None:
    tokens = fresh_tokens(4 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    assert await client.store(kv, tokens) is True
    got = await client.retrieve(tokens[: 2 * CS + 3])
    assert got is not None and torch.equal(got, kv[:, :, : 2 * CS])
    other = tokens[: 3 * CS] + [7] * CS  # the last chunk differs: hit stops after 3 chunks
    got = await client.retrieve(other)
    assert got is not None and torch.equal(got, kv[:, :, : 3 * CS])
    assert await client.lookup(other) == 3 * CS
    assert await client.retrieve([5] + tokens[1:]) is None  # the first chunk differs


async def test_retrieve_into_out(client: AsyncClient) -> None:
    tokens = fresh_tokens(3 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    assert await client.store(kv[:, :, : 2 * CS], tokens[: 2 * CS]) is True
    out = torch.zeros(SMALL_GEOMETRY.kv_shape(4 * CS), dtype=torch.bfloat16)
    got = await client.retrieve(tokens, out=out)
    assert got is not None
    assert got.shape == (2, 2, 2 * CS, 16)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out[:, :, : 2 * CS], kv[:, :, : 2 * CS])
    assert torch.count_nonzero(out[:, :, 2 * CS :]) == 0
    with pytest.raises(ValueError, match=r"out has shape \[2, 2, 16, 16\], expected \[2, 2, 48, 16\]"):
        await client.retrieve(tokens, out=torch.zeros(2, 2, CS, 16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out has dtype torch.float32"):
        await client.retrieve(tokens, out=torch.zeros(2, 2, 3 * CS, 16))


async def test_a_large_store_is_read_back_bitwise_by_another_client(server: Any) -> None:
    """16 MiB in 32 chunks (above the size whose copy is cut into parts and, into pool pages
    nobody has written, written through the segment's descriptor), then read by a new client
    into a new tensor and into ``out=``, and stored again into slots the first client mapped."""
    geometry = KVGeometry(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
    model = unique_model()
    tokens = fresh_tokens(32 * CS)
    kv = random_kv(geometry, len(tokens))
    async with AsyncClient(server.url, server.http_url, model, geometry=geometry, timeout=60) as writer:
        assert await writer.store(kv, tokens) is True
        again = [t + 1 for t in tokens]  # other prompts: fresh slots or recycled ones
        assert await writer.store(kv.flip(2), again) is True
    async with AsyncClient(server.url, server.http_url, model, geometry=geometry, timeout=60) as reader:
        got = await reader.retrieve(tokens)
        assert got is not None and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
        out = torch.zeros_like(kv)
        got = await reader.retrieve(again, out=out)
        assert got is not None and torch.equal(out.view(torch.uint8), kv.flip(2).view(torch.uint8))


async def test_remap(client: AsyncClient) -> None:
    source = fresh_tokens(4 * CS)
    target = [1, 2, 3] + source[3:]
    kv = random_kv(SMALL_GEOMETRY, len(source))
    assert await client.store(kv, source) is True
    assert await client.lookup(target) == 0
    res = await client.remap(source, target)
    assert res == lmc.RemapResult(retrieved_tokens=4 * CS, stored_tokens=4 * CS, stored_new=True)
    assert await client.lookup(target) == 4 * CS
    got = await client.retrieve(target)
    assert got is not None and torch.equal(got, kv)
    assert await client.remap(source, target) == lmc.RemapResult(4 * CS, 4 * CS, False)
    short = await client.remap(source, [9] + source[1 : 2 * CS + 7], target_cache_salt="s")
    assert short == lmc.RemapResult(2 * CS, 2 * CS, True)  # only what the target can take
    got = await client.retrieve([9] + source[1 : 2 * CS], cache_salt="s")
    assert got is not None and torch.equal(got, kv[:, :, : 2 * CS])
    assert await client.remap(fresh_tokens(2 * CS), target) == lmc.RemapResult(0, 0, False)


async def test_bad_input_is_refused_before_anything_is_sent(client: AsyncClient) -> None:
    tokens = fresh_tokens(CS)
    kv = random_kv(SMALL_GEOMETRY, CS)
    sent_before = peek(client).next_request_uid()
    cases: list[tuple[Any, type[Exception], str]] = [
        (client.store(kv, tokens, cache_salt="a/b"), ValueError, "cache_salt must not contain '/'"),
        (  # tokens may be longer than the KV, never shorter
            client.store(kv, tokens[:-1]),
            ValueError,
            r"kv covers 16 tokens but tokens has 15",
        ),
        (
            client.store(kv.float(), tokens),
            TypeError,
            "kv has dtype torch.float32, the geometry says torch.bfloat16",
        ),
        (client.store(kv[0], tokens), ValueError, "kv must have 4 dimensions"),
        (client.store("kv", tokens), TypeError, "kv must be a torch.Tensor, got str"),  # type: ignore[arg-type]
        (client.retrieve([2**32]), ValueError, r"tokens: token id 4294967296 is outside"),
        (client.retrieve(tokens, cache_salt="x" * 200), ValueError, "at most 128 characters"),
        (client.lookup([1.5]), TypeError, "tokens must contain ints, found float"),  # type: ignore[list-item]
        (client.remap(tokens, [-1]), ValueError, "target_tokens: token id -1"),
        (client.retrieve(tokens, timeout=-1), ValueError, "timeout must be a non-negative number"),
    ]
    for coro, exc_type, message in cases:
        with pytest.raises(exc_type, match=message):
            await coro
    assert peek(client).next_request_uid() == sent_before + 1  # nothing was sent meanwhile


async def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="model_name must not contain '@'"):
        AsyncClient("tcp://127.0.0.1:1", "http://127.0.0.1:1", "a@b")
    with pytest.raises(ValueError, match="url must look like tcp://host:port"):
        AsyncClient("localhost:5555", "http://127.0.0.1:1", "m")
    with pytest.raises(ValueError, match="num_kv_readers must be an int >= 1, got 0"):
        AsyncClient("tcp://127.0.0.1:1", "http://127.0.0.1:1", "m", num_kv_readers=0)
    with pytest.raises(ValueError, match="transfer must be 'auto', 'shm' or 'pickle'"):
        AsyncClient("tcp://127.0.0.1:1", "http://127.0.0.1:1", "m", transfer="rdma")  # type: ignore[arg-type]


async def test_unregistered_model_names_the_registered_ones(server: Any) -> None:
    with pytest.raises(lmc.ModelNotRegisteredError, match="model 'nobody' is not registered") as info:
        await lmc.connect(server.url, server.http_url, "nobody", timeout=10)
    assert isinstance(info.value, LookupError)
    assert "nobody" not in info.value.registered


async def test_unreachable_server_is_a_connection_error() -> None:
    from harness.real_server import free_loopback_port

    port = free_loopback_port()
    with pytest.raises(lmc.LMCacheConnectionError, match=f"GET http://127.0.0.1:{port}/lmc_version failed"):
        await lmc.connect(f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{port}", "m", geometry=SMALL_GEOMETRY)


async def test_256_concurrent_mixed_operations(client: AsyncClient) -> None:
    n = 64
    prompts = [fresh_tokens(2 * CS) for _ in range(n)]
    kvs = [random_kv(SMALL_GEOMETRY, 2 * CS) for _ in range(n)]
    baseline = await counts(client)
    # 64 stores, then 64 retrieves + 64 lookups + 64 (re-)stores all at once.
    assert (
        await asyncio.gather(*(client.store(kv, p) for kv, p in zip(kvs, prompts, strict=True))) == [True] * n
    )
    ops: list[Any] = []
    for i in range(n):
        ops.append(client.retrieve(prompts[i]))
        ops.append(client.lookup(prompts[i][: CS + 3]))
        ops.append(client.store(kvs[i], prompts[i]))
        ops.append(client.retrieve(prompts[i][:CS]))
    results = await asyncio.gather(*ops)
    for i in range(n):
        full, looked, restored, first = results[4 * i : 4 * i + 4]
        assert torch.equal(full, kvs[i])
        assert looked == CS
        assert restored is False
        assert torch.equal(first, kvs[i][:, :, :CS])
    # status() first waits for the end_session messages sent in the background.
    assert await counts(client) == baseline
    assert peek(client).conn.in_flight == 0
    assert peek(client).conn.dropped == (0, 0)


async def test_timeouts_and_cancellations_leave_no_sessions_or_locks(own_server: Any) -> None:
    # A server of its own: the check clears its cache, which must not disturb other tests.
    srv = own_server()
    async with AsyncClient(srv.url, srv.http_url, unique_model(), geometry=SMALL_GEOMETRY, timeout=30) as c:
        tokens = [fresh_tokens(4 * CS) for _ in range(8)]
        kv = random_kv(SMALL_GEOMETRY, 4 * CS)
        for t in tokens[:4]:
            assert await c.store(kv, t) is True
        baseline = await counts(c)
        # Deadlines that expire at once or mid-flight: the operations are abandoned.
        for t, timeout in zip(tokens, [0.0, 0.0005, 0.001, 0.002, 0.0, 0.0005, 0.001, 0.002], strict=True):
            calls: list[Callable[[], Awaitable[object]]] = [
                lambda: c.retrieve(t, timeout=timeout),
                lambda: c.lookup(t, timeout=timeout),
                lambda: c.store(kv, t, timeout=timeout),
                lambda: c.remap(t, [0, *t[1:]], timeout=timeout),
            ]
            for call in calls:
                try:
                    await call()
                except lmc.LMCacheTimeoutError as exc:
                    assert exc.operation in ("retrieve", "lookup", "store", "remap")
        # Cancellations at every await point: cancel after k event-loop iterations.
        for k in range(12):
            tasks: list[asyncio.Task[Any]] = [asyncio.create_task(c.retrieve(t)) for t in tokens]
            tasks += [asyncio.create_task(c.store(kv, t)) for t in tokens[4:]]
            for _ in range(k):
                await asyncio.sleep(0)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        st = await wait_for_baseline(c, *baseline)
        assert (st["active_sessions"], st["active_prefetch_jobs"]) == baseline
        assert peek(c).conn.in_flight == 0
        # Stores that were reserved completed in full: each prompt is all there or absent.
        for t in tokens:
            got = await c.retrieve(t)
            assert got is None or torch.equal(got, kv)
        # No read lock is left: a non-forced clear evicts everything.
        await peek(c).conn.call(Op.CLEAR, (False,), timeout=10)
        for t in tokens:
            assert await c.lookup(t) == 0


async def test_explicit_and_status_geometry_agree(real_server: Any) -> None:
    server = real_server
    from harness.workers import EngineWorker

    model = unique_model("engine")
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=4)
    with EngineWorker(server.url) as eng:
        eng.register(model, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64)
        tokens = fresh_tokens(2 * CS)
        kv = random_kv(geometry, len(tokens))
        async with lmc.AsyncClient(server.url, server.http_url, model, timeout=30) as derived:
            assert derived.geometry == geometry
            assert await derived.store(kv, tokens) is True
            async with lmc.AsyncClient(
                server.url, server.http_url, model, geometry=geometry, timeout=30
            ) as explicit:
                a = await derived.retrieve(tokens)
                b = await explicit.retrieve(tokens)
                assert a is not None and b is not None
                assert torch.equal(a, kv) and torch.equal(b, kv)
                assert await explicit.store(kv, tokens) is False


async def test_interop_with_the_engine_path(real_server: Any) -> None:
    server = real_server
    """KV an inference engine (lmcache's own lmcache-driven path, as vLLM) stores is read
    bitwise by AsyncClient, and KV AsyncClient stores under a target prefix (the remap
    flow) is read bitwise by the engine."""
    from harness.workers import EngineWorker

    model = unique_model("engine")
    with EngineWorker(server.url) as eng:
        eng.register(model, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64)
        source = fresh_tokens(3 * CS)
        target = [11, 12] + source[2:]
        kv = random_kv(KVGeometry(2, 2, 8, torch.bfloat16, 4), len(source))
        assert eng.store(source, kv) is True
        async with lmc.AsyncClient(server.url, server.http_url, model, timeout=30) as c:
            got = await c.retrieve(source)
            assert got is not None and torch.equal(got, kv)
            assert await c.remap(source, target) == lmc.RemapResult(3 * CS, 3 * CS, True)
        engine_view = eng.retrieve(target)
        assert engine_view is not None and torch.equal(engine_view, kv)


async def test_interop_with_the_official_sdk(real_server: Any) -> None:
    server = real_server
    from harness.workers import EngineWorker, SDKWorker

    model = unique_model("sdk")
    eng, sdk = EngineWorker(server.url), SDKWorker()
    eng.spawn(), sdk.spawn()  # overlap the two ~2.5 s interpreter startups
    with eng, sdk:
        # The SDK needs an engine registration in /status to learn the geometry.
        eng.register(model, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64)
        sdk.connect(server.url, server.http_url, model)
        geometry = KVGeometry(2, 2, 8, torch.bfloat16, 4)
        ours, theirs = fresh_tokens(2 * CS), fresh_tokens(2 * CS)
        kv_ours, kv_theirs = random_kv(geometry, 2 * CS), random_kv(geometry, 2 * CS)
        async with lmc.AsyncClient(server.url, server.http_url, model, timeout=30) as c:
            assert await c.store(kv_ours, ours) is True
            got = sdk.retrieve(ours)
            assert got is not None and torch.equal(got, kv_ours)
            assert sdk.store(theirs, kv_theirs) is True
            mine = await c.retrieve(theirs)
            assert mine is not None and torch.equal(mine, kv_theirs)
            # The SDK says True on a pickle re-store; this client says False on both.
            assert sdk.store(ours, kv_ours) is (server.mode == "pickle")
            assert await c.store(kv_theirs, theirs) is False


async def test_closed_client_refuses_calls(server: Any) -> None:
    c = await lmc.connect(server.url, server.http_url, unique_model(), geometry=SMALL_GEOMETRY, timeout=10)
    assert "state=open" in repr(c)
    await c.aclose()
    await c.aclose()
    assert c.closed
    with pytest.raises(lmc.ClientClosedError, match="the client is closed"):
        await c.lookup([1] * CS)


async def test_end_session_goes_in_the_background_and_drain_waits_for_it(
    client: AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """store and retrieve return once their last answer is in; their ``end_session`` is
    sent at once without being waited for (one round trip less), and ``drain()`` and
    ``status()`` wait for it, so the server's sessions are back at the baseline."""
    from lmcache_async._transport.connection import Connection

    posted: list[Op] = []
    real = Connection.send_nowait

    def spy(self: Connection, op: Op, args: Any, *, timeout: float) -> Any:
        posted.append(op)
        return real(self, op, args, timeout=timeout)

    monkeypatch.setattr(Connection, "send_nowait", spy)
    baseline = await counts(client)
    tokens, kv = fresh_tokens(2 * CS), random_kv(SMALL_GEOMETRY, 2 * CS)
    assert await client.store(kv, tokens) is True
    got = await client.retrieve(tokens)
    assert got is not None and torch.equal(got, kv)
    assert await client.lookup(tokens) == 2 * CS  # a lookup ends its session before returning
    # (pipelined requests are posted too; a lookup's own end_session is awaited). An
    # inline store also verifies with a lookup whose locks and session are released
    # in the background.
    if client.transfer == "shm":
        expected = [Op.END_SESSION, Op.END_SESSION]
    else:
        expected = [Op.END_SESSION, Op.FREE_LOOKUP_LOCKS, Op.END_SESSION, Op.END_SESSION]
    assert [o for o in posted if o in (Op.END_SESSION, Op.FREE_LOOKUP_LOCKS)] == expected
    assert await client.drain(timeout=10) is True
    assert peek(client).conn.in_flight == 0
    assert await counts(client) == baseline


@pytest.mark.parametrize("closer", ["drain", "aclose"])
async def test_drain_and_aclose_wait_for_follow_ups_posted_while_they_wait(server: Any, closer: str) -> None:
    """An operation that ends while ``drain()``/``aclose()`` waits may post its cleanup
    (``end_session``) then: that follow-up is waited for too, not counted as an operation
    still running at close (which would retire the registration)."""
    c = await lmc.connect(server.url, server.http_url, unique_model(), geometry=SMALL_GEOMETRY, timeout=10)
    loop = asyncio.get_running_loop()
    first: asyncio.Future[None] = loop.create_future()
    follow_up: asyncio.Future[None] = loop.create_future()
    retired: list[str] = []
    peek(c).intercept_retire(lambda _id, reason="": retired.append(reason))

    def post_follow_up(_f: object) -> None:
        peek(c).track(follow_up)
        loop.call_later(0.05, follow_up.set_result, None)

    first.add_done_callback(post_follow_up)
    peek(c).track(first)
    loop.call_later(0.02, first.set_result, None)
    if closer == "drain":
        assert await c.drain(timeout=5) is True
        assert follow_up.done()
        await c.aclose()
    else:
        await c.aclose()
        assert follow_up.done()
    assert retired == []
    assert c.closed
