"""Beyond one machine: per-host LMCache servers sharing a REAL Redis L2.

Real parts only: Debian's ``redis-server`` (``harness/redis_server.py``, installed
by ``harness/ensure_redis.sh``) and real LMCache servers started with
``--l2-adapter '{"type":"resp","host":"127.0.0.1","port":PORT}'`` -- 0.5.6 from
``.lmcache-venv`` and, for the rolling upgrade, 0.5.7rc3 from ``.lmcache-venv-057``
(the ``lmcache057_python`` fixture, built by the test set-up like the 0.5.6 one). "Hosts" are servers on loopback ports with their own L1;
the L2 is the only thing they share, as on separate machines.

What LMCache 0.5.6 does (read in its source, checked here):

* write-behind: a chunk reaches Redis after the store has returned, from the server's
  StoreController thread (``storage_controllers/store_controller.py``); tests wait for
  the Redis keys (``<model>@<kv_rank>@<group>@<chunk hash>[@<salt>]``) with a deadline.
* prefetch on lookup: a lookup that misses L1 asks Redis (EXISTS) and loads the hits into
  L1 as *temporary* objects, deleted once read (``DefaultPrefetchPolicy``), so every
  cross-server retrieve goes to Redis again.
* per-server locks: the L2 "locks" are counters inside each server's adapter; nothing is
  locked in Redis.
* no cross-server invalidation: each server serves its own L1 first; nothing tells it
  that the L2 copy changed.
* a Redis restart is not survived: the RESP adapter never reconnects; L2 writes fail
  (a WARNING in the server log), L2 lookups miss silently, until the LMCache server
  itself restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.real_server import REPO_ROOT, RealLMCacheServer
from harness.redis_server import RedisServer
from lmcache_async import AsyncClient, KVGeometry, RemapResult, TransferError
from lmcache_async._transport.shm import ShmPool
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, random_kv, unique_model

pytestmark = pytest.mark.anyio

CS = 16
GEOM = SMALL_GEOMETRY
#: The 0.5.7rc3 venv (reference/lmcache-0.5.7.md); the rolling-upgrade test needs it.


# --------------------------------------------------------------------------- topology


@dataclass
class Cluster:
    """One Redis and the LMCache servers that use it as their L2."""

    redis: RedisServer
    a: RealLMCacheServer  # SHM (clients on its host map the pool)
    b: RealLMCacheServer  # pickle (KV over TCP)


def l2_args(redis: RedisServer) -> list[str]:
    return ["--l2-adapter", redis.l2_adapter_arg()]


@pytest.fixture(scope="module")
def cluster(_real_server_registry: Any, lmcache_python: Path) -> Iterator[Cluster]:
    """Redis + server A (SHM) + server B (pickle), both with Redis as L2, shared by the
    module's tests (each uses its own model name)."""
    redis = RedisServer().start()
    try:
        a, b = _real_server_registry.start_together(
            ("shm", lmcache_python, {"name": "l2_a", "extra_args": l2_args(redis)}),
            ("pickle", lmcache_python, {"name": "l2_b", "extra_args": l2_args(redis)}),
        )
        yield Cluster(redis, a, b)
        a.terminate(), b.terminate()  # they shut down in parallel
        for srv in (a, b):
            srv.stop()
            assert srv.leftovers() == []
    finally:
        redis.cleanup()
    assert redis.pid is None


@contextlib.asynccontextmanager
async def client_of(srv: RealLMCacheServer, model: str, **kw: Any) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(srv.url, srv.http_url, model, geometry=GEOM, timeout=30, **kw) as c:
        yield c


async def in_redis(redis: RedisServer, pattern: str, count: int) -> list[str]:
    """The keys matching ``pattern`` once there are exactly ``count`` (write-behind)."""
    return await asyncio.to_thread(redis.wait_for_keys, pattern, count)


def chunk_bytes(kv: torch.Tensor) -> set[bytes]:
    """The bytes of each chunk object ``[2, L, CS, D]`` as LMCache keeps it."""
    n = kv.shape[2] // CS
    return {
        kv[:, :, i * CS : (i + 1) * CS, :].contiguous().view(torch.uint8).numpy().tobytes() for i in range(n)
    }


def redis_values(redis: RedisServer, pattern: str) -> set[bytes]:
    return {redis.command("GET", k) for k in redis.keys(pattern)}


# --------------------------------------------------------------------------- one L2, two servers


async def test_remap_through_a_is_read_bitwise_through_b(cluster: Cluster) -> None:
    model = unique_model("mh")
    source, target = fresh_tokens(4 * CS), fresh_tokens(4 * CS)
    kv = random_kv(GEOM, 4 * CS)
    async with client_of(cluster.a, model) as ca, client_of(cluster.b, model) as cb:
        assert ca.transfer == "shm" and cb.transfer == "pickle"
        assert await ca.store(kv, source) is True
        assert await ca.remap(source, target) == RemapResult(4 * CS, 4 * CS, True)
        keys = await in_redis(cluster.redis, f"{model}@*", 8)  # 4 source + 4 target chunks
        assert all(k.count("@") == 3 for k in keys)  # unsalted: model@rank@group@hash
        # Redis holds exactly the chunk objects' bytes (4 distinct chunks, twice each).
        assert redis_values(cluster.redis, f"{model}@*") == chunk_bytes(kv)
        assert await cb.lookup(target) == 4 * CS
        got = await cb.retrieve(target)
        assert got is not None and torch.equal(got, kv)
        # The other direction: stored through B, read through A.
        other, kv2 = fresh_tokens(2 * CS), random_kv(GEOM, 2 * CS)
        assert await cb.store(kv2, other) is True
        await in_redis(cluster.redis, f"{model}@*", 10)
        got = await ca.retrieve(other)
        assert got is not None and torch.equal(got, kv2)
        # A prefix shorter than what was stored, and a longer prompt: only whole chunks hit.
        got = await cb.retrieve(target[: 2 * CS + 5])
        assert got is not None and torch.equal(got, kv[:, :, : 2 * CS])
        assert await ca.lookup(other + fresh_tokens(CS)) == 2 * CS


