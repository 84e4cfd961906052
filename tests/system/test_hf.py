"""lmcache_async.hf: a real transformers model's KV in and out of LMCache.

The model is :func:`lmcache_async.testing.tiny_llama.tiny_llama` (a ``LlamaForCausalLM``
with 4 layers, 8 attention heads sharing 2 KV heads of 16, RoPE; fixed-seed random
weights, nothing downloaded), in float32 and bfloat16. Server tests run on every server
configuration (the real LMCache 0.5.6 server over SHM and pickle, the embedded server);
the interop tests run lmcache's own engine path (the fake vLLM worker) against it.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcache_async import AsyncClient, Client, KVGeometry, hf
from lmcache_async.testing.tiny_llama import tiny_llama
from tests.helpers import SESSION_CHUNK_SIZE, peek, unique_model

# One xdist group with the experiment's tests: `make check` (--dist loadgroup) runs them on
# one worker, so only one pays the first use of transformers (~3-5 s).
pytestmark = [pytest.mark.anyio, pytest.mark.xdist_group("transformers")]

CS = SESSION_CHUNK_SIZE
VOCAB = 512
PROMPT = 2 * CS + 5  # two whole chunks and a tail of 5 tokens
NEW = 6  # tokens generated per call (kept small: 2 shared cores)
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]

_MODELS: dict[tuple[torch.dtype, int], Any] = {}


def model_of(dtype: torch.dtype, kv_heads: int = 2) -> Any:
    key = (dtype, kv_heads)
    if key not in _MODELS:
        _MODELS[key] = tiny_llama(dtype, num_key_value_heads=kv_heads)
    return _MODELS[key]


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def own_cache(model: Any, tokens: list[int]) -> Any:
    """The model's own cache after the prompt, computed with transformers directly."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kwarg = "cache" if "cache" in hf._forward_params(type(model)) else "past_key_values"
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]), use_cache=True, **{kwarg: cache})
    return cache


def vllm_exchange(cache: Any) -> torch.Tensor:
    """The model's KV in the layout vLLM's connector hands LMCache, written out
    independently of hf.py: per layer a paged ``[2, blocks, block_size, NH, HS]`` cache
    whose slot for token t holds ``key[0, :, t, :]`` (``[NH, HS]``); flattened over
    (NH, HS), i.e. head 0's HS values, then head 1's, ... -> ``[2, L, T, NH*HS]``."""
    planes = []
    for plane in ("keys", "values"):
        layers = []
        for layer in cache.layers:
            t = getattr(layer, plane)  # [1, NH, T, HS]
            layers.append(torch.cat([t[0, h] for h in range(t.shape[1])], dim=-1))  # [T, NH*HS]
        planes.append(torch.stack(layers))
    return torch.stack(planes)


