"""The CPU side of the CUDA path: what runs on every machine.

* Both inline codecs (0.5.6 pickle, 0.5.7 tensor envelope) take the copy hook the CUDA
  path stages through (``encode_inline(wire, tensors, copy=...)``): the hook is called
  once per non-empty tensor, in order, with a flat CPU view of exactly that tensor's
  place in the frame, and the frame it writes is byte-for-byte the hook-less one.
* ``retrieve(device=...)`` on a machine without CUDA: ``"cpu"`` works, a CUDA device or
  a bad value is refused with ``ValueError`` before anything is sent.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest
import torch

from lmcache_async import AsyncClient
from lmcache_async._protocol.payload.inline import decode_inline, encode_inline
from lmcache_async._protocol.wire import GEN_0_5_6, GEN_0_5_7, WireGeneration
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, peek, unique_model


@pytest.mark.parametrize("wire", [GEN_0_5_6, GEN_0_5_7], ids=lambda w: w.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_inline_codecs_write_through_the_copy_hook(wire: WireGeneration, dtype: torch.dtype) -> None:
    base = torch.randn(2, 3, 64, 8).to(dtype)
    # Strided sources (every other token), as chunk views of a KV tensor are.
    tensors = [base[:, :, i : i + 32 : 2] for i in (0, 1)] + [base[:, :, 5:21]]
    calls: list[tuple[int, int, torch.dtype, bool]] = []

    def hook(i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        calls.append((i, dst.numel(), dst.dtype, dst.is_contiguous() and dst.dim() == 1))
        dst.copy_(src.reshape(-1))

    plain = encode_inline(wire, tensors)
    hooked = encode_inline(wire, tensors, copy=hook)
    assert bytes(hooked) == bytes(plain)
    assert calls == [
        (0, 2 * 3 * 16 * 8, dtype, True),
        (1, 2 * 3 * 16 * 8, dtype, True),
        (2, 2 * 3 * 16 * 8, dtype, True),
    ]
    back = decode_inline(wire, bytes(hooked)[5:], count=3, shape=(2, 3, 16, 8), dtype=dtype)
    assert all(torch.equal(b, t) for b, t in zip(back, tensors, strict=True))


@pytest.mark.parametrize("wire", [GEN_0_5_6, GEN_0_5_7], ids=lambda w: w.name)
def test_copy_hook_is_not_called_for_empty_tensors(wire: WireGeneration) -> None:
    tensors = [torch.ones(2, 0, 4, dtype=torch.float16), torch.full((2, 1, 4), 3.0, dtype=torch.float16)]
    seen: list[int] = []

    def hook(i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        seen.append(i)
        dst.copy_(src.reshape(-1))

    assert bytes(encode_inline(wire, tensors, copy=hook)) == bytes(encode_inline(wire, tensors))
    assert seen == [1]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["shm", "pickle"])
async def test_retrieve_device_argument_without_cuda(mode: Literal["shm", "pickle"]) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    from lmcache_async.testing import EmbeddedServer

    geom = SMALL_GEOMETRY
    async with (
        EmbeddedServer(chunk_size=16, mode=mode) as srv,
        AsyncClient(srv.url, srv.http_url, unique_model("dev"), geometry=geom) as c,
    ):
        tokens = fresh_tokens(32)
        kv = torch.randn(geom.kv_shape(32)).to(geom.dtype)
        assert await c.store(kv, tokens) is True
        got = await c.retrieve(tokens, device="cpu")
        assert got is not None and got.device.type == "cpu" and torch.equal(got, kv)
        got = await c.retrieve(tokens, out=torch.empty_like(kv), device=torch.device("cpu"))
        assert got is not None and torch.equal(got, kv)
        sent_before = peek(c).next_request_uid()
        cases: list[tuple[Any, str]] = [
            (c.retrieve(tokens, device="cuda"), "device cuda requested but CUDA is not available"),
            (c.retrieve(tokens, device="cuda:1"), "device cuda:1 requested but CUDA is not available"),
            (c.retrieve(tokens, device="meta"), "device must be the CPU or a CUDA device, got meta"),
            (
                c.retrieve(tokens, device="nonsense"),
                "device must be a torch.device or a device string, got 'nonsense'",
            ),
            (
                c.retrieve(tokens, device=3.5),  # type: ignore[arg-type]
                "device must be a torch.device or a device string, got 3.5",
            ),
        ]
        for coro, message in cases:
            with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
                await coro
        assert peek(c).next_request_uid() == sent_before + 1  # nothing was sent meanwhile
