"""A wrong or hostile 0.5.7 server: tensor envelopes that lie, pickles where an envelope
belongs; and the exact frames the client sends on the 0.5.7 wire. Scripted with
tests/fakes/fake_router.py plus a stub HTTP API that reports version 0.5.7rc3.dev0."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest
import torch

import lmcache_async as lmc
from lmcache_async import _wire as wire
from lmcache_async._payload.tensor_envelope import decode_tensor_envelope, encode_tensor_envelope
from lmcache_async._wire import Op
from tests.fakes.fake_router import FakeRouter, json_http_server
from tests.faults.test_hostile_server import POOL, scripted, shm_segment, slot
from tests.helpers import SMALL_GEOMETRY

__all__ = ["shm_segment"]  # a fixture, used by name

pytestmark = pytest.mark.anyio

CS = 16
SHAPE = SMALL_GEOMETRY.kv_shape(CS)


@pytest.fixture
async def http_057() -> AsyncIterator[str]:
    # /config has the configured minimum chunk size: the live size is in /status
    mp = {"chunk_size": 8, "supported_transfer_mode": "auto", "instance_id": "x", "max_cpu_workers": 1}
    async with json_http_server(
        {
            "/lmc_version": "0.5.7rc3.dev0",
            "/config": {"mp": mp},
            "/status": {"chunk_size": CS, "active_sessions": 0},
        }
    ) as url:
        yield url


def _envelope(tensors: list[torch.Tensor]) -> bytes:
    out = msgpack.unpackb(bytes(encode_tensor_envelope(tensors)))
    assert isinstance(out, bytes)
    return out


GOOD = torch.arange(2 * 2 * CS * 16, dtype=torch.float32).view(SHAPE).to(torch.bfloat16)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (_envelope([GOOD.float()]), "dtype float32 != expected bfloat16"),
        (_envelope([GOOD, GOOD]), "holds 2 tensors, expected 1"),
        (_envelope([GOOD[:, :, :8]]), r"shape \[2, 2, 8, 16\] != expected \[2, 2, 16, 16\]"),
        (_envelope([GOOD])[:-1], "truncated"),
        (b"\x82\xa7version\x01\xa7tensors\xdd\xff\xff\xff\xff", "holds 4294967295 tensors"),
        (msgpack.packb({"version": 1, "tensors": [], "evil": 1}), "has 3 fields"),
        # a 0.5.6 payload is not accepted on 0.5.7 (pickle's PROTO byte reads as an empty map)
        (pickle.dumps([GOOD]), "tensor envelope has 0 fields"),
    ],
)
async def test_a_lying_envelope_is_refused_and_the_session_still_ends(
    http_057: str, payload: bytes, message: str
) -> None:
    handler = scripted(
        {"shm_name": "", "pool_size": 0},
        {Op.QUERY_PREFETCH_STATUS: 1, Op.PREPARE_RETRIEVE: {"success": True, "data": payload, "context": {}}},
    )
    async with FakeRouter(handler) as router:
        async with lmc.AsyncClient(router.url, http_057, "m", geometry=SMALL_GEOMETRY, timeout=5) as c:
            assert (c.wire_generation, c.transfer, c.chunk_size) == ("0.5.7", "pickle", CS)
            with pytest.raises(lmc.ProtocolError, match=message):
                await c.retrieve(list(range(CS)))
        ops = [r.op for r in router.requests]
    assert ops[-2:] == [Op.END_SESSION, Op.UNREGISTER_ENGINE_DRIVEN]


async def test_a_good_envelope_is_read_bitwise(http_057: str) -> None:
    handler = scripted(
        {"shm_name": "", "pool_size": 0},
        {
            Op.QUERY_PREFETCH_STATUS: 2,
            Op.PREPARE_RETRIEVE: {"success": True, "data": _envelope([GOOD, GOOD + 1]), "context": {}},
        },
    )
    async with FakeRouter(handler) as router:
        async with lmc.AsyncClient(router.url, http_057, "m", geometry=SMALL_GEOMETRY, timeout=5) as c:
            got = await c.retrieve(list(range(2 * CS + 3)))
    assert got is not None and torch.equal(got, torch.cat([GOOD, GOOD + 1], dim=2))


async def test_the_0_5_7_frames_the_client_sends(http_057: str) -> None:
    """Keys carry token_bytes, free_lookup_locks and prepare_store their new trailing
    frames, an inline store's data is a TensorEnvelope of the chunks not yet cached."""
    handler = scripted(
        {"shm_name": "", "pool_size": 0},
        {Op.QUERY_PREFETCH_STATUS: 1, Op.COMMIT_STORE: True, Op.PREPARE_STORE: {"context": {}}},
    )
    toks = list(range(100, 100 + 3 * CS))
    kv = torch.randn(SMALL_GEOMETRY.kv_shape(3 * CS)).to(torch.bfloat16)
    async with FakeRouter(handler) as router:
        # timeout 2: the store retries its unverified chunks until its deadline (they look
        # reserved by another writer) and only the frames of its first attempt, sent within
        # milliseconds, are inspected; a longer deadline is only a longer wait.
        async with lmc.AsyncClient(router.url, http_057, "m", geometry=SMALL_GEOMETRY, timeout=2) as c:
            # the store's lookup says 1 chunk is cached; its verification lookup says 1
            # too, so the store reports a failure, after the commit we inspect
            with pytest.raises(lmc.TransferError):
                await c.store(kv, toks)
        requests = list(router.requests)
    lookup = next(r for r in requests if r.op is Op.LOOKUP)
    key = wire.unpackb(lookup.args[0])
    assert "token_ids" not in key and key["token_bytes"] == wire.pack_token_bytes(toks)
    assert (key["start"], key["end"], key["worker_id"], key["num_kv_readers"]) == (0, 3 * CS, None, 1)
    free = next(r for r in requests if r.op is Op.FREE_LOOKUP_LOCKS)
    assert len(free.args) == 3 and wire.unpackb(free.args[2]) == []
    assert wire.unpackb(free.args[0])["token_bytes"] == wire.pack_token_bytes(toks[:CS])
    commit = next(r for r in requests if r.op is Op.COMMIT_STORE)
    ckey = wire.unpackb(commit.args[0])
    assert (ckey["start"], ckey["end"], ckey["worker_id"]) == (CS, 3 * CS, 0)
    data = wire.unpackb(commit.args[2])
    chunks = decode_tensor_envelope(data, count=2, shape=SHAPE, dtype=torch.bfloat16)
    assert torch.equal(torch.cat(chunks, dim=2), kv[:, :, CS:])


