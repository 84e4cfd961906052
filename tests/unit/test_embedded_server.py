"""The embedded LMCache-compatible server (``lmcache_async.testing``): exact wire replies,
silence on bad requests, eviction, TTLs, restricted unpickling, ``/status``, lifecycle,
and the client against it.

Geometry used throughout: chunk size 16, 2 layers, hidden 8, float32, so one chunk object
is ``[2, 2, 16, 8]`` = 2048 bytes in a 4096-byte slot.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import re
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import zmq
import zmq.asyncio

from lmcache_async import AsyncClient, KVGeometry
from lmcache_async._protocol import wire as wire
from lmcache_async._protocol.payload.pickle_tensors import decode_tensor_list, encode_tensor_list
from lmcache_async._protocol.wire import Op, packb
from lmcache_async.testing import EmbeddedServer, ModelSpec

pytestmark = pytest.mark.anyio

CS = 16
SHAPE = (2, 2, CS, 8)
GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
IID = 4242
MODES = ["shm", "pickle"]
REPO = Path(__file__).resolve().parents[2]
MISS = {"success": False, "data": b"", "context": {}}


def exists(path: str | None) -> bool:
    assert path is not None
    return os.path.exists(path)


def register_payload(instance_id: int = IID, model: str = "m") -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "model_name": model,
        "world_size": 1,
        "block_size": 16,
        "num_layers": 2,
        "hidden_dim_size": 8,
        "dtype_str": "float32",
        "use_mla": False,
        "num_physical_slots": CS,
    }


def key(
    tokens: Sequence[int],
    end: int,
    rid: str,
    *,
    start: int = 0,
    worker: int | None = None,
    salt: str = "",
    readers: int = 1,
    model: str = "m",
) -> dict[str, Any]:
    return {
        "model_name": model,
        "world_size": 1,
        "worker_id": worker,
        "token_ids": list(tokens),
        "start": start,
        "end": end,
        "request_id": rid,
        "cache_salt": salt,
        "request_configs": None,
        "num_kv_readers": readers,
    }


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


class Raw:
    """A bare zmq.asyncio DEALER speaking the wire by hand (one reply per call)."""

    def __init__(self, url: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.uid = 0

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    async def send(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    async def recv(self, timeout: float) -> list[bytes] | None:
        if await self.sock.poll(int(timeout * 1000)):
            frames: list[bytes] = await self.sock.recv_multipart()
            return frames
        return None

    def frames(self, op: int | str, *args: Any) -> list[bytes]:
        """Request frames: via :func:`wire.encode_request` for a well-formed request with a
        legacy id, by hand otherwise (names, wrong arity, unknown ids)."""
        self.uid += 1
        if isinstance(op, Op) and len(args) == op.arity:
            return [bytes(f) for f in wire.encode_request(self.uid, op, args)]
        return [packb(self.uid), packb(op), *(packb(a) for a in args)]

    async def call_frames(self, op: int | str, *args: Any, timeout: float = 5.0) -> list[bytes]:
        frames = self.frames(op, *args)
        await self.send(frames)
        reply = await self.recv(timeout)
        assert reply is not None, f"no reply to {op!r}"
        assert reply[:2] == frames[:2], "uid and op must be echoed verbatim"
        return reply

    async def call(self, op: int | str, *args: Any, timeout: float = 5.0) -> Any:
        """The decoded payload; ``None`` for a frameless reply (asserted exact)."""
        reply = wire.decode_reply(await self.call_frames(op, *args, timeout=timeout))
        assert (reply.uid, reply.op) == (self.uid, int(op) if isinstance(op, Op) else op)
        return reply.value()

    async def barrier(self) -> None:
        """One request on each dispatch lane; their replies mean all earlier ones ran."""
        assert await self.call(Op.NOOP) == "OK"
        assert await self.call(Op.PING, None) is True
        assert await self.call(Op.COMMIT_RETRIEVE, key([], 0, "barrier", worker=0), IID) is True


@pytest.fixture
async def raw_pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[EmbeddedServer, Raw]]:
    mode: Literal["shm", "pickle"] = getattr(request, "param", "shm")
    async with EmbeddedServer(chunk_size=CS, mode=mode, size_bytes=1 << 20) as srv:
        raw = Raw(srv.url)
        try:
            assert await raw.call(Op.REGISTER_ENGINE_DRIVEN, register_payload()) == {
                "shm_name": srv.engine.shm_name,
                "pool_size": 1 << 20 if mode == "shm" else 0,
            }
            yield srv, raw
        finally:
            raw.close()


def shm_view(srv: EmbeddedServer, slot: dict[str, Any]) -> torch.Tensor:
    assert slot["dtype"] == "float32" and slot["length"] == 2048
    return srv.engine.arena.view(slot["offset"], tuple(slot["shape"]), torch.float32)


async def raw_store(
    srv: EmbeddedServer, raw: Raw, tokens: list[int], end: int, rid: str, seeds: list[int]
) -> Any:
    """Store chunks ``seeds[i]`` under ``tokens[:end]`` the way the mode requires."""
    k = key(tokens, end, rid, worker=0)
    if srv.mode == "shm":
        ctx = (await raw.call(Op.PREPARE_STORE, k, IID))["context"]
        for slot, j in zip(ctx["slots"], ctx["chunk_indices"], strict=True):
            shm_view(srv, slot).copy_(chunk(seeds[j]))
        result = await raw.call(Op.COMMIT_STORE, k, IID, b"") if ctx["slots"] else ctx
    else:
        data = bytes(encode_tensor_list([chunk(s) for s in seeds[: end // CS]], msgpack_bin=False))
        result = await raw.call(Op.COMMIT_STORE, k, IID, data)
    assert await raw.call(Op.END_SESSION, rid) is None
    return result


# --------------------------------------------------------------------------- wire


async def test_management_ops_reply_exactly_and_echo_uid_and_op_bytes() -> None:
    async with EmbeddedServer(chunk_size=CS, size_bytes=1 << 16) as srv:
        raw = Raw(srv.url)
        try:
            # legacy id and name both accepted; op frame echoed byte for byte
            assert await raw.call_frames(Op.NOOP) == [packb(1), packb(24), packb("OK")]
            assert await raw.call_frames("noop") == [packb(2), packb("noop"), packb("OK")]
            assert await raw.call(Op.GET_CHUNK_SIZE) == CS
            assert await raw.call("get_chunk_size") == CS
            assert await raw.call(Op.PING, None) is True
            assert await raw.call(Op.PING, 12345) is True
            assert await raw.call(Op.GET_EXPERIMENTAL) == []
            assert await raw.call(Op.CLEAR, False) is None
            assert await raw.call(Op.CLEAR, True) is None
            assert await raw.call(Op.END_SESSION, "never-seen") is None  # unknown id still acks
            assert await raw.call(Op.QUERY_PREFETCH_STATUS, "never-seen") == 0
            assert await raw.call(Op.WAIT_PREFETCH_STATUS, "never-seen", 0.5) == 0
            assert await raw.call(Op.UNREGISTER_ENGINE_DRIVEN, 999) is None  # unknown id acks
            # the uid frame is never decoded: any bytes come back verbatim
            await raw.send([b"\xff\xfe-any-uid", packb(Op.NOOP)])
            assert await raw.recv(5.0) == [b"\xff\xfe-any-uid", packb(24), packb("OK")]
        finally:
            raw.close()


@pytest.mark.parametrize("raw_pair", MODES, indirect=True)
async def test_store_lookup_retrieve_round_trip_exact_replies(raw_pair: tuple[EmbeddedServer, Raw]) -> None:
    srv, raw = raw_pair
    toks = list(range(40))  # two whole chunks + 8 tail tokens
    k32 = key(toks, 32, "s1", worker=0)
    if srv.mode == "shm":
        prep = await raw.call(Op.PREPARE_STORE, k32, IID)
        assert prep == {
            "context": {
                "slots": [
                    {"offset": 0, "length": 2048, "shape": list(SHAPE), "dtype": "float32"},
                    {"offset": 4096, "length": 2048, "shape": list(SHAPE), "dtype": "float32"},
                ],
                "chunk_indices": [0, 1],
            }
        }
        for slot, j in zip(prep["context"]["slots"], [0, 1], strict=True):
            shm_view(srv, slot).copy_(chunk(j))
        assert await raw.call(Op.COMMIT_STORE, k32, IID, b"") is True
        assert await raw.call(Op.COMMIT_STORE, k32, IID, b"") is False  # nothing pending
        again = await raw.call(Op.PREPARE_STORE, key(toks, 32, "s2", worker=0), IID)
        assert again == {"context": {"slots": [], "chunk_indices": []}}
        assert await raw.call(Op.END_SESSION, "s2") is None
    else:
        assert await raw.call(Op.PREPARE_STORE, k32, IID) == {"context": {}}
        data = bytes(encode_tensor_list([chunk(0), chunk(1)], msgpack_bin=False))
        assert await raw.call(Op.COMMIT_STORE, k32, IID, data) is True
        assert await raw.call(Op.COMMIT_STORE, k32, IID, data) is True  # written == reserved == 0
    assert await raw.call(Op.END_SESSION, "s1") is None

    # lookup -> the hit length in chunks, exactly once; its locks released explicitly
    assert await raw.call(Op.LOOKUP, key(toks, 40, "r0"), 1) is None
    assert await raw.call(Op.QUERY_PREFETCH_STATUS, "r0") == 2
    assert await raw.call(Op.QUERY_PREFETCH_STATUS, "r0") == 0
    assert srv.status()["storage_manager"]["l1_manager"]["read_locked_count"] == 2
    assert await raw.call(Op.FREE_LOOKUP_LOCKS, key(toks, 32, "r0"), 1) is None
    assert srv.status()["storage_manager"]["l1_manager"]["read_locked_count"] == 0
    assert await raw.call(Op.END_SESSION, "r0") is None
    # a fresh lookup, waited for, then retrieved
    assert await raw.call(Op.LOOKUP, key(toks, 40, "r1"), 1) is None
    assert await raw.call(Op.WAIT_PREFETCH_STATUS, "r1", 1.0) == 2

    rk = key(toks, 32, "r1", worker=0)
    reply = await raw.call(Op.PREPARE_RETRIEVE, rk, IID)
    assert reply["success"] is True
    if srv.mode == "shm":
        assert reply["data"] == b""
        assert [s["offset"] for s in reply["context"]["slots"]] == [0, 4096]
        got = [shm_view(srv, s).clone() for s in reply["context"]["slots"]]
    else:
        assert reply["context"] == {}
        got = decode_tensor_list(reply["data"], count=2, shape=SHAPE, dtype=torch.float32)
    assert all(torch.equal(g, chunk(i)) for i, g in enumerate(got))
    assert await raw.call(Op.COMMIT_RETRIEVE, rk, IID) is True
    # the retrieve consumed the only read lock: a second prepare finds nothing locked
    assert await raw.call(Op.PREPARE_RETRIEVE, rk, IID) == MISS
    assert await raw.call(Op.FREE_LOOKUP_LOCKS, key(toks, 32, "r1"), 1) is None
    assert await raw.call(Op.END_SESSION, "r1") is None
    status = srv.status()
    assert (status["active_sessions"], status["active_prefetch_jobs"]) == (0, 0)
    assert status["storage_manager"]["l1_manager"]["read_locked_count"] == 0
    assert await raw.call(Op.UNREGISTER_ENGINE_DRIVEN, IID) is None
    assert srv.status()["registered_non_cuda_instance_ids"] == []


async def test_prefix_salt_and_reader_counts() -> None:
    async with EmbeddedServer(chunk_size=CS, size_bytes=1 << 20) as srv:
        raw = Raw(srv.url)
        try:
            await raw.call(Op.REGISTER_ENGINE_DRIVEN, register_payload())
            toks = list(range(48))
            assert await raw_store(srv, raw, toks, 48, "s", [0, 1, 2]) is True
            # a salt is part of the identity; a shorter prefix hits just that prefix
            assert await raw.call(Op.LOOKUP, key(toks, 48, "salted", salt="tenant"), 1) is None
            assert await raw.call(Op.QUERY_PREFETCH_STATUS, "salted") == 0
            assert await raw.call(Op.LOOKUP, key(toks, 20, "prefix"), 1) is None
            assert await raw.call(Op.QUERY_PREFETCH_STATUS, "prefix") == 1
            assert await raw.call(Op.FREE_LOOKUP_LOCKS, key(toks, 16, "prefix"), 1) is None
            # the first token changes every chunk key (keys chain over the prefix)
            assert await raw.call(Op.LOOKUP, key([7, *toks[1:]], 48, "other"), 1) is None
            assert await raw.call(Op.QUERY_PREFETCH_STATUS, "other") == 0
            # num_kv_readers locks per object; free_lookup_locks releases the same count
            assert await raw.call(Op.LOOKUP, key(toks, 48, "two", readers=2), 1) is None
            assert await raw.call(Op.QUERY_PREFETCH_STATUS, "two") == 3
            assert srv.status()["storage_manager"]["l1_manager"]["read_locked_count"] == 3
            assert await raw.call(Op.FREE_LOOKUP_LOCKS, key(toks, 32, "two", start=16, readers=2), 1) is None
            assert srv.status()["storage_manager"]["l1_manager"]["read_locked_count"] == 2
            assert await raw.call(Op.FREE_LOOKUP_LOCKS, key(toks, 48, "two", readers=2), 1) is None
            assert srv.status()["storage_manager"]["l1_manager"]["read_locked_count"] == 0
            for rid in ("salted", "prefix", "other", "two"):
                assert await raw.call(Op.END_SESSION, rid) is None
            assert srv.status()["active_sessions"] == 0
        finally:
            raw.close()


async def test_unregister_admits_pending_shm_writes_like_the_real_server() -> None:
    async with EmbeddedServer(chunk_size=CS, size_bytes=1 << 20) as srv:
        raw = Raw(srv.url)
        try:
            await raw.call(Op.REGISTER_ENGINE_DRIVEN, register_payload(1))
            await raw.call(Op.REGISTER_ENGINE_DRIVEN, register_payload(2))  # keeps the layout
            toks = list(range(100, 132))
            prep = await raw.call(Op.PREPARE_STORE, key(toks, 32, "w", worker=0), 1)
            assert prep["context"]["chunk_indices"] == [0, 1]
            assert srv.status()["lmcache_async_embedded"]["pending_shm_writes"] == 1
            assert await raw.call(Op.UNREGISTER_ENGINE_DRIVEN, 1) is None  # never committed
            assert srv.status()["lmcache_async_embedded"]["pending_shm_writes"] == 0
            assert await raw.call(Op.LOOKUP, key(toks, 32, "l"), 1) is None
            assert await raw.call(Op.QUERY_PREFETCH_STATUS, "l") == 2  # admitted anyway
        finally:
            raw.close()


# --------------------------------------------------------------------------- silence


async def test_bad_requests_get_no_reply_and_the_loop_survives() -> None:
    async with EmbeddedServer(chunk_size=CS, size_bytes=1 << 20) as srv:
        raw = Raw(srv.url)
        try:
            await raw.call(Op.REGISTER_ENGINE_DRIVEN, register_payload())
            toks = list(range(32))
            bad: list[list[bytes]] = [
                raw.frames(99),  # unknown legacy id
                raw.frames("no_such_operation"),  # unknown name
                raw.frames("register_kv_cache", 1, [], "m", 1, "vllm", {}, []),  # lmcache-driven: not served
                [packb(900), packb(24.0)],  # op frame neither int nor str
                [packb(901), b"\xc1"],  # op frame not msgpack
                raw.frames(Op.NOOP, 1),  # wrong arity
                raw.frames(Op.CLEAR),  # the force frame is required
                raw.frames(Op.END_SESSION, 5),  # str expected
                raw.frames(Op.PING, True),  # int | None expected, not bool
                raw.frames(Op.LOOKUP, key(toks, 32, "x", readers=0), 1),  # num_kv_readers 0
                raw.frames(Op.LOOKUP, key(toks, 32, "x", salt="a/b"), 1),  # forbidden salt
                raw.frames(Op.LOOKUP, {"model_name": "m"}, 1),  # incomplete key
                raw.frames(Op.PREPARE_STORE, key(toks, 20, "x", worker=0), IID),  # unaligned end
                raw.frames(Op.PREPARE_STORE, key(toks, 32, "x"), IID),  # worker_id nil
                raw.frames(Op.PREPARE_STORE, key(toks[:16], 32, "x", worker=0), IID),  # end > tokens
                raw.frames(Op.PREPARE_STORE, key(toks, 32, "x", worker=0), 777),  # unregistered
                raw.frames(Op.COMMIT_STORE, key(toks, 32, "x", worker=0), IID, "not-bin"),
                raw.frames(Op.REGISTER_ENGINE_DRIVEN, dict(register_payload(9), dtype_str="nope")),
                raw.frames(Op.REGISTER_ENGINE_DRIVEN, dict(register_payload(9), use_mla=0)),
                [b"lonely"],  # fewer than two frames: kills the real server's loop, not ours
            ]
            for frames in bad:
                await raw.send(frames)
            await raw.barrier()  # every lane has processed everything sent before
            assert await raw.recv(0.2) is None  # and not one of them was answered
            assert srv.dropped == len(bad)
            assert await raw.call(Op.NOOP) == "OK"
        finally:
            raw.close()


async def test_a_short_message_does_not_kill_the_loop() -> None:
    async with EmbeddedServer(chunk_size=CS, size_bytes=1 << 16, mode="pickle") as srv:
        raw = Raw(srv.url)
        try:
            await raw.send([b"\x01"])
            frames = raw.frames(Op.NOOP)
            await raw.send(frames)
            assert await raw.recv(5.0) == [*frames, packb("OK")]  # the short one got nothing
        finally:
            raw.close()


@pytest.mark.parametrize("raw_pair", MODES, indirect=True)
async def test_pickle_store_refuses_a_malicious_pickle(
    raw_pair: tuple[EmbeddedServer, Raw], tmp_path: Path
) -> None:
    srv, raw = raw_pair
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    toks = list(range(16))
    payloads = [pickle.dumps([Evil()]), pickle.dumps([chunk(0), Evil()]), b"not a pickle"]
    for data in payloads:
        await raw.send(raw.frames(Op.COMMIT_STORE, key(toks, 16, "evil", worker=0), IID, data))
    await raw.barrier()
    assert await raw.recv(0.2) is None
    assert srv.dropped == len(payloads)
    assert not marker.exists()  # nothing ran
    assert await raw.call(Op.LOOKUP, key(toks, 16, "look"), 1) is None
    assert await raw.call(Op.QUERY_PREFETCH_STATUS, "look") == 0  # and nothing was stored


# --------------------------------------------------------------------------- eviction / TTL


async def test_eviction_lru_within_a_small_byte_budget() -> None:
    # room for exactly four chunk objects
    async with EmbeddedServer(chunk_size=CS, size_bytes=4 * 4096) as srv:
        raw = Raw(srv.url)
        try:
            await raw.call(Op.REGISTER_ENGINE_DRIVEN, register_payload())
            a, b, c = list(range(48)), list(range(1000, 1048)), list(range(2000, 2080))
            assert await raw_store(srv, raw, a, 48, "a", [0, 1, 2]) is True
            assert await raw_store(srv, raw, b, 48, "b", [3, 4, 5]) is True
            # B needed two more slots: A's *later* chunks went first, its first one stays
            assert srv.status()["lmcache_async_embedded"]["evictions"] == 2

            async def hit(tokens: list[int], rid: str) -> int:
                await raw.call(Op.LOOKUP, key(tokens, len(tokens), rid), 1)
                n: int = await raw.call(Op.QUERY_PREFETCH_STATUS, rid)
                await raw.call(Op.FREE_LOOKUP_LOCKS, key(tokens, n * CS, rid), 1)
                await raw.call(Op.END_SESSION, rid)
                return n

            assert await hit(a, "ha") == 1
            assert await hit(b, "hb") == 3
            # a batch larger than the whole budget is refused whole; nothing is evicted
            refused: dict[str, list[int]] = {"slots": [], "chunk_indices": []}
            assert await raw_store(srv, raw, c, 80, "c", [6, 7, 8, 9, 10]) == refused
            assert srv.status()["lmcache_async_embedded"]["evictions"] == 2
            # read-locked objects are never evicted: with B locked only A's chunk can go
            await raw.call(Op.LOOKUP, key(b, 48, "lock-b"), 1)
            assert await raw.call(Op.QUERY_PREFETCH_STATUS, "lock-b") == 3
            assert await raw_store(srv, raw, c, 32, "c2", [6, 7]) == refused
            assert await raw_store(srv, raw, c, 16, "c3", [6]) is True
            assert srv.status()["lmcache_async_embedded"]["evictions"] == 3
            assert await hit(a, "ha2") == 0
            assert srv.status()["storage_manager"]["l1_manager"]["memory_used_bytes"] == 4 * 4096
        finally:
            raw.close()


async def test_ttls_expire_sessions_read_locks_and_write_reservations() -> None:
    ttl = 0.6  # generous: the steps before the sleep must finish well within it
    async with EmbeddedServer(
        chunk_size=CS, size_bytes=1 << 20, session_ttl=ttl, read_lock_ttl=ttl, write_ttl=ttl
    ) as srv:
        raw = Raw(srv.url)
        try:
            await raw.call(Op.REGISTER_ENGINE_DRIVEN, register_payload())
            toks = list(range(32))
            assert await raw_store(srv, raw, toks, 32, "s", [0, 1]) is True
            # a lookup's session and read locks
            assert await raw.call(Op.LOOKUP, key(toks, 32, "r"), 1) is None
            assert await raw.call(Op.QUERY_PREFETCH_STATUS, "r") == 2
            assert srv.status()["active_sessions"] == 1
            assert srv.status()["storage_manager"]["l1_manager"]["read_locked_count"] == 2
            # a write reservation that is never committed
            other = list(range(500, 516))
            prep = await raw.call(Op.PREPARE_STORE, key(other, 16, "w", worker=0), IID)
            assert len(prep["context"]["slots"]) == 1
            await asyncio.sleep(ttl * 2)
            status = srv.status()
            assert status["active_sessions"] == 0  # TTL counted from creation
            assert status["storage_manager"]["l1_manager"]["read_locked_count"] == 0
            assert status["storage_manager"]["l1_manager"]["write_locked_count"] == 0
            rk = key(toks, 32, "r", worker=0)
            assert await raw.call(Op.PREPARE_RETRIEVE, rk, IID) == MISS
            # committing an expired reservation is acknowledged but admits nothing
            assert await raw.call(Op.COMMIT_STORE, key(other, 16, "w", worker=0), IID, b"") is True
            assert await raw.call(Op.LOOKUP, key(other, 16, "l"), 1) is None
            assert await raw.call(Op.QUERY_PREFETCH_STATUS, "l") == 0
            # and the expired buffer is handed to the next writer
            again = await raw.call(Op.PREPARE_STORE, key(other, 16, "w2", worker=0), IID)
            assert again["context"]["slots"] == prep["context"]["slots"]
        finally:
            raw.close()


# --------------------------------------------------------------------------- HTTP


async def test_status_config_and_declared_models() -> None:
    spec = ModelSpec("org/llama-like", num_layers=4, num_kv_heads=8, head_dim=64, num_blocks=16)
    async with EmbeddedServer(chunk_size=CS, size_bytes=1 << 20, models=[spec], instance_id="abc") as srv:

        def get(path: str) -> Any:
            with urllib.request.urlopen(srv.http_url + path, timeout=10) as resp:
                return json.loads(resp.read())

        health, config, status = await asyncio.gather(
            *(asyncio.to_thread(get, p) for p in ("/healthcheck", "/config", "/status"))
        )
        assert health == {"status": "healthy"}
        mp = config["mp"]
        assert (mp["chunk_size"], mp["supported_transfer_mode"], mp["instance_id"]) == (CS, "auto", "abc")
        assert mp["shm_name"] == srv.shm_name and mp["max_cpu_workers"] == 1
        assert status["engine_type"] == "MPCacheServer" and status["is_healthy"] is True
        assert (status["active_sessions"], status["active_prefetch_jobs"]) == (0, 0)
        (entry,) = status["cache_context_meta"].values()
        assert entry == {
            "model_name": "org/llama-like",
            "world_size": 1,
            "kv_cache_layout": {
                "num_layers": 4,
                "num_blocks": 16,
                "cache_size_per_token": 2 * 4 * 512 * 2,
                "kernel_groups": [
                    {
                        "kernel_group_idx": 0,
                        "engine_group_idx": 0,
                        "object_group_idx": 0,
                        "num_layers": 4,
                        "layer_indices": [0, 1, 2, 3],
                        "tokens_per_block": 16,
                        "slots_per_block": 16,
                        "dtype": "torch.bfloat16",
                        "engine_kv_concrete_shape": "4 x [2, 16, 16, 8, 64]",
                        "is_mla": False,
                        "engine_kv_format": "NL_X_TWO_NB_BS_NH_HS",
                        "engine_kv_shape": "NL x [2, NB, BS, NH, HS]",
                        "attention_backend": "vLLM non-MLA flash attention",
                    }
                ],
            },
        }
        assert KVGeometry.from_status(status, "org/llama-like") == spec.geometry()
        assert spec.geometry() == KVGeometry(4, 8, 64, torch.bfloat16, 16)

        # exact counts: a lookup leaves a job and a session until consumed / ended
        raw = Raw(srv.url)
        try:
            toks = list(range(16))
            await raw.call(Op.LOOKUP, key(toks, 16, "j", model="org/llama-like"), 1)
            assert (srv.status()["active_sessions"], srv.status()["active_prefetch_jobs"]) == (1, 1)
            assert await raw.call(Op.QUERY_PREFETCH_STATUS, "j") == 0
            assert (srv.status()["active_sessions"], srv.status()["active_prefetch_jobs"]) == (1, 0)
            await raw.call(Op.END_SESSION, "j")
            assert (srv.status()["active_sessions"], srv.status()["active_prefetch_jobs"]) == (0, 0)
        finally:
            raw.close()


# --------------------------------------------------------------------------- lifecycle


async def test_shm_segment_exists_while_serving_and_is_removed_on_stop() -> None:
    srv = EmbeddedServer(chunk_size=CS, size_bytes=1 << 20, shm_name=f"lmca_test_{os.getpid()}_seg")
    assert srv.shm_segment == f"/dev/shm/lmcache_l1_pool_lmca_test_{os.getpid()}_seg"
    async with srv:
        assert os.stat(srv.shm_segment).st_size == 1 << 20
    assert not exists(srv.shm_segment)
    # a failed start (the port is taken) removes the segment too
    async with EmbeddedServer(chunk_size=CS, size_bytes=1 << 16) as first:
        second = EmbeddedServer(chunk_size=CS, size_bytes=1 << 16, port=first.port)
        with pytest.raises(OSError, match=f"cannot bind the ZMQ endpoint {first.url}: the port is in use"):
            await second.start()
        assert not exists(second.shm_segment)
    assert not exists(first.shm_segment)


def test_start_in_thread_from_sync_code() -> None:
    handle = EmbeddedServer.start_in_thread(chunk_size=CS, size_bytes=1 << 16)
    try:
        assert handle.mode == "shm" and handle.chunk_size == CS
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", handle.url)
        assert handle.shm_segment is not None and os.path.exists(handle.shm_segment)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(handle.url)
            sock.send_multipart([packb(7), packb(Op.NOOP)])
            assert sock.poll(5000)
            assert sock.recv_multipart() == [packb(7), packb(24), packb("OK")]
        finally:
            sock.close(linger=0)
            ctx.term()
        with urllib.request.urlopen(handle.http_url + "/healthcheck", timeout=10) as resp:
            assert json.loads(resp.read()) == {"status": "healthy"}
        assert handle.status()["active_sessions"] == 0
    finally:
        handle.stop()
    handle.stop()  # idempotent
    assert not os.path.exists(handle.shm_segment)
    with pytest.raises(ValueError, match="mode"):
        EmbeddedServer.start_in_thread(mode="tcp")  # type: ignore[arg-type]


def test_plain_with_is_refused_with_the_hint() -> None:
    server = EmbeddedServer(chunk_size=CS, size_bytes=1 << 16)
    with pytest.raises(TypeError) as info:
        with server:
            pass  # pragma: no cover
    assert str(info.value) == (
        "EmbeddedServer is asynchronous: use `async with EmbeddedServer(...)` in a coroutine, "
        "or `EmbeddedServer.start_in_thread(...)` (a context manager) from blocking code"
    )
    assert server.shm_segment is not None and not os.path.exists(server.shm_segment)  # nothing started


# --------------------------------------------------------------------------- the client


@pytest.mark.parametrize("mode", MODES)
async def test_async_client_against_the_embedded_server(mode: Literal["shm", "pickle"]) -> None:
    spec = ModelSpec("m", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
    async with (
        EmbeddedServer(chunk_size=CS, mode=mode, size_bytes=1 << 20, models=[spec]) as srv,
        AsyncClient(srv.url, srv.http_url, "m", timeout=10) as client,  # geometry from /status
    ):
        assert client.geometry == GEOM
        assert client.transfer == mode
        toks = list(range(50))
        kv = torch.randn(GEOM.kv_shape(50))
        assert await client.store(kv, toks) is True
        assert await client.store(kv, toks) is False  # every chunk cached already
        out = await client.retrieve(toks)
        assert out is not None and torch.equal(out, kv[:, :, :48])
        prefix = await client.retrieve(toks[:20])
        assert prefix is not None and torch.equal(prefix, kv[:, :, :16])
        assert await client.retrieve(toks, cache_salt="tenant-b") is None
        assert await client.lookup(toks) == 48
        assert await client.lookup(toks, cache_salt="tenant-b") == 0
        assert await client.store(kv, toks, cache_salt="tenant-b") is True
        assert await client.lookup(toks, cache_salt="tenant-b") == 48
        assert await client.drain()  # the end_session messages sent in the background
        status = srv.status()
        assert (status["active_sessions"], status["active_prefetch_jobs"]) == (0, 0)
        assert status["storage_manager"]["l1_manager"]["read_locked_count"] == 0
        assert status["lmcache_async_embedded"]["pending_shm_writes"] == 0
        assert status["lmcache_async_embedded"]["pending_shm_reads"] == 0
        assert status["registered_non_cuda_instance_ids"] == [client.instance_id]
    assert srv.dropped == 0


# --------------------------------------------------------------------------- the docs example


def test_the_documented_user_fixture_example_runs(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "guides" / "testing-your-code.md").read_text()
    match = re.search(r"<!-- example: user-test -->\s*```python\n(.*?)```", doc, re.S)
    assert match is not None, "docs/guides/testing-your-code.md lost its user-test example"
    test_file = tmp_path / "test_user_example.py"
    test_file.write_text(match.group(1))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\b2 passed\b", proc.stdout), proc.stdout