async def test_remap_many_spread_over_both_servers(cluster: Cluster) -> None:
    model = unique_model("mh-batch")
    n = 8
    sources = [fresh_tokens(2 * CS) for _ in range(n)]
    targets = [fresh_tokens(2 * CS) for _ in range(n)]
    kvs = [random_kv(GEOM, 2 * CS) for _ in range(n)]
    async with client_of(cluster.a, model) as ca, client_of(cluster.b, model) as cb:
        # Half the sources are stored through each server.
        for i in range(n):
            assert await (ca if i % 2 else cb).store(kvs[i], sources[i]) is True
        await in_redis(cluster.redis, f"{model}@*", 2 * n)
        # The batch is split: even pairs through A, odd pairs through B -- each server
        # remaps sources the OTHER one stored (read from Redis).
        pairs = list(zip(sources, targets, strict=True))
        ra, rb = await asyncio.gather(ca.remap_many(pairs[0::2]), cb.remap_many(pairs[1::2]))
        for r in (ra, rb):
            assert (r.summary.items, r.summary.hits, r.summary.misses, r.summary.failures) == (
                n // 2,
                n // 2,
                0,
                0,
            )
            assert r.summary.stored_new == n // 2
            assert [x.retrieved_tokens for x in r] == [2 * CS] * (n // 2)
        await in_redis(cluster.redis, f"{model}@*", 4 * n)
        # Every target, read through the server that did NOT remap it.
        for i in range(n):
            got = await (cb if i % 2 == 0 else ca).retrieve(targets[i])
            assert got is not None and torch.equal(got, kvs[i]), i


async def test_salts_stay_isolated_across_servers(cluster: Cluster) -> None:
    model = unique_model("mh-salt")
    tokens = fresh_tokens(2 * CS)
    kv1, kv2 = random_kv(GEOM, 2 * CS), random_kv(GEOM, 2 * CS)
    async with client_of(cluster.a, model) as ca, client_of(cluster.b, model) as cb:
        assert await ca.store(kv1, tokens, cache_salt="tenant-1") is True
        assert await in_redis(cluster.redis, f"{model}@*", 2) == await in_redis(
            cluster.redis, f"{model}@*@tenant-1", 2
        )
        assert await cb.retrieve(tokens) is None
        assert await cb.retrieve(tokens, cache_salt="tenant-2") is None
        assert await cb.lookup(tokens, cache_salt="tenant-2") == 0
        got = await cb.retrieve(tokens, cache_salt="tenant-1")
        assert got is not None and torch.equal(got, kv1)
        # Same tokens, other salt, other KV, stored through B: A sees each under its salt.
        assert await cb.store(kv2, tokens, cache_salt="tenant-2") is True
        await in_redis(cluster.redis, f"{model}@*@tenant-2", 2)
        got1 = await ca.retrieve(tokens, cache_salt="tenant-1")
        got2 = await ca.retrieve(tokens, cache_salt="tenant-2")
        assert got1 is not None and torch.equal(got1, kv1)
        assert got2 is not None and torch.equal(got2, kv2)
        assert await ca.retrieve(tokens) is None
        assert len(cluster.redis.keys(f"{model}@*")) == 4


async def test_no_cross_server_invalidation(cluster: Cluster) -> None:
    """Two servers can serve different KV under one key: each reads its own L1 first and
    nothing invalidates it when another server rewrites the Redis copy."""
    model = unique_model("mh-inval")
    tokens = fresh_tokens(2 * CS)
    kv_b, kv_a = random_kv(GEOM, 2 * CS), random_kv(GEOM, 2 * CS)
    async with client_of(cluster.a, model) as ca, client_of(cluster.b, model) as cb:
        assert await cb.store(kv_b, tokens) is True  # B's L1 and then Redis hold kv_b
        await in_redis(cluster.redis, f"{model}@*", 2)
        assert redis_values(cluster.redis, f"{model}@*") == chunk_bytes(kv_b)
        # A's L1 does not hold the key; an SHM store reserves L1 slots without asking L2,
        # so A writes kv_a and its write-behind overwrites the Redis copy.
        assert await ca.store(kv_a, tokens) is True
        deadline = time.monotonic() + 20
        while redis_values(cluster.redis, f"{model}@*") != chunk_bytes(kv_a):
            assert time.monotonic() < deadline, "A's write-behind never reached Redis"
            await asyncio.sleep(0.02)
        got_a, got_b = await ca.retrieve(tokens), await cb.retrieve(tokens)
        assert got_a is not None and torch.equal(got_a, kv_a)
        assert got_b is not None and torch.equal(got_b, kv_b)  # B still serves its L1 copy


async def test_server_a_killed_b_serves_what_reached_redis(cluster: Cluster, fresh_real_server: Any) -> None:
    """A server that dies (SIGKILL, no shutdown) loses only what had not reached Redis."""
    model = unique_model("mh-kill")
    a2 = fresh_real_server("shm", name="l2_a_killed", extra_args=l2_args(cluster.redis))
    tokens, kv = fresh_tokens(3 * CS), random_kv(GEOM, 3 * CS)
    async with client_of(a2, model) as ca:
        assert await ca.store(kv, tokens) is True
    await in_redis(cluster.redis, f"{model}@*", 3)
    assert a2.pid is not None
    os.kill(a2.pid, signal.SIGKILL)  # exactly the pid this test started
    a2.stop()  # reaps the pid, removes the SHM segment it could not remove itself
    assert a2.leftovers() == []
    async with client_of(cluster.b, model) as cb:
        got = await cb.retrieve(tokens)
        assert got is not None and torch.equal(got, kv)


@pytest.mark.timeout(240)
async def test_redis_restart_is_not_survived_until_servers_restart(
    fresh_real_server: Any,
) -> None:
    """What LMCache 0.5.6 guarantees across a Redis restart (here a Redis that keeps its
    data, AOF with fsync always): nothing is lost from Redis or from the servers' L1s,
    but each LMCache server's RESP connection is dead and never re-established -- new KV
    stays in the L1 of the server that stored it (the L2 write fails, with a WARNING in
    its log) and other servers miss it silently -- until that LMCache server restarts."""
    model = unique_model("mh-redis")
    with RedisServer(persistent=True) as redis:
        a, b = fresh_real_server.together(
            {"mode": "shm", "name": "l2r_a", "extra_args": l2_args(redis)},
            {"mode": "pickle", "name": "l2r_b", "extra_args": l2_args(redis)},
        )
        before, kv1 = fresh_tokens(2 * CS), random_kv(GEOM, 2 * CS)
        after, kv2 = fresh_tokens(2 * CS), random_kv(GEOM, 2 * CS)
        async with client_of(a, model) as ca:
            assert await ca.store(kv1, before) is True
            await in_redis(redis, f"{model}@*", 2)
            await asyncio.to_thread(redis.restart)
            assert len(redis.keys(f"{model}@*")) == 2  # persisted
            # A still serves its L1; B's L2 lookup fails silently: a miss, not an error.
            got = await ca.retrieve(before)
            assert got is not None and torch.equal(got, kv1)
            async with client_of(b, model) as cb:
                assert await cb.lookup(before) == 0
                assert await cb.retrieve(before) is None
            # New KV: A takes it (True), but the write-behind to Redis fails.
            failures = a.log_tail(10_000).count("to adapter 0 failed")
            assert await ca.store(kv2, after) is True
            deadline = time.monotonic() + 20
            while a.log_tail(10_000).count("to adapter 0 failed") == failures:
                assert time.monotonic() < deadline, "no L2 store failure logged"
                await asyncio.sleep(0.05)
            assert len(redis.keys(f"{model}@*")) == 2
            got = await ca.retrieve(after)
            assert got is not None and torch.equal(got, kv2)
        # Restarting B reconnects it to Redis: what Redis kept is served again.
        await asyncio.to_thread(b.restart)
        async with client_of(b, model) as cb:
            got = await cb.retrieve(before)
            assert got is not None and torch.equal(got, kv1)
            assert await cb.retrieve(after) is None  # never reached Redis
        a.terminate(), b.terminate()  # they shut down in parallel
        for srv in (a, b):
            srv.stop()
            assert srv.leftovers() == []


# --------------------------------------------------------------------------- remote clients


@pytest.fixture
def remote(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process cannot map any server's SHM pool, as on another host."""

    def fail(self: ShmPool, shm_name: str, pool_size: int) -> None:
        raise TransferError(
            f"cannot open shared memory /dev/shm/{shm_name}: [Errno 2] No such file or directory"
        )

    monkeypatch.setattr(ShmPool, "__init__", fail)


@pytest.mark.usefixtures("remote")
async def test_remote_client_of_a_pickle_server_works_over_tcp(cluster: Cluster) -> None:
    model = unique_model("mh-remote")
    source, target = fresh_tokens(2 * CS), fresh_tokens(2 * CS)
    kv = random_kv(GEOM, 2 * CS)
    async with client_of(cluster.b, model) as cb:
        assert cb.transfer == "pickle"
        assert await cb.store(kv, source) is True
        got = await cb.retrieve(source)
        assert got is not None and torch.equal(got, kv)
        assert await cb.remap(source, target) == RemapResult(2 * CS, 2 * CS, True)
        got = await cb.retrieve(target)
        assert got is not None and torch.equal(got, kv)
    await in_redis(cluster.redis, f"{model}@*", 4)


@pytest.mark.usefixtures("remote")
async def test_remote_client_of_an_shm_server_is_told_at_connect_and_retrieve_fails(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    model = unique_model("mh-remote-shm")
    tokens, kv = fresh_tokens(2 * CS), random_kv(GEOM, 2 * CS)
    shm = f"lmcache_l1_pool_{cluster.a.shm_name}"
    expected = (
        f"the server {cluster.a.url} keeps its KV in the shared-memory pool {shm!r}, which this client "
        f"does not map (cannot open shared memory /dev/shm/{shm}: [Errno 2] No such file or directory); "
        "an SHM server never sends KV over TCP, so retrieve and remap cannot work from here. Run the "
        "client on the server's host, or start the server with --shm-name '' to serve KV over TCP. "
        "store and lookup work."
    )
    with caplog.at_level(logging.WARNING, logger="lmcache_async._engine.session"):
        async with client_of(cluster.a, model) as remote_a:
            assert [r.getMessage() for r in caplog.records if r.name == "lmcache_async._engine.session"] == [
                expected
            ]
            assert remote_a.transfer == "pickle"
            # A miss fails too, before anything is sent: never a silent miss.
            with pytest.raises(TransferError) as info:
                await remote_a.retrieve(tokens)
            assert str(info.value) == expected
            # Stores work over TCP, and are visible to everyone.
            assert await remote_a.store(kv, tokens) is True
            assert await remote_a.lookup(tokens) == 2 * CS
            with pytest.raises(TransferError) as info:
                await remote_a.retrieve(tokens)
            assert str(info.value) == expected
            with pytest.raises(TransferError) as info:
                await remote_a.remap(tokens, fresh_tokens(2 * CS))
            assert str(info.value) == expected
            batch = await remote_a.remap_many([(tokens, fresh_tokens(2 * CS))])
            assert batch.summary.failures == 1 and str(batch[0].error) == expected
        await in_redis(cluster.redis, f"{model}@*", 2)
        # Insisting on SHM fails at connect.
        with pytest.raises(TransferError, match=r"cannot open shared memory"):
            async with client_of(cluster.a, model, transfer="shm"):
                pass
    async with client_of(cluster.b, model) as cb:  # B reads it from Redis
        got = await cb.retrieve(tokens)
        assert got is not None and torch.equal(got, kv)


async def test_remote_store_lands_in_the_shm_servers_l1(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote client's pickle store into an SHM server is readable bitwise by a client
    on the server's host (no prepare_store is sent, so nothing is left reserved)."""
    model = unique_model("mh-remote-local")
    tokens, kv = fresh_tokens(3 * CS), random_kv(GEOM, 3 * CS)
    async with client_of(cluster.a, model) as local:
        assert local.transfer == "shm"
        with monkeypatch.context() as m:
            m.setattr(
                ShmPool, "__init__", lambda *a: (_ for _ in ()).throw(TransferError("no /dev/shm here"))
            )
            async with client_of(cluster.a, model) as remote_a:
                assert remote_a.transfer == "pickle"
                assert await remote_a.store(kv, tokens) is True
        got = await local.retrieve(tokens)
        assert got is not None and torch.equal(got, kv)
        assert await local.store(kv, tokens) is False
        # Asking for pickle on an SHM server gives the same store-only client, on purpose.
        async with client_of(cluster.a, model, transfer="pickle") as by_choice:
            assert by_choice.transfer == "pickle"
            assert await by_choice.lookup(tokens) == 3 * CS
            with pytest.raises(TransferError, match=r"does not map \(transfer='pickle' was asked for\)"):
                await by_choice.retrieve(tokens)


# --------------------------------------------------------------------------- bulk jobs across hosts


#: What ``--shard auto`` reads; cleared from the environment of the CLI runs below so
#: that only the variables a test sets are seen.
SCHEDULER_VARS = (
    "JOB_COMPLETION_INDEX", "LMCACHE_ASYNC_SHARD_COUNT", "RANK", "WORLD_SIZE", "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_STEP",
)  # fmt: skip


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in SCHEDULER_VARS}
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache_async", *args],
        capture_output=True,
        text=True,
        cwd=str(cwd),
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
        env={**base, **(env or {}), "PYTHONPATH": str(REPO_ROOT)},  # this checkout's lmcache_async
    )
    return proc


def server_flags(srv: RealLMCacheServer) -> list[str]:
    return ["--url", srv.url, "--http-url", srv.http_url, "--timeout", "30",
            "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8"]  # fmt: skip


@pytest.mark.timeout(240)
async def test_remap_batch_sharded_over_two_hosts(cluster: Cluster, tmp_path: Path) -> None:
    """``remap-batch --shard 1/2`` on host A and ``--shard 2/2`` on host B: every pair is
    remapped exactly once, each target is visible through the other server, and each
    shard resumes from its own report."""
    from lmcache_async.cli.sharding import Shard, select_shard

    model = unique_model("mh-shard")
    n = 12
    sources = [fresh_tokens(2 * CS) for _ in range(n)]
    targets = [fresh_tokens(2 * CS) for _ in range(n)]
    kvs = [random_kv(GEOM, 2 * CS) for _ in range(n)]
    async with client_of(cluster.a, model) as ca:
        for kv, src in zip(kvs, sources, strict=True):
            assert await ca.store(kv, src) is True
    await in_redis(cluster.redis, f"{model}@*", 2 * n)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in zip(sources, targets, strict=True))
    )

    hosts = {1: cluster.a, 2: cluster.b}
    reports = {i: tmp_path / f"report-{i}.jsonl" for i in hosts}
    argv = {
        i: ["remap-batch", str(pairs), *server_flags(srv), "--model-name", model,
            "--shard", f"{i}/2", "--report", str(reports[i]), "--json"]
        for i, srv in hosts.items()
    }  # fmt: skip
    procs = await asyncio.gather(*(asyncio.to_thread(cli, *argv[i], cwd=tmp_path) for i in hosts))
    rows: dict[int, list[dict[str, Any]]] = {}
    for i, proc in zip(hosts, procs, strict=True):
        assert proc.returncode == 0, proc.stderr
        rows[i] = [json.loads(x) for x in reports[i].read_text().splitlines()]
        summary = json.loads(proc.stdout)
        assert (summary["pairs"], summary["hits"], summary["failures"]) == (len(rows[i]), len(rows[i]), 0)
    # Exactly once: the shards partition the lines, as sharding.select_shard says.
    lines_of = {i: sorted(r["line"] for r in rows[i]) for i in hosts}
    assert sorted(lines_of[1] + lines_of[2]) == list(range(1, n + 1))
    assert lines_of[1] and lines_of[2]
    keys = {r["line"]: r["key"] for i in hosts for r in rows[i]}
    for i in hosts:
        assert lines_of[i] == select_shard(range(1, n + 1), Shard(i, 2), key=lambda ln: keys[ln])
    assert all(r["status"] == "hit" and r["stored_new"] is True for i in hosts for r in rows[i])
    await in_redis(cluster.redis, f"{model}@*", 4 * n)
    # Each target through the server that did not remap it.
    async with client_of(cluster.a, model) as ca, client_of(cluster.b, model) as cb:
        for i in hosts:
            other = cb if i == 1 else ca
            for line in lines_of[i]:
                got = await other.retrieve(targets[line - 1])
                assert got is not None and torch.equal(got, kvs[line - 1]), line
    # Resume is per shard: shard 1 with its own report has nothing left to do.
    again = cli("remap-batch", str(pairs), *server_flags(cluster.a), "--model-name", model,
                "--shard", "1/2", "--report", str(reports[1]), "--resume", "--json", cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout)
    assert (summary["pairs"], summary["skipped"], summary["run"]) == (len(rows[1]), len(rows[1]), 0)
    bad = cli(
        "remap-batch",
        str(pairs),
        *server_flags(cluster.a),
        "--model-name",
        model,
        "--shard",
        "3/2",
        cwd=tmp_path,
    )
    assert bad.returncode == 2
    assert "argument --shard: shard index must be in 1..2, got 3" in bad.stderr


