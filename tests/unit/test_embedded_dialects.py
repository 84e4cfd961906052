"""The embedded server's two dialects (``generation="0.5.6"`` / ``"0.5.7"``), its HTTP API
keys, and the in-process entry point (:class:`InProcessServer`).

Requests are built by hand here (msgpack maps, hand-made 0.5.7 tensor envelopes) so
nothing of the server's own decoding is used to check it; the last tests run lmcache's
own counterparts of each generation (the official SDK and the engine-driven worker
path) against the embedded server, bitwise.

Geometry: chunk size 16, 2 layers, hidden 8, float32: one chunk object is
``[2, 2, 16, 8]`` (2048 bytes).
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from harness.workers import EngineWorker, SDKWorker
from lmcache_async._protocol.payload.pickle_tensors import encode_tensor_list
from lmcache_async._protocol.wire import Op
from lmcache_async.testing import EmbeddedServer, InProcessServer, ModelSpec, NoReply, ServerGeneration

pytestmark = pytest.mark.anyio

CS = 16
SHAPE = (2, 2, CS, 8)
NBYTES = 2 * 2 * CS * 8 * 4
IID = 77
BOTH: list[ServerGeneration] = ["0.5.6", "0.5.7"]


def register_payload(model: str = "m") -> dict[str, Any]:
    return {
        "instance_id": IID,
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
    protocol: str,
    tokens: Sequence[int],
    end: int,
    rid: str,
    *,
    start: int = 0,
    worker: int | None = None,
    configs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A key map in the protocol's form: ``token_ids`` (0.5.6) or ``token_bytes`` (0.5.7)."""
    k: dict[str, Any] = {"model_name": "m", "world_size": 1, "worker_id": worker}
    if protocol == "0.5.6":
        k["token_ids"] = list(tokens)
    else:
        k["token_bytes"] = struct.pack(f">{len(tokens)}I", *tokens)
    k.update(start=start, end=end, request_id=rid, cache_salt="", request_configs=configs, num_kv_readers=1)
    return k


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def envelope(tensors: Sequence[torch.Tensor], **override: Any) -> bytes:
    """A 0.5.7 TensorEnvelope made by hand with msgpack (``override`` edits each frame)."""
    frames = [
        {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": t.contiguous().view(torch.uint8).numpy().tobytes(),
            **override,
        }
        for t in tensors
    ]
    return bytes(msgpack.packb({"version": 1, "tensors": frames}, use_bin_type=True))


def from_envelope(data: bytes) -> list[torch.Tensor]:
    env = msgpack.unpackb(data, raw=False)
    assert set(env) == {"version", "tensors"} and env["version"] == 1
    out = []
    for f in env["tensors"]:
        assert set(f) == {"dtype", "shape", "data"}
        out.append(torch.frombuffer(bytearray(f["data"]), dtype=getattr(torch, f["dtype"])).view(f["shape"]))
    return out


async def silent(srv: InProcessServer, op: Any, args: list[Any], reason: str) -> None:
    with pytest.raises(NoReply, match=reason):
        await srv.handle(op, args)


async def hits(srv: InProcessServer, protocol: str, tokens: list[int], rid: str, **kw: Any) -> int:
    """lookup + status + free the locks + end_session: the hit length in chunks."""
    k = key(protocol, tokens, len(tokens), rid, **kw)
    assert await srv.handle(Op.LOOKUP, [k, 1]) is None
    n: int = await srv.handle(Op.QUERY_PREFETCH_STATUS, [rid])
    frees = [k, 1] if protocol == "0.5.6" else [k, 1, []]
    assert await srv.handle(Op.FREE_LOOKUP_LOCKS, frees) is None
    assert await srv.handle(Op.END_SESSION, [rid]) is None
    return n


# --------------------------------------------------------------------------- dialects


@pytest.mark.parametrize("protocol", BOTH)
async def test_lmc_version_and_register_reply(protocol: ServerGeneration) -> None:
    async with EmbeddedServer(chunk_size=CS, mode="shm", size_bytes=1 << 20, generation=protocol) as srv:
        status, body, _ = await asyncio.to_thread(_get, f"{srv.http_url}/lmc_version")
        assert (status, body) == (200, {"0.5.6": "0.5.6", "0.5.7": "0.5.7rc3.dev0"}[protocol])
        reply = await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [register_payload()])
        expected: dict[str, Any] = {"shm_name": srv.engine.shm_name, "pool_size": 1 << 20}
        if protocol == "0.5.7":
            expected["null_block_id"] = 0
        assert reply == expected
        assert srv.status()["chunk_size"] == CS
        assert protocol in repr(srv)


