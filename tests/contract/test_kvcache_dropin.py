"""``lmcache_async.kvcache``: the official SDK's module-level API, against the real server.

The model is registered the way vLLM does it (an lmcache-driven registration from
``harness/engine_worker.py``), so ``connect`` without ``geometry=`` derives the
layout from ``/status`` exactly like the official SDK. The official SDK itself
(``harness/sdk_worker.py``, in the lmcache venv) runs next to it on the same
server: return values and stored bytes are compared with it.
"""

from __future__ import annotations

import inspect
import os
import random
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import lmcache_async.kvcache as lmc_sdk
from harness.real_server import RealLMCacheServer
from harness.workers import EngineWorker, SDKWorker
from lmcache_async import KVGeometry, ModelNotRegisteredError
from lmcache_async.sync_client import Client

# every test here runs on a real server (some reach it through request.getfixturevalue)
pytestmark = pytest.mark.real_server

MODEL = f"test-kvcache-dropin-{os.getpid()}"
GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)
CS = 16

_rng = random.Random()


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(1 << 31) for _ in range(n)]


def _kv(n: int) -> torch.Tensor:
    return torch.randn(GEOM.kv_shape(n)).to(GEOM.dtype)


@dataclass
class Registered:
    """A session server on which an engine registered MODEL, and the official SDK."""

    server: RealLMCacheServer
    engine: EngineWorker
    sdk: SDKWorker

    @property
    def mode(self) -> str:
        return self.server.mode


@pytest.fixture(scope="module", params=["shm", "pickle", "057-shm", "057-pickle"])
def registered(
    request: pytest.FixtureRequest, lmcache_python: Path, lmcache057_python: Path
) -> Iterator[Registered]:
    """Each generation's real server, its own engine path and its own official SDK (both
    venvs are named as fixtures so that they are built before any test runs)."""
    generation, _, mode = str(request.param).rpartition("-")
    if generation:
        srv: RealLMCacheServer = request.getfixturevalue(f"real_server_057_{mode}")
        python = lmcache057_python
    else:
        srv = request.getfixturevalue(f"real_server_{mode}")
        python = lmcache_python
    engine, sdk = EngineWorker(srv.url, python=python), SDKWorker(python=python)
    engine.spawn(), sdk.spawn()  # overlap the two ~2.5 s interpreter startups
    with engine, sdk:
        engine.register(
            MODEL,
            num_layers=GEOM.num_layers,
            num_kv_heads=GEOM.num_kv_heads,
            head_dim=GEOM.head_dim,
            block_size=GEOM.block_size,
            num_blocks=32,
            dtype=GEOM.dtype,
        )
        sdk.connect(srv.url, srv.http_url, MODEL)
        yield Registered(srv, engine, sdk)


def test_the_issue_snippet_runs_unchanged_but_for_the_import(registered: Registered) -> None:
    srv = registered.server
    # Chunk-aligned, as the snippet needs with the official SDK too: its store raises when
    # len(tokens) differs from the KV's token count (retrieve returns whole chunks only).
    source_tokens, target_tokens = _tokens(3 * CS), _tokens(3 * CS)
    source_kv = _kv(3 * CS)
    assert registered.engine.store(source_tokens, source_kv)  # written the vLLM way

    # ---- the official example's snippet (only the import and the endpoints differ) ----
    ctx = lmc_sdk.connect(url=srv.url, http_url=srv.http_url, model_name=MODEL)
    kv = lmc_sdk.retrieve(ctx, tokens=source_tokens)
    if kv is not None:
        lmc_sdk.store(ctx, kv=kv, tokens=target_tokens)
    lmc_sdk.close(ctx)
    # ---- end of the snippet ----

    assert kv is not None and torch.equal(kv, source_kv)
    assert isinstance(ctx, Client) and ctx.closed
    moved = registered.engine.retrieve(target_tokens)  # read back the vLLM way
    assert moved is not None and torch.equal(moved, source_kv)
    official = registered.sdk.retrieve(target_tokens)
    assert official is not None and torch.equal(official, source_kv)


