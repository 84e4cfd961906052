"""A store that fails after ``prepare_store`` never lets an unwritten reservation become
visible KV, against the real LMCache 0.5.6 and 0.5.7 servers
(and the embedded one where it needs no server-side expiry).

The LMCache server has no operation that drops a write reservation: committing it,
unregistering the instance or the server reaping a pinged instance all admit the slots
as valid KV, whatever they hold. These tests show that a tensor that cannot be copied is
refused before anything is sent, that a copy failing midway is repaired from a CPU copy of
the caller's tensor, and that a reservation the client cannot fill is never admitted: not
at close, and a new writer can store the key once the server's write lock expired.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import lmcache_async as lmc
from lmcache_async import AsyncClient
from lmcache_async._engine import copies as copies
from lmcache_async.errors import UnfilledReservationError
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, peek, random_kv, unique_model

pytestmark = pytest.mark.anyio

CS = 16
Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]

#: The SHM servers these tests run on (a reservation exists only on SHM).
SHM_SERVERS = [
    pytest.param("real_server_shm", marks=pytest.mark.real_server),
    pytest.param("real_server_057_shm", marks=pytest.mark.real_server),
    "embedded_server_shm",
]


@pytest.fixture(params=SHM_SERVERS)
def shm_server(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def _open(srv: Any, model: str, **kw: Any) -> AsyncClient:
    return AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30, **kw)


def _sent(client: AsyncClient) -> int:
    """The next request uid of the client's connection (taking it skips one)."""
    return peek(client).next_request_uid()


async def test_uncopyable_kv_is_refused_before_anything_is_sent(shm_server: Any) -> None:
    model = unique_model("layout")
    tokens = fresh_tokens(2 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    async with _open(shm_server, model) as c:
        before = _sent(c)
        cases: list[tuple[torch.Tensor, str]] = [
            (kv.to("meta"), "kv is a meta tensor"),
            (kv.to_sparse(), "kv has layout torch.sparse_coo"),
        ]
        for bad, message in cases:
            with pytest.raises(ValueError, match=message):
                await c.store(bad, tokens)
        assert _sent(c) == before + 1  # nothing was sent in between
        # Nothing was reserved either: the same key stores at once and reads back exactly.
        assert await c.store(kv, tokens) is True
    async with _open(shm_server, model) as other:
        got = await other.retrieve(tokens)
        assert got is not None and torch.equal(got, kv)


async def test_a_copy_failing_midway_is_repaired_from_a_cpu_copy(
    shm_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = unique_model("repair")
    tokens = fresh_tokens(3 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    calls: list[int] = []

    def failing_fill(pairs: Pairs, pool: Any = None) -> None:
        calls.append(len(pairs))
        target, _source = pairs[0]
        target.fill_(7)  # half-written garbage, then the failure
        raise RuntimeError("simulated device error mid-copy")

    monkeypatch.setattr(copies, "fill_slots", failing_fill)
    async with _open(shm_server, model) as c:
        assert await c.store(kv, tokens) is True
        assert calls == [3]
    async with _open(shm_server, model) as other:
        got = await other.retrieve(tokens)
        assert got is not None and torch.equal(got, kv)


@pytest.mark.parametrize("generation", ["0.5.6", "0.5.7"])
async def test_an_unfillable_reservation_is_never_admitted(
    fresh_real_server: Any, monkeypatch: pytest.MonkeyPatch, generation: str
) -> None:
    srv = fresh_real_server(
        "shm", generation=generation, chunk_size=CS, extra_args=["--l1-write-ttl-seconds", "3"]
    )
    model = unique_model("poison")
    tokens = fresh_tokens(2 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))

    def garbage_then_fail(pairs: Pairs, pool: Any = None) -> None:
        for target, _source in pairs:
            target.fill_(3)
        raise RuntimeError("simulated device lost")

    monkeypatch.setattr(copies, "fill_slots", garbage_then_fail)
    monkeypatch.setattr(copies, "refill_slots", garbage_then_fail)
    c = await lmc.connect(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30)
    first_id = c.instance_id
    with pytest.raises(UnfilledReservationError, match="could not write 2 reserved chunks") as info:
        await c.store(kv, tokens)
    assert isinstance(info.value, lmc.TransferError)
    assert c.instance_id != first_id  # the registration holding the slots is retired
    monkeypatch.undo()
    # The client goes on under a new registration; the key is still reserved (by the
    # retired registration) and reported as such, never as stored.
    with pytest.raises(lmc.TransferError, match="reserved by another writer"):
        await c.store(kv, tokens, timeout=1)
    await c.aclose()  # before the fix, the unregister admitted the garbage slots

    async with _open(srv, model) as other:
        assert await other.lookup(tokens) == 0
        assert await other.retrieve(tokens) is None
        # Once the write lock expired the key is writable again: the real data goes in.
        deadline = time.monotonic() + 30
        while True:
            try:
                assert await other.store(kv, tokens, timeout=2) is True
                break
            except lmc.TransferError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        got = await other.retrieve(tokens)
        assert got is not None and torch.equal(got, kv)


async def test_a_second_writer_of_the_same_prompt_waits_for_the_first(
    shm_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one client copies into its reservation, another client storing the
    same prompt gets nothing reserved; it waits for the first writer (within its deadline)
    and answers False, instead of "L1 full"."""
    model = unique_model("twins")
    tokens = fresh_tokens(4 * CS)
    kv = random_kv(SMALL_GEOMETRY, len(tokens))
    real_fill = copies.fill_slots
    slow = [True]

    def slow_first_fill(pairs: Pairs, pool: Any = None) -> None:
        if slow.pop() if slow else False:
            time.sleep(1.0)  # in a worker thread: the first writer is still copying
        real_fill(pairs, pool)

    monkeypatch.setattr(copies, "THREAD_COPY_BYTES", 0)
    monkeypatch.setattr(copies, "fill_slots", slow_first_fill)
    async with _open(shm_server, model) as a, _open(shm_server, model) as b:
        first = asyncio.create_task(a.store(kv, tokens))
        await asyncio.sleep(0.3)
        assert not first.done()
        assert await b.store(kv, tokens, timeout=20) is False  # someone else stored it
        assert await first is True
        got = await b.retrieve(tokens)
        assert got is not None and torch.equal(got, kv)
