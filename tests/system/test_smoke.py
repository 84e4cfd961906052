"""Smoke tests through the project's own code against each real server configuration:
/config, a noop over a DEALER, /status after an engine registered."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lmcache_async import KVGeometry
from lmcache_async._protocol.server_config import mp_section
from lmcache_async._protocol.wire import Op
from lmcache_async._transport.connection import Connection
from lmcache_async._transport.metadata import Metadata
from tests.helpers import SESSION_CHUNK_SIZE, unique_model

pytestmark = pytest.mark.anyio


async def test_config_gives_the_chunk_size(real_server: Any) -> None:
    meta = Metadata(real_server.http_url)
    try:
        config = await meta.config()
        assert mp_section(config)["chunk_size"] == SESSION_CHUNK_SIZE
        assert mp_section(config)["supported_transfer_mode"] == "auto"
        assert await meta.healthcheck() is True
    finally:
        await meta.close()


async def test_noop_over_a_dealer(real_server: Any) -> None:
    conn = Connection(real_server.url)
    await conn.open()
    try:
        reply = await conn.call(Op.NOOP, (), timeout=10)
        assert reply.value() == "OK"
        assert (await conn.call(Op.GET_CHUNK_SIZE, (), timeout=10)).value() == SESSION_CHUNK_SIZE
    finally:
        await conn.close()


async def test_status_lists_an_engine_registration(real_server: Any) -> None:
    from harness.workers import EngineWorker

    model = unique_model("smoke")
    meta = Metadata(real_server.http_url)
    try:
        with EngineWorker(real_server.url) as eng:
            eng.register(model, num_layers=3, num_kv_heads=4, head_dim=8, block_size=8, num_blocks=16)
            status = await meta.status(max_age=0)
            geometry = KVGeometry.from_status(status, model)
            assert geometry == KVGeometry(3, 4, 8, torch.bfloat16, block_size=8)
            entry = next(e for e in status["cache_context_meta"].values() if e["model_name"] == model)
            group = entry["kv_cache_layout"]["kernel_groups"][0]
            assert group["engine_kv_format"] == "NL_X_TWO_NB_BS_NH_HS"
            assert group["engine_kv_concrete_shape"] == "3 x [2, 16, 8, 4, 8]"
    finally:
        await meta.close()
