"""AsyncClient.compose (and Client.compose, compose_many): cached ranges placed into a
target prompt, shifted keys rotated, on every server configuration (the real LMCache
0.5.6 and 0.5.7 servers and the embedded ones, over SHM and inline transfers).

The expected target KV is built here from the stored sources with
:meth:`RopeSpec.shift` (whose exactness against transformers is tested in
tests/unit/test_rope.py): the stored target must equal it bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lmcache_async import AsyncClient, Client, ComposeItem, ComposeResult, KVPart, PartResult, RopeSpec
from tests.helpers import SESSION_CHUNK_SIZE, SMALL_GEOMETRY, fresh_tokens, peek, random_kv, unique_model

pytestmark = pytest.mark.anyio

CS = SESSION_CHUNK_SIZE
ROPE = RopeSpec(head_dim=SMALL_GEOMETRY.head_dim, theta=10000.0)


def expected(pieces: list[tuple[torch.Tensor, int, int, int]]) -> torch.Tensor:
    """``(source kv, start, end, offset)`` per part -> the target KV the parts make."""
    out = []
    for kv, start, end, offset in pieces:
        out.append(ROPE.shift(kv[:, :, start:end].contiguous(), offset - start))
    return torch.cat(out, dim=2)


async def stored_source(client: AsyncClient, n: int) -> tuple[list[int], torch.Tensor]:
    toks = fresh_tokens(n)
    kv = random_kv(SMALL_GEOMETRY, n)
    assert await client.store(kv, toks) is True
    return toks, kv


async def test_two_parts_chunk_aligned_one_shifted(client: AsyncClient) -> None:
    a, kv_a = await stored_source(client, 3 * CS)
    b, kv_b = await stored_source(client, 2 * CS)
    target = fresh_tokens(3 * CS)
    res = await client.compose(target, [KVPart(a, 0, 2 * CS), KVPart(b, CS, 2 * CS)], rope=ROPE)
    assert res == ComposeResult(
        parts=(
            PartResult(offset=0, tokens=2 * CS, shift=0, hit=True, cached_tokens=2 * CS, placed=2 * CS),
            PartResult(offset=2 * CS, tokens=CS, shift=CS, hit=True, cached_tokens=2 * CS, placed=CS),
        ),
        stored_tokens=3 * CS,
        stored_new=True,
    )
    assert res.hit and res.missed == ()
    got = await client.retrieve(target)
    assert got is not None
    want = expected([(kv_a, 0, 2 * CS, 0), (kv_b, CS, 2 * CS, 2 * CS)])
    assert torch.equal(got, want)
    assert not torch.equal(got[0, :, 2 * CS :], kv_b[0, :, CS:])  # the keys did move
    assert torch.equal(got[1, :, 2 * CS :], kv_b[1, :, CS:])  # the values did not
    again = await client.compose(target, [KVPart(a, 0, 2 * CS), KVPart(b, CS, 2 * CS)], rope=ROPE)
    assert again.stored_tokens == 3 * CS and again.stored_new is False


async def test_unaligned_ranges_and_a_partial_last_chunk(client: AsyncClient) -> None:
    a, kv_a = await stored_source(client, 2 * CS)
    b, kv_b = await stored_source(client, 2 * CS)
    # 24 tokens from a (shift -5) then 17 from b (shift +21): 41 tokens, 2 whole chunks
    target = fresh_tokens(45)
    parts = [KVPart(a, 5, 29), KVPart(b, 3, 20)]
    res = await client.compose(target, parts, rope=ROPE)
    assert [(p.offset, p.shift, p.placed, p.hit) for p in res.parts] == [(0, -5, 24, True), (24, 21, 8, True)]
    assert (res.stored_tokens, res.stored_new) == (2 * CS, True)
    got = await client.retrieve(target)
    assert got is not None and got.shape[2] == 2 * CS  # the third chunk was not stored
    assert torch.equal(got, expected([(kv_a, 5, 29, 0), (kv_b, 3, 11, 24)]))


async def test_unaligned_whole_source_parts_that_read_past_their_ends(client: AsyncClient) -> None:
    """Each part reads whole chunks, so its read reaches into the next part's place:
    the next part's own KV must end up there."""
    a, kv_a = await stored_source(client, 2 * CS)
    b, kv_b = await stored_source(client, CS)
    c, kv_c = await stored_source(client, 2 * CS)
    target = fresh_tokens(4 * CS)
    parts = [KVPart(a, 0, 20), KVPart(b, 0, 12), KVPart(c, 0, 2 * CS)]
    res = await client.compose(target, parts, rope=ROPE)
    assert [(p.offset, p.shift, p.placed) for p in res.parts] == [(0, 0, 20), (20, 20, 12), (32, 32, 2 * CS)]
    assert res.stored_tokens == 4 * CS
    got = await client.retrieve(target)
    assert got is not None
    assert torch.equal(got, expected([(kv_a, 0, 20, 0), (kv_b, 0, 12, 20), (kv_c, 0, 2 * CS, 32)]))