@pytest.mark.timeout(240)
async def test_remap_batch_shard_auto_as_a_kubernetes_indexed_job(cluster: Cluster, tmp_path: Path) -> None:
    """Two processes with an Indexed Job's variables (``JOB_COMPLETION_INDEX`` 0 and 1, the
    count from ``LMCACHE_ASYNC_SHARD_COUNT`` for one and ``--shard auto/2`` for the other)
    run exactly the shards ``--shard 1/2`` and ``--shard 2/2`` would, one per host."""
    from lmcache_async.cli.sharding import Shard, select_shard

    model = unique_model("mh-auto")
    n = 10
    sources = [fresh_tokens(CS) for _ in range(n)]
    targets = [fresh_tokens(CS) for _ in range(n)]
    kvs = [random_kv(GEOM, CS) for _ in range(n)]
    async with client_of(cluster.a, model) as ca:
        for kv, src in zip(kvs, sources, strict=True):
            assert await ca.store(kv, src) is True
    await in_redis(cluster.redis, f"{model}@*", n)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in zip(sources, targets, strict=True))
    )
    hosts = {0: cluster.a, 1: cluster.b}
    reports = {i: tmp_path / f"report-{i}.jsonl" for i in hosts}
    envs = {
        0: {"JOB_COMPLETION_INDEX": "0", "LMCACHE_ASYNC_SHARD_COUNT": "2"},
        1: {"JOB_COMPLETION_INDEX": "1"},
    }
    shard_flag = {0: "auto", 1: "auto/2"}
    procs = await asyncio.gather(
        *(
            asyncio.to_thread(
                cli, "remap-batch", str(pairs), *server_flags(srv), "--model-name", model,
                "--shard", shard_flag[i], "--report", str(reports[i]), "--json", cwd=tmp_path, env=envs[i],
            )
            for i, srv in hosts.items()
        )
    )  # fmt: skip
    rows: dict[int, list[dict[str, Any]]] = {}
    for i, proc in zip(hosts, procs, strict=True):
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == (
            f"lmcache-async remap-batch: shard {i + 1}/2 from Kubernetes Indexed Job (JOB_COMPLETION_INDEX)\n"
        )
        rows[i] = [json.loads(x) for x in reports[i].read_text().splitlines()]
        summary = json.loads(proc.stdout)
        assert (summary["shard"], summary["pairs"], summary["hits"], summary["failures"]) == (
            f"{i + 1}/2",
            len(rows[i]),
            len(rows[i]),
            0,
        )
    keys = {r["line"]: r["key"] for i in hosts for r in rows[i]}
    assert sorted(keys) == list(range(1, n + 1))
    for i in hosts:
        lines = sorted(r["line"] for r in rows[i])
        assert lines and lines == select_shard(range(1, n + 1), Shard(i + 1, 2), key=lambda ln: keys[ln])
    await in_redis(cluster.redis, f"{model}@*", 2 * n)
    async with client_of(cluster.a, model) as ca, client_of(cluster.b, model) as cb:
        for line in keys:
            for c in (ca, cb):
                got = await c.retrieve(targets[line - 1])
                assert got is not None and torch.equal(got, kvs[line - 1]), line
    # No scheduler variable, or disagreeing ones: exit 2 before any server is contacted.
    bad = cli("remap-batch", str(pairs), "--url", "tcp://127.0.0.1:1", "--model-name", model,
              "--shard", "auto", cwd=tmp_path)  # fmt: skip
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr == (
        "lmcache-async remap-batch: error: --shard auto: no scheduler variable is set; looked for "
        "JOB_COMPLETION_INDEX (Kubernetes Indexed Job), SLURM_ARRAY_TASK_ID (Slurm array), "
        "RANK/WORLD_SIZE (torchrun)\n"
    )
    bad = cli("remap-batch", str(pairs), "--url", "tcp://127.0.0.1:1", "--model-name", model,
              "--shard", "auto/3", cwd=tmp_path, env={"RANK": "0", "WORLD_SIZE": "2"})  # fmt: skip
    assert (bad.returncode, bad.stderr) == (
        2,
        "lmcache-async remap-batch: error: --shard auto/3: torchrun (RANK/WORLD_SIZE) says 2 shards\n",
    )


