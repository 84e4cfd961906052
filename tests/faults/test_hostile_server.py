"""A wrong or hostile server: slot descriptors outside the pool, pickle payloads that are
not plain tensors, silence; on the 0.5.7 wire (the ``generation`` parameter), tensor
envelopes that lie, pickles where an envelope belongs, and the exact frames the client
sends. Scripted with tests/fakes/fake_router.py plus a stub HTTP API of the generation
(0.5.6 unless a test parametrizes ``generation``; 0.5.7 reports version 0.5.7rc3.dev0)."""

from __future__ import annotations

import asyncio
import os
import pickle
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import lmcache_async as lmc
from lmcache_async._protocol import wire as wire
from lmcache_async._protocol.payload.tensor_envelope import decode_tensor_envelope, encode_tensor_envelope
from lmcache_async._protocol.wire import Op
from lmcache_async._transport.metadata import Metadata
from tests.fakes import server_wire
from tests.fakes.fake_router import FakeRouter, json_http_server
from tests.helpers import SMALL_GEOMETRY

pytestmark = pytest.mark.anyio

CS = 16
POOL = 1 << 20
SLOT_BYTES = 2 * 2 * CS * 16 * 2  # [2, L=2, 16, D=16] bf16


@pytest.fixture
async def http_stub(generation: str) -> AsyncIterator[str]:
    """The HTTP API of a server of ``generation`` (the real_servers plugin's fixture: 0.5.6
    unless the test parametrizes it)."""
    if generation == "0.5.6":
        routes: dict[str, Any] = {
            "/config": {
                "mp": {
                    "chunk_size": CS,
                    "supported_transfer_mode": "auto",
                    "instance_id": "x",
                    "max_cpu_workers": 1,
                }
            },
            "/status": {"cache_context_meta": {}, "active_sessions": 0},
        }
    else:
        # /config has the configured minimum chunk size: the live size is in /status
        mp = {"chunk_size": 8, "supported_transfer_mode": "auto", "instance_id": "x", "max_cpu_workers": 1}
        routes = {
            "/lmc_version": "0.5.7rc3.dev0",
            "/config": {"mp": mp},
            "/status": {"chunk_size": CS, "active_sessions": 0},
        }
    async with json_http_server(routes) as url:
        yield url


@pytest.fixture
def shm_segment() -> Any:
    name = f"lmca_hostile_{secrets.token_hex(4)}"
    path = Path("/dev/shm") / name
    with open(path, "wb") as f:
        f.truncate(POOL)
    yield name
    path.unlink(missing_ok=True)


def scripted(
    register: dict[str, Any], on: dict[Op, Any]
) -> Callable[[server_wire.Request], list[tuple[Any, ...]]]:
    def handler(req: server_wire.Request) -> list[tuple[Any, ...]]:
        if req.op is Op.NOOP:
            return [("reply", "OK")]
        if req.op is Op.GET_CHUNK_SIZE:  # asked of a 0.5.6 server at connect
            return [("reply", CS)]
        if req.op is Op.REGISTER_ENGINE_DRIVEN:
            return [("reply", register)]
        if req.op in on:
            value = on[req.op]
            return [("reply", value(req) if callable(value) else value)]
        if req.op in (Op.LOOKUP, Op.FREE_LOOKUP_LOCKS, Op.END_SESSION, Op.UNREGISTER_ENGINE_DRIVEN):
            return [("reply", None)]
        return []

    return handler


def slot(offset: int, length: int = SLOT_BYTES, shape: tuple[int, ...] = (2, 2, CS, 16)) -> dict[str, Any]:
    return {"offset": offset, "length": length, "shape": list(shape), "dtype": "bfloat16"}


