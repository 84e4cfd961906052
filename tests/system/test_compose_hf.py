"""Composition with a real model: the tiny Llama of the suite
(:func:`lmcache_async.testing.tiny_llama.tiny_llama`), its KV served by the embedded server.

* float32: a part moved by any delta (chunk-aligned or not, from any start) equals that
  text prefilled at its new positions: keys within 1e-4 of the largest key of the fresh
  prefill, values bitwise in the first layer and within float32 rounding after it.
* bfloat16: the next-token logits after a moved prompt err at most half as much as with
  the unrotated KV (the control).
* :func:`hf.compose_and_repair`: ``recompute=0`` is :meth:`AsyncClient.compose`;
  recomputing whole parts gives the full prefill; the error falls as ``recompute`` grows.
* :func:`hf_blend.cache_document`: ``prefix + document`` padded to whole chunks is stored
  (bitwise the prefill's KV) once; its part; refusals before anything is sent.
* :func:`hf_blend.select_and_recompute`: the early pass stopped at the layer's value
  projection gives bitwise the values of a pass through the whole layer, so the tokens
  chosen are exactly the top deviations of those values, per part; the others keep their
  composed KV bitwise. With ``selection="query"`` the scores are the attention weights
  the tail pays each token (within float32 rounding of transformers' eager attention), the
  tokens chosen exactly its top ones per part; no tail, or an unknown selection, is
  refused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from lmcache_async import AsyncClient, KVPart, RopeSpec, hf, hf_blend
from lmcache_async.testing.tiny_llama import tiny_llama
from tests.helpers import SESSION_CHUNK_SIZE, fresh_tokens, unique_model

pytestmark = [pytest.mark.anyio, pytest.mark.xdist_group("transformers")]

CS = SESSION_CHUNK_SIZE
VOCAB = 512
_MODELS: dict[torch.dtype, Any] = {}


def model_of(dtype: torch.dtype) -> Any:
    if dtype not in _MODELS:
        _MODELS[dtype] = tiny_llama(dtype)
    return _MODELS[dtype]


def text(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_at(model: Any, tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` alone (nothing in front) at positions ``start ..``: their KV and the
    last position's logits, computed with transformers directly."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kwarg = "cache" if "cache" in hf._forward_params(type(model)) else "past_key_values"
    positions = torch.arange(start, start + len(tokens)).unsqueeze(0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([tokens]), position_ids=positions, use_cache=True, **{kwarg: cache}
        )
    return hf.cache_to_kv(cache, hf.geometry_from_model(model)), out.logits[0, -1].float()


def next_logits(model: Any, kv: torch.Tensor, token: int, position: int) -> torch.Tensor:
    """The logits of ``token`` at ``position`` over the cache ``kv`` (whatever positions
    its keys were computed at)."""
    geometry = hf.geometry_from_model(model)
    cache = hf.kv_to_cache(kv, geometry, config=model.config)
    kwarg = "cache" if "cache" in hf._forward_params(type(model)) else "past_key_values"
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([[token]]),
            position_ids=torch.tensor([[position]]),
            use_cache=True,
            **{kwarg: cache},
        )
    return out.logits[0, -1].float()


@pytest.fixture
async def client_f32(embedded_server_pickle: Any) -> AsyncIterator[AsyncClient]:
    srv = embedded_server_pickle
    geometry = hf.geometry_from_model(model_of(torch.float32))
    async with AsyncClient(srv.url, srv.http_url, unique_model("hf"), geometry=geometry, timeout=60) as c:
        yield c


@pytest.mark.parametrize(
    ("start", "offset"),
    [(0, CS), (0, 2 * CS), (0, 5), (0, 23), (0, 100), (7, 30), (CS, 3 * CS + 1)],
    ids=lambda v: str(v),
)
async def test_float32_moved_part_equals_a_prefill_at_its_new_positions(
    client_f32: AsyncClient, start: int, offset: int
) -> None:
    model = model_of(torch.float32)
    rope = RopeSpec.from_hf_config(model.config)
    doc = text(1, 3 * CS)
    await hf.prefill_and_store(client_f32, model, doc)
    filler = text(2, 8 * CS)
    await hf.prefill_and_store(client_f32, model, filler)
    target = fresh_tokens(offset) + doc[start:]
    res = await client_f32.compose(target, [KVPart(filler, 0, offset), KVPart(doc, start)], rope=rope)
    assert res.hit and res.parts[1].shift == offset - start
    got = await client_f32.retrieve(target)
    assert got is not None and got.shape[2] == res.stored_tokens
    moved = got[:, :, offset:]
    fresh, _ = prefill_at(model, doc, offset - start)
    fresh = fresh[:, :, start : start + moved.shape[2]]
    keys_err = float((moved[0] - fresh[0]).abs().max())
    assert keys_err <= 1e-4 * float(fresh[0].abs().max()), keys_err
    assert torch.equal(moved[1, 0], fresh[1, 0])  # the first layer's values: bitwise
    values_err = float((moved[1] - fresh[1]).abs().max())
    assert values_err <= 64 * torch.finfo(torch.float32).eps * float(fresh[1].abs().max()), values_err


async def test_bfloat16_logit_error_is_at_most_half_the_unrotated_controls() -> None:
    model = model_of(torch.bfloat16)
    rope = RopeSpec.from_hf_config(model.config)
    doc = text(3, 3 * CS + 1)
    cached, _ = prefill_at(model, doc[:-1], 0)  # the prompt as cached at position 0
    for delta in (CS, 37, 200):
        _, want = prefill_at(model, doc, delta)  # the prompt prefilled at its new positions
        rotated = next_logits(model, rope.shift(cached, delta), doc[-1], delta + len(doc) - 1)
        control = next_logits(model, cached, doc[-1], delta + len(doc) - 1)
        err, err_control = float((rotated - want).abs().max()), float((control - want).abs().max())
        assert err <= 0.5 * err_control, (delta, err, err_control)


async def test_compose_and_repair(client_f32: AsyncClient) -> None:
    model = model_of(torch.float32)
    system, doc1, doc2 = text(4, 2 * CS), text(5, 3 * CS), text(6, 3 * CS)
    for t in (system, doc1, doc2):
        await hf.prefill_and_store(client_f32, model, t)
    target = system + doc1 + doc2
    parts = [KVPart(system, cache_salt=""), KVPart(doc1, cache_salt=""), KVPart(doc2, cache_salt="")]
    full, _ = prefill_at(model, target, 0)

    plain = await client_f32.compose(
        target, parts, rope=RopeSpec.from_hf_config(model.config), cache_salt="plain"
    )
    assert plain.stored_tokens == len(target)
    plain_kv = await client_f32.retrieve(target, "plain")
    errors = []
    for k in (0, 4, 16, 3 * CS):
        out = await hf.compose_and_repair(client_f32, model, target, parts, recompute=k, cache_salt=f"k{k}")
        assert out.kv is not None and out.result.stored_tokens == len(target) and out.result.stored_new
        assert out.recomputed_tokens == 2 * k
        stored = await client_f32.retrieve(target, f"k{k}")
        assert stored is not None and torch.equal(stored, out.kv)
        if k == 0:
            assert plain_kv is not None and torch.equal(out.kv, plain_kv)
        errors.append(float((out.kv - full).abs().mean()))
    assert errors[0] > errors[1] > errors[2] > errors[3], errors
    # whole parts recomputed over the right prefix: the full prefill, to float32 rounding
    assert errors[3] <= 1e-6 * float(full.abs().mean()), errors


async def test_compose_and_repair_miss_and_refusals(client_f32: AsyncClient) -> None:
    model = model_of(torch.float32)
    doc = text(7, 2 * CS)
    await hf.prefill_and_store(client_f32, model, doc)
    target = doc + text(8, 2 * CS)
    out = await hf.compose_and_repair(
        client_f32, model, target, [KVPart(doc), KVPart(text(8, 2 * CS))], recompute=4
    )
    assert out.kv is None and out.recomputed_tokens == 0 and out.result.missed == (1,)
    assert await client_f32.lookup(target) == 2 * CS  # only doc's own chunks: nothing stored
    with pytest.raises(ValueError, match="recompute must be an int >= 0, got -1"):
        await hf.compose_and_repair(client_f32, model, target, [KVPart(doc)], recompute=-1)
    with pytest.raises(ValueError, match="rope_type 'dynamic' is refused"):
        await hf.compose_and_repair(
            client_f32,
            model,
            target,
            [KVPart(doc)],
            rope=RopeSpec.from_hf_config(
                {"head_dim": 16, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
            ),
        )


async def test_cache_document_stores_prefix_and_document_once_and_returns_its_part(
    client_f32: AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_of(torch.float32)
    prefix, doc, pad = text(10, 5), text(11, 20), 3
    part = await hf_blend.cache_document(
        client_f32, model, doc, prefix=prefix, pad_token_id=pad, cache_salt="d"
    )
    source = prefix + doc + [pad] * (2 * CS - 25)
    assert part == KVPart(source, 5, 25, cache_salt="d")
    stored = await client_f32.retrieve(source, "d")
    want, _ = prefill_at(model, source, 0)
    assert stored is not None and torch.equal(stored, want)  # the prefill's KV, bitwise
    calls: list[object] = []
    monkeypatch.setattr(hf_blend, "prefill_and_store", lambda *a, **k: calls.append(a))
    again = await hf_blend.cache_document(
        client_f32, model, doc, prefix=prefix, pad_token_id=pad, cache_salt="d"
    )
    assert again == part and calls == []  # cached already: nothing computed or sent again
    monkeypatch.undo()
    whole = text(12, 2 * CS)  # alone, whole chunks: no pad needed
    assert await hf_blend.cache_document(client_f32, model, whole) == KVPart(whole, 0, 2 * CS, cache_salt="")
    assert await client_f32.lookup(whole) == 2 * CS


async def test_cache_document_refuses_before_sending(client_f32: AsyncClient) -> None:
    model = model_of(torch.float32)
    doc = text(13, 20)
    with pytest.raises(
        ValueError, match=r"^prefix \+ document is 20 tokens, not whole chunks of 16: pass pad_token_id$"
    ):
        await hf_blend.cache_document(client_f32, model, doc)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 512 ids"):
        await hf_blend.cache_document(client_f32, model, doc, pad_token_id=VOCAB)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 512 ids"):
        await hf_blend.cache_document(client_f32, model, doc, prefix=[VOCAB], pad_token_id=1)
    with pytest.raises(ValueError, match="must not be empty"):
        await hf_blend.cache_document(client_f32, model, [], prefix=doc)
    assert await client_f32.lookup(doc + [0] * 12) == 0 and await client_f32.lookup(doc + [1] * 12) == 0


def test_selection_is_the_top_value_deviations_of_each_part() -> None:
    model = model_of(torch.float32)
    geometry = hf.geometry_from_model(model)
    system, doc1, doc2 = text(20, CS), text(21, 2 * CS), text(22, 2 * CS)
    toks = system + doc1 + doc2
    kv = torch.cat([prefill_at(model, t, 0)[0] for t in (system, doc1, doc2)], dim=2)  # unrotated: fine here
    spans = [(CS, 3 * CS), (3 * CS, 5 * CS)]
    for layer in (1, 2):
        early = hf_blend._layer_values(model, toks, kv, CS, 5 * CS, layer)
        whole = hf_blend._layer_kv(model, toks, kv, CS, 5 * CS, layer)[1]
        assert torch.equal(early, whole)  # stopping at v_proj changes nothing
        dev = (whole.float() - kv[1, layer, CS:].float()).pow(2).sum(dim=1)
        want = sorted(
            int(i) + a
            for a, b in spans
            for i in torch.topk(dev[a - CS : b - CS], int(0.25 * (b - a) + 0.5)).indices
        )
        out = kv.clone()
        chosen = hf_blend.select_and_recompute(model, toks, out, spans, 0.25, select_layer=layer, exact=CS)
        assert chosen == want and len(chosen) == 16
        kept = [i for i in range(5 * CS) if i not in set(chosen)]
        assert torch.equal(out[:, :, kept], kv[:, :, kept])
        assert not torch.equal(out[:, :, chosen], kv[:, :, chosen])
    assert geometry.num_layers >= 3


def test_query_selection_is_the_tails_top_attention_of_each_part() -> None:
    model = model_of(torch.float32)
    eager = tiny_llama(torch.float32, attn_implementation="eager")  # the same weights
    system, doc1, doc2, question = text(30, CS), text(31, 2 * CS), text(32, 2 * CS), text(33, 9)
    toks = system + doc1 + doc2 + question
    total = 5 * CS
    kv = torch.cat([prefill_at(model, t, 0)[0] for t in (system, doc1, doc2)], dim=2)
    spans = [(CS, 3 * CS), (3 * CS, 5 * CS)]
    cache = hf.kv_to_cache(kv, hf.geometry_from_model(model), config=model.config)
    kwarg = "cache" if "cache" in hf._forward_params(type(eager)) else "past_key_values"
    with torch.no_grad():
        out = eager(
            input_ids=torch.tensor([question]),
            position_ids=torch.arange(total, len(toks)).unsqueeze(0),
            use_cache=True,
            output_attentions=True,
            **{kwarg: cache},
        )
    for layer in (1, 2):
        want_scores = out.attentions[layer][0, :, :, CS:total].float().sum(dim=(0, 1))
        scores = hf_blend._query_attention(model, toks, kv, CS, layer)
        assert scores.shape == (4 * CS,)
        assert float((scores - want_scores).abs().max()) <= 1e-5 * float(want_scores.max())
        want = sorted(
            int(i) + a
            for a, b in spans
            for i in torch.topk(want_scores[a - CS : b - CS], int(0.25 * (b - a) + 0.5)).indices
        )
        got = kv.clone()
        chosen = hf_blend.select_and_recompute(
            model, toks, got, spans, 0.25, select_layer=layer, exact=CS, selection="query"
        )
        assert chosen == want and len(chosen) == 16
        kept = [i for i in range(total) if i not in set(chosen)]
        assert torch.equal(got[:, :, kept], kv[:, :, kept])
        assert not torch.equal(got[:, :, chosen], kv[:, :, chosen])
    # The default layers: a quarter of the depth (at least 1), and 1.
    assert hf.geometry_from_model(model).num_layers == 4
    assert hf_blend.default_select_layer("query", 4) == 1
    assert hf_blend.default_select_layer("deviation", 4) == 1
    assert [hf_blend.default_select_layer("query", n) for n in (1, 2, 8, 30, 32)] == [0, 1, 2, 7, 8]
    with pytest.raises(
        ValueError,
        match=r"^selection='query' needs tokens after the composed KV's 80 \(the question\); there are 0$",
    ):
        hf_blend.select_and_recompute(
            model, toks[:total], kv.clone(), spans, 0.25, exact=CS, selection="query"
        )
    with pytest.raises(ValueError, match=r"^selection must be one of 'deviation', 'query', got 'attention'$"):
        hf_blend.select_and_recompute(model, toks, kv.clone(), spans, 0.25, exact=CS, selection="attention")


async def test_served_composition_generates_from_the_composed_kv_while_the_store_runs(
    client_f32: AsyncClient,
) -> None:
    """``max_new_tokens``: the tokens are :func:`hf.generate` over the composed KV (the
    same KV that is stored), and the store, returned unfinished, stores exactly it."""
    model = model_of(torch.float32)
    doc1, doc2 = text(20, 3 * CS), text(21, 2 * CS)
    for t in (doc1, doc2):
        await hf.prefill_and_store(client_f32, model, t)
    question = text(22, 5)
    target = doc2 + doc1 + question
    parts = [KVPart(doc2, cache_salt=""), KVPart(doc1, cache_salt="")]
    for blend in (False, True):
        salt = f"served-{blend}-{fresh_tokens(1)[0]}"
        if blend:
            served = await hf_blend.compose_and_blend(
                client_f32, model, target, parts, recompute_fraction=0.2, cache_salt=salt, max_new_tokens=4
            )
        else:
            served = await hf.compose_and_repair(
                client_f32, model, target, parts, recompute=3, cache_salt=salt, max_new_tokens=4
            )
        assert served.generation is not None and served.stored is not None and served.kv is not None
        assert served.result.stored_tokens == 5 * CS and served.recomputed_tokens > 0
        want = hf.generate(model, target, max_new_tokens=4, prefix_kv=served.kv)
        assert served.generation.tokens == want.tokens
        assert torch.equal(served.generation.logits, want.logits)
        assert served.generation.reused_tokens == 5 * CS and served.generation.computed_tokens == 5
        assert await served.stored is True
        got = await client_f32.retrieve(target, salt)
        assert got is not None and torch.equal(got, served.kv)


async def test_served_composition_cancelled_while_generating_cancels_the_store(
    client_f32: AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancellation while the tokens are generated cancels the store running beside
    them: nothing is stored, and the client is left with nothing in flight."""
    model = model_of(torch.float32)
    doc = text(23, 4 * CS)
    await hf.prefill_and_store(client_f32, model, doc)
    target = doc + text(24, 3)
    generating = asyncio.Event()
    loop = asyncio.get_running_loop()
    real_generate, real_store = hf.generate, client_f32.store

    def slow_generate(*args: Any, **kwargs: Any) -> Any:
        loop.call_soon_threadsafe(generating.set)
        time.sleep(0.2)
        return real_generate(*args, **kwargs)

    async def slow_store(*args: Any, **kwargs: Any) -> bool:
        await asyncio.sleep(0.5)
        return await real_store(*args, **kwargs)

    monkeypatch.setattr(hf, "generate", slow_generate)
    monkeypatch.setattr(client_f32, "store", slow_store)
    salt = "cancelled-while-generating"
    task = asyncio.ensure_future(
        hf.compose_and_repair(
            client_f32, model, target, [KVPart(doc, cache_salt="")], cache_salt=salt, max_new_tokens=2
        )
    )
    await generating.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.6)  # past the store's delay: a store not cancelled would run now
    assert await client_f32.drain(timeout=10)
    assert await client_f32.lookup(target, salt) == 0