def _no_sends(client: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    sent: list[Any] = []

    async def refuse(op: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(op)
        raise AssertionError(f"{op} was sent")

    monkeypatch.setattr(peek(client).conn, "call", refuse)
    return sent


# --------------------------------------------------------------------------- no server


def test_geometry_from_a_transformers_config() -> None:
    model = model_of(torch.float32)
    assert hf.geometry_from_config(model.config) == KVGeometry(4, 2, 16, torch.float32, 16)
    assert hf.geometry_from_model(model_of(torch.bfloat16)) == KVGeometry(4, 2, 16, torch.bfloat16, 16)
    assert hf.geometry_from_config(model.config, dtype="bfloat16", block_size=4) == KVGeometry(
        4, 2, 16, torch.bfloat16, 4
    )
    # no head_dim: hidden_size / attention heads; no num_key_value_heads: one per head
    plain = SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, hidden_size=64, dtype="float16")
    assert hf.geometry_from_config(plain) == KVGeometry(3, 4, 16, torch.float16, 16)
    with pytest.raises(
        ValueError,
        match=r"^only full-attention layers are supported; the config has sliding_attention layers$",
    ):
        hf.geometry_from_config(
            SimpleNamespace(
                **vars(plain), layer_types=["full_attention", "sliding_attention", "full_attention"]
            )
        )
    with pytest.raises(
        ValueError, match=r"^multi-head latent attention \(kv_lora_rank\) caches are not supported$"
    ):
        hf.geometry_from_config(SimpleNamespace(**vars(plain), kv_lora_rank=512))


def test_layout_mapping_spells_out_the_head_order() -> None:
    """``[p, l, t, h * HS + d]`` of the LMCache tensor is ``(key, value)[p][0, h, t, d]`` of
    layer ``l``: each element carries its own coordinates, so any other order shows."""
    geometry = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    T = 5
    p, layer, h, t, d = torch.meshgrid(
        torch.arange(2), torch.arange(3), torch.arange(2), torch.arange(T), torch.arange(4), indexing="ij"
    )
    coded = (p * 10000 + layer * 1000 + h * 100 + t * 10 + d).float()  # [2, L, H, T, HS]
    legacy = tuple((coded[0, i].unsqueeze(0), coded[1, i].unsqueeze(0)) for i in range(3))
    kv = hf.cache_to_kv(legacy, geometry)
    assert kv.shape == (2, 3, T, 8)
    for pp, ll, tt, hh, dd in [(0, 0, 0, 0, 0), (0, 2, 4, 1, 3), (1, 1, 2, 1, 0), (1, 0, 3, 0, 2)]:
        assert kv[pp, ll, tt, hh * 4 + dd].item() == pp * 10000 + ll * 1000 + hh * 100 + tt * 10 + dd
    # and back, bitwise, as a DynamicCache
    cache = hf.kv_to_cache(kv, geometry)
    for i in range(3):
        assert torch.equal(cache.layers[i].keys, legacy[i][0])
        assert torch.equal(cache.layers[i].values, legacy[i][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_models_cache_round_trips_bitwise(dtype: torch.dtype) -> None:
    model = model_of(dtype)
    geometry = hf.geometry_from_model(model)
    tokens = prompt(1)
    cache = own_cache(model, tokens)
    kv = hf.cache_to_kv(cache, geometry)
    assert kv.dtype == dtype and kv.shape == (2, 4, PROMPT, 32)
    assert torch.equal(kv, vllm_exchange(cache))
    assert torch.equal(hf.prefill(model, tokens).kv, kv)  # prefill = the model's own cache
    back = hf.kv_to_cache(kv, geometry, config=model.config)
    assert back.get_seq_length() == PROMPT
    for mine, theirs in zip(back.layers, cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        assert mine.keys.data_ptr() != theirs.keys.data_ptr()
    # the KV is copied: the cache never aliases the tensor it was built from
    kv.zero_()
    assert not torch.equal(back.layers[0].keys, torch.zeros_like(back.layers[0].keys))


def test_conversion_errors_are_clear() -> None:
    model = model_of(torch.float32)
    geometry = hf.geometry_from_model(model)
    cache = own_cache(model, prompt(2, 8))
    with pytest.raises(
        ValueError, match=r"^the cache has 4 layers, the geometry 2 \(a cache of another model\?\)$"
    ):
        hf.cache_to_kv(cache, KVGeometry(2, 2, 16, torch.float32))
    with pytest.raises(
        ValueError,
        match=r"^layer 0 key has 2 KV heads x 16, the geometry 4 x 8 \(a cache of another model\?\)$",
    ):
        hf.cache_to_kv(cache, KVGeometry(4, 4, 8, torch.float32))
    with pytest.raises(
        TypeError, match=r"^layer 0 key has dtype torch.float32, the geometry says torch.bfloat16$"
    ):
        hf.cache_to_kv(cache, KVGeometry(4, 2, 16, torch.bfloat16))
    batch2 = tuple((layer.keys.expand(2, -1, -1, -1), layer.values) for layer in cache.layers)
    with pytest.raises(
        ValueError,
        match=r"^layer 0 key has batch size 2; LMCache stores one sequence per key: pass a batch-1 cache \(one sequence\)$",
    ):
        hf.cache_to_kv(batch2, geometry)
    with pytest.raises(
        TypeError,
        match=r"^cache must be a transformers Cache \(e.g. DynamicCache\) or a tuple of \(key, value\) pairs, got dict$",
    ):
        hf.cache_to_kv({}, geometry)
    kv = hf.cache_to_kv(cache, geometry)
    with pytest.raises(
        ValueError,
        match=r"^kv has shape \[2, 4, 8, 16\], expected \[2, 4, -1, 32\] with T = tokens \(4 layers, 2 KV heads x 16, torch.float32\)$",
    ):
        hf.kv_to_cache(kv[..., :16], geometry)
    with pytest.raises(TypeError, match=r"^kv has dtype torch.bfloat16, the geometry says torch.float32$"):
        hf.kv_to_cache(kv.bfloat16(), geometry)
    with pytest.raises(ValueError, match=r"^prefix_kv covers 8 tokens, the prompt has 7$"):
        hf.generate(model, prompt(2, 7), prefix_kv=kv)
    with pytest.raises(TypeError, match=r"^kv has dtype torch.bfloat16, the geometry says torch.float32$"):
        hf.generate(model, prompt(2, 8), prefix_kv=kv.bfloat16())
    with pytest.raises(ValueError, match=r"^tokens must not be empty$"):
        hf.generate(model, [])
    with pytest.raises(ValueError, match=r"^token id 512 is outside the model's vocabulary of 512 ids$"):
        hf.prefill(model, [1, 512])


def test_the_tail_runs_at_the_positions_after_the_cached_prefix() -> None:
    """The tail's keys (RoPE-rotated by position) equal a full prefill's: they would not
    if the tail were computed at positions starting from 0, as the last check shows."""
    model = model_of(torch.float32)
    geometry = hf.geometry_from_model(model)
    tokens = prompt(3)
    full = hf.generate(model, tokens, max_new_tokens=NEW, keep_kv=True)
    assert (full.reused_tokens, full.computed_tokens) == (0, PROMPT)
    assert full.prompt_kv is not None and torch.equal(full.prompt_kv, hf.prefill(model, tokens).kv)
    prefix = full.prompt_kv[:, :, : 2 * CS].clone()
    cached = hf.generate(model, tokens, max_new_tokens=NEW, prefix_kv=prefix, keep_kv=True)
    assert (cached.hit_tokens, cached.reused_tokens, cached.computed_tokens) == (2 * CS, 2 * CS, 5)
    assert cached.prompt_kv is not None
    assert torch.equal(cached.prompt_kv[:, :, : 2 * CS], prefix)  # the prefix is used as is
    torch.testing.assert_close(cached.prompt_kv, full.prompt_kv, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached.logits, full.logits, rtol=0, atol=1e-4)
    assert cached.tokens == full.tokens and len(cached.tokens) == NEW
    # The same tail computed at positions 0..4 instead of 32..36: its keys are far off.
    restarted = hf.kv_to_cache(prefix, geometry, config=model.config)
    hf._forward(model, tokens[2 * CS :], restarted, 0)
    wrong = hf.cache_to_kv(restarted, geometry)
    assert (wrong[0, :, 2 * CS :] - full.prompt_kv[0, :, 2 * CS :]).abs().max().item() > 0.1


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    model = model_of(torch.bfloat16)
    tokens = prompt(4, 2 * CS)
    kv = hf.prefill(model, tokens).kv
    gen = hf.generate(model, tokens, max_new_tokens=NEW, prefix_kv=kv)
    assert (gen.hit_tokens, gen.reused_tokens, gen.computed_tokens) == (2 * CS, 2 * CS - 1, 1)
    assert len(gen.tokens) == NEW


async def test_model_work_runs_on_one_thread_off_the_event_loop() -> None:
    def where(x: int) -> tuple[str, int]:
        return threading.current_thread().name, x * 2

    got = [await hf.run_model(where, i) for i in range(3)]
    assert got == [("lmcache-hf-model_0", 0), ("lmcache-hf-model_0", 2), ("lmcache-hf-model_0", 4)]
    assert threading.current_thread().name != "lmcache-hf-model_0"


# --------------------------------------------------------------------------- with a server


@pytest.mark.parametrize("dtype", DTYPES)
async def test_the_kv_edit_flow_with_a_real_model(server: Any, dtype: torch.dtype) -> None:
    """The official flow: the engine stores the source's KV, the SDK stores it under a
    target that differs in its first tokens, the engine serves the target from LMCache
    and produces the source's output (both served the same way: cached prefix + tail)."""
    model = model_of(dtype)
    geometry = hf.geometry_from_model(model)
    source = prompt(5)
    target = [(t + 1) % VOCAB for t in source[:3]] + source[3:]
    async with AsyncClient(
        server.url, server.http_url, unique_model("hf"), geometry=geometry, timeout=30
    ) as c:
        stored = await hf.prefill_and_store(c, model, source)
        assert (stored.prompt_tokens, stored.stored_tokens, stored.stored_chunks, stored.stored_new) == (
            PROMPT,
            2 * CS,
            2,
            True,
        )
        kv = await c.retrieve(source)
        assert kv is not None and kv.shape == (2, 4, 2 * CS, 32)
        assert torch.equal(kv, vllm_exchange(own_cache(model, source))[:, :, : 2 * CS])
        assert await c.lookup(target) == 0
        assert await c.store(kv, target) is True  # the target is longer than the KV
        assert await c.lookup(target) == 2 * CS
        src = await hf.generate_with_cache(c, model, source, max_new_tokens=NEW)
        tgt = await hf.generate_with_cache(c, model, target, max_new_tokens=NEW, keep_kv=True)
        assert (tgt.hit_tokens, tgt.reused_tokens, tgt.computed_tokens) == (2 * CS, 2 * CS, 5)
        assert tgt.prompt_kv is not None and torch.equal(tgt.prompt_kv[:, :, : 2 * CS], kv)
        assert torch.equal(tgt.logits, src.logits)
        assert tgt.tokens == src.tokens and len(tgt.tokens) == NEW
        control = hf.generate(model, target, max_new_tokens=NEW)  # no cache: its own prompt
        assert control.hit_tokens == 0 and not torch.equal(control.logits, src.logits)
        assert (await hf.prefill_and_store(c, model, source)).stored_new is False  # all cached
        miss = await hf.generate_with_cache(c, model, prompt(55), max_new_tokens=2)  # nothing cached
        assert (miss.hit_tokens, miss.reused_tokens, miss.computed_tokens) == (0, 0, PROMPT)
        assert torch.equal(miss.logits, hf.generate(model, prompt(55), max_new_tokens=0).logits)


async def test_bad_inputs_fail_before_anything_is_sent(
    embedded_server_shm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = embedded_server_shm
    model = model_of(torch.float32)
    geometry = hf.geometry_from_model(model)
    async with AsyncClient(srv.url, srv.http_url, unique_model("hf-bad"), geometry=geometry, timeout=30) as c:
        sent = _no_sends(c, monkeypatch)
        other = model_of(torch.float32, kv_heads=4)  # another model's geometry
        msg = (
            r"^the client's geometry \(4 layers, 2 KV heads x 16, torch.float32\) does not match the "
            r"model's \(4 layers, 4 KV heads x 16, torch.float32\)$"
        )
        with pytest.raises(ValueError, match=msg):
            await hf.prefill_and_store(c, other, prompt(6))
        with pytest.raises(ValueError, match=msg):
            await hf.generate_with_cache(c, other, prompt(6))
        with pytest.raises(ValueError, match=r"model's \(4 layers, 2 KV heads x 16, torch.bfloat16\)$"):
            await hf.generate_with_cache(c, model_of(torch.bfloat16), prompt(6))
        with pytest.raises(ValueError, match=r"^layer 0 key has 4 KV heads x 16, the geometry 2 x 16"):
            await hf.store_cache(c, own_cache(other, prompt(6, 20)), prompt(6, 20))
        cache = own_cache(model, prompt(6, 20))
        batch2 = tuple(
            (layer.keys.repeat(2, 1, 1, 1), layer.values.repeat(2, 1, 1, 1)) for layer in cache.layers
        )
        with pytest.raises(ValueError, match=r"^layer 0 key has batch size 2; LMCache stores one sequence"):
            await hf.store_cache(c, batch2, prompt(6, 20))
        with pytest.raises(
            TypeError, match=r"^layer 0 key has dtype torch.bfloat16, the geometry says torch.float32$"
        ):
            await hf.store_cache(c, own_cache(model_of(torch.bfloat16), prompt(6, 20)), prompt(6, 20))
        with pytest.raises(ValueError, match=r"^kv covers 20 tokens but tokens has 19"):
            await hf.store_cache(c, cache, prompt(6, 19))
        with pytest.raises(ValueError, match=r"^token id 600 is outside the model's vocabulary"):
            await hf.prefill_and_store(c, model, [*prompt(6), 600])
        with pytest.raises(ValueError, match=r"^max_new_tokens must be an int >= 0, got -1$"):
            await hf.generate_with_cache(c, model, prompt(6), max_new_tokens=-1)
        assert sent == []
        monkeypatch.undo()
        # the same cache, well formed, stores (tokens may be longer than the cache)
        tokens = prompt(6, 21)
        assert await hf.store_cache(c, own_cache(model, tokens[:20]), tokens) is True
        assert await c.lookup(tokens) == CS


def test_the_blocking_client_path(embedded_server_pickle: Any) -> None:
    """With the blocking Client: prefill/generate are the model-only building blocks."""
    srv = embedded_server_pickle
    model = model_of(torch.bfloat16)
    tokens = prompt(7)
    with Client(srv.url, srv.http_url, unique_model("hf-sync"), geometry=hf.geometry_from_model(model)) as c:
        pre = hf.prefill(model, tokens)
        assert c.store(pre.kv, tokens) is True
        kv = c.retrieve(tokens)
        assert kv is not None and torch.equal(kv, pre.kv[:, :, : 2 * CS])
        gen = hf.generate(model, tokens, max_new_tokens=NEW, prefix_kv=kv)
        assert gen.reused_tokens == 2 * CS
        same = hf.generate(model, tokens, max_new_tokens=NEW, prefix_kv=pre.kv[:, :, : 2 * CS])
        assert torch.equal(gen.logits, same.logits) and gen.tokens == same.tokens


# --------------------------------------------------------------------------- engine interop


async def test_interop_with_lmcaches_engine_path(real_server: Any) -> None:
    """lmcache's own engine path (the fake vLLM worker: paged [2, blocks, 4, NH, HS] per
    layer) stores the model's KV and hf.py reads it bitwise and serves from it; KV that
    hf.py stores is what the engine reads back into its paged cache, bitwise."""
    from harness.workers import EngineWorker

    model = model_of(torch.bfloat16)
    name = unique_model("hf-engine")
    a, b = prompt(8), prompt(9)
    with EngineWorker(real_server.url) as eng:
        eng.register(name, num_layers=4, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=64)
        engine_kv = vllm_exchange(own_cache(model, a))
        assert eng.store(a, engine_kv) is True
        geometry = hf.geometry_from_model(model)
        async with AsyncClient(
            real_server.url, real_server.http_url, name, geometry=geometry, timeout=30
        ) as c:
            kv = await c.retrieve(a)
            assert kv is not None and torch.equal(kv, engine_kv[:, :, : 2 * CS])
            cache = hf.kv_to_cache(kv, geometry, config=model.config)
            for mine, theirs in zip(cache.layers, own_cache(model, a).layers, strict=True):
                assert torch.equal(mine.keys, theirs.keys[:, :, : 2 * CS])
                assert torch.equal(mine.values, theirs.values[:, :, : 2 * CS])
            served = await hf.generate_with_cache(c, model, a, max_new_tokens=NEW)
            assert served.reused_tokens == 2 * CS
            stored = await hf.prefill_and_store(c, model, b)
            assert stored.stored_new is True
        got = eng.retrieve(b)
        assert got is not None and torch.equal(got, vllm_exchange(own_cache(model, b))[:, :, : 2 * CS])