# --------------------------------------------------------------------------- Ray Data across hosts
#
# One local Ray cluster (2 CPUs, a 300 MB object store: the machine is shared) for the
# module's Ray tests, which share one pytest-xdist worker. The actors reach their server by
# ``servers={node_ip: ...}``; with one Ray node they all use the same one: A (its L1 holds
# the sources) in the first test, B (it reads them from Redis) in the second.

RAY_PAIRS = 1000
#: Ray's own deprecation notices (its DataContext defaults) are not this project's.
ray_test = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")


@pytest.fixture(scope="module")
def ray_node() -> Iterator[str]:
    """A local Ray cluster on loopback (``harness.ray_local``), stopped after the module;
    yields the node's IP, 127.0.0.1."""
    pytest.importorskip("ray")
    from harness.ray_local import local_ray

    with local_ray() as node:
        yield node


def pairs_dataset(rows: list[dict[str, Any]], blocks: int = 4) -> Any:
    import ray.data

    return ray.data.from_items(rows, override_num_blocks=blocks)


def store_sources(
    model: str, sources: list[list[int]], kvs: list[torch.Tensor], srv: RealLMCacheServer
) -> None:
    async def run() -> None:
        async with client_of(srv, model) as c:
            r = await c.store_many(list(zip(kvs, sources, strict=True)), concurrency=16)
            assert r.summary.failures == 0

    asyncio.run(run())