@pytest.mark.parametrize(
    ("bad_slot", "message"),
    [
        (slot(POOL - 100), "outside the pool"),
        (slot(-SLOT_BYTES), "outside the pool"),
        (slot(0, length=POOL), "does not match shape"),
        (slot(0, shape=(2, 2, CS, 1 << 20)), "slot shape"),
    ],
)
async def test_retrieve_refuses_slots_outside_the_pool(
    http_stub: str, shm_segment: str, bad_slot: dict[str, Any], message: str
) -> None:
    handler = scripted(
        {"shm_name": shm_segment, "pool_size": POOL},
        {
            Op.QUERY_PREFETCH_STATUS: 1,
            Op.PREPARE_RETRIEVE: {"success": True, "data": b"", "context": {"slots": [bad_slot]}},
            Op.COMMIT_RETRIEVE: True,
        },
    )
    async with FakeRouter(handler) as router:
        async with lmc.AsyncClient(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5) as c:
            assert c.transfer == "shm"
            with pytest.raises(lmc.ProtocolError, match=message):
                await c.retrieve(list(range(CS)))
        ops = [r.op for r in router.requests]
    # The pending read is released and the session ended even though the reply was bad.
    assert ops[-3:] == [Op.COMMIT_RETRIEVE, Op.END_SESSION, Op.UNREGISTER_ENGINE_DRIVEN]


async def test_store_refuses_bad_slots_and_commits_nothing(http_stub: str, shm_segment: str) -> None:
    handler = scripted(
        {"shm_name": shm_segment, "pool_size": POOL},
        {Op.PREPARE_STORE: {"context": {"slots": [slot(POOL)], "chunk_indices": [0]}}, Op.COMMIT_STORE: True},
    )
    async with FakeRouter(handler) as router:
        async with lmc.AsyncClient(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5) as c:
            kv = torch.ones(SMALL_GEOMETRY.kv_shape(CS), dtype=torch.bfloat16)
            with pytest.raises(lmc.ProtocolError, match="outside the pool"):
                await c.store(kv, list(range(CS)))
        ops = [r.op for r in router.requests]
    assert Op.COMMIT_STORE not in ops
    # The server reserved slots this client could not fill: the registration that holds
    # them is retired, never unregistered (unregistering would admit the slots as KV).
    assert ops[-1] == Op.END_SESSION
    assert Op.UNREGISTER_ENGINE_DRIVEN not in ops


class _Mkdir:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("where", ["outer", "inside-a-tensor"])
async def test_pickle_reply_that_is_not_plain_tensors_runs_nothing(
    http_stub: str, tmp_path: Path, where: str
) -> None:
    marker = tmp_path / "pwned"
    if where == "outer":
        payload = pickle.dumps([_Mkdir(str(marker))])
    else:
        payload = pickle.dumps([torch.zeros(2, 2, CS, 16, dtype=torch.bfloat16), _Mkdir(str(marker))])
    handler = scripted(
        {"shm_name": "", "pool_size": 0},
        {Op.QUERY_PREFETCH_STATUS: 1, Op.PREPARE_RETRIEVE: {"success": True, "data": payload, "context": {}}},
    )
    async with FakeRouter(handler) as router:
        async with lmc.AsyncClient(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5) as c:
            assert c.transfer == "pickle"
            with pytest.raises(lmc.UnsafePayloadError, match="posix.mkdir, which is not allowed"):
                await c.retrieve(list(range(CS)))
    assert not marker.exists()


async def test_pickle_reply_with_wrong_shapes_is_refused(http_stub: str) -> None:
    payload = pickle.dumps([torch.zeros(2, 2, CS, 8, dtype=torch.bfloat16)])
    handler = scripted(
        {"shm_name": "", "pool_size": 0},
        {Op.QUERY_PREFETCH_STATUS: 1, Op.PREPARE_RETRIEVE: {"success": True, "data": payload, "context": {}}},
    )
    async with FakeRouter(handler) as router:
        async with lmc.AsyncClient(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5) as c:
            with pytest.raises(
                lmc.ProtocolError, match=r"tensor shape \[2, 2, 16, 8\] != expected \[2, 2, 16, 16\]"
            ):
                await c.retrieve(list(range(CS)))