async def test_keys_must_be_in_the_protocols_form() -> None:
    tokens = list(range(100, 100 + 2 * CS))
    pairs: list[tuple[ServerGeneration, ServerGeneration]] = [("0.5.6", "0.5.7"), ("0.5.7", "0.5.6")]
    for protocol, other in pairs:
        with InProcessServer(chunk_size=CS, mode="pickle", size_bytes=1 << 20, generation=protocol) as srv:
            await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [register_payload()])
            field = "token_ids" if protocol == "0.5.6" else "token_bytes"
            await silent(
                srv, Op.LOOKUP, [key(other, tokens, 2 * CS, "r"), 1], f"missing required field `{field}`"
            )
            assert await srv.handle(Op.LOOKUP, [key(protocol, tokens, 2 * CS, "r"), 1]) is None
            assert await srv.handle(Op.QUERY_PREFETCH_STATUS, ["r"]) == 0
            # A key carrying both forms decodes on either generation (unknown fields are ignored).
            both = {**key("0.5.6", tokens, 2 * CS, "b"), **key("0.5.7", tokens, 2 * CS, "b")}
            assert await srv.handle(Op.LOOKUP, [both, 1]) is None
            bad_salt = {**key(protocol, tokens, 2 * CS, "s"), "cache_salt": "a@b"}
            await silent(srv, Op.LOOKUP, [bad_salt, 1], "cache_salt must not contain")
    with InProcessServer(chunk_size=CS, mode="pickle", size_bytes=1 << 20, generation="0.5.7") as srv:
        ragged = {**key("0.5.7", tokens, 2 * CS, "x"), "token_bytes": b"\x00" * 7}
        await silent(srv, Op.LOOKUP, [ragged, 1], "not a whole number of 4-byte token ids")
        as_str = {**key("0.5.7", tokens, 2 * CS, "x"), "token_bytes": "abcd"}
        await silent(srv, Op.LOOKUP, [as_str, 1], "Expected `bytes`, got `str`")
    with InProcessServer(chunk_size=CS, mode="pickle", size_bytes=1 << 20, generation="0.5.6") as srv:
        await silent(srv, Op.LOOKUP, [key("0.5.6", [2**32], 1, "x"), 1], "token ids must fit uint32")
        await silent(srv, Op.LOOKUP, [key("0.5.6", [True], 1, "x"), 1], "Expected `int`, got `bool`")


async def test_argument_frames_per_protocol() -> None:
    tokens = list(range(2 * CS))
    with InProcessServer(chunk_size=CS, mode="shm", size_bytes=1 << 20, generation="0.5.7") as srv:
        await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [register_payload()])
        k = key("0.5.7", tokens, 2 * CS, "s", worker=0)
        await silent(srv, Op.PREPARE_STORE, [k, IID], "takes 3 argument frames, got 2")
        await silent(srv, Op.PREPARE_STORE, [k, IID, [[1]]], "skipped_chunks has 1 groups")
        await silent(srv, Op.PREPARE_STORE, [k, IID, [["x"]]], "cannot decode")
        ctx = (await srv.handle(Op.PREPARE_STORE, [k, IID, []]))["context"]
        assert ctx["chunk_indices"] == [0, 1] and len(ctx["slots"]) == 2
        assert await srv.handle(Op.COMMIT_STORE, [k, IID, b""]) is True
        await silent(srv, Op.FREE_LOOKUP_LOCKS, [k, 1], "takes 3 argument frames, got 2")
        assert await srv.handle(Op.FREE_LOOKUP_LOCKS, [k, 1, [[0, CS]]]) is None
        assert await srv.handle(Op.END_SESSION, ["s"]) is None
        assert srv.leftovers().is_clean()
    with InProcessServer(chunk_size=CS, mode="shm", size_bytes=1 << 20, generation="0.5.6") as srv:
        await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [register_payload()])
        k = key("0.5.6", tokens, 2 * CS, "s", worker=0)
        await silent(srv, Op.PREPARE_STORE, [k, IID, []], "takes 2 argument frames, got 3")
        await silent(srv, Op.FREE_LOOKUP_LOCKS, [k, 1, []], "takes 2 argument frames, got 3")
        await silent(srv, "negotiate_chunk_size", [16], "no handler registered")
        await silent(srv, 11, [], "unknown legacy operation id 11")
        payload = {**register_payload(), "instance_id": IID + 1, "group_layouts": [{"x": 1}]}
        assert (await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [payload]))["pool_size"] == 1 << 20  # ignored


