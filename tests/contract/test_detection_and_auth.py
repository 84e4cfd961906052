"""Generation detection at connect and HTTP API keys: a tiny aiohttp fake for the answers
a real server will not give on demand, the real 0.5.6 and 0.5.7rc3 servers for the rest."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch
from aiohttp import web

import lmcache_async as lmc
from harness.real_server import RealLMCacheServer
from lmcache_async.errors import UnknownServerVersionWarning
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, random_kv, unique_model

pytestmark = pytest.mark.anyio

KEY = "sekrit-key-1"


class FakeHTTP:
    """An HTTP server whose answers a test sets: ``routes[path] = (status, json_body)``;
    ``key`` set: every path but ``/`` and ``/healthcheck`` wants ``Bearer key``."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, Any]] = {}
        self.key: str | None = None
        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization header)
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization")
        self.seen.append((request.path, auth))
        if (
            self.key is not None
            and request.path not in ("/", "/healthcheck")
            and auth != f"Bearer {self.key}"
        ):
            return web.json_response({"detail": "Invalid or missing API key"}, status=401)
        status, body = self.routes.get(request.path, (404, {"detail": "Not Found"}))
        return web.Response(status=status, text=json.dumps(body), content_type="application/json")


@pytest.fixture
async def fake() -> AsyncIterator[FakeHTTP]:
    srv = FakeHTTP()
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", srv.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    srv.url = f"http://127.0.0.1:{port}"
    yield srv
    await runner.cleanup()


def _client(fake: FakeHTTP, **kw: Any) -> lmc.AsyncClient:
    # The ZMQ endpoint is never reached: every test here fails or stops on HTTP first.
    return lmc.AsyncClient("tcp://127.0.0.1:9", fake.url, "m", geometry=SMALL_GEOMETRY, timeout=10, **kw)


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LMCACHE_API_KEY", raising=False)


# --------------------------------------------------------------------------- detection


@pytest.mark.parametrize("version", ["0.5.5", "0.4.2", "nightly"])
async def test_an_unsupported_version_is_a_clear_error_naming_it(fake: FakeHTTP, version: str) -> None:
    fake.routes["/lmc_version"] = (200, version)
    with pytest.raises(
        lmc.UnsupportedServerVersionError, match=f"unsupported LMCache server version {version!r}"
    ) as ei:
        await _client(fake).open()
    assert ei.value.version == version
    assert [p for p, _ in fake.seen] == ["/lmc_version"]  # nothing else was asked


async def test_a_newer_version_is_best_effort_with_a_warning(fake: FakeHTTP) -> None:
    fake.routes["/lmc_version"] = (200, "0.6.0")
    fake.routes["/config"] = (503, {"error": "engine not initialized"})
    with pytest.warns(UnknownServerVersionWarning, match="'0.6.0' is newer than any this client knows"):
        with pytest.raises(lmc.HTTPStatusError, match="/config failed with HTTP 503") as ei:
            await _client(fake).open()
    assert ei.value.status == 503
    assert ei.value.url == f"{fake.url}/config"
    assert "engine not initialized" in ei.value.body
    assert not isinstance(ei.value, lmc.AuthenticationError)


async def test_no_lmc_version_route_is_talked_to_as_0_5_6_with_a_logged_warning(
    fake: FakeHTTP, caplog: pytest.LogCaptureFixture
) -> None:
    fake.routes["/config"] = (500, "boom")
    with caplog.at_level(logging.WARNING, logger="lmcache_async._engine.session"):
        with pytest.raises(lmc.HTTPStatusError) as ei:
            await _client(fake).open()
    assert ei.value.status == 500
    assert any(
        "has no /lmc_version" in r.getMessage() and "as 0.5.6" in r.getMessage() for r in caplog.records
    )


async def test_a_non_string_version_is_a_protocol_error(fake: FakeHTTP) -> None:
    fake.routes["/lmc_version"] = (200, {"version": "0.5.7"})
    with pytest.raises(lmc.ProtocolError, match="GET /lmc_version answered .* not a version string"):
        await _client(fake).open()


# --------------------------------------------------------------------------- API keys


async def test_401_without_a_key_says_a_key_is_needed(fake: FakeHTTP) -> None:
    fake.key = KEY
    with pytest.raises(
        lmc.AuthenticationError, match="requires an API key: pass api_key= or set LMCACHE_API_KEY"
    ) as ei:
        await _client(fake).open()
    assert (ei.value.status, ei.value.url, ei.value.key_sent) == (401, f"{fake.url}/lmc_version", False)
    assert isinstance(ei.value, lmc.HTTPStatusError) and isinstance(ei.value, PermissionError)
    assert fake.seen == [("/lmc_version", None)]