async def test_a_silent_server_times_out_naming_the_operation(http_stub: str) -> None:
    handler = scripted({"shm_name": "", "pool_size": 0}, {})
    async with FakeRouter(lambda req: [] if req.op is Op.LOOKUP else handler(req)) as router:
        async with lmc.AsyncClient(
            router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5, cleanup_grace=0.5
        ) as c:
            with pytest.raises(TimeoutError) as info:
                await c.lookup(list(range(CS)), timeout=0.3)
            assert isinstance(info.value, lmc.LMCacheTimeoutError)
            assert info.value.operation == "lookup"
            assert info.value.elapsed >= 0.3


async def test_registration_refused_is_a_timeout_on_connect(http_stub: str) -> None:
    probes = {Op.NOOP: "OK", Op.GET_CHUNK_SIZE: CS}
    async with FakeRouter(lambda req: [("reply", probes[req.op])] if req.op in probes else []) as router:
        with pytest.raises(lmc.LMCacheTimeoutError, match="register_kv_cache_engine_driven_context"):
            await lmc.connect(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=0.5)


async def test_keepalive_reregisters_without_pinging_and_unregisters_on_close(http_stub: str) -> None:
    """The keep-alive refreshes the registration by registering the same id again, never
    with ``ping``: a pinged instance is reaped (and its reservations admitted) 120 s after
    it falls silent, a never-pinged one only after the registration grace (3600 s)."""
    base = scripted({"shm_name": "", "pool_size": 0}, {})
    async with FakeRouter(lambda req: [("reply", True)] if req.op is Op.PING else base(req)) as router:
        c = await lmc.connect(
            router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5, ping_interval=0.1
        )
        await asyncio.sleep(0.6)
        await c.aclose()
        assert [r for r in router.requests if r.op is Op.PING] == []
        last = router.requests[-1]
        assert last.op is Op.UNREGISTER_ENGINE_DRIVEN
        assert wire.unpackb(last.args[0]) == c.instance_id
        registers = [wire.unpackb(r.args[0]) for r in router.requests if r.op is Op.REGISTER_ENGINE_DRIVEN]
        assert len(registers) >= 3
        assert all(
            r
            == {
                "instance_id": c.instance_id,
                "model_name": "m",
                "world_size": 1,
                "block_size": 16,
                "num_layers": 2,
                "hidden_dim_size": 16,
                "dtype_str": "bfloat16",
                "use_mla": False,
                "num_physical_slots": CS,
            }
            for r in registers
        )


# --------------------------------------------------------------------------- the 0.5.7 wire

SHAPE = SMALL_GEOMETRY.kv_shape(CS)


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
@pytest.mark.parametrize("generation", ["0.5.7"])
async def test_a_lying_envelope_is_refused_and_the_session_still_ends(
    http_stub: str, payload: bytes, message: str
) -> None:
    handler = scripted(
        {"shm_name": "", "pool_size": 0},
        {Op.QUERY_PREFETCH_STATUS: 1, Op.PREPARE_RETRIEVE: {"success": True, "data": payload, "context": {}}},
    )
    async with FakeRouter(handler) as router:
        async with lmc.AsyncClient(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5) as c:
            assert (c.wire_generation, c.transfer, c.chunk_size) == ("0.5.7", "pickle", CS)
            with pytest.raises(lmc.ProtocolError, match=message):
                await c.retrieve(list(range(CS)))
        ops = [r.op for r in router.requests]
    assert ops[-2:] == [Op.END_SESSION, Op.UNREGISTER_ENGINE_DRIVEN]


@pytest.mark.parametrize("generation", ["0.5.7"])
async def test_a_good_envelope_is_read_bitwise(http_stub: str) -> None:
    handler = scripted(
        {"shm_name": "", "pool_size": 0},
        {
            Op.QUERY_PREFETCH_STATUS: 2,
            Op.PREPARE_RETRIEVE: {"success": True, "data": _envelope([GOOD, GOOD + 1]), "context": {}},
        },
    )
    async with FakeRouter(handler) as router:
        async with lmc.AsyncClient(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5) as c:
            got = await c.retrieve(list(range(2 * CS + 3)))
    assert got is not None and torch.equal(got, torch.cat([GOOD, GOOD + 1], dim=2))