async def test_057_group_layouts_are_refused() -> None:
    with InProcessServer(chunk_size=CS, mode="pickle", size_bytes=1 << 20, generation="0.5.7") as srv:
        group = {"num_layers": 2, "hidden_dim_size": 8, "dtype_str": "float32", "tokens_per_block": 16}
        payload = {**register_payload(), "group_layouts": [group, group]}
        await silent(srv, Op.REGISTER_ENGINE_DRIVEN, [payload], "single-group registrations only")
        await silent(
            srv,
            Op.REGISTER_ENGINE_DRIVEN,
            [{**register_payload(), "group_layouts": [{}]}],
            "missing required",
        )


# --------------------------------------------------------------------------- 0.5.7 inline envelope


async def test_057_inline_envelope_both_ways() -> None:
    tokens = list(range(500, 500 + 2 * CS))
    with InProcessServer(chunk_size=CS, mode="pickle", size_bytes=1 << 20, generation="0.5.7") as srv:
        await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [register_payload()])
        k = key("0.5.7", tokens, 2 * CS, "st", worker=0)
        assert await srv.handle(Op.PREPARE_STORE, [k, IID, []]) == {"context": {}}
        assert await srv.handle(Op.COMMIT_STORE, [k, IID, envelope([chunk(1), chunk(2)])]) is True
        assert await srv.handle(Op.END_SESSION, ["st"]) is None

        rk = key("0.5.7", tokens, 2 * CS, "rt")
        assert await srv.handle(Op.LOOKUP, [rk, 1]) is None
        assert await srv.handle(Op.QUERY_PREFETCH_STATUS, ["rt"]) == 2
        reply = await srv.handle(Op.PREPARE_RETRIEVE, [{**rk, "worker_id": 0}, IID])
        assert reply["success"] is True and reply["context"] == {}
        got = from_envelope(reply["data"])
        assert len(got) == 2 and torch.equal(got[0], chunk(1)) and torch.equal(got[1], chunk(2))
        assert await srv.handle(Op.COMMIT_RETRIEVE, [{**rk, "worker_id": 0}, IID]) is True
        assert await srv.handle(Op.END_SESSION, ["rt"]) is None
        assert srv.leftovers().is_clean()


async def test_057_inline_envelope_is_checked_before_anything_is_stored() -> None:
    tokens = list(range(900, 900 + 2 * CS))
    good = [chunk(3), chunk(4)]
    with InProcessServer(chunk_size=CS, mode="pickle", size_bytes=1 << 20, generation="0.5.7") as srv:
        await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [register_payload()])
        k = key("0.5.7", tokens, 2 * CS, "bad", worker=0)
        cases = {
            "count mismatch: expected 2, got 1": envelope(good[:1]),
            "dtype mismatch: expected float32, got bfloat16": envelope([t.bfloat16() for t in good]),
            "shape mismatch": envelope(good, shape=[2, 2, CS, 4]),
            "byte length mismatch": envelope(good, data=b"\x00" * 8),
            "Object contains unknown field `extra`": envelope(good, extra=1),
            "Expected `int` >= 0": envelope(good, shape=[-2, 2, CS, 8]),
            r"Invalid enum value 2 - at `\$.version`": bytes(msgpack.packb({"version": 2, "tensors": []})),
            "not a valid inline tensor envelope": bytes(encode_tensor_list(good, msgpack_bin=False)),
        }
        for reason, payload in cases.items():
            await silent(srv, Op.COMMIT_STORE, [k, IID, payload], reason)
        await silent(srv, Op.COMMIT_STORE, [k, IID, b""], "empty commit_store data on a pickle server")
        assert await srv.handle(Op.END_SESSION, ["bad"]) is None
        assert await hits(srv, "0.5.7", tokens, "look") == 0
        assert srv.engine.status()["resident_objects"] == 0
        assert srv.leftovers().is_clean()


async def test_056_pickle_inline_still_works_and_refuses_an_envelope() -> None:
    tokens = list(range(700, 700 + CS))
    with InProcessServer(chunk_size=CS, mode="pickle", size_bytes=1 << 20, generation="0.5.6") as srv:
        await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [register_payload()])
        k = key("0.5.6", tokens, CS, "p", worker=0)
        await silent(srv, Op.COMMIT_STORE, [k, IID, envelope([chunk(5)])], "malformed pickle payload")
        data = bytes(encode_tensor_list([chunk(5)], msgpack_bin=False))
        assert await srv.handle(Op.COMMIT_STORE, [k, IID, data]) is True
        assert await srv.handle(Op.END_SESSION, ["p"]) is None
        assert await hits(srv, "0.5.6", tokens, "l") == 1


