"""Fuzzing of everything that parses what a server sends.

The reply decoders of :mod:`lmcache_async._protocol.wire` (frames, the register / prepare_store /
prepare_retrieve replies, SHM slot descriptors) and the inline tensor payload decoders of
both server generations (the restricted unpickler of 0.5.6, the msgpack ``TensorEnvelope``
of 0.5.7, reached through :func:`lmcache_async._protocol.payload.inline.decode_inline` as the client
does): any bytes, any msgpack-shaped object and any mutation of a VALID payload (sizes,
dtypes, shapes, strides, offsets, lengths, memo indices) give a result or a
:class:`ProtocolError` (its subclass :class:`UnsafePayloadError` for a hostile pickle),
never another exception, and never an allocation the payload merely claims: every decode
runs under ``tracemalloc`` with a bound of a small multiple of the input size, and
hypothesis's per-example deadline catches a hang.

The ``test_regression_*`` tests are the payloads this fuzzing found (a 13-byte pickle that
made the client allocate 3 GiB, a memo index that made it allocate and zero 1 GiB, a
storage blob whose claimed element count torch allocated before reading); each fails
without the pre-scan in ``pickle_codec``.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import secrets
import struct
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar, cast

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from lmcache_async._engine.ops import Operations, Registration, RemapResult
from lmcache_async._engine.runner import OpState
from lmcache_async._protocol import wire as wire
from lmcache_async._protocol.payload import pickle_tensors as pickle_codec
from lmcache_async._protocol.payload.inline import decode_inline
from lmcache_async._protocol.payload.pickle_tensors import decode_tensor_list, encode_tensor_list
from lmcache_async._protocol.payload.tensor_envelope import encode_tensor_envelope
from lmcache_async._transport.shm import ShmPool
from lmcache_async.errors import LMCacheError, LMCacheTimeoutError, ProtocolError, UnsafePayloadError
from lmcache_async.testing import InProcessServer, NoReply, ServerGeneration
from tests.helpers import SMALL_GEOMETRY
from tests.plugins.hypothesis_budget import examples

T = TypeVar("T")

#: A decode may allocate at most this much beyond a few copies of its input.
ALLOC_SLACK = 1 << 20

FUZZ = settings(
    max_examples=examples(150),
    deadline=2000,  # a hang fails the example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# msgpack-shaped values: what ``unpackb`` can give back.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=16),
)
objects = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)
huge_ints = st.sampled_from([-1, 0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**64 - 1])


def bounded(fn: Callable[[], T], input_size: int) -> T | ProtocolError:
    """Run ``fn``; return its result or the ProtocolError it raised. Any other
    exception propagates (the test fails) and so does an allocation peak beyond a few
    copies of the input."""
    tracemalloc.start()
    try:
        try:
            return fn()
        except ProtocolError as exc:
            return exc
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak <= 4 * input_size + ALLOC_SLACK, f"decode allocated {peak} bytes for {input_size} in"
    finally:
        if tracemalloc.is_tracing():  # pragma: no cover - stopped above
            tracemalloc.stop()


# --------------------------------------------------------------------------- frames


@FUZZ
@given(st.lists(st.binary(max_size=24), max_size=5))
def test_decode_reply_of_any_frames(frames: list[bytes]) -> None:
    got = bounded(lambda: wire.decode_reply(frames), sum(map(len, frames)))
    if isinstance(got, ProtocolError):
        return
    assert len(frames) in (2, 3)
    assert type(got.uid) is int
    assert got.payload == (frames[2] if len(frames) == 3 else None)
    value = bounded(got.value, len(frames[2]) if len(frames) == 3 else 0)
    assert not isinstance(value, BaseException) or isinstance(value, ProtocolError)


@FUZZ
@given(st.integers(min_value=0, max_value=2**64 - 1), st.sampled_from(list(wire.Op)), objects)
def test_decode_reply_of_valid_frames_with_any_payload(uid: int, op: wire.Op, payload: object) -> None:
    frames = [wire.packb(uid), wire.packb(int(op)), wire.packb(payload)]
    got = wire.decode_reply(frames)
    assert (got.uid, got.op) == (uid, int(op))
    assert wire.packb(got.value()) == wire.packb(payload)


@FUZZ
@given(st.binary(max_size=64))
def test_unpackb_claims_are_bounded_by_the_input(tail: bytes) -> None:
    # array32 / map32 / bin32 / str32 headers claiming 4 Gi items or bytes.
    for head in (b"\xdd", b"\xdf", b"\xc6", b"\xdb"):
        data = head + b"\xff\xff\xff\xff" + tail
        got = bounded(lambda data=data: wire.unpackb(data), len(data))  # type: ignore[misc]
        assert isinstance(got, ProtocolError)


# --------------------------------------------------------------------------- reply maps

VALID_REGISTER = {"shm_name": "lmcache_pool", "pool_size": 1 << 30}
VALID_SLOT = {"offset": 4096, "length": 2048, "shape": [2, 2, 16, 16], "dtype": "bfloat16"}
VALID_STORE = {"context": {"slots": [VALID_SLOT, dict(VALID_SLOT, offset=8192)], "chunk_indices": [0, 1]}}
VALID_RETRIEVE = {"success": True, "data": b"", "context": {"slots": [VALID_SLOT]}}
PARSERS: dict[str, tuple[Callable[[object], object], dict[str, Any]]] = {
    "register": (wire.parse_register_response, VALID_REGISTER),
    "prepare_store": (wire.parse_prepare_store, VALID_STORE),
    "prepare_retrieve": (wire.parse_prepare_retrieve, VALID_RETRIEVE),
    "slot": (wire.SlotDescriptor.from_wire, VALID_SLOT),
    "register_payload": (wire.RegisterPayload.from_wire, {}),
    "cache_key": (wire.CacheKey.from_wire, {}),
}


def mutate(obj: Any, draw: Callable[[st.SearchStrategy[Any]], Any], depth: int = 0) -> Any:
    """A copy of ``obj`` with one field somewhere replaced, removed or added."""
    if isinstance(obj, dict) and obj and depth < 4:
        key = draw(st.sampled_from(sorted(obj)))
        action = draw(st.sampled_from(["replace", "recurse", "drop", "add"]))
        out = dict(obj)
        if action == "drop":
            del out[key]
        elif action == "add":
            out[draw(st.text(max_size=6))] = draw(objects)
        elif action == "recurse":
            out[key] = mutate(obj[key], draw, depth + 1)
        else:
            out[key] = draw(st.one_of(objects, huge_ints))
        return out
    if isinstance(obj, list) and obj and depth < 4:
        i = draw(st.integers(0, len(obj) - 1))
        out_list = list(obj)
        action = draw(st.sampled_from(["replace", "recurse", "drop", "dup"]))
        if action == "drop":
            del out_list[i]
        elif action == "dup":
            out_list.append(obj[i])
        elif action == "recurse":
            out_list[i] = mutate(obj[i], draw, depth + 1)
        else:
            out_list[i] = draw(st.one_of(objects, huge_ints))
        return out_list
    return draw(st.one_of(objects, huge_ints))


@pytest.mark.parametrize("name", sorted(PARSERS))
@FUZZ
@given(data=st.data())
def test_reply_parsers_take_any_object(name: str, data: st.DataObject) -> None:
    parse, valid = PARSERS[name]
    obj = data.draw(objects) if not valid or data.draw(st.booleans()) else mutate(valid, data.draw)
    got = bounded(lambda: parse(obj), 1 << 16)
    if isinstance(got, ProtocolError):
        return
    # What a parser accepts is well typed: nothing malformed reaches the client.
    if name == "register":
        assert isinstance(got, tuple) and isinstance(got[0], str) and type(got[1]) is int and got[1] >= 0
    elif name == "prepare_store":
        assert isinstance(got, tuple)
        slots, indices = got
        assert len(slots) == len(indices) == len(set(indices))
        assert all(type(i) is int and i >= 0 for i in indices)
    elif name == "prepare_retrieve":
        assert isinstance(got, tuple)
        success, payload, slots = got
        assert type(success) is bool and type(payload) is bytes
        assert all(isinstance(s, wire.SlotDescriptor) for s in slots)


@FUZZ
@given(
    offset=st.one_of(huge_ints, st.integers(-(2**20), 2**31)),
    length=st.one_of(huge_ints, st.integers(-(2**20), 2**31)),
    shape=st.lists(st.integers(0, 2**33), max_size=5),
    dtype=st.sampled_from(["bfloat16", "float16", "float32", "int8", "uint8", "float64", "evil"]),
)
def test_a_slot_that_passes_its_check_lies_inside_the_pool(
    offset: int, length: int, shape: list[int], dtype: str
) -> None:
    pool = 1 << 24
    want_shape, want_dtype, itemsize = (2, 2, 16, 16), "bfloat16", 2
    try:
        slot = wire.SlotDescriptor.from_wire(
            {"offset": offset, "length": length, "shape": shape, "dtype": dtype}
        )
        slot.check(pool, want_shape, want_dtype, itemsize)
    except ProtocolError:
        return
    assert slot.offset >= 0 and slot.offset + slot.length <= pool
    assert slot.length == 2 * 2 * 16 * 16 * itemsize and slot.offset % itemsize == 0
    assert slot.shape == want_shape and slot.dtype == want_dtype


# --------------------------------------------------------------------------- tensor payloads

SHAPE = (2, 2, 4, 8)
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]


def _tensors(count: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(SHAPE, generator=g) * 200).to(dtype) for _ in range(count)]


def _payload(generation: wire.WireGeneration, tensors: list[torch.Tensor]) -> bytes:
    if generation.inline_payload == "pickle":
        return bytes(encode_tensor_list(tensors, msgpack_bin=False))
    return bytes(encode_tensor_envelope(tensors, msgpack_bin=False))


def _decode(generation: wire.WireGeneration, data: bytes, count: int, dtype: torch.dtype) -> object:
    return bounded(lambda: decode_inline(generation, data, count=count, shape=SHAPE, dtype=dtype), len(data))


def _check_decoded(got: object, count: int, dtype: torch.dtype) -> None:
    if isinstance(got, ProtocolError):
        return
    assert isinstance(got, list) and len(got) == count
    assert all(t.shape == SHAPE and t.dtype == dtype for t in got)


GENERATIONS = pytest.mark.parametrize("generation", [wire.GEN_0_5_6, wire.GEN_0_5_7], ids=lambda g: g.name)


@GENERATIONS
@FUZZ
@given(data=st.binary(max_size=512), count=st.integers(0, 3), dtype=st.sampled_from(DTYPES))
def test_inline_payload_of_any_bytes(
    generation: wire.WireGeneration, data: bytes, count: int, dtype: torch.dtype
) -> None:
    _check_decoded(_decode(generation, data, count, dtype), count, dtype)


@GENERATIONS
@FUZZ
@given(
    count=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    edits=st.lists(
        st.tuples(st.integers(0, 2**20), st.binary(min_size=1, max_size=9)), min_size=1, max_size=4
    ),
    cut=st.one_of(st.none(), st.integers(0, 2**20)),
)
def test_inline_payload_with_bytes_overwritten(
    generation: wire.WireGeneration,
    count: int,
    dtype: torch.dtype,
    seed: int,
    edits: list[tuple[int, bytes]],
    cut: int | None,
) -> None:
    """A valid payload with a few bytes overwritten (sizes, counts, opcodes, headers) or
    cut short: the right tensors, or a ProtocolError."""
    tensors = _tensors(count, dtype, seed)
    data = bytearray(_payload(generation, tensors))
    for pos, patch in edits:
        pos %= len(data)
        data[pos : pos + len(patch)] = patch[: len(data) - pos]
    if cut is not None:
        del data[cut % (len(data) + 1) :]
    got = _decode(generation, bytes(data), count, dtype)
    _check_decoded(got, count, dtype)


# Structured mutations of a valid 0.5.7 envelope: every field of its schema.
def _envelope_obj(tensors: list[torch.Tensor]) -> dict[str, Any]:
    return {
        "version": 1,
        "tensors": [
            {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.contiguous().view(torch.uint8).numpy().tobytes()}
            for t in tensors
        ],
    }  # fmt: skip


@FUZZ
@given(count=st.integers(1, 3), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), data=st.data())
def test_envelope_with_fields_mutated(count: int, dtype: torch.dtype, seed: int, data: st.DataObject) -> None:
    tensors = _tensors(count, dtype, seed)
    obj = _envelope_obj(tensors)
    assert torch.equal(
        torch.stack(decode_inline(wire.GEN_0_5_7, msgpack.packb(obj), count=count, shape=SHAPE, dtype=dtype)),
        torch.stack(tensors),
    )
    field = data.draw(st.sampled_from(["version", "count", "dtype", "shape", "data", "extra", "any"]))
    i = data.draw(st.integers(0, count - 1))
    frame = obj["tensors"][i]
    if field == "version":
        obj["version"] = data.draw(st.one_of(huge_ints, objects))
    elif field == "count":
        obj["tensors"] = obj["tensors"] * data.draw(st.integers(0, 3))
    elif field == "dtype":
        frame["dtype"] = data.draw(
            st.one_of(st.sampled_from(["float64", "int64", "bool", "float8_e4m3fn", ""]), objects)
        )
    elif field == "shape":
        frame["shape"] = data.draw(st.lists(st.one_of(huge_ints, st.integers(0, 64)), max_size=20))
    elif field == "data":
        frame["data"] = data.draw(st.one_of(st.binary(max_size=600), objects))
    elif field == "extra":
        frame[data.draw(st.text(max_size=5))] = data.draw(objects)
    else:
        obj = mutate(obj, data.draw)
    payload = msgpack.packb(obj)
    got = _decode(wire.GEN_0_5_7, payload, count, dtype)
    _check_decoded(got, count, dtype)
    if not isinstance(got, ProtocolError):
        assert isinstance(got, list)
        want = [
            torch.frombuffer(bytearray(f["data"]), dtype=torch.uint8).view(dtype).view(SHAPE)
            for f in obj["tensors"]
        ]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# Structured mutations of a valid 0.5.6 pickle: the values the tensor rebuild takes.
@FUZZ
@given(
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    offset=st.one_of(huge_ints, st.integers(0, 600)),
    size=st.lists(st.one_of(huge_ints, st.integers(0, 20)), max_size=6),
    stride=st.lists(st.one_of(huge_ints, st.integers(0, 600)), max_size=6),
    numel=st.one_of(huge_ints, st.integers(0, 600)),
)
def test_pickle_with_rebuild_arguments_mutated(
    dtype: torch.dtype, seed: int, offset: int, size: list[int], stride: list[int], numel: int
) -> None:
    (tensor,) = _tensors(1, dtype, seed)
    payload = bytes(encode_tensor_list([tensor], msgpack_bin=False))
    head = (
        b"K\x00"
        + pickle_codec._pickle_int_tuple(list(SHAPE))
        + pickle_codec._pickle_int_tuple([64, 32, 8, 1])
    )
    assert payload.count(head) == 1
    mutated = payload.replace(
        head,
        pickle_codec._pickle_int(offset)
        + pickle_codec._pickle_int_tuple(size)
        + pickle_codec._pickle_int_tuple(stride),
    )
    # The element count the storage blob's persistent id claims (torch allocates it).
    old_meta = pickle_codec._blob_meta(dtype, tensor.numel(), "0")
    new_meta = pickle_codec._blob_meta(dtype, numel, "0") if 0 <= numel < 2**63 else old_meta
    if len(new_meta) == len(old_meta):
        mutated = mutated.replace(old_meta, new_meta)
    got = bounded(lambda: decode_tensor_list(mutated), len(mutated))
    if isinstance(got, ProtocolError):
        return
    assert isinstance(got, list) and len(got) == 1
    (t,) = got
    # Accepted: a view that lies inside its storage.
    assert t.untyped_storage().nbytes() <= len(mutated)


# --------------------------------------------------------------------------- regressions


def test_regression_a_counted_bytes_claim_is_checked_before_allocating() -> None:
    payload = b"\x80\x04\x8e" + struct.pack("<Q", 3 << 30) + b"xx"  # BINBYTES8 of 3 GiB, 2 bytes
    got = bounded(lambda: decode_tensor_list(payload), len(payload))
    assert isinstance(got, UnsafePayloadError)
    assert str(got) == "pickle payload claims 3221225472 bytes at byte 11 but holds 2"


def test_regression_a_memo_index_is_checked_before_the_memo_grows() -> None:
    payload = b"\x80\x04N" + b"r" + struct.pack("<I", 1 << 26) + b"\x94."  # LONG_BINPUT 64 Mi
    got = bounded(lambda: decode_tensor_list(payload), len(payload))
    assert isinstance(got, UnsafePayloadError)
    assert str(got) == "pickle memo index 67108864 is out of range"
    text = b"\x80\x02Np99999999\n."  # PUT, the text form
    assert str(bounded(lambda: decode_tensor_list(text), len(text))) == "pickle memo index is out of range"


def test_regression_a_storage_claim_is_checked_before_torch_allocates_it() -> None:
    # A well-formed pickle of one 4-float tensor whose storage blob claims 2**28 floats
    # (1 GiB, which torch's own allocator, invisible to tracemalloc, reserved first).
    blob = pickle_codec._BLOB_HEAD + pickle_codec._blob_meta(torch.float32, 1 << 28, "0") + bytes(16)
    payload = (
        b"\x80\x04](" + pickle_codec._TENSOR_HEAD
        + b"\x8e" + struct.pack("<Q", len(blob)) + blob
        + b"\x85RK\x00" + pickle_codec._pickle_int_tuple([4]) + pickle_codec._pickle_int_tuple([1])
        + b"\x89" + pickle_codec._HOOKS + b"tRe."
    )  # fmt: skip
    got = bounded(lambda: decode_tensor_list(payload), len(payload))
    assert isinstance(got, UnsafePayloadError)
    # What it holds after its five small pickles: the int64 count and the 4 floats.
    assert str(got) == f"storage blob claims {1 << 30} bytes of data but holds 24"


def test_regression_opcodes_that_each_build_an_object_are_bounded_by_the_count() -> None:
    # 200,000 one-byte EMPTY_LISTs built ~70 bytes of objects each (14 MiB from 200 kB).
    payload = b"\x80\x04" + b"]" * 200_000 + b"."
    got = bounded(lambda: decode_tensor_list(payload, count=1), len(payload))
    assert isinstance(got, UnsafePayloadError)
    assert str(got) == "pickle payload has more than 320 opcodes"


def test_the_pre_scan_reads_torchs_own_pickles() -> None:
    tensors = _tensors(3, torch.bfloat16, 7)
    for protocol in (2, 3, 4, 5):
        got = decode_tensor_list(pickle.dumps(tensors, protocol=protocol), count=3, shape=SHAPE)
        assert all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))


# --------------------------------------------------------------------------- operations


class TamperingChannel:
    """The operations' channel over an in-process engine, with the reply to request
    number ``tamper_at`` replaced by ``replace(reply)`` (what a wrong server sends)."""

    def __init__(self, srv: InProcessServer, generation: wire.WireGeneration) -> None:
        self.srv = srv
        self.wire = generation
        self.sent = 0
        self.tamper_at: int | None = None
        self.replace: Callable[[Any], Any] = lambda value: value

    @property
    def usable(self) -> bool:
        return True

    async def call(self, opcode: wire.Op, args: Sequence[Any], timeout: float | None) -> Any:
        self.sent += 1
        try:
            value = await self.srv.handle(opcode, list(self.wire.request_args(opcode, args)))
        except NoReply as exc:  # the real server would answer nothing: a timeout
            raise LMCacheTimeoutError(opcode.name.lower(), 0.0) from exc
        if self.sent == self.tamper_at:
            value = self.replace(value)
        return value


OPS_CS = 16
OPS_END = 3 * OPS_CS


async def _run_tampered(
    mode: Literal["shm", "pickle"],
    generation: wire.WireGeneration,
    case: str,
    tamper_at: int,
    replace: Callable[[Any], Any],
) -> object:
    name = f"lmca_fuzz_{os.getpid()}_{secrets.token_hex(4)}" if mode == "shm" else None
    srv = InProcessServer(
        chunk_size=OPS_CS,
        mode=mode,
        generation=cast(ServerGeneration, generation.name),
        size_bytes=4 << 20,
        shm_name=name,
    )
    pool: ShmPool | None = None
    try:
        geom = SMALL_GEOMETRY
        made = await srv.register(geom, instance_id=7)
        pool = ShmPool(made.shm_name, made.pool_size) if made.shm_name else None
        reg = Registration("m", geom, OPS_CS, generation, 7, pool=pool, server_has_shm=bool(made.shm_name))
        channel = TamperingChannel(srv, generation)
        ops = Operations(channel, reg, cleanup_grace=1.0)
        toks, other = list(range(100, 100 + OPS_END)), list(range(900, 900 + OPS_END))
        kv = torch.randn(geom.kv_shape(OPS_END), generator=torch.Generator().manual_seed(1)).to(geom.dtype)
        assert await ops.store(OpState(None), kv, toks, OPS_END, "") is True
        channel.sent, channel.tamper_at, channel.replace = 0, tamper_at, replace
        op = OpState(time.monotonic() + 5)
        body: Callable[[], Awaitable[object]] = {
            "lookup": lambda: ops.lookup(op, toks, OPS_END, ""),
            "retrieve": lambda: ops.retrieve(op, toks, OPS_END, ""),
            "store": lambda: ops.store(op, kv, other, OPS_END, ""),
            "remap": lambda: ops.remap(op, toks, other, OPS_END, "", ""),
        }[case]
        try:
            return await asyncio.wait_for(body(), 10)
        except LMCacheError as exc:  # ProtocolError, a timeout, a TransferError ...
            return exc
    finally:
        if pool is not None:
            pool.close()
        srv.close()


@pytest.mark.parametrize("mode", ["shm", "pickle"])
@GENERATIONS
@pytest.mark.parametrize("case", ["lookup", "retrieve", "store", "remap"])
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), tamper_at=st.integers(1, 8))
def test_operations_given_one_wrong_reply(
    mode: Literal["shm", "pickle"],
    generation: wire.WireGeneration,
    case: str,
    data: st.DataObject,
    tamper_at: int,
) -> None:
    """One reply of an operation replaced by any object or a mutation of the real one:
    the operation returns a well-typed result or raises an LMCacheError (ProtocolError,
    a timeout), never another exception, and never hangs."""

    def replace(value: Any) -> Any:
        if isinstance(value, dict | list) and data.draw(st.booleans()):
            return mutate(value, data.draw)
        return data.draw(st.one_of(objects, huge_ints))

    got = asyncio.run(_run_tampered(mode, generation, case, tamper_at, replace))
    if isinstance(got, LMCacheError):
        return
    if case == "lookup":
        assert type(got) is int and 0 <= got <= OPS_END
    elif case == "retrieve":
        assert got is None or (isinstance(got, torch.Tensor) and got.dtype == SMALL_GEOMETRY.dtype)
    elif case == "store":
        assert type(got) is bool
    else:
        assert isinstance(got, RemapResult)


@pytest.mark.parametrize("count", [4, 2**31, 2**63 - 1])
def test_regression_a_prefetch_status_beyond_the_chunks_asked_is_refused(count: int) -> None:
    # Request 2 of a lookup is its query_prefetch_status. Before: a hit of 2**31 chunks
    # was returned as 34,359,738,352 tokens for a 48-token query, and 2**63 - 1 made the
    # free_lookup_locks key unencodable (a raw OverflowError; no lock released).
    got = asyncio.run(_run_tampered("pickle", wire.GEN_0_5_6, "lookup", 2, lambda value: count))
    assert isinstance(got, ProtocolError)
    assert str(got) == f"prefetch status {count} is not a chunk count in [0, 3]"
