"""The command line against the real LMCache 0.5.7rc3 server: a remap over SHM and inline,
and an API-keyed server (the key comes from ``LMCACHE_API_KEY``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from harness.real_server import RealLMCacheServer
from lmcache_async import AsyncClient
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, random_kv, unique_model
from tests.system.test_cli_commands import GEOMETRY_FLAGS, cli, ok, server_args

pytestmark = pytest.mark.real_server

KEY = "cli-key-057"


async def _store(
    srv: RealLMCacheServer, model: str, kv: torch.Tensor, tokens: list[int], api_key: str | None = None
) -> None:
    async with AsyncClient(
        srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30, api_key=api_key
    ) as c:
        assert await c.store(kv, tokens) is True


async def _retrieve(
    srv: RealLMCacheServer, model: str, tokens: list[int], salt: str, api_key: str | None = None
) -> torch.Tensor | None:
    async with AsyncClient(
        srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30, api_key=api_key
    ) as c:
        return await c.retrieve(tokens, salt)


@pytest.mark.parametrize("mode", ["shm", "pickle"])
def test_remap_on_0_5_7(mode: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    srv: RealLMCacheServer = request.getfixturevalue(f"real_server_057_{mode}")
    model = unique_model("cli057")
    src, dst = fresh_tokens(64), fresh_tokens(40)
    kv = random_kv(SMALL_GEOMETRY, 64, seed=5)
    asyncio.run(_store(srv, model, kv, src))
    done = ok(cli("remap", *server_args(srv), *GEOMETRY_FLAGS, "--model-name", model, "--source-tokens",
                  f"{src[0]}:{src[0] + 64}", "--target-tokens", f"{dst[0]}:{dst[0] + 40}",
                  "--target-cache-salt", "t", "--json", cwd=tmp_path))  # fmt: skip
    assert json.loads(done.stdout) == {
        "model_name": model,
        "cache_salt": "",
        "target_cache_salt": "t",
        "source_tokens": 64,
        "target_tokens": 40,
        "retrieved_tokens": 32,
        "stored_tokens": 32,
        "stored_new": True,
        "hit": True,
    }
    got = asyncio.run(_retrieve(srv, model, dst, "t"))
    assert got is not None and torch.equal(got, kv[:, :, :32])


def test_an_api_keyed_server_needs_the_key_from_the_environment(
    fresh_real_server: Callable[..., RealLMCacheServer], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    srv = fresh_real_server("pickle", generation="0.5.7", api_key=KEY)
    model = unique_model("cli057-key")
    src, dst = fresh_tokens(32), fresh_tokens(32)
    kv = random_kv(SMALL_GEOMETRY, 32, seed=6)
    asyncio.run(_store(srv, model, kv, src, api_key=KEY))
    args = [*server_args(srv), *GEOMETRY_FLAGS, "--model-name", model, "--source-tokens",
            f"{src[0]}:{src[0] + 32}", "--target-tokens", f"{dst[0]}:{dst[0] + 32}", "--json"]  # fmt: skip
    monkeypatch.delenv("LMCACHE_API_KEY", raising=False)
    refused = cli("remap", *args, cwd=tmp_path)
    assert refused.returncode != 0
    assert "requires an API key: pass api_key= or set LMCACHE_API_KEY" in refused.stderr + refused.stdout
    monkeypatch.setenv("LMCACHE_API_KEY", KEY)
    done = ok(cli("remap", *args, cwd=tmp_path))
    assert json.loads(done.stdout)["stored_tokens"] == 32
    got = asyncio.run(_retrieve(srv, model, dst, "", api_key=KEY))
    assert got is not None and torch.equal(got, kv)