# --------------------------------------------------------------------------- 0.5.7 semantics


async def test_057_lookup_start_skip_load_and_extra_ranges() -> None:
    tokens = list(range(40, 40 + 3 * CS))
    with InProcessServer(chunk_size=CS, mode="shm", size_bytes=1 << 20, generation="0.5.7") as srv:
        await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [register_payload()])
        k = key("0.5.7", tokens, 3 * CS, "st", worker=0)
        assert (await srv.handle(Op.PREPARE_STORE, [k, IID, []]))["context"]["chunk_indices"] == [0, 1, 2]
        assert await srv.handle(Op.COMMIT_STORE, [k, IID, b""]) is True
        assert await srv.handle(Op.END_SESSION, ["st"]) is None

        def read_locked() -> int:
            return int(srv.engine.status()["l1_manager"]["read_locked_count"])

        # start = one chunk: counted as a hit, but only chunks 1 and 2 are read-locked.
        lk = key("0.5.7", tokens, 3 * CS, "a", start=CS)
        assert await srv.handle(Op.LOOKUP, [lk, 1]) is None
        assert await srv.handle(Op.QUERY_PREFETCH_STATUS, ["a"]) == 3
        assert read_locked() == 2
        # Freeing from 0 releases nothing below the lookup's start (never locked there).
        assert await srv.handle(Op.FREE_LOOKUP_LOCKS, [{**lk, "start": 0}, 1, []]) is None
        assert read_locked() == 0
        assert await srv.handle(Op.END_SESSION, ["a"]) is None

        # lmcache.skip_load: a miss with no locks.
        assert await hits(srv, "0.5.7", tokens, "skip", configs={"lmcache.skip_load": True}) == 0
        assert read_locked() == 0

        # extra_ranges release what an earlier, abandoned lookup of the request locked.
        first = key("0.5.7", tokens, 2 * CS, "e")
        assert await srv.handle(Op.LOOKUP, [first, 1]) is None
        assert await srv.handle(Op.QUERY_PREFETCH_STATUS, ["e"]) == 2
        again = key("0.5.7", tokens, 3 * CS, "e", start=2 * CS)  # the engine retried later
        assert await srv.handle(Op.LOOKUP, [again, 1]) is None
        assert await srv.handle(Op.QUERY_PREFETCH_STATUS, ["e"]) == 3
        assert read_locked() == 3  # chunks 0-1 of the first lookup, chunk 2 of the second
        assert await srv.handle(Op.FREE_LOOKUP_LOCKS, [again, 1, [[0, 2 * CS]]]) is None
        assert read_locked() == 0
        assert await srv.handle(Op.END_SESSION, ["e"]) is None
        assert srv.leftovers().is_clean()


async def test_056_ignores_start_and_request_configs() -> None:
    tokens = list(range(60, 60 + 2 * CS))
    with InProcessServer(chunk_size=CS, mode="pickle", size_bytes=1 << 20, generation="0.5.6") as srv:
        await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [register_payload()])
        data = bytes(encode_tensor_list([chunk(6), chunk(7)], msgpack_bin=False))
        k = key("0.5.6", tokens, 2 * CS, "st", worker=0)
        assert await srv.handle(Op.COMMIT_STORE, [k, IID, data]) is True
        assert await srv.handle(Op.END_SESSION, ["st"]) is None
        lk = key("0.5.6", tokens, 2 * CS, "a", start=CS, configs={"lmcache.skip_load": True})
        assert await srv.handle(Op.LOOKUP, [lk, 1]) is None
        assert await srv.handle(Op.QUERY_PREFETCH_STATUS, ["a"]) == 2
        assert srv.engine.status()["l1_manager"]["read_locked_count"] == 2


# --------------------------------------------------------------------------- in-process entry


