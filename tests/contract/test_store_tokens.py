"""``store`` takes ``tokens`` longer than the KV: the seed's own snippet
``store(retrieve(source), target)`` for prompts that are not a whole number of chunks.

A retrieve returns whole chunks only, so for a prompt of ``n`` tokens the retrieved KV
covers ``n // CS * CS`` of them; ``store`` stores it under ``tokens[:T]``. Fewer tokens
than the KV covers stay an error, raised before anything is sent. Checked on every server
configuration (the real server over SHM and pickle, the embedded server), through
:class:`AsyncClient`, :class:`Client` and the ``kvcache`` drop-in.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lmcache_async.kvcache as lmc_sdk
from lmcache_async import AsyncClient, Client
from tests.helpers import SESSION_CHUNK_SIZE, SMALL_GEOMETRY, fresh_tokens, peek, random_kv, unique_model

CS = SESSION_CHUNK_SIZE

pytestmark = pytest.mark.anyio


def _no_sends(client: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    sent: list[Any] = []

    async def refuse(op: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(op)
        raise AssertionError(f"{op} was sent")

    monkeypatch.setattr(peek(client).conn, "call", refuse)
    return sent


async def test_async_store_takes_tokens_longer_than_the_kv(
    client: AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = fresh_tokens(3 * CS + 5)
    target = [7, 8, 9, *source[3:]]
    kv = random_kv(SMALL_GEOMETRY, len(source))
    assert await client.store(kv, source) is True
    retrieved = await client.retrieve(source)
    assert retrieved is not None and retrieved.shape[2] == 3 * CS  # whole chunks only
    # The seed's snippet: the retrieved KV under the (longer) target prompt.
    assert await client.store(retrieved, target) is True
    got = await client.retrieve(target)
    assert got is not None and torch.equal(got, kv[:, :, : 3 * CS])
    assert await client.lookup(target) == 3 * CS
    # Stored under target[:T] exactly: the same KV under the same prefix is all cached.
    assert await client.store(retrieved, target[: 3 * CS]) is False
    # A KV that is not a whole number of chunks under a longer prompt: its whole chunks.
    other = fresh_tokens(2 * CS + 9)
    kv_other = random_kv(SMALL_GEOMETRY, CS + 3)
    assert await client.store(kv_other, other) is True
    got = await client.retrieve(other)
    assert got is not None and torch.equal(got, kv_other[:, :, :CS])
    # Fewer tokens than the KV covers: an error, and nothing is sent.
    sent = _no_sends(client, monkeypatch)
    with pytest.raises(
        ValueError,
        match=r"^kv covers 48 tokens but tokens has 47: tokens may be longer than the KV "
        r"\(it is stored under tokens\[:T\]\), never shorter$",
    ):
        await client.store(retrieved, target[: 3 * CS - 1])
    assert sent == []


async def test_a_wrong_shape_is_still_a_shape_error(client: AsyncClient) -> None:
    tokens = fresh_tokens(2 * CS + 1)
    kv = random_kv(SMALL_GEOMETRY, 2 * CS)
    with pytest.raises(ValueError, match=r"kv has shape \[2, 1, 32, 16\], expected \[2, 2, 32, 16\]"):
        await client.store(kv[:, :1], tokens)
    with pytest.raises(ValueError, match="kv must have 4 dimensions"):
        await client.store(kv[0], tokens)
    with pytest.raises(TypeError, match="kv has dtype torch.float32, the geometry says torch.bfloat16"):
        await client.store(kv.float(), tokens)


def test_blocking_client_and_drop_in_take_tokens_longer_than_the_kv(server: Any) -> None:
    model = unique_model("longer")
    source = fresh_tokens(2 * CS + 3)
    target = [1, *source[1:]]
    kv = random_kv(SMALL_GEOMETRY, len(source))
    with Client(server.url, server.http_url, model, geometry=SMALL_GEOMETRY, timeout=30) as c:
        assert c.store(kv, source) is True
        retrieved = c.retrieve(source)
        assert retrieved is not None and retrieved.shape[2] == 2 * CS
        assert c.store(retrieved, target) is True
        got = c.retrieve(target)
        assert got is not None and torch.equal(got, kv[:, :, : 2 * CS])
        with pytest.raises(ValueError, match="kv covers 32 tokens but tokens has 31"):
            c.store(retrieved, target[: 2 * CS - 1])
    ctx = lmc_sdk.connect(server.url, server.http_url, model, geometry=SMALL_GEOMETRY)
    try:
        target2 = [2, *source[1:]]
        prefix = lmc_sdk.retrieve(ctx, tokens=source)
        assert prefix is not None
        assert lmc_sdk.store(ctx, kv=prefix, tokens=target2) is True  # the official snippet
        got = lmc_sdk.retrieve(ctx, tokens=target2)
        assert got is not None and torch.equal(got, kv[:, :, : 2 * CS])
        with pytest.raises(ValueError, match="kv covers 32 tokens but tokens has 16"):
            lmc_sdk.store(ctx, kv=prefix, tokens=target2[:CS])
    finally:
        lmc_sdk.close(ctx)


async def test_store_many_counts_the_tokens_the_kv_covers(client: AsyncClient) -> None:
    source = fresh_tokens(2 * CS + 5)
    kv = random_kv(SMALL_GEOMETRY, len(source))
    assert await client.store(kv, source) is True
    retrieved = await client.retrieve(source)
    assert retrieved is not None
    target = [3, *source[1:], *fresh_tokens(CS)]  # a whole chunk longer than the KV
    result = await client.store_many([(retrieved, target)])
    assert [(r.stored_tokens, r.stored_new, r.error) for r in result.results] == [(2 * CS, True, None)]
    got = await client.retrieve(target)
    assert got is not None and torch.equal(got, kv[:, :, : 2 * CS])
