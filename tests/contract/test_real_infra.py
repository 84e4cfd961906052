"""Tests of the real-server test infrastructure (harness/), not of lmcache_async.

They pin down what the other real-server tests rely on: both server
configurations answer over HTTP with chunk size 16; the fake vLLM worker
(``EngineWorker``) publishes a vLLM flash-attention layout in ``/status`` and
round-trips KV bitwise through lmcache's lmcache-driven path; the official
SDK (``SDKWorker``) reads what the engine stored and vice versa; servers and
workers leave no process or /dev/shm segment behind.

The 0.5.7 generation (the tests whose ``generation`` parameter is 0.5.7): the real
LMCache 0.5.7rc3 server, run from ``.lmcache-venv-057``, starts in both transports with
the same flags as 0.5.6, says what it is on ``/lmc_version``, and the generation of a
venv is read from what is installed in it. lmcache 0.5.7's own counterparts -- the fake
vLLM worker (lmcache-driven transfer context) and the official SDK -- run from that venv
and exchange KV with each other bitwise.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.real_server import (
    LAUNCHER_ENV,
    LMC_VERSIONS,
    LMCacheServerError,
    RealLMCacheServer,
    _Launcher,
    pid_alive,
    venv_generation,
)
from harness.workers import EngineWorker, SDKWorker, WorkerError, WorkerTimeout

CS = 16  # chunk size of the session servers (tests.helpers.SESSION_CHUNK_SIZE)
# A small vLLM-style geometry: 2 layers, 2 KV heads, head dim 8, block 4.
L, NH, HS, BS, NB = 2, 2, 8, 4, 64
D = NH * HS


def _kv(tokens: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, L, tokens, D, generator=g).to(dtype)


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _register(eng: EngineWorker, model: str) -> dict[str, Any]:
    return eng.register(
        model, num_layers=L, num_kv_heads=NH, head_dim=HS, block_size=BS, num_blocks=NB,
        dtype=torch.bfloat16,
    )  # fmt: skip


# --------------------------------------------------------------------------- HTTP


def test_http_healthcheck_and_config(real_server: RealLMCacheServer) -> None:
    status, body = real_server.http_get("/healthcheck")
    assert status == 200
    assert json.loads(body) == {"status": "healthy"}

    mp = real_server.config()["mp"]
    assert mp["chunk_size"] == CS == real_server.chunk_size
    assert mp["supported_transfer_mode"] == "auto"
    assert mp["host"] == "127.0.0.1"
    assert mp["port"] == real_server.port
    assert mp["shm_name"] == real_server.shm_name
    assert real_server.url == f"tcp://127.0.0.1:{real_server.port}"
    assert real_server.http_url == f"http://127.0.0.1:{real_server.http_port}"

    if real_server.mode == "shm":
        assert real_server.shm_name.startswith(f"lmca_{os.getpid()}_")
        assert real_server.shm_segment == f"/dev/shm/lmcache_l1_pool_{real_server.shm_name}"
        assert os.stat(real_server.shm_segment).st_size == 1 << 30  # the whole 1 GiB L1
    else:
        assert real_server.shm_name == ""
        assert real_server.shm_segment is None


# --------------------------------------------------------------------------- engine worker


def test_engine_registers_vllm_layout_and_round_trips(real_server: RealLMCacheServer) -> None:
    model = f"infra/engine-{real_server.mode}"
    with EngineWorker(real_server) as eng:
        reg = _register(eng, model)
        assert reg["chunk_size"] == CS
        assert reg["blocks_in_chunk"] == CS // BS
        assert reg["kv_shape"] == [2, NB, BS, NH, HS]
        assert reg["layer_names"] == [f"model.layers.{i}.self_attn.attn" for i in range(L)]
        assert len(reg["kv_segments"]) == L  # one POSIX shm segment per layer tensor

        meta = real_server.status()["cache_context_meta"]
        entry = meta[str(eng.instance_id)]
        assert entry["model_name"] == model
        assert entry["world_size"] == 1
        layout = entry["kv_cache_layout"]
        assert layout["num_layers"] == L
        assert layout["num_blocks"] == NB
        assert layout["cache_size_per_token"] == 2 * L * D * 2  # K+V, bf16
        (group,) = layout["kernel_groups"]
        assert group["engine_kv_format"] == "NL_X_TWO_NB_BS_NH_HS"
        assert group["engine_kv_concrete_shape"] == f"{L} x [2, {NB}, {BS}, {NH}, {HS}]"
        assert group["engine_kv_shape"] == "NL x [2, NB, BS, NH, HS]"
        assert group["tokens_per_block"] == BS
        assert group["dtype"] == "torch.bfloat16"
        assert group["is_mla"] is False
        assert group["layer_indices"] == list(range(L))

        # 2 whole chunks + a partial tail (never stored).
        tokens = _tokens(1000, 2 * CS + 5)
        kv = _kv(len(tokens), seed=1)
        assert eng.store(tokens, kv) is True

        got = eng.retrieve(tokens)
        assert got is not None
        assert got.dtype == torch.bfloat16
        assert got.shape == (2, L, 2 * CS, D)
        assert torch.equal(got, kv[:, :, : 2 * CS])

        # Shared first chunk, different second chunk: a 1-chunk prefix hit.
        other = tokens[:CS] + _tokens(9000, CS)
        got1 = eng.retrieve(other)
        assert got1 is not None
        assert torch.equal(got1, kv[:, :, :CS])

        assert eng.retrieve(_tokens(5000, 2 * CS)) is None  # never stored
        assert eng.retrieve(tokens[: CS - 1]) is None  # shorter than one chunk

        instance_id = eng.instance_id
        left = eng.unregister()
        assert left["kv_segments"] == []
        assert str(instance_id) not in real_server.status()["cache_context_meta"]


# --------------------------------------------------------------------------- official SDK


def test_sdk_interoperates_with_engine(real_server: RealLMCacheServer) -> None:
    model = f"infra/sdk-{real_server.mode}"
    eng, sdk = EngineWorker(real_server), SDKWorker()
    eng.spawn(), sdk.spawn()  # overlap the two ~2.5 s interpreter startups
    with eng, sdk:
        _register(eng, model)
        tokens = _tokens(2000, 2 * CS)
        kv = _kv(len(tokens), seed=2)
        assert eng.store(tokens, kv) is True

        conn = sdk.connect(real_server.url, real_server.http_url, model)
        assert conn["chunk_size"] == CS
        expected = {"shm": "EngineDrivenContextShm", "pickle": "EngineDrivenContextPickle"}
        assert conn["transfer"] == expected[real_server.mode]

        # What the engine stored, read by the official SDK.
        got = sdk.retrieve(tokens)
        assert got is not None
        assert got.shape == (2, L, 2 * CS, D)
        assert torch.equal(got, kv)

        # The SDK's own store, read back by the SDK and by the engine.
        own_tokens = _tokens(3000, 3 * CS)
        own = _kv(len(own_tokens), seed=3)
        assert sdk.store(own_tokens, own) is True
        got_own = sdk.retrieve(own_tokens)
        assert got_own is not None
        assert torch.equal(got_own, own)
        got_eng = eng.retrieve(own_tokens)
        assert got_eng is not None
        assert torch.equal(got_eng, own)

        # Salted entries are invisible without the salt.
        salted_tokens = _tokens(4000, CS)
        salted = _kv(CS, seed=4)
        assert sdk.store(salted_tokens, salted, cache_salt="alice") is True
        assert sdk.retrieve(salted_tokens) is None
        got_salted = sdk.retrieve(salted_tokens, cache_salt="alice")
        assert got_salted is not None
        assert torch.equal(got_salted, salted)
        eng.unregister()


# --------------------------------------------------------------------------- lifecycle


def test_stop_and_restart_leave_nothing_behind(
    fresh_real_server: Callable[..., RealLMCacheServer],
) -> None:
    # SHM mode: the case with a /dev/shm segment to clean up. (The session
    # pickle server's stop is checked by the real_servers plugin at session end.)
    srv = fresh_real_server("shm")
    pid = srv.pid
    assert pid is not None and pid_alive(pid)
    seg = srv.shm_segment
    assert seg is not None and os.path.exists(seg)
    instance_id = srv.config()["mp"]["instance_id"]
    url, http_url, shm_name = srv.url, srv.http_url, srv.shm_name

    srv.restart()
    assert (srv.url, srv.http_url, srv.shm_name) == (url, http_url, shm_name)
    assert srv.pid is not None and srv.pid != pid
    assert not pid_alive(pid)
    assert srv.config()["mp"]["instance_id"] != instance_id
    assert srv.started_pids == [pid, srv.pid]

    new_pid = srv.pid
    srv.stop()
    assert srv.pid is None
    assert not srv.is_running()
    assert not pid_alive(new_pid)
    assert not os.path.exists(seg)
    assert srv.leftovers() == []
    srv.stop()  # idempotent


@pytest.mark.skipif(
    os.environ.get(LAUNCHER_ENV) == "0", reason="servers started by Popen (LMCACHE_ASYNC_TEST_LAUNCHER=0)"
)
@pytest.mark.parametrize("generation", ["0.5.6", "0.5.7"])
def test_a_server_is_forked_by_its_venvs_launcher_as_popen_would_start_it(
    fresh_real_server: Callable[..., RealLMCacheServer], generation: str
) -> None:
    """Servers are forked from a launcher that imported lmcache once per venv
    (harness/lmcache_launcher.py): each is still a process of its own session, reading
    /dev/null, writing its log, with the child environment; its exit code (a signal's
    as ``-signum``) reaches ``stop()``; ``LMCACHE_ASYNC_TEST_LAUNCHER=0`` is Popen."""
    srv, other = fresh_real_server.together(  # type: ignore[attr-defined]
        {"mode": "pickle", "generation": generation}, {"mode": "pickle", "generation": generation}
    )
    pid = srv.pid
    assert pid is not None and other.pid is not None
    launcher = _Launcher._all[Path(srv.command[0]).parent / "python"]
    assert launcher.alive() and launcher.pid_owner == os.getpid()
    parents = {
        int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) for p in (pid, other.pid)
    }
    assert parents == {launcher.proc.pid}
    assert os.getsid(pid) == pid
    assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    assert os.readlink(f"/proc/{pid}/fd/1") == os.readlink(f"/proc/{pid}/fd/2") == str(srv.log_path)
    environ = dict(
        item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
    )
    assert "PYTHONPATH" not in environ and environ["LMCACHE_DISABLE_BANNER"] == "1"
    ignored = int(Path(f"/proc/{pid}/status").read_text().split("SigIgn:")[1].split()[0], 16)
    assert ignored & (
        1 << (13 - 1)
    )  # SIGPIPE ignored, as in any Python: a closed peer is an error, not death
    assert srv.get_json("/lmc_version") == LMC_VERSIONS[generation]  # type: ignore[index]
    os.kill(pid, 9)
    assert srv._proc is not None and srv._proc.wait(10) == -9
    # lmcache reads some variables on import: another environment takes a new interpreter
    os.environ["LMCACHE_LOG_LEVEL"] = "DEBUG"
    try:
        own = fresh_real_server("pickle", generation)
    finally:
        del os.environ["LMCACHE_LOG_LEVEL"]
    assert own.pid is not None
    assert int(Path(f"/proc/{own.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid()
    assert own.stop() == -15
    assert not srv.is_running() and srv.stop() == -9
    assert other.stop() == -15  # SIGTERM, as a Popen'd server ends


# --------------------------------------------------------------------------- worker deadlines


def test_worker_reports_errors_and_never_hangs(lmcache_python: Path) -> None:
    dead_url = "tcp://127.0.0.1:9"  # nothing listens on the discard port
    with EngineWorker(dead_url, python=lmcache_python, request_timeout=20.0) as eng:
        with pytest.raises(WorkerError, match="unknown cmd"):
            eng.request("no-such-command")
        with pytest.raises(WorkerError, match="not registered"):
            eng.retrieve(_tokens(0, CS))
        # lmcache's own call times out inside the worker -> an error reply.
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="Timeout"):
            eng.request(
                "register", deadline=20.0, timeout=1.0, url=dead_url, model_name="m",
                num_layers=L, num_kv_heads=NH, head_dim=HS, block_size=BS, num_blocks=NB,
            )  # fmt: skip
        assert time.monotonic() - t0 < 15.0
        assert eng.is_running()
        # Our deadline shorter than the worker's: the child is killed.
        pid = eng.pid
        with pytest.raises(WorkerTimeout):
            eng.request(
                "register", deadline=2.0, timeout=30.0, url=dead_url, model_name="m",
                num_layers=L, num_kv_heads=NH, head_dim=HS, block_size=BS, num_blocks=NB,
            )  # fmt: skip
        assert not eng.is_running()
        assert pid is not None and not pid_alive(pid)


# --------------------------------------------------------------------------- the 0.5.7 generation


def test_lmc_version_names_each_generation(
    real_server_057: RealLMCacheServer, real_server_shm: RealLMCacheServer
) -> None:
    assert real_server_057.generation == "0.5.7"
    assert real_server_057.get_json("/lmc_version") == "0.5.7rc3.dev0" == real_server_057.lmc_version
    assert real_server_shm.generation == "0.5.6"
    assert real_server_shm.get_json("/lmc_version") == "0.5.6" == LMC_VERSIONS["0.5.6"]


@pytest.mark.parametrize("generation", ["0.5.7"])
def test_server_health_config_and_status(real_server: RealLMCacheServer) -> None:
    status, body = real_server.http_get("/healthcheck")
    assert (status, json.loads(body)) == (200, {"status": "healthy"})

    mp = real_server.config()["mp"]
    assert mp["chunk_size"] == CS == real_server.chunk_size
    assert mp["supported_transfer_mode"] == "auto"
    assert mp["port"] == real_server.port
    assert mp["shm_name"] == real_server.shm_name
    # 0.5.7 negotiates the chunk size; with no engine asking, the live one is the minimum.
    assert real_server.status()["chunk_size"] == CS

    if real_server.mode == "shm":
        assert real_server.shm_segment == f"/dev/shm/lmcache_l1_pool_{real_server.shm_name}"
        assert os.stat(real_server.shm_segment).st_size == 1 << 30  # the whole 1 GiB L1
    else:
        assert real_server.shm_segment is None


@pytest.mark.parametrize("generation", ["0.5.7"])  # API keys: 0.5.7 servers only
def test_fresh_server_with_api_key_then_stops_clean(
    fresh_real_server: Callable[..., RealLMCacheServer], generation: str
) -> None:
    srv = fresh_real_server("shm", generation=generation, api_key="k-123")
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


@pytest.mark.parametrize("generation", ["0.5.7"])
def test_engine_and_official_sdk_interoperate(real_server: RealLMCacheServer) -> None:
    """lmcache 0.5.7's own engine path stores, its official SDK reads bitwise, and back."""
    model = f"infra057/sdk-{real_server.mode}"
    eng, sdk = EngineWorker(real_server), SDKWorker(generation=real_server.generation)
    eng.spawn(), sdk.spawn()  # overlap the two interpreter startups
    with eng, sdk:
        assert (eng.generation, eng.lmcache_version) == ("0.5.7", "0.5.7rc3.dev0")
        assert (sdk.generation, sdk.lmcache_version) == ("0.5.7", "0.5.7rc3.dev0")
        reg = eng.register(
            model, num_layers=L, num_kv_heads=NH, head_dim=HS, block_size=BS, num_blocks=NB,
            dtype=torch.bfloat16,
        )  # fmt: skip
        assert (reg["chunk_size"], reg["blocks_in_chunk"]) == (CS, CS // BS)
        group = real_server.status()["cache_context_meta"][str(eng.instance_id)]["kv_cache_layout"]
        assert group["kernel_groups"][0]["engine_kv_concrete_shape"] == f"{L} x [2, {NB}, {BS}, {NH}, {HS}]"

        # 2 whole chunks + a partial tail (never stored), through the engine's paged blocks.
        tokens = _tokens(1000, 2 * CS + 5)
        kv = _kv(len(tokens), seed=1)
        assert eng.store(tokens, kv) is True
        got = eng.retrieve(tokens)
        assert got is not None and got.dtype == torch.bfloat16
        assert torch.equal(got, kv[:, :, : 2 * CS])

        conn = sdk.connect(real_server.url, real_server.http_url, model)
        assert conn["chunk_size"] == CS
        expected = {"shm": "EngineDrivenContextShm", "pickle": "EngineDrivenContextInline"}
        assert conn["transfer"] == expected[real_server.mode]

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
        assert sdk.store(own_tokens, own) is (real_server.mode == "pickle")
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
