"""RopeSpec.shift on CUDA tensors: the rotation runs on the tensor's device and equals
the CPU rotation within one rounding of the KV's dtype; values stay bitwise.

Marked ``gpu`` and skipped without CUDA. On a GPU machine, from the repo root:

    python -m pytest tests/gpu/test_rope_cuda.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch

from lmcache_async import RopeLayer, RopeScaling, RopeSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HD, HEADS, LAYERS, T = 128, 8, 4, 512

SPECS = {
    "neox": RopeSpec(HD, theta=500000.0),
    "llama3": RopeSpec(HD, 500000.0, scaling=RopeScaling("llama3", 8.0, 8192)),
    "gptj-partial": RopeSpec(HD, rotary_dim=64, interleaved=True),
    "per-layer": RopeSpec(
        HD, layers=(RopeLayer(1e4), None, RopeLayer(1e6, RopeScaling("yarn", 4.0, 4096)), RopeLayer(1e4))
    ),
}


def pair_norm(keys: torch.Tensor) -> torch.Tensor:
    x = keys.float().view(*keys.shape[:-1], HEADS, HD)
    a, b = x[..., : HD // 2], x[..., HD // 2 :]
    n = (a * a + b * b).sqrt()
    return torch.cat([n, n], dim=-1).view(keys.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("delta", [1, 4096, -300, 100_000])
def test_cuda_rotation_equals_the_cpu_one_within_one_rounding(
    name: str, dtype: torch.dtype, delta: int
) -> None:
    spec = SPECS[name]
    kv = torch.randn(2, LAYERS, T, HEADS * HD, generator=torch.Generator().manual_seed(delta % 97)).to(dtype)
    cpu = spec.shift(kv, delta)
    gpu = spec.shift(kv.cuda(), delta)
    assert gpu.device.type == "cuda" and gpu.dtype == dtype
    got = gpu.cpu()
    assert torch.equal(got[1], kv[1])
    bound = torch.finfo(dtype).eps * pair_norm(cpu[0]) + 4 * torch.finfo(torch.float32).eps * pair_norm(kv[0])
    assert bool(((got[0].float() - cpu[0].float()).abs() <= bound).all())


def test_cuda_in_place_and_into_out() -> None:
    spec = SPECS["neox"]
    kv = torch.randn(2, LAYERS, T, HEADS * HD, device="cuda").to(torch.bfloat16)
    want = spec.shift(kv, 77)
    out = torch.empty_like(kv)
    assert spec.shift(kv, 77, out=out) is out and torch.equal(out, want)
    assert spec.shift(kv, 77, out=kv) is kv and torch.equal(kv, want)
