"""The transformers integration with the model on a GPU: the cache is served into GPU
memory (the client's CUDA path), composition and both repairs run there, and the
results are those of the CPU path within float32 rounding.

Marked ``gpu`` and skipped without CUDA. On a GPU machine, from the repository root:

    python -m pytest -m gpu tests/gpu/test_hf_cuda.py -q

The tiny Llama of the suite in float32, the same weights on the CPU and on the GPU,
against the embedded server over SHM and inline (0.5.6), chunk 16.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

from lmcache_async import AsyncClient, KVPart, hf, hf_blend
from lmcache_async.testing.tiny_llama import tiny_llama
from tests.helpers import unique_model

HAVE_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.anyio,
    pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU"),
]
CS = 16
VOCAB = 512


@pytest.fixture(scope="module", params=["shm", "pickle"])
def hf_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    from lmcache_async.testing import EmbeddedServer

    handle = EmbeddedServer.start_in_thread(chunk_size=CS, mode=request.param, size_bytes=256 << 20)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    cpu = tiny_llama(torch.float32)
    gpu = tiny_llama(torch.float32).to("cuda")
    return cpu, gpu


@pytest.fixture
async def client(hf_server: Any, models: tuple[Any, Any]) -> AsyncIterator[AsyncClient]:
    geometry = hf.geometry_from_model(models[0])
    async with AsyncClient(
        hf_server.url, hf_server.http_url, unique_model("hf-cuda"), geometry=geometry, timeout=60
    ) as c:
        yield c


def text(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal within float32 rounding of a forward pass (relative to the largest value)."""
    return float((a.float().cpu() - b.float().cpu()).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))


async def test_generate_with_cache_serves_into_gpu_memory_as_the_cpu_path(
    client: AsyncClient, models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu, gpu = models
    prompt = text(1, 5 * CS + 7)
    stored = await hf.prefill_and_store(client, gpu, prompt[: 5 * CS])  # stored from the GPU
    assert stored.kv.device.type == "cuda" and stored.stored_chunks == 5
    got = await client.retrieve(prompt[: 5 * CS])
    assert got is not None and torch.equal(got, stored.kv.cpu())  # what was stored, bitwise
    devices: list[Any] = []
    real = client.retrieve

    async def spy(*args: Any, **kwargs: Any) -> Any:
        devices.append((kwargs.get("device"), kwargs.get("out")))
        return await real(*args, **kwargs)

    monkeypatch.setattr(client, "retrieve", spy)
    on_gpu = await hf.generate_with_cache(client, gpu, prompt, max_new_tokens=6, keep_kv=True)
    on_cpu = await hf.generate_with_cache(client, cpu, prompt, max_new_tokens=6, keep_kv=True)
    assert devices == [(torch.device("cuda", 0), None), (None, None)]
    assert on_gpu.reused_tokens == on_cpu.reused_tokens == 5 * CS
    assert on_gpu.prompt_kv is not None and on_gpu.prompt_kv.device.type == "cuda"
    assert on_cpu.prompt_kv is not None
    assert torch.equal(on_gpu.prompt_kv[:, :, : 5 * CS].cpu(), got)  # the cached prefix, bitwise
    assert close(on_gpu.prompt_kv, on_cpu.prompt_kv)
    assert close(on_gpu.logits, on_cpu.logits)
    assert on_gpu.tokens == on_cpu.tokens
    full = hf.generate(gpu, prompt, max_new_tokens=6)
    assert full.tokens == on_gpu.tokens and close(on_gpu.logits, full.logits)


@pytest.mark.parametrize("repair", ["plain", "first-k", "deviation", "query"], ids=lambda r: str(r))
async def test_composition_runs_on_the_gpu_as_on_the_cpu(
    client: AsyncClient, models: tuple[Any, Any], repair: str
) -> None:
    cpu, gpu = models
    docs = [text(10 + i, 3 * CS) for i in range(3)]
    for d in docs:
        await hf.prefill_and_store(client, cpu, d)
    question = text(20, 9)
    target = docs[2] + docs[0] + docs[1] + question
    parts = [KVPart(docs[2], cache_salt=""), KVPart(docs[0], cache_salt=""), KVPart(docs[1], cache_salt="")]
    results = []
    for model, salt in ((cpu, f"cpu-{repair}"), (gpu, f"gpu-{repair}")):
        if repair in ("plain", "first-k"):
            res = await hf.compose_and_repair(
                client, model, target, parts, recompute=5 if repair == "first-k" else 0,
                cache_salt=salt, max_new_tokens=5,
            )  # fmt: skip
        else:
            res = await hf_blend.compose_and_blend(
                client, model, target, parts, recompute_fraction=0.15, selection=repair,
                cache_salt=salt, max_new_tokens=5,
            )  # fmt: skip
        assert res.stored is not None and await res.stored is True
        results.append(res)
    on_cpu, on_gpu = results
    assert on_gpu.kv is not None and on_gpu.kv.device.type == "cuda" and on_cpu.kv is not None
    assert on_gpu.recomputed_positions == on_cpu.recomputed_positions
    assert len(on_gpu.recomputed_positions) == {"plain": 0, "first-k": 10}.get(repair, 14)
    assert close(on_gpu.kv, on_cpu.kv)
    assert on_gpu.generation is not None and on_cpu.generation is not None
    assert on_gpu.generation.tokens == on_cpu.generation.tokens
    assert close(on_gpu.generation.logits, on_cpu.generation.logits)
    stored = await client.retrieve(target, f"gpu-{repair}", device="cuda")
    assert stored is not None and torch.equal(stored, on_gpu.kv)  # the stored KV is the served one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_in_place_pass_is_the_masked_pass_on_the_gpu(dtype: torch.dtype) -> None:
    """On CUDA the repairs' passes write in place and cut attention by position (fused
    kernels: flash in bf16, the efficient one in fp32); the 4D-mask pass they replace
    gives the same KV within the dtype's rounding, and only the chosen tokens change."""
    import random

    from lmcache_async._engine import hf_recompute as _hf_recompute

    model = tiny_llama(dtype).to("cuda")
    geometry = hf.geometry_from_model(model)
    total = 1200
    gen = torch.Generator().manual_seed(7)
    toks = torch.randint(0, VOCAB, (total + 9,), generator=gen).tolist()
    kv = torch.randn(geometry.kv_shape(total), generator=gen).to(dtype).to("cuda")
    chosen = sorted(random.Random(4).sample(range(300, total), 200))
    assert _hf_recompute.usable(model, kv)
    fast = kv.clone()
    hf._recompute_at(model, toks, fast, chosen)
    values_fast = hf_blend._layer_values(model, toks, kv, 300, total, 1)
    saved, _hf_recompute.DEVICES = _hf_recompute.DEVICES, ()
    try:
        masked = kv.clone()
        hf._recompute_at(model, toks, masked, chosen)
        values_masked = hf_blend._layer_values(model, toks, kv, 300, total, 1)
    finally:
        _hf_recompute.DEVICES = saved
    assert model.config._attn_implementation == "sdpa"
    others = [t for t in range(total) if t not in set(chosen)]
    assert torch.equal(fast[:, :, others], kv[:, :, others])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = float(masked.float().abs().max())
    assert float((fast.float() - masked.float()).abs().max()) <= tol * scale
    assert float((values_fast.float() - values_masked.float()).abs().max()) <= tol * float(
        values_masked.float().abs().max()
    )
