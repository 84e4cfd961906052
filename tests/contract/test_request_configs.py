"""``request_configs``: carried in the cache key on both generations (the official SDK's
``retrieve(tokens, cache_salt, request_configs)`` / ``store(kv, tokens, cache_salt,
request_configs)``), and honoured by a 0.5.7 server (``lmcache.skip_load``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lmcache_async as lmc
import lmcache_async.kvcache as lmc_sdk
from harness.real_server import RealLMCacheServer
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, peek, random_kv, unique_model

SKIP = {"lmcache.skip_load": True}


@pytest.fixture(
    params=[
        pytest.param(name, marks=pytest.mark.real_server)
        for name in ("real_server_shm", "real_server_pickle", "real_server_057_shm", "real_server_057_pickle")
    ]
)
def any_real_server(request: pytest.FixtureRequest) -> RealLMCacheServer:
    srv: RealLMCacheServer = request.getfixturevalue(request.param)
    return srv


def test_the_drop_in_context_takes_the_sdks_positional_request_configs(
    any_real_server: RealLMCacheServer,
) -> None:
    srv = any_real_server
    ctx = lmc_sdk.connect(srv.url, srv.http_url, unique_model(), geometry=SMALL_GEOMETRY)
    try:
        assert isinstance(ctx, lmc_sdk.KVCacheContext) and isinstance(ctx, lmc.Client)
        toks, kv = fresh_tokens(40), random_kv(SMALL_GEOMETRY, 40)
        configs: dict[str, Any] = {"lmcache.tag": "x", "n": 1}
        # The official context's positional order: (kv, tokens, cache_salt, request_configs).
        assert ctx.store(kv, toks, "alice", configs) is True
        # A dict third is request_configs (it used to be taken for ``out``).
        got = ctx.retrieve(toks, "alice", configs)
        assert got is not None and torch.equal(got, kv[:, :, :32])
        got = lmc_sdk.retrieve(ctx, toks, "alice", configs)
        assert got is not None and torch.equal(got, kv[:, :, :32])
        assert lmc_sdk.lookup(ctx, toks, "alice", configs) == 32
        skipped = ctx.retrieve(toks, "alice", SKIP)
        if ctx.wire_generation == "0.5.7":
            # the 0.5.7 load policy reads the flag from the key: a reported miss
            assert skipped is None
            assert lmc_sdk.lookup(ctx, toks, "alice", SKIP) == 0
        else:
            # 0.5.6 carries the configs but no module reads them
            assert skipped is not None and torch.equal(skipped, kv[:, :, :32])
        out = torch.zeros(SMALL_GEOMETRY.kv_shape(48), dtype=SMALL_GEOMETRY.dtype)
        view = ctx.retrieve(toks, "alice", None, out=out)
        assert view is not None and view.data_ptr() == out.data_ptr() and torch.equal(view, kv[:, :, :32])
    finally:
        ctx.close()


@pytest.mark.anyio
async def test_async_client_forwards_request_configs(real_server_057_shm: RealLMCacheServer) -> None:
    srv = real_server_057_shm
    async with lmc.AsyncClient(srv.url, srv.http_url, unique_model(), geometry=SMALL_GEOMETRY) as c:
        toks, kv = fresh_tokens(32), random_kv(SMALL_GEOMETRY, 32)
        assert await c.store(kv, toks, request_configs={"k": [1, 2]}) is True
        assert await c.lookup(toks) == 32
        assert await c.lookup(toks, request_configs=SKIP) == 0
        assert await c.retrieve(toks, request_configs=SKIP) is None
        got = await c.retrieve(toks, request_configs={"lmcache.skip_load": False})
        assert got is not None and torch.equal(got, kv)
        st = await c.status(max_age=0)
        assert (st["active_sessions"], st["active_prefetch_jobs"]) == (0, 0)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("configs", "error", "message"),
    [
        ([("a", 1)], TypeError, "request_configs must be a mapping or None, got list"),
        ({1: "a"}, TypeError, "request_configs keys must be str, got int"),
        ({"a": object()}, TypeError, "request_configs must hold msgpack-encodable values"),
    ],
)
async def test_bad_request_configs_are_refused_before_anything_is_sent(
    client: lmc.AsyncClient, configs: Any, error: type[Exception], message: str
) -> None:
    toks = fresh_tokens(16)
    with pytest.raises(error, match=message):
        await client.lookup(toks, request_configs=configs)
    with pytest.raises(error, match=message):
        await client.retrieve(toks, request_configs=configs)
    with pytest.raises(error, match=message):
        await client.store(random_kv(SMALL_GEOMETRY, 16), toks, request_configs=configs)
    assert not peek(client).in_flight_ops
