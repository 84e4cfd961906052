"""The grouped SHM store of a CUDA ``kv`` (``Operations._store_shm_grouped``: every
group's ``prepare_store`` at once, each group copied and committed on its own), run here
with a CPU ``kv`` over the in-process engine: bitwise, cached groups, cancellation at
every request leaves the engine clean, a failing copy of one group is repaired."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from lmcache_async import _copies as copies
from lmcache_async._ops import Operations, store_groups
from lmcache_async._runner import OpState
from tests.unit import test_operations_cancellation as cancellation
from tests.unit.test_operations_cancellation import CS, END, Harness

harness = cancellation.harness  # the in-process engine fixture (both generations, SHM and inline)

pytestmark = pytest.mark.anyio

GROUPS = [(0, 1), (1, 2), (2, 3)]


def grouped(kv: torch.Tensor, toks: list[int], end: int = END, groups: Any = GROUPS) -> Any:
    def body(ops: Operations, op: OpState) -> Any:
        return ops._store_shm_grouped(op, kv, toks, end, "", None, None, groups)

    return body


async def retrieved(h: Harness, toks: list[int], end: int = END) -> torch.Tensor | None:
    got: torch.Tensor | None = await h.run(lambda ops, op: ops.retrieve(op, toks, end, ""), None)
    return got


def test_store_groups_cover_the_chunks_in_order() -> None:
    for n in range(1, 70):
        groups = store_groups(n)
        assert groups[0][0] == 0 and groups[-1][1] == n
        assert all(a < b for a, b in groups)
        assert all(groups[i][1] == groups[i + 1][0] for i in range(len(groups) - 1))
        assert (len(groups) == 1) == (n < 4)
    assert store_groups(16) == [(0, 2), (2, 8), (8, 14), (14, 16)]


async def test_grouped_store_is_bitwise_and_clean(harness: Harness) -> None:
    h = harness
    if h.pool is None:
        pytest.skip("SHM only")
    toks, kv = h.tokens(), h.kv()
    assert await h.run(grouped(kv, toks), None) is True
    sent = [o.name for o in h.channel.sent]
    assert sent.count("PREPARE_STORE") == 3 and sent.count("COMMIT_STORE") == 3 and sent[-1] == "END_SESSION"
    assert h.srv.leftovers().is_clean()
    got = await retrieved(h, toks)
    assert got is not None and torch.equal(got, kv[:, :, :END])
    # All cached: False, nothing reserved.
    assert await h.run(grouped(kv, toks), None) is False
    assert h.srv.leftovers().is_clean()


async def test_grouped_store_with_cached_groups_stores_the_rest(harness: Harness) -> None:
    h = harness
    if h.pool is None:
        pytest.skip("SHM only")
    toks, kv = h.tokens(), h.kv()
    assert await h.run(grouped(kv[:, :, : 2 * CS], toks[: 2 * CS], 2 * CS, [(0, 1), (1, 2)]), None) is True
    assert await h.run(grouped(kv, toks), None) is True  # groups 1-2 cached, group 3 new
    assert h.srv.leftovers().is_clean()
    got = await retrieved(h, toks)
    assert got is not None and torch.equal(got, kv[:, :, :END])


async def test_grouped_store_cancelled_at_every_request_leaves_the_engine_clean(harness: Harness) -> None:
    h = harness
    if h.pool is None:
        pytest.skip("SHM only")
    toks, kv = h.tokens(), h.kv()
    assert await h.run(grouped(kv, toks), None) is True
    n_requests = len(h.channel.sent)
    for k in range(1, n_requests + 1):
        toks, kv = h.tokens(), h.kv()
        result = await h.run(grouped(kv, toks), cancel_at=k)
        assert isinstance(result, asyncio.CancelledError), f"request {k} of {n_requests}: not cancelled"
        left = h.srv.leftovers()
        assert left.is_clean(), f"cancelled at request {k} ({h.channel.sent[k - 1].name}): {left}"
        got = await retrieved(h, toks)  # every group was completed and committed
        assert got is not None and torch.equal(got, kv[:, :, :END]), f"cancelled at request {k}"


async def test_grouped_store_repairs_a_failing_group_copy(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness
    if h.pool is None:
        pytest.skip("SHM only")
    real = copies.fill_slots
    calls = []

    def flaky(pairs: Any, pool: Any = None) -> None:
        calls.append(len(pairs))
        if len(calls) == 2:  # the second group's copy writes garbage, then fails
            pairs[0][0].fill_(7)
            raise RuntimeError("injected copy failure")
        real(pairs, pool)

    monkeypatch.setattr(copies, "fill_slots", flaky)
    toks, kv = h.tokens(), h.kv()
    assert await h.run(grouped(kv, toks), None) is True
    assert len(calls) == 3  # one copy per group; the failed one was filled again by refill_slots
    assert h.srv.leftovers().is_clean()
    got = await retrieved(h, toks)
    assert got is not None and torch.equal(got, kv[:, :, :END])