async def read_back(
    srv: RealLMCacheServer, model: str, targets: list[list[int]], kvs: list[torch.Tensor]
) -> None:
    """Every target through ``srv``: whole and bitwise its source's KV."""
    async with client_of(srv, model) as c:
        got = await c.retrieve_many(targets, concurrency=16)
        for i, r in enumerate(got):
            assert r.error is None and r.kv is not None and torch.equal(r.kv, kvs[i]), i


@ray_test
@pytest.mark.xdist_group("ray")
@pytest.mark.timeout(300)
async def test_ray_job_equals_one_process_remap_many(cluster: Cluster, ray_node: str) -> None:
    """A Ray Data job (2 actors) over 1,000 pairs gives, pair for pair, what one process's
    ``remap_many`` gives over the same pairs; every target is read whole and bitwise
    through either server."""
    from lmcache_async.ray import OUTPUT_COLUMNS, remap_dataset

    n = RAY_PAIRS
    stored = n - 60  # 50 misses (source never stored) and 10 invalid pairs
    model = unique_model("ray")
    sources = [fresh_tokens(CS) for _ in range(n)]
    targets = [fresh_tokens(CS) for _ in range(n)]  # the Ray job's
    others = [fresh_tokens(CS) for _ in range(n)]  # the single process's, from the same sources
    kvs = [random_kv(GEOM, CS) for _ in range(stored)]
    for i in range(n - 10, n):
        sources[i] = [-1] * CS
    await asyncio.to_thread(store_sources, model, sources[:stored], kvs, cluster.a)
    rows = [{"id": i, "source": sources[i], "target": targets[i]} for i in range(n)]

    out = await asyncio.to_thread(
        lambda: remap_dataset(
            pairs_dataset(rows), model, actors=2, batch_size=100, concurrency=8,
            servers={ray_node: (cluster.a.url, cluster.a.http_url)},
            client_options={"geometry": GEOM, "timeout": 30},
        ).take_all()
    )  # fmt: skip
    async with client_of(cluster.a, model) as ca:
        one = await ca.remap_many(list(zip(sources[: n - 10], others[: n - 10], strict=True)), concurrency=8)

    assert len(out) == n and all(tuple(r) == OUTPUT_COLUMNS for r in out)
    by_id = {int(r["id"]): r for r in out}
    assert sorted(by_id) == list(range(n))
    bpt = GEOM.bytes_per_token
    for i in range(n - 10):
        r, item = by_id[i], one[i]
        assert item.error is None
        assert (r["status"], r["retrieved_tokens"], r["stored_tokens"], r["bytes"], r["stored_new"]) == (
            "hit" if item.hit else "miss",
            item.retrieved_tokens,
            item.stored_tokens,
            (item.retrieved_tokens + item.stored_tokens) * bpt,
            item.stored_new,
        ), i
        assert (r["already_cached"], r["error_type"], r["error"], r["server"]) == (
            False,
            None,
            None,
            cluster.a.url,
        )
    assert [by_id[i]["status"] for i in range(n - 60)] == ["hit"] * (n - 60)
    assert [by_id[i]["status"] for i in range(n - 60, n - 10)] == ["miss"] * 50
    for i in range(n - 10, n):
        assert (by_id[i]["status"], by_id[i]["error_type"]) == ("error", "ValueError")
        assert by_id[i]["error"] == ("source_tokens: token id -1 is outside [0, 2**32)")
    # The row key is remap-batch's key of the same pair.
    from lmcache_async._base.pair_key import pair_key

    assert [by_id[i]["key"] for i in range(n)] == [
        pair_key(sources[i], targets[i], "", None) for i in range(n)
    ]
    await in_redis(cluster.redis, f"{model}@*", 3 * stored)  # sources, both sets of targets
    for srv in (cluster.a, cluster.b):
        await read_back(srv, model, targets[:stored], kvs)


