"""lmcache_async.rope: RopeSpec from configs of both transformers generations, and the
rotation of cached keys by a position delta against transformers' own rotary embeddings.

Keys are laid out as LMCache stores them (``[2, L, T, D]``, heads outermost), built here
from transformers' ``[1, heads, T, head_dim]`` tensors the way vLLM's connector flattens
them (see tests/system/test_hf.py).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lmcache_async import RopeLayer, RopeScaling, RopeSpec

pytestmark = pytest.mark.xdist_group("transformers")

HEADS, HD, LAYERS, T = 2, 64, 3, 7
MAX_POS = 2048


def lmcache_layout(keys: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """``[1, H, T, hd]`` keys (the same for every layer) -> ``[2, LAYERS, T, H*hd]``."""
    row = torch.cat([keys[0, h] for h in range(keys.shape[1])], dim=-1)  # [T, H*hd]
    k = torch.stack([row] * LAYERS)
    v = values if values is not None else torch.randn(k.shape, generator=torch.Generator().manual_seed(9))
    return torch.stack([k, v.to(k.dtype)])


def random_kv(dtype: torch.dtype = torch.float32, layers: int = LAYERS, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, layers, T, HEADS * HD, generator=g).to(dtype)


def pair_norm(keys: torch.Tensor) -> torch.Tensor:
    """Per NeoX pair (i, i + hd/2) of each head: the pair's norm, broadcast to both."""
    x = keys.float().view(*keys.shape[:-1], HEADS, HD)
    a, b = x[..., : HD // 2], x[..., HD // 2 :]
    n = (a * a + b * b).sqrt()
    return torch.cat([n, n], dim=-1).view(keys.shape)


# --------------------------------------------------------------------------- properties


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_shift_then_inverse_returns_the_keys_within_one_rounding(dtype: torch.dtype) -> None:
    spec = RopeSpec(HD, theta=500000.0)
    kv = random_kv(dtype)
    back = spec.shift(spec.shift(kv, 1234), -1234)
    # each shift rounds once to the dtype (half an epsilon of the pair's size): two of
    # them, plus the float32 arithmetic of the rotations (a few float32 epsilons)
    bound = torch.finfo(dtype).eps + 4 * torch.finfo(torch.float32).eps
    err = (back[0].float() - kv[0].float()).abs()
    assert float((err / pair_norm(kv[0])).max()) <= bound
    assert not torch.equal(spec.shift(kv, 1234)[0], kv[0])  # it did rotate


def test_shift_by_a_then_b_equals_shift_by_a_plus_b_in_float32() -> None:
    spec = RopeSpec(HD)
    kv = random_kv()
    for a, b in [(5, 9), (-300, 1000), (17, -17), (4096, 123)]:
        twice = spec.shift(spec.shift(kv, a), b)
        once = spec.shift(kv, a + b)
        assert float(((twice[0] - once[0]).abs() / pair_norm(kv[0])).max()) < 4e-7, (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_values_are_untouched_and_delta_zero_is_a_copy(dtype: torch.dtype) -> None:
    spec = RopeSpec(HD, rotary_dim=32)
    kv = random_kv(dtype)
    out = spec.shift(kv, 77)
    assert torch.equal(out[1], kv[1])
    # coordinates past rotary_dim are never rotated
    k, o = kv[0].view(LAYERS, T, HEADS, HD), out[0].view(LAYERS, T, HEADS, HD)
    assert torch.equal(o[..., 32:], k[..., 32:])
    assert not torch.equal(o[..., :32], k[..., :32])
    same = spec.shift(kv, 0)
    assert torch.equal(same, kv) and same.data_ptr() != kv.data_ptr()


def test_shift_in_place_equals_shift_into_a_new_tensor() -> None:
    spec = RopeSpec(HD)
    kv = random_kv(torch.bfloat16)
    want = spec.shift(kv, 321)
    got = spec.shift(kv, 321, out=kv)
    assert got is kv and torch.equal(kv, want)


def test_rounded_once_to_the_dtype() -> None:
    """bfloat16 KV: the result is the float32 rotation of the bfloat16 keys, rounded once."""
    spec = RopeSpec(HD)
    kv = random_kv(torch.bfloat16)
    exact = spec.shift(kv.float(), 999)
    assert torch.equal(spec.shift(kv, 999)[0], exact[0].to(torch.bfloat16))


def test_layers_without_rope_and_per_layer_theta() -> None:
    spec = RopeSpec(HD, layers=(RopeLayer(10000.0), None, RopeLayer(1e6, RopeScaling("linear", 8.0))))
    kv = random_kv()
    out = spec.shift(kv, 50)
    assert torch.equal(out[0, 1], kv[0, 1])  # no RoPE in layer 1
    for layer, alone in ((0, RopeSpec(HD)), (2, RopeSpec(HD, 1e6, scaling=RopeScaling("linear", 8.0)))):
        assert torch.equal(out[0, layer], alone.shift(kv, 50)[0, layer])
    assert torch.equal(out[1], kv[1])
    with pytest.raises(ValueError, match=r"kv has 2 layers, the RopeSpec describes 3"):
        spec.shift(random_kv(layers=2), 1)
    with pytest.raises(ValueError, match="layer 1 has no rotary embedding"):
        spec.inv_freq(1)


def test_bad_arguments_are_refused() -> None:
    spec = RopeSpec(HD)
    with pytest.raises(ValueError, match=r"kv has shape \[3, 7\]; expected \[2, L, T, D\]"):
        spec.shift(torch.zeros(3, 7), 1)
    with pytest.raises(TypeError, match="kv has dtype torch.int8; RoPE shifts need"):
        spec.shift(torch.zeros(2, 1, 1, HD, dtype=torch.int8), 1)
    with pytest.raises(ValueError, match="kv has D = 96, not a multiple of head_dim 64"):
        spec.shift(torch.zeros(2, 1, 1, 96), 1)
    with pytest.raises(TypeError, match="delta must be an int, got float"):
        spec.shift(random_kv(), 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out is"):
        spec.shift(random_kv(), 1, out=random_kv(torch.bfloat16))
    kv = random_kv()
    for delta in (2**32, -(2**32), 10**30, 2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match="out of range") as info:
            spec.shift(kv, delta)
        assert str(info.value) == f"delta {delta} is out of range: |delta| must be below 2**32"
        with pytest.raises(ValueError, match=r"\|delta\| must be below 2\*\*32"):
            spec.rotate_keys(kv[0], delta, out=kv[0].clone())
    edge = spec.shift(kv, 2**32 - 1)  # the largest accepted delta
    assert torch.equal(spec.shift(kv, -(2**32) + 1, out=edge.clone())[1], kv[1])
    with pytest.raises(ValueError, match=r"rotary_dim must be an even int in \[2, head_dim=64\], got 33"):
        RopeSpec(HD, rotary_dim=33)
    with pytest.raises(ValueError, match="theta must be a number > 0"):
        RopeSpec(HD, theta=0)
    with pytest.raises(ValueError, match="llama3 scaling needs original_max_position_embeddings"):
        RopeScaling("llama3", 8.0)
    with pytest.raises(ValueError, match="kind must be 'linear', 'llama3' or 'yarn'"):
        RopeScaling("dynamic", 2.0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- against transformers


def _llama(rope_scaling: dict[str, Any] | None, **kw: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=HEADS * 2 * HD,
        num_attention_heads=HEADS * 2,
        num_key_value_heads=HEADS,
        num_hidden_layers=LAYERS,
        max_position_embeddings=MAX_POS * 4,
        rope_scaling=rope_scaling,
        **kw,
    )


SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAX_POS},
    "yarn-untruncated": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": MAX_POS,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "truncate": False,
    },
}


def _moved_keys_agree(spec: RopeSpec, rotary: Any, apply: Any, seed: int) -> None:
    """Keys embedded by transformers at random positions p, shifted by ``spec`` by random
    deltas, equal transformers' keys at p + delta to float32 rounding of the angles."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(6):
        k = torch.randn(1, HEADS, T, HD, generator=g)
        p = int(torch.randint(0, MAX_POS, (1,), generator=g))
        delta = int(torch.randint(-p, MAX_POS, (1,), generator=g))
        pos = torch.arange(p, p + T).unsqueeze(0)
        at_p = apply(k, rotary, pos)
        at_moved = apply(k, rotary, pos + delta)
        got = spec.shift(lmcache_layout(at_p), delta)
        want = lmcache_layout(at_moved, got[1])
        # transformers computes each angle in float32: at position P it is off by up to
        # about P * 2**-24 radians; ours (float64 angle) adds one float32 rounding.
        bound = float(at_p.abs().max()) * (4 * (p + abs(delta) + T) * 2**-24 + 1e-6)
        assert float((got[0] - want[0]).abs().max()) <= bound, (p, delta)


def _neox_apply(k: torch.Tensor, rotary: Any, pos: torch.Tensor) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = rotary(k, pos)
    return apply_rotary_pos_emb(k, k, cos, sin)[1]


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_each_scaling_matches_transformers_rotary_embedding(kind: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _llama(SCALINGS[kind])
    spec = RopeSpec.from_hf_config(config)
    rotary = LlamaRotaryEmbedding(config)
    assert torch.equal(spec.inv_freq(), rotary.inv_freq)  # the same frequencies, bitwise
    if kind != "default":
        assert spec.scaling is not None and spec.scaling.kind == kind.split("-")[0]
    _moved_keys_agree(spec, rotary, _neox_apply, seed=len(kind))


def test_partial_rotary_dimension_matches_gpt_neox() -> None:
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    config = GPTNeoXConfig(
        hidden_size=HEADS * HD, num_attention_heads=HEADS, num_hidden_layers=LAYERS, rotary_pct=0.25
    )
    spec = RopeSpec.from_hf_config(config)
    assert (spec.rotary_dim, spec.interleaved) == (16, False)
    rotary = GPTNeoXRotaryEmbedding(config)
    assert torch.equal(spec.inv_freq(), rotary.inv_freq)

    def apply(k: torch.Tensor, rot: Any, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = rot(k, pos)
        return apply_rotary_pos_emb(k, k, cos, sin)[1]

    _moved_keys_agree(spec, rotary, apply, seed=3)


def test_gptj_pairing_matches_gptj() -> None:
    from transformers import GPTJConfig
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    config = GPTJConfig(n_embd=HEADS * HD, n_head=HEADS, n_layer=LAYERS, rotary_dim=32)
    spec = RopeSpec.from_hf_config(config)
    assert (spec.head_dim, spec.rotary_dim, spec.interleaved, spec.theta) == (HD, 32, True, 10000.0)
    table = create_sinusoidal_positions(MAX_POS * 2, 32)

    def apply(k: torch.Tensor, _: Any, pos: torch.Tensor) -> torch.Tensor:
        x = k.transpose(1, 2)  # GPT-J rotates [batch, T, heads, hd]
        sincos = table[pos]
        sin, cos = torch.split(sincos, 16, dim=-1)
        rot = apply_rotary_pos_emb(x[..., :32], sin, cos)
        return torch.cat([rot, x[..., 32:]], dim=-1).transpose(1, 2)

    _moved_keys_agree(spec, None, apply, seed=4)


# --------------------------------------------------------------------------- configs


def test_transformers_4_and_5_config_shapes_give_the_same_spec() -> None:
    t4 = {
        "model_type": "llama",
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_hidden_layers": 4,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    t5 = {
        "model_type": "llama",
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_hidden_layers": 4,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    want = RopeSpec(64, 500000.0, scaling=RopeScaling("llama3", 8.0, 8192, 1.0, 4.0))
    assert RopeSpec.from_hf_config(t4) == want
    assert RopeSpec.from_hf_config(t5) == want
    assert RopeSpec.from_hf_config(_llama(None, rope_theta=500000.0)).theta == 500000.0
    # plain t4: rope_theta only; a multimodal config's text_config
    plain = {"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 1e6, "head_dim": 128}
    assert RopeSpec.from_hf_config(plain) == RopeSpec(128, 1e6)
    assert RopeSpec.from_hf_config({"model_type": "llava", "text_config": plain}) == RopeSpec(128, 1e6)


def test_per_layer_types_and_no_rope_layers() -> None:
    from transformers import Gemma3TextConfig

    gemma = Gemma3TextConfig(num_hidden_layers=6, head_dim=HD)
    spec = RopeSpec.from_hf_config(gemma)
    assert spec.layers == (RopeLayer(10000.0),) * 5 + (RopeLayer(1e6),)
    t4_gemma = {
        "model_type": "gemma3_text",
        "head_dim": HD,
        "num_hidden_layers": 3,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    }
    assert RopeSpec.from_hf_config(t4_gemma).layers == (RopeLayer(1e4), RopeLayer(1e4), RopeLayer(1e6))
    smol = {"head_dim": HD, "num_hidden_layers": 4, "rope_theta": 2e6, "no_rope_layers": [1, 1, 1, 0]}
    assert RopeSpec.from_hf_config(smol).layers == (RopeLayer(2e6),) * 3 + (None,)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"head_dim": 64, "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "rope_type 'dynamic' is refused: dynamic NTK scaling changes the frequencies with the sequence length",
        ),
        (
            {
                "head_dim": 64,
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0],
                    "long_factor": [2.0],
                },
            },
            "rope_type 'longrope' is refused: LongRoPE switches its frequencies",
        ),
        (
            {
                "head_dim": 64,
                "rope_theta": 1e6,
                "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            },
            "M-RoPE .multimodal. rotates by several position axes",
        ),
        (
            {"model_type": "gpt2", "n_embd": 768, "n_head": 12},
            "the config of gpt2 has no rotary position embedding: its cached keys cannot be moved",
        ),
        (
            {"model_type": "bert", "position_embedding_type": "absolute", "hidden_size": 64},
            r"has no rotary position embedding \(position_embedding_type 'absolute'\)",
        ),
    ],
    ids=["dynamic", "longrope", "mrope", "gpt2", "absolute"],
)
def test_refused_kinds(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RopeSpec.from_hf_config(config)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"head_dim": "64", "rope_theta": [1]}, "the config's rope_theta must be a number, got [1]"),
        ({"head_dim": [64], "rope_theta": 1e4}, "the config's head_dim must be an integer, got [64]"),
        ({"head_dim": 64.5, "rope_theta": 1e4}, "the config's head_dim must be an integer, got 64.5"),
        (
            {"head_dim": 64, "rope_theta": 1e4, "rope_scaling": {"rope_type": "linear", "factor": "x"}},
            "the config's factor must be a number, got 'x'",
        ),
        (
            {"head_dim": 64, "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": {}}},
            "the config's low_freq_factor must be a number, got {}",
        ),
        (
            {"head_dim": 64, "rope_theta": 1e4, "rotary_dim": "a"},
            "the config's rotary_dim must be an integer, got 'a'",
        ),
        ({"head_dim": 64, "rope_theta": True}, "the config's rope_theta must be a number, got True"),
    ],
    ids=[
        "theta-list",
        "head_dim-list",
        "head_dim-fraction",
        "factor-str",
        "low_freq-dict",
        "rotary_dim",
        "bool",
    ],
)
def test_non_numeric_config_fields_are_named(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="the config's ") as info:
        RopeSpec.from_hf_config(config)
    assert str(info.value) == message


def test_from_a_real_transformers_5_config_object_with_yarn() -> None:
    config = _llama(SCALINGS["yarn"])
    spec = RopeSpec.from_hf_config(config)
    assert spec.scaling == RopeScaling("yarn", 4.0, MAX_POS)
    assert math.isclose(spec.theta, 10000.0)