async def test_in_process_handle_leftovers_and_silence() -> None:
    tokens = list(range(10, 10 + 2 * CS))
    async with InProcessServer(chunk_size=CS, mode="shm", size_bytes=1 << 20, generation="0.5.7") as srv:
        assert await srv.handle(Op.NOOP, []) == "OK"
        assert await srv.handle("get_chunk_size", []) == CS
        assert await srv.handle(Op.PING, [None]) is True
        assert srv.leftovers().is_clean()
        await srv.handle(Op.REGISTER_ENGINE_DRIVEN, [register_payload()])
        sk = key("0.5.7", tokens, 2 * CS, "s", worker=0)
        await srv.handle(Op.PREPARE_STORE, [sk, IID, []])
        left = srv.leftovers()
        assert (left.sessions, left.pending_shm_writes, left.write_reservations) == (1, 1, 2)
        assert not left.is_clean()
        assert await srv.handle(Op.COMMIT_STORE, [sk, IID, b""]) is True
        assert await srv.handle(Op.END_SESSION, ["s"]) is None
        assert srv.leftovers().is_clean()

        lk = key("0.5.7", tokens, 2 * CS, "l")
        assert await srv.handle(Op.LOOKUP, [lk, 1]) is None
        left = srv.leftovers()
        assert (left.sessions, left.prefetch_jobs, left.read_locked_objects) == (1, 1, 2)
        assert await srv.handle(Op.QUERY_PREFETCH_STATUS, ["l"]) == 2
        ctx = (await srv.handle(Op.PREPARE_RETRIEVE, [{**lk, "worker_id": 0}, IID]))["context"]
        assert len(ctx["slots"]) == 2 and srv.leftovers().pending_shm_reads == 1
        assert await srv.handle(Op.COMMIT_RETRIEVE, [{**lk, "worker_id": 0}, IID]) is True
        assert await srv.handle(Op.END_SESSION, ["l"]) is None
        assert srv.leftovers().is_clean()

        await silent(srv, Op.PREPARE_STORE, [sk, IID + 1, []], "handler error: .*not registered")
        await silent(srv, "no_such_op", [], "no handler registered")
        await silent(srv, Op.NOOP, [1], "takes 0 argument frames, got 1")
        await silent(srv, Op.END_SESSION, [7], "Expected `str`, got `int`")
        assert await srv.handle(Op.UNREGISTER_ENGINE_DRIVEN, ["77"]) is None  # int() coercion


async def test_the_socket_path_goes_through_the_same_core() -> None:
    async with EmbeddedServer(chunk_size=CS, mode="pickle", size_bytes=1 << 20, generation="0.5.7") as srv:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(srv.url)
        try:
            k = key("0.5.6", list(range(CS)), CS, "r")  # a 0.5.6 key: silence on 0.5.7
            bad = [msgpack.packb(1), msgpack.packb(8), msgpack.packb(k, use_bin_type=True), msgpack.packb(1)]
            good = [msgpack.packb(2), msgpack.packb("noop")]
            await sock.send_multipart(bad)
            await sock.send_multipart(good)
            assert await sock.poll(5000)
            assert await sock.recv_multipart() == [*good, msgpack.packb("OK")]
            assert not await sock.poll(200)  # and nothing for the bad one
            assert srv.dropped == 1
        finally:
            sock.close(linger=0)
            ctx.term()


# --------------------------------------------------------------------------- HTTP API keys


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read()), dict(err.headers)


async def test_http_api_key() -> None:
    with pytest.raises(ValueError, match=r"api_key needs generation='0\.5\.7'"):
        EmbeddedServer(api_key="k")
    with pytest.raises(ValueError, match="api_key needs"):
        EmbeddedServer(generation="0.5.7", api_key="")
    handle = EmbeddedServer.start_in_thread(chunk_size=CS, mode="pickle", generation="0.5.7", api_key="k-1")
    try:
        base = handle.http_url
        assert _get(f"{base}/")[:2] == (200, {"status": "ok", "service": "LMCache HTTP API"})
        assert _get(f"{base}/healthcheck")[:2] == (200, {"status": "healthy"})
        for path in ("/config", "/status", "/lmc_version"):
            status, body, headers = _get(f"{base}{path}")
            assert (status, body) == (401, {"detail": "Invalid or missing API key"}), path
            assert headers["WWW-Authenticate"] == "Bearer"
        assert _get(f"{base}/lmc_version", {"Authorization": "Bearer wrong"})[0] == 401
        assert _get(f"{base}/lmc_version", {"Authorization": "Basic k-1"})[0] == 401
        assert _get(f"{base}/lmc_version", {"Authorization": "Bearer k-1"})[:2] == (200, "0.5.7rc3.dev0")
        assert _get(f"{base}/lmc_version", {"authorization": "bearer k-1"})[:2] == (200, "0.5.7rc3.dev0")
        assert _get(f"{base}/lmc_version", {"X-LMCache-API-Key": "k-1"})[:2] == (200, "0.5.7rc3.dev0")
        assert _get(f"{base}/status", {"X-LMCache-API-Key": "k-1"})[1]["chunk_size"] == CS
        assert (handle.generation, handle.api_key) == ("0.5.7", "k-1")
    finally:
        handle.stop()


# --------------------------------------------------------------------------- lmcache's own counterparts

L, NH, HS, BS = 2, 2, 8, 4
D = NH * HS


