"""The 0.5.7 generation in the real-server test infrastructure (harness/, tests/plugins/).

The real LMCache 0.5.7rc3 server, run from ``.lmcache-venv-057``, starts in both
transports with the same flags as 0.5.6, says what it is on ``/lmc_version``, and
the generation of a venv is read from what is installed in it. lmcache 0.5.7's own
counterparts -- the fake vLLM worker (lmcache-driven transfer context) and the
official SDK -- run from that venv and exchange KV with each other bitwise.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from harness.real_server import (
    LMC_VERSIONS,
    LMCacheServerError,
    RealLMCacheServer,
    venv_generation,
)
from harness.workers import EngineWorker, SDKWorker

CS = 16  # chunk size of the session servers (tests.helpers.SESSION_CHUNK_SIZE)


def test_lmc_version_names_each_generation(
    real_server_057: RealLMCacheServer, real_server_shm: RealLMCacheServer
) -> None:
    assert real_server_057.generation == "0.5.7"
    assert real_server_057.get_json("/lmc_version") == "0.5.7rc3.dev0" == real_server_057.lmc_version
    assert real_server_shm.generation == "0.5.6"
    assert real_server_shm.get_json("/lmc_version") == "0.5.6" == LMC_VERSIONS["0.5.6"]


def test_057_server_health_config_and_status(real_server_057: RealLMCacheServer) -> None:
    status, body = real_server_057.http_get("/healthcheck")
    assert (status, json.loads(body)) == (200, {"status": "healthy"})

    mp = real_server_057.config()["mp"]
    assert mp["chunk_size"] == CS == real_server_057.chunk_size
    assert mp["supported_transfer_mode"] == "auto"
    assert mp["port"] == real_server_057.port
    assert mp["shm_name"] == real_server_057.shm_name
    # 0.5.7 negotiates the chunk size; with no engine asking, the live one is the minimum.
    assert real_server_057.status()["chunk_size"] == CS

    if real_server_057.mode == "shm":
        assert real_server_057.shm_segment == f"/dev/shm/lmcache_l1_pool_{real_server_057.shm_name}"
        assert os.stat(real_server_057.shm_segment).st_size == 1 << 30  # the whole 1 GiB L1
    else:
        assert real_server_057.shm_segment is None


def test_fresh_057_server_with_api_key_then_stops_clean(
    fresh_real_server: Callable[..., RealLMCacheServer],
) -> None:
    srv = fresh_real_server("shm", generation="0.5.7", api_key="k-123")
    assert (srv.generation, srv.api_key) == ("0.5.7", "k-123")
    no_key: dict[str, str] = {}
    # Public routes answer without a key; every other one needs it.
    assert srv.http_get("/", headers=no_key) == (200, b'{"status":"ok","service":"LMCache HTTP API"}')
    assert srv.http_get("/healthcheck", headers=no_key)[0] == 200
    for path in ("/config", "/status", "/lmc_version"):
        status, body = srv.http_get(path, headers=no_key)
        assert (status, json.loads(body)) == (401, {"detail": "Invalid or missing API key"}), path
    assert srv.http_get("/lmc_version", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert srv.http_get("/lmc_version", headers={"Authorization": "Basic k-123"})[0] == 401
    assert srv.http_get("/lmc_version", headers={"Authorization": "Bearer k-123"}) == (
        200,
        b'"0.5.7rc3.dev0"',
    )
    assert srv.http_get("/lmc_version", headers={"X-LMCache-API-Key": "k-123"}) == (200, b'"0.5.7rc3.dev0"')
    assert srv.get_json("/lmc_version") == "0.5.7rc3.dev0"  # sends the server's key

    segment = srv.shm_segment
    assert segment is not None and os.path.exists(segment)
    assert srv.stop() is not None
    assert srv.leftovers() == []
    assert not os.path.exists(segment)


def test_venv_generation_is_read_from_the_venv(lmcache_python: Path, lmcache057_python: Path) -> None:
    assert venv_generation(lmcache_python) == "0.5.6"
    assert venv_generation(lmcache057_python) == "0.5.7"
    assert RealLMCacheServer("pickle", venv_python=lmcache057_python).generation == "0.5.7"
    assert RealLMCacheServer("pickle", venv_python=lmcache_python).generation == "0.5.6"
    with pytest.raises(ValueError, match=r"is an lmcache 0\.5\.7 venv, not 0\.5\.6"):
        RealLMCacheServer("pickle", venv_python=lmcache057_python, generation="0.5.6")


def test_unknown_generation_and_foreign_venv_are_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"unknown LMCache server generation '0\.5\.8'; known: 0\.5\.6, 0\.5\.7"
    ):
        RealLMCacheServer("shm", generation="0.5.8")  # type: ignore[arg-type]
    with pytest.raises(LMCacheServerError, match="found no lmcache distribution"):
        venv_generation(tmp_path / "bin" / "python")
    assert RealLMCacheServer("shm").generation == "0.5.6"
    with pytest.raises(ValueError, match="api_key needs generation 0.5.7"):
        RealLMCacheServer("shm", api_key="k")


# --------------------------------------------------------------------------- lmcache's own counterparts

# A small vLLM-style geometry: 2 layers, 2 KV heads, head dim 8, block 4.
L, NH, HS, BS, NB = 2, 2, 8, 4, 64
D = NH * HS


def _kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, L, tokens, D, generator=g).to(torch.bfloat16)


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_057_engine_and_official_sdk_interoperate(real_server_057: RealLMCacheServer) -> None:
    """lmcache 0.5.7's own engine path stores, its official SDK reads bitwise, and back."""
    model = f"infra057/sdk-{real_server_057.mode}"
    eng, sdk = EngineWorker(real_server_057), SDKWorker(generation=real_server_057.generation)
    eng.spawn(), sdk.spawn()  # overlap the two interpreter startups
    with eng, sdk:
        assert (eng.generation, eng.lmcache_version) == ("0.5.7", "0.5.7rc3.dev0")
        assert (sdk.generation, sdk.lmcache_version) == ("0.5.7", "0.5.7rc3.dev0")
        reg = eng.register(
            model, num_layers=L, num_kv_heads=NH, head_dim=HS, block_size=BS, num_blocks=NB,
            dtype=torch.bfloat16,
        )  # fmt: skip
        assert (reg["chunk_size"], reg["blocks_in_chunk"]) == (CS, CS // BS)
        group = real_server_057.status()["cache_context_meta"][str(eng.instance_id)]["kv_cache_layout"]
        assert group["kernel_groups"][0]["engine_kv_concrete_shape"] == f"{L} x [2, {NB}, {BS}, {NH}, {HS}]"

        # 2 whole chunks + a partial tail (never stored), through the engine's paged blocks.
        tokens = _tokens(1000, 2 * CS + 5)
        kv = _kv(len(tokens), seed=1)
        assert eng.store(tokens, kv) is True
        got = eng.retrieve(tokens)
        assert got is not None and got.dtype == torch.bfloat16
        assert torch.equal(got, kv[:, :, : 2 * CS])

        conn = sdk.connect(real_server_057.url, real_server_057.http_url, model)
        assert conn["chunk_size"] == CS
        expected = {"shm": "EngineDrivenContextShm", "pickle": "EngineDrivenContextInline"}
        assert conn["transfer"] == expected[real_server_057.mode]

        # What the engine stored, read by the official 0.5.7 SDK.
        got_sdk = sdk.retrieve(tokens)
        assert got_sdk is not None
        assert got_sdk.shape == (2, L, 2 * CS, D)
        assert torch.equal(got_sdk, kv[:, :, : 2 * CS])

        # The SDK's own store, read back by the SDK and by the engine.
        own_tokens = _tokens(3000, 3 * CS)
        own = _kv(len(own_tokens), seed=3)
        assert sdk.store(own_tokens, own) is True
        # Storing it again: nothing reserved on SHM (False), inline reports True (as 0.5.6's pickle).
        assert sdk.store(own_tokens, own) is (real_server_057.mode == "pickle")
        got_own = sdk.retrieve(own_tokens)
        assert got_own is not None and torch.equal(got_own, own)
        got_eng = eng.retrieve(own_tokens)
        assert got_eng is not None and torch.equal(got_eng, own)

        # Salted entries are invisible without the salt; request_configs are not part of the key.
        salted_tokens = _tokens(4000, CS)
        salted = _kv(CS, seed=4)
        assert sdk.store(salted_tokens, salted, cache_salt="alice", request_configs={"x": 1}) is True
        assert sdk.retrieve(salted_tokens) is None
        got_salted = sdk.retrieve(salted_tokens, cache_salt="alice")
        assert got_salted is not None and torch.equal(got_salted, salted)
        eng.unregister()


def test_worker_refuses_a_venv_of_another_generation(lmcache_python: Path) -> None:
    with pytest.raises(ValueError, match=r"is an lmcache 0\.5\.6 venv, not 0\.5\.7"):
        SDKWorker(python=lmcache_python, generation="0.5.7")
    assert EngineWorker("tcp://127.0.0.1:9", python=lmcache_python).generation == "0.5.6"