async def test_one_source_used_twice_at_two_offsets(client: AsyncClient) -> None:
    a, kv_a = await stored_source(client, 2 * CS)
    target = fresh_tokens(2 * CS)
    res = await client.compose(target, [KVPart(a, CS, 2 * CS), KVPart(a, 0, CS)], rope=ROPE)
    assert [p.shift for p in res.parts] == [-CS, CS]
    got = await client.retrieve(target)
    assert got is not None
    assert torch.equal(got, expected([(kv_a, CS, 2 * CS, 0), (kv_a, 0, CS, CS)]))


async def test_two_sources_that_share_the_chunks_read(
    client: AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prompts with one cached prefix and different tails, each giving that prefix:
    on SHM the chunks are read once, in the pool (two pending reads of one key by one
    client would share one entry on the server, which keys them by client and key)."""
    from lmcache_async._engine.ops.base import OperationsBase
    from lmcache_async._protocol.wire import Op

    real = OperationsBase.call
    sent: list[Op] = []

    async def spy(self: Any, op: Any, opcode: Op, *args: Any) -> Any:
        sent.append(opcode)
        return await real(self, op, opcode, *args)

    shared, kv = await stored_source(client, 2 * CS)
    a, b = shared + fresh_tokens(5), shared + fresh_tokens(7)
    target = fresh_tokens(4 * CS)
    monkeypatch.setattr(OperationsBase, "call", spy)
    res = await client.compose(target, [KVPart(a, 0, 2 * CS), KVPart(b, 0, 2 * CS)], rope=ROPE)
    monkeypatch.undo()
    if client.transfer == "shm":
        assert (sent.count(Op.PREPARE_RETRIEVE), sent.count(Op.PREPARE_STORE)) == (1, 1)
    assert (res.stored_tokens, res.stored_new, res.missed) == (4 * CS, True, ())
    assert [(p.hit, p.shift, p.cached_tokens) for p in res.parts] == [
        (True, 0, 2 * CS),
        (True, 2 * CS, 2 * CS),
    ]
    got = await client.retrieve(target)
    assert got is not None
    assert torch.equal(got, expected([(kv, 0, 2 * CS, 0), (kv, 0, 2 * CS, 2 * CS)]))
    assert await client.drain(timeout=30)


async def test_a_missed_part_stores_nothing_and_is_named(client: AsyncClient) -> None:
    a, _ = await stored_source(client, 2 * CS)
    half, _ = await stored_source(client, CS)  # only its first chunk is cached
    longer = half + fresh_tokens(CS)
    target = fresh_tokens(5 * CS)
    res = await client.compose(
        target, [KVPart(a), KVPart(fresh_tokens(CS)), KVPart(longer, 0, CS + 1)], rope=ROPE
    )
    assert res.missed == (1, 2) and not res.hit
    assert [(p.hit, p.cached_tokens, p.placed) for p in res.parts] == [
        (True, 2 * CS, 0),
        (False, 0, 0),
        (False, CS, 0),
    ]
    assert (res.stored_tokens, res.stored_new) == (0, False)
    assert await client.retrieve(target) is None
    assert await client.lookup(target) == 0


async def test_sync_client_and_compose_many(server: Any) -> None:
    with Client(server.url, server.http_url, unique_model(), geometry=SMALL_GEOMETRY, timeout=30) as c:
        a, b = fresh_tokens(2 * CS), fresh_tokens(2 * CS)
        kv_a, kv_b = random_kv(SMALL_GEOMETRY, 2 * CS), random_kv(SMALL_GEOMETRY, 2 * CS)
        c.store(kv_a, a)
        c.store(kv_b, b)
        t1, t2, t3 = fresh_tokens(2 * CS), fresh_tokens(2 * CS), fresh_tokens(2 * CS)
        res = c.compose(t1, [KVPart(b, CS, 2 * CS), KVPart(a, 0, CS)], rope=ROPE)
        assert res.stored_tokens == 2 * CS
        got = c.retrieve(t1)
        assert got is not None and torch.equal(got, expected([(kv_b, CS, 2 * CS, 0), (kv_a, 0, CS, CS)]))
        batch = c.compose_many(
            [
                ComposeItem(t2, [KVPart(a, 0, CS), KVPart(b, 0, CS)]),
                (t3, [KVPart(fresh_tokens(CS))]),
                (t3, [KVPart(a, CS, 2 * CS)]),
            ],
            rope=ROPE,
        )
        assert [(r.stored_tokens, r.hit, r.error is None) for r in batch] == [
            (2 * CS, True, True),
            (0, False, True),
            (CS, True, True),
        ]
        assert batch[1].composed is not None and batch[1].composed.missed == (0,)
        got = c.retrieve(t2)
        assert got is not None and torch.equal(got, expected([(kv_a, 0, CS, 0), (kv_b, 0, CS, CS)]))
        got = c.retrieve(t3)
        assert got is not None and torch.equal(got, expected([(kv_a, CS, 2 * CS, 0)]))
        t4 = fresh_tokens(CS)
        no_rope = c.compose_many([(t4, [KVPart(a, CS, 2 * CS)])])  # shifted: refused, fails its item
        err = no_rope[0].error
        assert isinstance(err, ValueError) and "parts[0] moves from position 16 to 0 (shift -16)" in str(err)
        assert c.retrieve(t4) is None


# --------------------------------------------------------------------------- refusals


@pytest.fixture
async def embedded_client(embedded_server_pickle: Any) -> Any:
    srv = embedded_server_pickle
    async with AsyncClient(srv.url, srv.http_url, unique_model(), geometry=SMALL_GEOMETRY, timeout=30) as c:
        yield c


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda s: (s[: 2 * CS], [KVPart(s, CS, 2 * CS)], None),
            ValueError,
            r"parts\[0\] moves from position 16 to 0 \(shift -16\): its keys must be rotated; pass rope=",
        ),
        (
            lambda s: (s[:CS], [KVPart(s, 0, CS), KVPart(s, 0, 1)], ROPE),
            ValueError,
            "the parts hold 17 tokens, more than the target's 16",
        ),
        (
            lambda s: (s, [KVPart(s[: CS + 3], 0, CS + 3)], ROPE),
            ValueError,
            r"parts\[0\] ends at token 19, past its source's whole chunks \(16 of 19 tokens at chunk size 16\)",
        ),
        (
            lambda s: (s, [KVPart(s, 0, CS), KVPart(s, 0, CS)], RopeSpec(16)),
            ValueError,
            "rope.head_dim is 16, the client's geometry has head_dim 8",
        ),
        (lambda s: (s, [], ROPE), ValueError, "parts must name at least one KVPart"),
        (lambda s: (s, [(s, 0, CS)], ROPE), TypeError, r"parts\[0\] must be a KVPart, got tuple"),
        (lambda s: (s, [KVPart(s)], "rope"), TypeError, "rope must be a RopeSpec or None, got str"),
    ],
    ids=["no-rope", "too-long", "past-whole-chunks", "head-dim", "empty", "tuple", "bad-rope"],
)
async def test_refusals_send_nothing(
    embedded_client: AsyncClient, monkeypatch: pytest.MonkeyPatch, make: Any, error: type, message: str
) -> None:
    source = fresh_tokens(3 * CS)
    target, parts, rope = make(source)
    sent: list[Any] = []

    async def refuse(op: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(op)
        raise AssertionError(f"{op} was sent")

    monkeypatch.setattr(peek(embedded_client).conn, "call", refuse)
    with pytest.raises(error, match=message):
        await embedded_client.compose(target, parts, rope=rope)
    assert sent == []


def test_kvpart_checks_its_range() -> None:
    assert KVPart([1, 2, 3]).end == 3 and KVPart([1, 2, 3], 1).length == 2
    with pytest.raises(
        ValueError, match=r"KVPart needs 0 <= start < end <= len\(source_tokens\) = 3, got start=2, end=2"
    ):
        KVPart([1, 2, 3], 2, 2)
    with pytest.raises(ValueError, match="got start=0, end=4"):
        KVPart([1, 2, 3], 0, 4)
    with pytest.raises(TypeError, match="KVPart.start must be an int, got float"):
        KVPart([1, 2, 3], 1.0)  # type: ignore[arg-type]
