"""The routing service (``lmcache_async.fleet.service``) over a Fleet of the two REAL
session servers (0.5.6, SHM and pickle; a fleet refuses the embedded server, which has
no LMCache chunk hashes): the exact JSON of a hit (from the index), a miss (from
fan-out), every bad request (400, word for word, nothing asked of a server or the
index), the deadline (an index that never answers: 504 in time), the health and the
counters. Then two replicas (two apps on two ports) sharing one REAL ``redis-server``
index: what replica A's fleet stored, replica B scores from the index, exactly as
``lookup`` on the servers answers."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from harness.redis_server import RedisServer
from lmcache_async.fleet import Fleet, FleetIndex, IndexOp, MemoryIndex, RedisIndex
from lmcache_async.fleet.service import create_app
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, random_kv, unique_model

pytestmark = pytest.mark.anyio
CS = 16


class _CountingIndex(MemoryIndex):
    """A memory index that counts the reads (a bad request must not reach it)."""

    def __init__(self) -> None:
        super().__init__(10_000)
        self.reads = 0

    async def prefix(self, hashes: Sequence[bytes], servers: Collection[str]) -> dict[str, int]:
        self.reads += 1
        return await super().prefix(hashes, servers)


class _StuckIndex(FleetIndex):
    """An index whose reads never answer (a Redis that hangs)."""

    async def apply(self, ops: Sequence[IndexOp]) -> None:
        return None

    async def prefix(self, hashes: Sequence[bytes], servers: Collection[str]) -> dict[str, int] | None:
        await asyncio.sleep(3600)
        return None


@pytest.fixture
async def service(real_server_shm: Any, real_server_pickle: Any) -> AsyncIterator[Any]:
    pairs = [(s.url, s.http_url) for s in (real_server_shm, real_server_pickle)]
    index = _CountingIndex()
    async with Fleet(pairs, unique_model("svc"), index=index, events=False, geometry=SMALL_GEOMETRY) as fleet:
        async with TestClient(TestServer(create_app(fleet, deadline=5.0, max_body=4096))) as http:
            yield fleet, index, http


async def test_a_hit_from_the_index_and_a_miss_by_fanout(service: Any) -> None:
    fleet, index, http = service
    a, b = fleet.servers
    toks = fresh_tokens(3 * CS)
    assert (await fleet.store(random_kv(SMALL_GEOMETRY, 3 * CS), toks, server=b)).value is True
    resp = await http.post("/score", json={"tokens": toks[: 2 * CS] + [1] * 5})
    assert resp.status == 200
    assert await resp.json() == {"scores": {a: 0, b: 2 * CS}, "server": b, "source": "index"}
    resp = await http.post("/score", json={"tokens": toks, "cache_salt": ""})
    assert await resp.json() == {"scores": {a: 0, b: 3 * CS}, "server": b, "source": "index"}
    miss = fresh_tokens(2 * CS)
    chosen = (await fleet.best(miss, fanout="never")).server
    resp = await http.post("/score", json={"tokens": miss})
    assert resp.status == 200
    assert await resp.json() == {"scores": {a: 0, b: 0}, "server": chosen, "source": "fanout"}
    # a salted prompt fans out (the index is salt-blind); the salted store is found there
    assert (await fleet.store(random_kv(SMALL_GEOMETRY, CS), miss[:CS], "s1", server=a)).value is True
    resp = await http.post("/score", json={"tokens": miss, "cache_salt": "s1"})
    assert await resp.json() == {"scores": {a: CS, b: 0}, "server": a, "source": "fanout"}
    assert index.reads == 5  # the four requests and the best() above
    resp = await http.get("/metrics")
    assert await resp.json() == {
        "requests": 4,
        "ok": 4,
        "index": 2,
        "fanout": 2,
        "bad_request": 0,
        "deadline": 0,
        "unavailable": 0,
        "failed": 0,
    }
    resp = await http.get("/healthz")
    assert resp.status == 200
    assert await resp.json() == {
        "servers": [{"url": c.url, "http_url": c.http_url, "up": True} for c in fleet.clients],
        "up": 2,
        "index": {"kind": "_CountingIndex", "available": True},
    }


BAD: list[tuple[dict[str, Any], str]] = [
    (
        {"data": "[1]", "headers": {"Content-Type": "text/plain"}},
        "Content-Type must be application/json, got 'text/plain'",
    ),
    ({"data": b"[1]"}, "Content-Type must be application/json, got 'application/octet-stream'"),
    ({"json": {"tokens": list(range(1000))}}, "the body is larger than 4096 bytes"),
    ({"data": "{", "headers": {"Content-Type": "application/json"}}, "the body is not valid JSON"),
    ({"json": [1, 2]}, "the body must be a JSON object, got list"),
    ({"json": {"tokens": [1], "salt": "x"}}, "unknown keys ['salt'] (known: 'tokens', 'cache_salt')"),
    ({"json": {}}, "'tokens' is required"),
    ({"json": {"tokens": "abc"}}, "tokens must be a sequence of ints, got str"),
    ({"json": {"tokens": [1, -1]}}, "tokens: token id -1 is outside [0, 2**32)"),
    ({"json": {"tokens": [1, 2.5]}}, "tokens must contain ints, found float"),
    ({"json": {"tokens": [True]}}, "tokens must contain ints, found bool"),
    ({"json": {"tokens": [1], "cache_salt": 5}}, "cache_salt must be a str, got int"),
    ({"json": {"tokens": [1], "cache_salt": "a/b"}}, "cache_salt must not contain '/': 'a/b'"),
]


async def test_bad_requests_are_400_before_anything_is_asked(service: Any) -> None:
    fleet, index, http = service
    got = []
    for kw, _ in BAD:
        resp = await http.post("/score", **kw)
        got.append((resp.status, await resp.json()))
    assert got == [(400, {"error": message}) for _, message in BAD]
    assert index.reads == 0
    assert all(c.in_flight == 0 for c in fleet.clients)
    assert (await (await http.get("/metrics")).json())["bad_request"] == len(BAD)


async def test_a_request_past_its_deadline_is_504_in_time(real_server_shm: Any) -> None:
    srv = real_server_shm
    async with Fleet(
        [(srv.url, srv.http_url)],
        unique_model("svc"),
        index=_StuckIndex(),
        events=False,
        geometry=SMALL_GEOMETRY,
    ) as fleet:
        async with TestClient(TestServer(create_app(fleet, deadline=0.2))) as http:
            start = time.monotonic()
            resp = await http.post("/score", json={"tokens": fresh_tokens(CS)})
            took = time.monotonic() - start
            assert (resp.status, await resp.json()) == (
                504,
                {"error": "the request ran past its deadline of 0.2 s"},
            )
            assert 0.2 <= took < 1.5
            assert (await (await http.get("/metrics")).json())["deadline"] == 1


async def test_create_app_refuses_bad_arguments(real_server_shm: Any) -> None:
    with pytest.raises(TypeError, match="^fleet must be a Fleet, got str$"):
        create_app("fleet")  # type: ignore[arg-type]
    srv = real_server_shm
    fleet = Fleet([(srv.url, srv.http_url)], unique_model("svc"), events=False, geometry=SMALL_GEOMETRY)
    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match=r"^deadline must be a finite number of seconds > 0, got "):
            create_app(fleet, deadline=bad)  # type: ignore[arg-type]
    for bad_size in (0, True, 1.5):
        with pytest.raises(ValueError, match=r"^max_body must be an int >= 1, got "):
            create_app(fleet, max_body=bad_size)  # type: ignore[arg-type]


async def test_no_server_up_is_503(real_server_shm: Any) -> None:
    srv = real_server_shm
    async with Fleet(
        [(srv.url, srv.http_url)], unique_model("svc"), events=False, geometry=SMALL_GEOMETRY
    ) as fleet:
        async with TestClient(TestServer(create_app(fleet))) as http:
            await fleet.clients[0].aclose()
            resp = await http.post("/score", json={"tokens": [1, 2, 3]})
            assert (resp.status, await resp.json()) == (503, {"error": "fleet: no server is up"})
            resp = await http.get("/healthz")
            assert resp.status == 503 and (await resp.json())["up"] == 0


async def test_two_replicas_share_one_redis_index(real_server_shm: Any, real_server_pickle: Any) -> None:
    pairs = [(s.url, s.http_url) for s in (real_server_shm, real_server_pickle)]
    a, b = (u for u, _ in pairs)
    model = unique_model("svc-redis")
    redis = RedisServer().start()
    url = f"redis://127.0.0.1:{redis.port}/0"
    indexes = [RedisIndex(url, model, deadline=0.5, retry_after=0.2) for _ in range(2)]
    try:
        async with (
            Fleet(pairs, model, index=indexes[0], events=False, geometry=SMALL_GEOMETRY) as fleet_a,
            Fleet(pairs, model, index=indexes[1], events=False, geometry=SMALL_GEOMETRY) as fleet_b,
            TestClient(TestServer(create_app(fleet_a))) as replica_a,
            TestClient(TestServer(create_app(fleet_b))) as replica_b,
        ):
            assert replica_a.port != replica_b.port
            toks = fresh_tokens(3 * CS)
            assert (await fleet_a.store(random_kv(SMALL_GEOMETRY, 3 * CS), toks, server=b)).value is True
            prompt = toks[: 2 * CS] + [1] * CS
            resp = await replica_b.post("/score", json={"tokens": prompt})
            assert resp.status == 200
            body = await resp.json()
            assert body == {"scores": {a: 0, b: 2 * CS}, "server": b, "source": "index"}
            assert body["scores"] == {c.url: await c.lookup(prompt) for c in fleet_b.clients}
            # replica A answers alike; a prompt nobody holds: both fan out, choose alike
            assert await (await replica_a.post("/score", json={"tokens": prompt})).json() == body
            miss = fresh_tokens(2 * CS)
            got = [
                await (await r.post("/score", json={"tokens": miss})).json() for r in (replica_a, replica_b)
            ]
            assert got[0] == got[1] and got[0]["scores"] == {a: 0, b: 0} and got[0]["source"] == "fanout"
            health = await (await replica_b.get("/healthz")).json()
            assert health["up"] == 2 and health["index"] == {"kind": "RedisIndex", "available": True}
            assert [i.failures for i in indexes] == [0, 0]
    finally:
        for index in indexes:
            await index.aclose()
        redis.cleanup()
    assert redis.pid is None


def test_the_route_command_serves_until_sigterm(real_server_shm: Any) -> None:
    srv = real_server_shm
    model = unique_model("svc-cli")
    argv = [sys.executable, "-m", "lmcache_async", "route", "--server", f"{srv.url},{srv.http_url}"]
    argv += ["--model-name", model, "--port", "0", "--json", "--num-layers", "2", "--num-kv-heads", "2"]
    argv += ["--head-dim", "8"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert info["servers"] == [srv.url] and info["index"] == "memory"
        body = json.dumps({"tokens": fresh_tokens(CS)}).encode()
        request = urllib.request.Request(
            info["url"] + "/score", body, {"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert json.loads(resp.read()) == {"scores": {srv.url: 0}, "server": srv.url, "source": "fanout"}
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        assert (proc.returncode, out) == (0, "stopped\n"), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    bad = subprocess.run(
        [sys.executable, "-m", "lmcache_async", "route", "--server", srv.url, "--model-name", model],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[-1] == (
        "lmcache-async route: error: argument --server: expected URL,HTTP_URL "
        f"(e.g. tcp://host:5555,http://host:8080), got {srv.url!r}"
    )