def test_return_values_are_the_official_sdks(registered: Registered) -> None:
    srv, sdk = registered.server, registered.sdk
    ctx = lmc_sdk.connect(srv.url, srv.http_url, MODEL, 30.0)
    try:
        assert ctx.geometry == GEOM  # derived from /status, as the official SDK does
        assert ctx.timeout == 30.0 and ctx.transfer == registered.mode
        ours, theirs = _tokens(2 * CS), _tokens(2 * CS)
        kv_ours, kv_theirs = _kv(2 * CS), _kv(2 * CS)
        # miss: None from both
        assert lmc_sdk.retrieve(ctx, tokens=ours) is None
        assert sdk.retrieve(ours) is None
        # shorter than a chunk, or empty: None (nothing to look up)
        assert lmc_sdk.retrieve(ctx, tokens=ours[: CS - 1]) is None
        assert lmc_sdk.retrieve(ctx, tokens=[]) is None
        # a fresh store: True from both
        assert lmc_sdk.store(ctx, kv=kv_ours, tokens=ours) is True
        assert sdk.store(theirs, kv_theirs) is True
        # the same store again: False -- "everything was cached already". The official
        # SDK says False on SHM but True on pickle (it reports written == reserved, 0 == 0);
        # this drop-in says False on both.
        assert lmc_sdk.store(ctx, kv=kv_ours, tokens=ours) is False
        assert lmc_sdk.store(ctx, kv=kv_theirs, tokens=theirs) is False
        assert sdk.store(theirs, kv_theirs) is (registered.mode == "pickle")
        # what one stored the other reads bitwise
        mine = sdk.retrieve(ours)
        assert mine is not None and torch.equal(mine, kv_ours)
        got = lmc_sdk.retrieve(ctx, tokens=theirs)
        assert got is not None and torch.equal(got, kv_theirs)
        assert torch.equal(got, sdk.retrieve(theirs))  # type: ignore[arg-type]
        # a longer query returns the cached prefix (whole chunks)
        longer = lmc_sdk.retrieve(ctx, tokens=[*ours, *_tokens(CS + 3)])
        assert longer is not None and torch.equal(longer, kv_ours)
        # lookup (an addition): the cached prefix length, nothing transferred
        assert lmc_sdk.lookup(ctx, tokens=ours) == 2 * CS
        assert lmc_sdk.lookup(ctx, [*ours[:CS], *_tokens(CS)]) == CS
        # a store shorter than one chunk adds nothing
        assert lmc_sdk.store(ctx, kv=_kv(CS - 1), tokens=_tokens(CS - 1)) is False
        # tokens beyond the last whole chunk are ignored, but their KV must be given
        odd, kv_odd = _tokens(CS + 5), _kv(CS + 5)
        assert lmc_sdk.store(ctx, kv=kv_odd, tokens=odd) is True
        prefix = lmc_sdk.retrieve(ctx, tokens=odd)
        assert prefix is not None and torch.equal(prefix, kv_odd[:, :, :CS])
        # tokens may be longer than the KV (stored under tokens[:T]; the official SDK
        # raises here), never shorter
        assert lmc_sdk.store(ctx, kv=prefix, tokens=odd) is False  # odd[:CS] is cached
        with pytest.raises(ValueError, match="kv covers 21 tokens but tokens has 16"):
            lmc_sdk.store(ctx, kv=kv_odd, tokens=odd[:CS])
    finally:
        lmc_sdk.close(ctx)