async def test_401_with_a_wrong_key_says_it_was_rejected(fake: FakeHTTP) -> None:
    fake.key = KEY
    with pytest.raises(lmc.AuthenticationError, match="the API key sent was rejected") as ei:
        await _client(fake, api_key="wrong").open()
    assert ei.value.key_sent is True
    assert fake.seen == [("/lmc_version", "Bearer wrong")]


@pytest.mark.parametrize("source", ["argument", "environment"])
async def test_the_key_goes_as_a_bearer_token_on_every_http_call(
    fake: FakeHTTP, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    fake.key = KEY
    fake.routes["/lmc_version"] = (200, "0.5.7rc3.dev0")
    fake.routes["/config"] = (200, {"mp": {"chunk_size": 16, "supported_transfer_mode": "auto"}})
    fake.routes["/status"] = (503, {"error": "engine not initialized"})
    kw: dict[str, Any] = {}
    if source == "argument":
        kw["api_key"] = KEY
    else:
        monkeypatch.setenv("LMCACHE_API_KEY", KEY)
    with pytest.raises(lmc.HTTPStatusError, match="/status failed with HTTP 503"):
        await _client(fake, **kw).open()
    # 0.5.7 reads the live chunk size from /status
    assert fake.seen == [(p, f"Bearer {KEY}") for p in ("/lmc_version", "/config", "/status")]


@pytest.mark.parametrize("bad", ["", "two words", "line\nbreak"])
def test_a_key_that_cannot_travel_in_a_header_is_refused_up_front(bad: str) -> None:
    with pytest.raises(ValueError, match="api_key must be a non-empty string"):
        lmc.AsyncClient("tcp://127.0.0.1:9", "http://127.0.0.1:9", "m", api_key=bad)


# --------------------------------------------------------------------------- real servers


async def test_server_version_of_the_real_servers(
    real_server_shm: RealLMCacheServer, real_server_057_pickle: RealLMCacheServer
) -> None:
    for srv, version, generation, transfer in (
        (real_server_shm, "0.5.6", "0.5.6", "shm"),
        (real_server_057_pickle, "0.5.7rc3.dev0", "0.5.7", "pickle"),
    ):
        async with lmc.AsyncClient(srv.url, srv.http_url, unique_model(), geometry=SMALL_GEOMETRY) as c:
            assert (c.server_version, c.wire_generation, c.transfer) == (version, generation, transfer)


async def test_real_0_5_7_server_with_an_api_key(
    fresh_real_server: Callable[..., RealLMCacheServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = fresh_real_server("shm", generation="0.5.7", api_key=KEY)
    model = unique_model()
    with pytest.raises(lmc.AuthenticationError, match="requires an API key") as ei:
        await lmc.AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY).open()
    assert ei.value.status == 401
    with pytest.raises(lmc.AuthenticationError, match="rejected"):
        await lmc.AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, api_key="nope").open()
    toks = fresh_tokens(40)
    kv = random_kv(SMALL_GEOMETRY, 40)
    async with lmc.AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, api_key=KEY) as c:
        assert c.server_version == "0.5.7rc3.dev0"
        assert await c.store(kv, toks) is True
        got = await c.retrieve(toks)
        assert got is not None and torch.equal(got, kv[:, :, :32])
        assert (await c.status(max_age=0))["chunk_size"] == 16
    monkeypatch.setenv("LMCACHE_API_KEY", KEY)
    async with lmc.AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY) as c:
        got = await c.retrieve(toks)
        assert got is not None and torch.equal(got, kv[:, :, :32])


def test_blocking_client_takes_the_key_and_reports_the_version(
    fresh_real_server: Callable[..., RealLMCacheServer],
) -> None:
    srv = fresh_real_server("pickle", generation="0.5.7", api_key=KEY)
    with lmc.Client(srv.url, srv.http_url, unique_model(), geometry=SMALL_GEOMETRY, api_key=KEY) as c:
        assert (c.server_version, c.wire_generation, c.transfer) == ("0.5.7rc3.dev0", "0.5.7", "pickle")
        toks = fresh_tokens(16)
        kv = random_kv(SMALL_GEOMETRY, 16)
        assert c.store(kv, toks) is True
        got = c.retrieve(toks)
        assert got is not None and torch.equal(got, kv)
