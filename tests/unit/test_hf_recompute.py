"""The repairs' in-place pass (``lmcache_async._engine.hf_recompute``), run on the CPU here by
adding it to ``DEVICES`` (on the GPU it is the default; ``tests/gpu/test_hf_cuda.py``
runs it there against the CPU path): the attention cut by position against a masked
reference, the blocks, and the repairs' results against the 4D-mask path they replace,
within float32 rounding; the model's attention setting restored after every pass."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lmcache_async import hf, hf_blend
from lmcache_async._engine import hf_recompute as _hf_recompute
from lmcache_async._engine.hf_recompute import BLOCK_QUERIES, BLOCK_SPAN, attend_up_to, blocks
from lmcache_async.testing.tiny_llama import tiny_llama

pytestmark = pytest.mark.xdist_group("transformers")


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_hf_recompute, "DEVICES", ("cuda", "cpu"))


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama(torch.float32)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: list[int], scale: float) -> torch.Tensor:
    """Float64 attention with the mask ``key position <= at[i]``, KV heads repeated."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(g, dim=1) for x in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    seen = torch.arange(k.shape[2]).unsqueeze(0) <= torch.tensor(at).unsqueeze(1)
    scores.masked_fill_(~seen, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize(
    "at",
    [
        [0],
        [5],
        list(range(0, 40)),
        list(range(30, 330)),  # two blocks of contiguous queries
        sorted(random.Random(1).sample(range(3000), 300)),  # blocks cut by span and count
        [0, 1, 2900, 2999],
    ],
    ids=["first", "one", "prefix", "contiguous", "scattered", "far"],
)
def test_attention_cut_by_position_is_the_masked_attention(at: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(at))
    total = 3000
    q = torch.randn(1, 4, len(at), 16, generator=gen)
    k = torch.randn(1, 2, total, 16, generator=gen)
    v = torch.randn(1, 2, total, 16, generator=gen)
    got = attend_up_to(q, k, v, torch.tensor(at), blocks(at), 0.25)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), reference(q, k, v, at, 0.25), rtol=0, atol=2e-6)


def test_blocks_hold_their_limits() -> None:
    assert blocks([]) == ()
    assert blocks([7]) == ((0, 1, 7, 7),)
    assert blocks(list(range(600))) == (
        (0, BLOCK_QUERIES, 0, BLOCK_QUERIES - 1),
        (BLOCK_QUERIES, 2 * BLOCK_QUERIES, BLOCK_QUERIES, 2 * BLOCK_QUERIES - 1),
        (2 * BLOCK_QUERIES, 600, 2 * BLOCK_QUERIES, 599),
    )
    assert blocks([0, BLOCK_SPAN - 1, BLOCK_SPAN, 5 * BLOCK_SPAN]) == (
        (0, 2, 0, BLOCK_SPAN - 1),
        (2, 3, BLOCK_SPAN, BLOCK_SPAN),
        (3, 4, 5 * BLOCK_SPAN, 5 * BLOCK_SPAN),
    )
    at = sorted(random.Random(2).sample(range(100_000), 5000))
    cut = blocks(at)
    assert [i for s, e, _, _ in cut for i in range(s, e)] == list(range(5000))
    assert all(e - s <= BLOCK_QUERIES and last - first < BLOCK_SPAN for s, e, first, last in cut)
    assert all((first, last) == (at[s], at[e - 1]) for s, e, first, last in cut)


def composed(model: Any, total: int) -> tuple[list[int], torch.Tensor]:
    geometry = hf.geometry_from_model(model)
    gen = torch.Generator().manual_seed(total)
    toks = torch.randint(0, 500, (total + 9,), generator=gen).tolist()
    return toks, torch.randn(geometry.kv_shape(total), generator=gen)