def _kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, L, tokens, D, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("mode", ["shm", "pickle"])
@pytest.mark.parametrize("protocol", BOTH)
def test_lmcache_counterparts_against_the_embedded_server(
    protocol: str, mode: str, lmcache_python: Path, lmcache057_python: Path
) -> None:
    """The official SDK and lmcache's engine-driven worker path of each generation
    store and retrieve bitwise through the embedded server speaking that generation."""
    python = lmcache_python if protocol == "0.5.6" else lmcache057_python
    spec = ModelSpec("emb/m", num_layers=L, num_kv_heads=NH, head_dim=HS, block_size=BS, dtype="bfloat16")
    handle = EmbeddedServer.start_in_thread(chunk_size=CS, mode=mode, generation=protocol, models=[spec])  # type: ignore[arg-type]
    try:
        eng, sdk = EngineWorker(handle, python=python), SDKWorker(python=python)
        assert eng.generation == protocol == sdk.generation
        eng.spawn(), sdk.spawn()
        with eng, sdk:
            reg = eng.register(
                spec.name, num_layers=L, num_kv_heads=NH, head_dim=HS, block_size=BS, num_blocks=64,
                transfer_mode="engine_driven",
            )  # fmt: skip
            assert reg["chunk_size"] == CS and reg["transfer"] == "EngineDrivenTransferContext"
            tokens = list(range(3000, 3000 + 2 * CS + 3))
            kv = _kv(len(tokens), seed=1)
            assert eng.store(tokens, kv) is True
            got = eng.retrieve(tokens)
            assert got is not None and torch.equal(got, kv[:, :, : 2 * CS])

            conn = sdk.connect(handle.url, handle.http_url, spec.name, geometry=[L, NH * HS])
            inline = {"0.5.6": "EngineDrivenContextPickle", "0.5.7": "EngineDrivenContextInline"}
            assert conn["transfer"] == ("EngineDrivenContextShm" if mode == "shm" else inline[protocol])
            got_sdk = sdk.retrieve(tokens)
            assert got_sdk is not None and torch.equal(got_sdk, kv[:, :, : 2 * CS])

            own_tokens = list(range(7000, 7000 + 3 * CS))
            own = _kv(len(own_tokens), seed=2)
            assert sdk.store(own_tokens, own) is True
            assert sdk.store(own_tokens, own) is (mode == "pickle")  # as on the real servers
            got_eng = eng.retrieve(own_tokens)
            assert got_eng is not None and torch.equal(got_eng, own)

            # The benchmark commands of the same worker (benchmarks/suite's SDK side).
            n = 3 * CS
            remap = sdk.request("remap", pairs=[[7000, 9000]], num_tokens=n)
            assert (remap["hits"], remap["stored"]) == (1, 1)
            got_remap = eng.retrieve(list(range(9000, 9000 + n)))
            assert got_remap is not None and torch.equal(got_remap, own)
            bench = sdk.request("bench", case="pair", chunks=1, iters=2, base=20_000)
            assert len(bench["times"]) == 2 and bench["cpu"] >= 0
            conc = sdk.request("concurrent", op="retrieve", starts=[7000, 9000], tokens=n, threads=2)
            assert conc["done"] == 2
            where: dict[str, Any] = {"url": handle.url, "http_url": handle.http_url, "model_name": spec.name}
            fresh = sdk.request("fresh", start=7000, tokens=n, **where)
            assert set(fresh) >= {"connect_s", "first_s", "second_s"}
            untouched = sdk.request("untouched", op="retrieve", starts=[7000, 9000], tokens=n, **where)
            assert (len(untouched["times"]), len(untouched["faults"])) == (2, 2)
            eng.unregister()
        assert handle.server.leftovers().is_clean()
    finally:
        handle.stop()


# --------------------------------------------------------------------------- side by side with the real 0.5.7 server