class DyingRemapBatches:
    """The test's stand-in for an actor killed mid-job: the first actor to reach its second
    batch (once per job, by an exclusive file) remaps half of that batch, then its process
    dies at once (``os._exit``: no clean-up, as under SIGKILL). Every actor logs the keys
    of the pairs it remapped (``<marker>.<pid>``); the dead one's pid is in the marker."""

    def __init__(self, *, marker: str, **kwargs: Any) -> None:
        from lmcache_async.ray import RemapBatches

        self.inner = RemapBatches(**kwargs)
        self.marker = Path(marker)
        self.calls = 0

    def _remap(self, batch: dict[str, Any]) -> Any:
        table = self.inner(batch)
        with open(f"{self.marker}.{os.getpid()}", "a") as log:
            log.writelines(k + "\n" for k in table.column("key").to_pylist())
        return table

    def __call__(self, batch: dict[str, Any]) -> Any:
        self.calls += 1
        if self.calls == 2:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                half = self._remap({k: v[: len(v) // 2] for k, v in batch.items()})
                self.marker.write_text(json.dumps([os.getpid(), half.column("key").to_pylist()]))
                os._exit(1)
        return self._remap(batch)


@ray_test
@pytest.mark.xdist_group("ray")
@pytest.mark.timeout(300)
async def test_ray_actor_killed_mid_job_then_resume_redoes_nothing(
    cluster: Cluster, ray_node: str, tmp_path: Path
) -> None:
    """An actor dies after half a batch: Ray restarts it and retries the batch, the job
    finishes, every pair is in the output once, the pairs redone say ``already_cached``
    (those of the half batch at least, and only pairs the dead actor had done), and every
    target is whole and bitwise. A job resumed from this
    output has nothing left to do; from a part of it, exactly the rest."""
    import ray.data

    from lmcache_async.ray import skip_done

    model = unique_model("ray-kill")
    n, batch = 200, 25
    sources = [fresh_tokens(2 * CS) for _ in range(n)]
    targets = [fresh_tokens(2 * CS) for _ in range(n)]
    kvs = [random_kv(GEOM, 2 * CS) for _ in range(n)]
    await asyncio.to_thread(store_sources, model, sources, kvs, cluster.a)
    await in_redis(cluster.redis, f"{model}@*", 2 * n)
    rows = [{"id": i, "source": sources[i], "target": targets[i]} for i in range(n)]
    marker = tmp_path / "died"
    kwargs = {
        "marker": str(marker), "model_name": model, "concurrency": 8,
        "servers": {ray_node: (cluster.b.url, cluster.b.http_url)},
        "client_options": {"geometry": GEOM, "timeout": 30},
    }  # fmt: skip
    out = await asyncio.to_thread(
        lambda: (
            pairs_dataset(rows)
            .map_batches(
                DyingRemapBatches,
                fn_constructor_kwargs=kwargs,
                compute=ray.data.ActorPoolStrategy(size=2),
                batch_size=batch,
                batch_format="numpy",
            )
            .take_all()
        )
    )
    pid, last = json.loads(marker.read_text())  # the dead actor, its last half batch
    assert len(last) == batch // 2
    by_dead = set((tmp_path / f"died.{pid}").read_text().split())  # every pair it remapped
    assert len(out) == n
    assert sorted(int(r["id"]) for r in out) == list(range(n))  # each pair once
    assert len({r["key"] for r in out}) == n
    assert all(r["status"] == "hit" and r["retrieved_tokens"] == r["stored_tokens"] == 2 * CS for r in out)
    # Redone: the half batch it died in (and whatever else of its work Ray retried, e.g.
    # a batch whose output had not reached the driver yet): only pairs the dead actor did.
    again = {r["key"] for r in out if r["already_cached"]}
    assert set(last) <= again <= by_dead
    assert all(r["stored_new"] is (r["key"] not in again) for r in out)
    await in_redis(cluster.redis, f"{model}@*", 4 * n)
    for srv in (cluster.a, cluster.b):
        await read_back(srv, model, targets, kvs)

    # Resume: from the whole output nothing is left; from a part, exactly the rest (a row
    # that says error is not done: pair 9 is redone).
    done_ds = ray.data.from_items(out)
    assert await asyncio.to_thread(lambda: skip_done(pairs_dataset(rows), done_ds).count()) == 0
    keep = [{**r, "status": "error"} if int(r["id"]) == 9 else r for r in out if int(r["id"]) % 3 == 0]
    left = await asyncio.to_thread(lambda: skip_done(pairs_dataset(rows), keep).take_all())
    assert sorted(int(r["id"]) for r in left) == [i for i in range(n) if i % 3 or i == 9]


# --------------------------------------------------------------------------- rolling upgrade


@pytest.fixture(scope="module")
def server_057(
    cluster: Cluster, _real_server_registry: Any, lmcache057_python: Path
) -> Iterator[RealLMCacheServer]:
    """A 0.5.7rc3 server (same flags) on the cluster's Redis."""
    srv = _real_server_registry.start(
        "shm", lmcache057_python, name="l2_057", extra_args=l2_args(cluster.redis)
    )
    assert srv.get_json("/lmc_version") == "0.5.7rc3.dev0"
    yield srv
    srv.stop()
    assert srv.leftovers() == []


@pytest.mark.timeout(240)
async def test_rolling_upgrade_056_and_057_share_redis(
    cluster: Cluster, server_057: RealLMCacheServer, lmcache_python: Path, lmcache057_python: Path
) -> None:
    """KV written through a 0.5.6 server is read bitwise through a 0.5.7rc3 server sharing
    the Redis L2, and the other way round (same chunk hashes, same Redis keys, same bytes).
    The 0.5.7 side is driven by the OFFICIAL 0.5.7rc3 SDK from its venv (a 0.5.7 engine
    registration gives it the geometry in /status); the 0.5.6 side by this client and by
    0.5.6's own engine path (a fake vLLM worker)."""
    from harness.workers import EngineWorker, SDKWorker

    model = unique_model("mh-upgrade")
    geometry = KVGeometry(2, 2, 8, torch.bfloat16, 4)
    reg: dict[str, Any] = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "block_size": 4,
        "num_blocks": 64,
    }
    ours, theirs, engine_056 = fresh_tokens(2 * CS), fresh_tokens(2 * CS), fresh_tokens(3 * CS)
    kv_ours, kv_theirs, kv_056 = (
        random_kv(geometry, 2 * CS),
        random_kv(geometry, 2 * CS),
        random_kv(geometry, 3 * CS),
    )
    new_engine = EngineWorker(server_057.url, python=lmcache057_python)
    new = SDKWorker(python=lmcache057_python)
    old = EngineWorker(cluster.a.url, python=lmcache_python)
    for worker in (new_engine, new, old):
        worker.spawn()  # overlap the three ~2.5 s interpreter startups
    with new_engine, new, old:
        new_engine.register(model, **reg)  # registration only: /status gets the layout
        assert new.connect(server_057.url, server_057.http_url, model)["chunk_size"] == CS
        old.register(model, **reg)
        async with AsyncClient(cluster.a.url, cluster.a.http_url, model, geometry=geometry, timeout=30) as ca:
            # 0.5.6 -> 0.5.7: this client and 0.5.6's engine write through A, 0.5.7 reads.
            assert await ca.store(kv_ours, ours) is True
            assert old.store(engine_056, kv_056) is True
            await in_redis(cluster.redis, f"{model}@*", 5)
            got = new.retrieve(ours)
            assert got is not None and torch.equal(got, kv_ours)
            got = new.retrieve(engine_056)
            assert got is not None and torch.equal(got, kv_056)
            # 0.5.7 -> 0.5.6: the 0.5.7 SDK writes, this client and 0.5.6's engine read.
            assert new.store(theirs, kv_theirs) is True
            await in_redis(cluster.redis, f"{model}@*", 7)
            got = await ca.retrieve(theirs)
            assert got is not None and torch.equal(got, kv_theirs)
        got = old.retrieve(theirs)
        assert got is not None and torch.equal(got, kv_theirs)


async def test_rolling_upgrade_this_client_on_both_generations(
    cluster: Cluster, server_057: RealLMCacheServer
) -> None:
    """This client on the 0.5.7 server reads what it stored through the 0.5.6 server, and
    the other way round, through the shared Redis."""
    model = unique_model("mh-upgrade-ours")
    up, down = fresh_tokens(2 * CS), fresh_tokens(2 * CS)
    kv_up, kv_down = random_kv(GEOM, 2 * CS), random_kv(GEOM, 2 * CS)
    async with client_of(cluster.a, model) as old, client_of(server_057, model) as new:
        assert await old.store(kv_up, up) is True
        assert await new.store(kv_down, down) is True
        await in_redis(cluster.redis, f"{model}@*", 4)
        got = await new.retrieve(up)
        assert got is not None and torch.equal(got, kv_up)
        got = await old.retrieve(down)
        assert got is not None and torch.equal(got, kv_down)