def test_cache_salt_and_the_context_methods_of_the_sdk(registered: Registered) -> None:
    srv = registered.server
    ctx = lmc_sdk.connect(url=srv.url, http_url=srv.http_url, model_name=MODEL)
    try:
        toks, kv = _tokens(CS), _kv(CS)
        assert lmc_sdk.store(ctx, kv=kv, tokens=toks, cache_salt="alice") is True
        assert lmc_sdk.retrieve(ctx, tokens=toks) is None  # other namespace
        got = lmc_sdk.retrieve(ctx, tokens=toks, cache_salt="alice")
        assert got is not None and torch.equal(got, kv)
        # the official context's methods and attributes work on the returned context
        assert ctx.chunk_size == CS and isinstance(ctx.instance_id, int)
        assert ctx.store(kv, toks, "alice") is False
        again = ctx.retrieve(toks, "alice")
        assert again is not None and torch.equal(again, kv)
        grad = kv.float().requires_grad_().to(GEOM.dtype)  # the SDK detaches; so do we
        assert lmc_sdk.store(ctx, kv=grad, tokens=_tokens(CS)) is True
    finally:
        ctx.close()
    assert ctx.closed


def test_geometry_extension_needs_no_engine(real_server: RealLMCacheServer) -> None:
    unregistered = f"{MODEL}-no-engine"
    with pytest.raises(ModelNotRegisteredError):
        lmc_sdk.connect(real_server.url, real_server.http_url, unregistered)
    ctx = lmc_sdk.connect(real_server.url, real_server.http_url, unregistered, geometry=GEOM)
    try:
        assert type(ctx) is lmc_sdk.LMCacheSDKContext
        toks, kv = _tokens(2 * CS), _kv(2 * CS)
        assert ctx.transfer == real_server.mode
        assert lmc_sdk.store(ctx, kv=kv, tokens=toks) is True
        assert lmc_sdk.store(ctx, kv=kv, tokens=toks) is False
        got = lmc_sdk.retrieve(ctx, tokens=toks)
        assert got is not None and torch.equal(got, kv)
    finally:
        lmc_sdk.close(ctx)


def test_signatures_match_the_official_sdk() -> None:
    def params(fn: object) -> list[tuple[str, object]]:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
        return [(p.name, p.default) for p in sig.parameters.values() if p.kind is not p.KEYWORD_ONLY]

    empty = inspect.Parameter.empty
    # lmcache 0.5.6: lmcache.sdk.kvcache.connect and LMCacheSDKContext.retrieve/store
    assert params(lmc_sdk.connect) == [
        ("url", empty),
        ("http_url", empty),
        ("model_name", empty),
        ("timeout", 60.0),
    ]
    # (0.5.6 and 0.5.7 alike: the context's retrieve(tokens, cache_salt, request_configs)
    # and store(kv, tokens, cache_salt, request_configs))
    configs = ("request_configs", None)
    assert params(lmc_sdk.retrieve) == [("ctx", empty), ("tokens", empty), ("cache_salt", ""), configs]
    assert params(lmc_sdk.store) == [
        ("ctx", empty),
        ("kv", empty),
        ("tokens", empty),
        ("cache_salt", ""),
        configs,
    ]
    assert params(lmc_sdk.lookup) == [("ctx", empty), ("tokens", empty), ("cache_salt", ""), configs]
    assert params(lmc_sdk.close) == [("ctx", empty)]
    assert params(lmc_sdk.KVCacheContext.retrieve) == [
        ("self", empty),
        ("tokens", empty),
        ("cache_salt", ""),
        configs,
    ]
    assert params(lmc_sdk.KVCacheContext.store) == [
        ("self", empty),
        ("kv", empty),
        ("tokens", empty),
        ("cache_salt", ""),
        configs,
    ]
    for name in ("geometry", "api_key"):
        assert inspect.signature(lmc_sdk.connect).parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert sorted(lmc_sdk.__all__) == [
        "KVCacheContext",
        "LMCacheSDKContext",
        "close",
        "connect",
        "lookup",
        "retrieve",
        "store",
    ]


def test_the_official_context_class_name_is_the_drop_ins_context() -> None:
    # lmcache.sdk.kvcache (0.5.6 and 0.5.7rc3) has the name LMCacheSDKContext, the class
    # of what its connect returns (imported from lmcache.sdk.context): annotations and
    # isinstance checks written against it keep working with only the import changed.
    assert lmc_sdk.LMCacheSDKContext is lmc_sdk.KVCacheContext
    assert typing.get_type_hints(lmc_sdk.connect)["return"] is lmc_sdk.LMCacheSDKContext