@pytest.mark.parametrize("generation", ["0.5.7"])
async def test_the_frames_the_client_sends(http_stub: str) -> None:
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
        async with lmc.AsyncClient(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=2) as c:
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


@pytest.mark.parametrize("generation", ["0.5.7"])
async def test_an_shm_store_sends_prepare_store_with_empty_skipped_chunks(
    http_stub: str, shm_segment: str
) -> None:
    handler = scripted(
        {"shm_name": shm_segment, "pool_size": POOL},
        {Op.PREPARE_STORE: {"context": {"slots": [slot(0)], "chunk_indices": [0]}}, Op.COMMIT_STORE: True},
    )
    kv = torch.randn(SHAPE).to(torch.bfloat16)
    async with FakeRouter(handler) as router:
        async with lmc.AsyncClient(router.url, http_stub, "m", geometry=SMALL_GEOMETRY, timeout=5) as c:
            assert c.transfer == "shm"
            assert await c.store(kv, list(range(CS))) is True
        prepare = next(r for r in router.requests if r.op is Op.PREPARE_STORE)
    assert len(prepare.args) == 3 and wire.unpackb(prepare.args[2]) == []
    assert wire.unpackb(prepare.args[0])["token_bytes"] == wire.pack_token_bytes(range(CS))
    raw = await asyncio.to_thread(Path(f"/dev/shm/{shm_segment}").read_bytes)
    written = torch.frombuffer(bytearray(raw[: kv.numel() * 2]), dtype=torch.bfloat16).view(SHAPE)
    assert torch.equal(written, kv)


# --------------------------------------------------------------------------- absurd /status (QA-4 n2)


def _meta_entry(model: str, num_layers: int, heads: int, head_dim: int) -> dict[str, Any]:
    """A ``cache_context_meta`` entry as a vLLM-style registration writes it."""
    return {
        "model_name": model,
        "world_size": 1,
        "kv_cache_layout": {
            "num_layers": num_layers,
            "kernel_groups": [
                {
                    "engine_kv_format": "NL_X_TWO_NB_BS_NH_HS",
                    "engine_kv_concrete_shape": f"{num_layers} x [2, 16, 16, {heads}, {head_dim}]",
                    "tokens_per_block": 16,
                    "dtype": "torch.bfloat16",
                }
            ],
        },
    }


@pytest.mark.parametrize(
    ("layers", "heads", "head_dim", "chunk_bytes"),
    [(10**9, 2, 8, 2 * 10**9 * 16 * CS * 2), (2, 10**6, 10**6, 2 * 2 * 10**12 * CS * 2)],
)
async def test_an_absurd_geometry_in_status_is_refused_at_connect(
    layers: int, heads: int, head_dim: int, chunk_bytes: int
) -> None:
    status = {"cache_context_meta": {"0": _meta_entry("m", layers, heads, head_dim)}, "active_sessions": 0}
    routes = {
        "/config": {"mp": {"chunk_size": CS, "supported_transfer_mode": "auto", "instance_id": "x"}},
        "/status": status,
    }
    async with json_http_server(routes) as http, FakeRouter() as router:
        with pytest.raises(lmc.ProtocolError) as info:
            await lmc.connect(router.url, http, "m", timeout=5)
        geometry = lmc.KVGeometry(layers, heads, head_dim, torch.bfloat16, block_size=16)
        assert str(info.value) == (
            f"/status describes an absurd KV geometry ({geometry}): one chunk of {CS} tokens would be "
            f"{chunk_bytes} bytes, more than 68719476736 (64 GiB); pass geometry= explicitly"
        )
        assert router.requests == []  # refused before the ZMQ connection is used


async def test_a_deeply_nested_status_is_a_protocol_error() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    async with json_http_server({"/status": deep}) as http:
        meta = Metadata(http)
        try:
            with pytest.raises(lmc.ProtocolError) as info:
                await meta.status(max_age=0, timeout=5)
            assert str(info.value) == f"GET {http}/status: invalid JSON (nested too deeply)"
        finally:
            await meta.close()