async def test_an_shm_store_sends_prepare_store_with_empty_skipped_chunks(
    http_057: str, shm_segment: str
) -> None:
    handler = scripted(
        {"shm_name": shm_segment, "pool_size": POOL},
        {Op.PREPARE_STORE: {"context": {"slots": [slot(0)], "chunk_indices": [0]}}, Op.COMMIT_STORE: True},
    )
    kv = torch.randn(SHAPE).to(torch.bfloat16)
    async with FakeRouter(handler) as router:
        async with lmc.AsyncClient(router.url, http_057, "m", geometry=SMALL_GEOMETRY, timeout=5) as c:
            assert c.transfer == "shm"
            assert await c.store(kv, list(range(CS))) is True
        prepare = next(r for r in router.requests if r.op is Op.PREPARE_STORE)
    assert len(prepare.args) == 3 and wire.unpackb(prepare.args[2]) == []
    assert wire.unpackb(prepare.args[0])["token_bytes"] == wire.pack_token_bytes(range(CS))
    raw = await asyncio.to_thread(Path(f"/dev/shm/{shm_segment}").read_bytes)
    written = torch.frombuffer(bytearray(raw[: kv.numel() * 2]), dtype=torch.bfloat16).view(SHAPE)
    assert torch.equal(written, kv)