def test_the_pass_is_not_used_on_the_cpu_by_default(model: Any) -> None:
    assert not _hf_recompute.usable(model, torch.zeros(1))


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("chosen", ["scattered", "spans"])
def test_recompute_in_place_is_the_masked_recompute(model: Any, chosen: str) -> None:
    toks, kv = composed(model, 700)
    if chosen == "scattered":
        at = sorted(random.Random(3).sample(range(64, 700), 150))
    else:
        at = [t for a in (64, 300, 520) for t in range(a, a + 20)]
    fast = kv.clone()
    assert _hf_recompute.usable(model, fast)
    hf._recompute_at(model, toks, fast, at)
    masked = kv.clone()
    _hf_recompute.DEVICES = ("cuda",)  # the fixture restores it
    assert not _hf_recompute.usable(model, masked)
    hf._recompute_at(model, toks, masked, at)
    assert model.config._attn_implementation == "sdpa"
    others = [t for t in range(700) if t not in set(at)]
    assert torch.equal(fast[:, :, others], kv[:, :, others])  # only the chosen tokens change
    assert not torch.equal(fast[:, :, at], kv[:, :, at])
    torch.testing.assert_close(fast, masked, rtol=0, atol=2e-5)


@pytest.mark.usefixtures("on_cpu")
def test_selection_values_in_place_are_those_of_the_prefill(model: Any) -> None:
    toks, kv = composed(model, 500)
    before = kv.clone()
    fast = hf_blend._layer_values(model, toks, kv, 100, 500, 1)
    assert torch.equal(kv, before)  # the selection's pass wrote into a copy
    _hf_recompute.DEVICES = ("cuda",)
    slow = hf_blend._layer_values(model, toks, kv, 100, 500, 1)
    torch.testing.assert_close(fast, slow, rtol=0, atol=2e-5)


@pytest.mark.usefixtures("on_cpu")
def test_select_and_recompute_chooses_the_same_tokens(model: Any) -> None:
    toks, kv = composed(model, 640)
    spans = [(160, 400), (400, 640)]
    results = []
    for devices in (("cuda", "cpu"), ("cuda",)):
        _hf_recompute.DEVICES = devices
        out = kv.clone()
        chosen = hf_blend.select_and_recompute(model, toks, out, spans, 0.2, exact=160)
        results.append((chosen, out))
    assert results[0][0] == results[1][0] and len(results[0][0]) == 96
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=2e-5)


@pytest.mark.usefixtures("on_cpu")
def test_other_threads_keep_their_attention_during_a_pass(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one thread's pass runs, a forward from another thread is sdpa's (the
    function hands it over), and the setting is restored after the pass."""
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    seen: list[torch.Tensor] = []
    inside = threading.Event()
    real = _hf_recompute.attend_up_to

    def meanwhile(*args: Any) -> torch.Tensor:
        if not inside.is_set():
            inside.set()
            assert model.config._attn_implementation == _hf_recompute.NAME
            worker = threading.Thread(target=lambda: seen.append(model(input_ids=ids).logits.detach()))
            worker.start()
            worker.join(30)
        return real(*args)

    monkeypatch.setattr(_hf_recompute, "attend_up_to", meanwhile)
    toks, kv = composed(model, 200)
    hf._recompute_at(model, toks, kv, [50, 60, 70])
    assert inside.is_set() and len(seen) == 1
    assert torch.equal(seen[0], expected)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.usefixtures("on_cpu")
def test_a_failed_pass_restores_the_attention(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any) -> torch.Tensor:
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(_hf_recompute, "attend_up_to", boom)
    toks, kv = composed(model, 100)
    with pytest.raises(RuntimeError, match="simulated"):
        hf._recompute_at(model, toks, kv, [10, 20])
    assert model.config._attn_implementation == "sdpa"
    assert not _hf_recompute._switched


def test_an_eager_model_keeps_the_masked_path(on_cpu: None) -> None:
    eager = tiny_llama(torch.float32, attn_implementation="eager")
    assert not _hf_recompute.usable(eager, torch.zeros(1))


@pytest.fixture(autouse=True)
def _no_switch_left() -> Iterator[None]:
    yield
    assert not _hf_recompute._switched