class _Raw:
    """A bare DEALER speaking the wire by hand; ``call`` -> (answered, decoded payload)."""

    def __init__(self, url: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.uid = 0

    def call(self, op: int | str, *args: Any, timeout: float = 10.0) -> tuple[bool, Any]:
        self.uid += 1
        frames = [msgpack.packb(self.uid), msgpack.packb(op)]
        frames += [msgpack.packb(a, use_bin_type=True) for a in args]
        self.sock.send_multipart(frames)
        if not self.sock.poll(int(timeout * 1000)):
            return False, None
        reply = self.sock.recv_multipart()
        assert reply[:2] == frames[:2]
        return True, (msgpack.unpackb(reply[2], raw=False) if len(reply) == 3 else None)

    def ok(self, op: int | str, *args: Any) -> Any:
        answered, value = self.call(op, *args)
        assert answered, f"no reply to {op!r}"
        return value

    def hits(self, k: dict[str, Any]) -> int:
        """lookup (ack) then poll the prefetch status until it is final."""
        assert self.ok(Op.LOOKUP, k, 1) is None
        for _ in range(500):
            n = self.ok(Op.QUERY_PREFETCH_STATUS, k["request_id"])
            if n is not None:
                return int(n)
            time.sleep(0.01)
        raise AssertionError("prefetch never finished")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _scripted_session(url: str, http_url: str, mode: str) -> list[Any]:
    """One request sequence; what a client observes (no offsets or names)."""
    model = "side-by-side"
    seen: list[Any] = []
    raw = _Raw(url)
    try:
        reply = raw.ok(Op.REGISTER_ENGINE_DRIVEN, {**register_payload(model), "group_layouts": []})
        seen.append(("register", sorted(reply), reply["null_block_id"], reply["pool_size"] > 0))

        def k(tokens: list[int], end: int, rid: str, **kw: Any) -> dict[str, Any]:
            return {**key("0.5.7", tokens, end, rid, **kw), "model_name": model}

        def store(tokens: list[int], seeds: list[int], rid: str) -> Any:
            sk = k(tokens, len(seeds) * CS, rid, worker=0)
            if mode == "shm":
                ctx = raw.ok(Op.PREPARE_STORE, sk, IID, [])["context"]
                seen.append(("prepare_store", ctx["chunk_indices"]))
                with open(os.path.join("/dev/shm", reply["shm_name"].lstrip("/")), "r+b") as f:
                    with mmap.mmap(f.fileno(), 0) as mm:
                        for slot, j in zip(ctx["slots"], ctx["chunk_indices"], strict=True):
                            assert slot["length"] == NBYTES and slot["dtype"] == "float32"
                            data = chunk(seeds[j]).view(torch.uint8).numpy().tobytes()
                            mm[slot["offset"] : slot["offset"] + NBYTES] = data
                result = raw.ok(Op.COMMIT_STORE, sk, IID, b"") if ctx["slots"] else "skipped"
            else:
                result = raw.ok(Op.COMMIT_STORE, sk, IID, envelope([chunk(s) for s in seeds]))
            raw.ok(Op.END_SESSION, rid)
            return result

        tokens = list(range(5000, 5000 + 3 * CS))
        seen.append(("store", store(tokens, [1, 2, 3], "s1")))
        seen.append(("store again", store(tokens, [1, 2, 3], "s2")))

        # lookup from start=CS: 3 hits, only chunks 1-2 locked; a free from 0 releases them.
        seen.append(("hits from start", raw.hits(k(tokens, 3 * CS, "a", start=CS))))
        raw.ok(Op.FREE_LOOKUP_LOCKS, k(tokens, 3 * CS, "a"), 1, [])
        raw.ok(Op.END_SESSION, "a")
        seen.append(("skip_load", raw.hits(k(tokens, 3 * CS, "b", configs={"lmcache.skip_load": True}))))
        raw.ok(Op.END_SESSION, "b")

        # The retrieve, bitwise.
        rk = k(tokens, 3 * CS, "r")
        seen.append(("hits", raw.hits(rk)))
        got = raw.ok(Op.PREPARE_RETRIEVE, {**rk, "worker_id": 0}, IID)
        if mode == "shm":
            with open(os.path.join("/dev/shm", reply["shm_name"].lstrip("/")), "r+b") as f:
                with mmap.mmap(f.fileno(), 0) as mm:
                    tensors = [
                        torch.frombuffer(
                            bytearray(mm[s["offset"] : s["offset"] + NBYTES]), dtype=torch.float32
                        ).view(SHAPE)
                        for s in got["context"]["slots"]
                    ]
        else:
            tensors = from_envelope(got["data"])
        seen.append(
            (
                "retrieved",
                got["success"],
                [torch.equal(t, chunk(s)) for t, s in zip(tensors, [1, 2, 3], strict=True)],
            )
        )
        seen.append(("commit_retrieve", raw.ok(Op.COMMIT_RETRIEVE, {**rk, "worker_id": 0}, IID)))
        raw.ok(Op.END_SESSION, "r")

        # No read lock is left: a non-forced clear evicts everything.
        raw.ok(Op.CLEAR, False)
        seen.append(("after clear", raw.hits(k(tokens, 3 * CS, "c"))))
        raw.ok(Op.END_SESSION, "c")

        # Silence, each as on the real server.
        bad_key = {**key("0.5.6", tokens, 3 * CS, "x"), "model_name": model}
        seen.append(("0.5.6 key", raw.call(Op.LOOKUP, bad_key, 1, timeout=1.0)[0]))
        seen.append(
            ("2-frame prepare", raw.call(Op.PREPARE_STORE, k(tokens, CS, "x", worker=0), IID, timeout=1.0)[0])
        )
        bad = envelope([chunk(1)])  # one tensor for a two-chunk key
        seen.append(
            (
                "short envelope",
                raw.call(Op.COMMIT_STORE, k(tokens, 2 * CS, "x", worker=0), IID, bad, timeout=1.0)[0],
            )
        )
        raw.ok(Op.END_SESSION, "x")
        seen.append(("status", raw.ok(Op.GET_CHUNK_SIZE)))
    finally:
        raw.close()
    with urllib.request.urlopen(f"{http_url}/status", timeout=10) as resp:
        status = json.loads(resp.read())
    seen.append(
        ("sessions/jobs", status["active_sessions"], status["active_prefetch_jobs"], status["chunk_size"])
    )
    return seen


@pytest.mark.parametrize("mode", ["shm", "pickle"])
def test_the_057_dialect_side_by_side_with_the_real_057_server(
    mode: str, fresh_real_server: Any, lmcache057_python: Path
) -> None:
    """The same hand-made request sequence, observed on the real 0.5.7rc3 server and on
    EmbeddedServer(generation="0.5.7"): identical observations."""
    real = fresh_real_server(mode, generation="0.5.7")
    expected = _scripted_session(real.url, real.http_url, mode)
    handle = EmbeddedServer.start_in_thread(chunk_size=CS, mode=mode, generation="0.5.7", size_bytes=64 << 20)  # type: ignore[arg-type]
    try:
        assert _scripted_session(handle.url, handle.http_url, mode) == expected
    finally:
        handle.stop()
    shm = mode == "shm"
    stores = (
        [("prepare_store", [0, 1, 2]), ("store", True), ("prepare_store", []), ("store again", "skipped")]
        if shm
        else [("store", True), ("store again", True)]
    )
    assert expected == [
        ("register", ["null_block_id", "pool_size", "shm_name"], 0, shm),
        *stores,
        ("hits from start", 3),
        ("skip_load", 0),
        ("hits", 3),
        ("retrieved", True, [True, True, True]),
        ("commit_retrieve", True),
        ("after clear", 0),
        ("0.5.6 key", False),
        ("2-frame prepare", False),
        ("short envelope", False),
        ("status", CS),
        ("sessions/jobs", 0, 0, CS),
    ]


def test_generation_is_the_one_name() -> None:
    import inspect

    import lmcache_async.testing
    import lmcache_async.testing.dialect
    from lmcache_async.testing import GENERATIONS, ServerOptions

    assert GENERATIONS == ("0.5.6", "0.5.7")
    for gone in ("Protocol", "PROTOCOLS"):  # the earlier names are not kept as aliases
        assert not hasattr(lmcache_async.testing, gone), gone
        assert not hasattr(lmcache_async.testing.dialect, gone), gone
    assert not hasattr(lmcache_async.testing.dialect, "check_protocol")
    for make in (EmbeddedServer, InProcessServer):
        srv: Any = make(chunk_size=CS, mode="pickle", size_bytes=1 << 20, generation="0.5.7")
        assert srv.generation == "0.5.7"
        assert not hasattr(srv, "protocol")
        assert make(chunk_size=CS, mode="pickle", size_bytes=1 << 20).generation == "0.5.6"
        with pytest.raises(TypeError, match=r"got an unexpected keyword argument 'protocol'$"):
            make(protocol="0.5.7")  # type: ignore[call-arg]
        with pytest.raises(ValueError, match=r"^unknown server generation '0.5.8'; known: 0.5.6, 0.5.7$"):
            make(generation="0.5.8")  # type: ignore[arg-type]
        if isinstance(srv, InProcessServer):
            srv.close()
    # ServerOptions names exactly the constructor's keywords (start_in_thread takes them).
    params = inspect.signature(EmbeddedServer).parameters
    assert list(ServerOptions.__annotations__) == list(params)
    assert "protocol" not in params
    assert ServerOptions.__total__ is False
    handle = EmbeddedServer.start_in_thread(
        chunk_size=CS, mode="pickle", size_bytes=1 << 20, generation="0.5.7"
    )
    with handle:
        assert (handle.generation, handle.server.chunk_size) == ("0.5.7", CS)
        assert not hasattr(handle, "protocol")