async def test_served_composition_store_is_finished_by_aclose(embedded_server_pickle: Any) -> None:
    """The store returned unfinished is an operation of the client: ``aclose()`` waits
    for it, and the target is stored whole."""
    srv = embedded_server_pickle
    model = model_of(torch.float32)
    geometry = hf.geometry_from_model(model)
    name = unique_model("hf-served")
    doc = text(26, 4 * CS)
    target = doc + text(27, 2)
    async with AsyncClient(srv.url, srv.http_url, name, geometry=geometry, timeout=60) as c:
        await hf.prefill_and_store(c, model, doc)
        served = await hf.compose_and_repair(
            c, model, target, [KVPart(doc, cache_salt="")], cache_salt="closed", max_new_tokens=1
        )
        assert served.stored is not None and served.kv is not None
    assert served.stored.done() and served.stored.result() is True
    async with AsyncClient(srv.url, srv.http_url, name, geometry=geometry, timeout=60) as c:
        got = await c.retrieve(target, "closed")
    assert got is not None and torch.equal(got, served.kv)


async def test_served_composition_refuses_bad_max_new_tokens_before_sending(client_f32: AsyncClient) -> None:
    model = model_of(torch.float32)
    doc = text(25, CS)
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
            await hf.compose_and_repair(client_f32, model, doc, [KVPart(doc)], max_new_tokens=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
            await hf_blend.compose_and_blend(
                client_f32,
                model,
                doc,
                [KVPart(doc)],
                recompute_fraction=0.1,
                max_new_tokens=bad,  # type: ignore[arg-type]
            )
