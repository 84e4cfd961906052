"""The sans-IO wire layer: exact frames, validation, and hypothesis round trips."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lmcache_async._protocol import wire as wire
from lmcache_async._protocol.wire import CacheKey, Op, RegisterPayload, SlotDescriptor
from lmcache_async.errors import ProtocolError
from tests.fakes import server_wire
from tests.plugins.hypothesis_budget import examples

salts = st.text(max_size=128).filter(lambda s: not any(c in s for c in "@/\\\x00"))
names = st.text(min_size=1, max_size=40).filter(lambda s: "@" not in s)
tokens = st.lists(st.integers(0, 2**32 - 1), max_size=64)


@st.composite
def keys(draw: st.DrawFn) -> CacheKey:
    toks = draw(tokens)
    end = draw(st.integers(0, len(toks)))
    start = draw(st.integers(0, end))
    return CacheKey(
        model_name=draw(names),
        world_size=draw(st.integers(1, 8)),
        worker_id=draw(st.none() | st.integers(0, 7)),
        token_ids=toks,
        start=start,
        end=end,
        request_id=draw(st.text(max_size=40)),
        cache_salt=draw(salts),
        request_configs=draw(
            st.none() | st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**64 - 1), max_size=3)
        ),
        num_kv_readers=draw(st.integers(1, 4)),
    )


def test_lookup_request_matches_the_reference_bytes() -> None:
    # The worked example of the protocol reference, section 2.1.
    key = CacheKey("m", 1, None, [1, 2], 0, 0, "r", num_kv_readers=1)
    frames = wire.encode_request(7, Op.LOOKUP, [key.to_wire(), 1])
    expected_key = (
        b"\x8a\xaamodel_name\xa1m\xaaworld_size\x01\xa9worker_id\xc0\xa9token_ids\x92\x01\x02"
        b"\xa5start\x00\xa3end\x00\xaarequest_id\xa1r\xaacache_salt\xa0"
        b"\xafrequest_configs\xc0\xaenum_kv_readers\x01"
    )
    assert frames == [b"\x07", b"\x08", expected_key, b"\x01"]


@given(keys())
def test_cache_key_round_trip(key: CacheKey) -> None:
    frames = wire.encode_request(3, Op.PREPARE_STORE, [key.to_wire(), 5])
    req = server_wire.decode_request([bytes(f) for f in frames])
    assert req.op is Op.PREPARE_STORE
    assert CacheKey.from_wire(wire.unpackb(req.args[0])) == key
    assert list(wire.unpackb(req.args[0])) == [
        "model_name", "world_size", "worker_id", "token_ids", "start", "end",
        "request_id", "cache_salt", "request_configs", "num_kv_readers",
    ]  # fmt: skip


@given(
    st.builds(
        RegisterPayload,
        st.integers(0, 2**63 - 1),
        names,
        st.integers(1, 8),
        st.integers(1, 64),
        st.integers(1, 128),
        st.integers(1, 8192),
        st.sampled_from(["bfloat16", "float16", "float32"]),
        st.booleans(),
        st.none() | st.integers(1, 1024),
    )
)
def test_register_payload_round_trip(payload: RegisterPayload) -> None:
    encoded = wire.packb(payload.to_wire())
    assert encoded[0] == 0x89  # a 9-entry map: every field written
    assert RegisterPayload.from_wire(wire.unpackb(encoded)) == payload


@given(
    st.integers(0, 2**40),
    st.sampled_from(list(Op)),
    st.none() | st.integers(-(2**63), 2**64 - 1) | st.text() | st.binary(),
)
def test_reply_round_trip(uid: int, op: Op, value: object) -> None:
    req = server_wire.decode_request([bytes(f) for f in wire.encode_request(uid, Op.NOOP, [])])
    req = server_wire.Request(req.uid_frame, wire.packb(int(op)), op, ())
    frames = server_wire.encode_reply(req, value)
    reply = wire.decode_reply([bytes(f) for f in frames])
    assert reply.uid == uid
    assert reply.op == int(op)
    assert reply.value() == value
    assert len(frames) == (2 if value is None else 3)


def test_falsy_values_still_have_a_payload_frame() -> None:
    req = server_wire.decode_request([bytes(f) for f in wire.encode_request(1, Op.NOOP, [])])
    for value in (0, False, ""):
        assert len(server_wire.encode_reply(req, value)) == 3


def test_bytes_are_bin_and_text_is_str() -> None:
    assert wire.packb(b"ab") == b"\xc4\x02ab"
    assert wire.packb("ab") == b"\xa2ab"
    assert wire.bin_header(3) == b"\xc4\x03"
    assert wire.bin_header(300) == b"\xc5\x01\x2c"
    assert wire.bin_header(70000) == b"\xc6\x00\x01\x11\x70"
    with pytest.raises(ValueError, match="at most"):
        wire.bin_header(2**32)


def test_arity_is_enforced_before_sending() -> None:
    with pytest.raises(ValueError, match="clear takes 1 argument frames, got 0"):
        wire.encode_request(1, Op.CLEAR, [])


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("a@b", "must not contain '@'"),
        ("a/b", "must not contain '/'"),
        ("a\\b", r"must not contain '\\\\'"),
        ("a\x00b", r"must not contain '\\x00'"),
        ("x" * 129, "at most 128 characters, got 129"),
    ],
)
def test_bad_salts(salt: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wire.validate_cache_salt(salt)


def test_salt_type() -> None:
    with pytest.raises(TypeError, match="cache_salt must be a str, got int"):
        wire.validate_cache_salt(3)


def test_token_lists_longer_than_the_bound_are_refused_before_they_are_walked() -> None:
    """QA-4 N2: ``lookup(range(2**40))`` walked its ids on the event loop for ever. The
    length is checked first (``len()``), for every kind of sequence, with one bound that
    the command line shares."""
    from lmcache_async.cli.arguments import MAX_TOKENS as CLI_MAX_TOKENS

    assert wire.MAX_TOKENS == CLI_MAX_TOKENS == 4_194_304
    n = wire.MAX_TOKENS
    assert wire.validate_tokens(range(n)) == list(range(n))  # the bound itself is accepted
    too_long = f"tokens has {n + 1} tokens; at most 4194304 (2**22) are accepted"
    for tokens in (
        range(n + 1),
        [0] * (n + 1),
        (0,) * (n + 1),
        numpy.zeros(n + 1, dtype=numpy.int64),
        torch.zeros(n + 1, dtype=torch.int64),
    ):
        with pytest.raises(ValueError, match=r"are accepted$") as info:
            wire.validate_tokens(tokens)
        assert str(info.value) == too_long
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"are accepted$") as info:
        wire.validate_tokens(range(2**40), "source_tokens")
    assert str(info.value) == "source_tokens has 1099511627776 tokens; at most 4194304 (2**22) are accepted"
    with pytest.raises(ValueError, match=r"are accepted$") as info:
        wire.validate_tokens(range(2**70))
    assert (
        str(info.value) == "tokens has more tokens than fit in an index; at most 4194304 (2**22) are accepted"
    )
    # A lazy sequence is never walked: a broken one that says it is long fails on its length.
    with pytest.raises(ValueError, match=r"^tokens has 4194305 tokens"):
        wire.validate_tokens(_LongLazy())
    assert time.perf_counter() - start < 0.1


class _LongLazy(Sequence[int]):
    """A sequence that claims 2**22 + 1 ids and raises if any is read."""

    def __len__(self) -> int:
        return wire.MAX_TOKENS + 1

    def __getitem__(self, index: Any) -> Any:
        raise AssertionError("an id was read")


def test_tokens_validation() -> None:
    assert wire.validate_tokens((1, 2)) == [1, 2]
    with pytest.raises(ValueError, match=r"token id 4294967296 is outside \[0, 2\*\*32\)"):
        wire.validate_tokens([1, 2**32])
    with pytest.raises(ValueError, match="token id -1"):
        wire.validate_tokens([-1])
    with pytest.raises(TypeError, match="tokens must contain ints, found float"):
        wire.validate_tokens([1.0])
    assert wire.validate_tokens(torch.tensor([3, 4])) == [3, 4]
    assert type(wire.validate_tokens([numpy.int64(5)])[0]) is int  # exact ints go on the wire
    with pytest.raises(TypeError, match="tokens must be a sequence of ints, got str"):
        wire.validate_tokens("abc")


def test_tokens_without_values_are_refused_by_name() -> None:
    # A meta tensor has a shape but no data: tolist() would raise a raw NotImplementedError.
    with pytest.raises(ValueError, match=r"^tokens is a tensor on the 'meta' device, which holds no values$"):
        wire.validate_tokens(torch.arange(4, device="meta"))
    with pytest.raises(ValueError, match=r"^src_tokens is a tensor on the 'meta' device"):
        wire.validate_tokens(torch.empty(0, dtype=torch.long, device="meta"), "src_tokens")


class _Colour(enum.IntEnum):
    RED = 7


def _reference_tokens(values: list[object]) -> list[int] | type[Exception]:
    """What validate_tokens must make of a list: exact ints, or the error's class."""
    out = []
    for v in values:
        if isinstance(v, bool | numpy.bool_) or not isinstance(v, int | numpy.integer):
            return TypeError
        out.append(int(v))
    if any(t < 0 or t >= 2**32 for t in out):
        return ValueError
    return out


_TOKEN_VALUES = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(allow_nan=False),
    st.just(_Colour.RED),
    st.integers(0, 2**32 - 1).map(numpy.int64),
    st.text(max_size=2),
    st.none(),
)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(_TOKEN_VALUES, max_size=12), st.booleans())
def test_tokens_validation_agrees_with_the_rule(values: list[object], as_tuple: bool) -> None:
    """Any list or tuple: a new list of exact ints, or TypeError/ValueError, as the
    element-by-element rule says (the fast msgspec path and the fallback agree)."""
    expected = _reference_tokens(values)
    given_tokens = tuple(values) if as_tuple else values
    if isinstance(expected, list):
        got = wire.validate_tokens(given_tokens)
        assert got == expected
        assert all(type(t) is int for t in got)
        assert got is not given_tokens
    else:
        with pytest.raises(expected, match="tokens"):
            wire.validate_tokens(given_tokens)


def test_validated_tokens_are_a_copy() -> None:
    tokens = [1, 2, 3]
    got = wire.validate_tokens(tokens)
    tokens[0] = 99  # the caller reuses its list while an operation runs
    assert got == [1, 2, 3]


def test_model_name_validation() -> None:
    with pytest.raises(ValueError, match="must not contain '@'"):
        wire.validate_model_name("a@b")
    with pytest.raises(ValueError, match="must not be empty"):
        wire.validate_model_name("")


def test_key_validation() -> None:
    with pytest.raises(ValueError, match="num_kv_readers must be >= 1, got 0"):
        CacheKey("m", 1, None, [1], 0, 1, "r", num_kv_readers=0)
    with pytest.raises(ValueError, match=r"end \(3\) exceeds len\(token_ids\) \(2\)"):
        CacheKey("m", 1, 0, [1, 2], 0, 3, "r")
    key = CacheKey("m", 1, 0, list(range(20)), 0, 20, "r")
    with pytest.raises(ValueError, match=r"range \[0, 20\) is not aligned to the chunk size 16"):
        key.check_aligned(16)


def test_decode_request_refuses_what_the_server_drops() -> None:
    with pytest.raises(ProtocolError, match="at least two frames"):
        server_wire.decode_request([b"\x01"])
    with pytest.raises(ProtocolError, match="unknown operation id 11"):
        server_wire.decode_request([b"\x01", b"\x0b"])
    with pytest.raises(ProtocolError, match="int or str"):
        server_wire.decode_request([b"\x01", msgpack.packb(1.5)])
    assert server_wire.decode_request([b"\x01", msgpack.packb("noop")]).op is Op.NOOP


def test_decode_reply_shapes() -> None:
    with pytest.raises(ProtocolError, match="2 or 3 frames, got 1"):
        wire.decode_reply([b"\x01"])
    with pytest.raises(ProtocolError, match="uid must be an int"):
        wire.decode_reply([msgpack.packb("x"), b"\x18"])
    with pytest.raises(ProtocolError, match="malformed msgpack"):
        wire.decode_reply([b"\xc1", b"\x18"])


def test_slot_descriptor_checks() -> None:
    ok = SlotDescriptor(64, 2 * 2 * 16 * 16 * 2, (2, 2, 16, 16), "bfloat16")
    ok.check(1 << 20, (2, 2, 16, 16), "bfloat16", 2)
    cases = [
        (SlotDescriptor((1 << 20) - 100, 2048, (2, 2, 16, 16), "bfloat16"), "outside the pool"),
        (SlotDescriptor(-2, 2048, (2, 2, 16, 16), "bfloat16"), "outside the pool"),
        (SlotDescriptor(0, 4096, (2, 2, 16, 16), "bfloat16"), "does not match shape"),
        (SlotDescriptor(0, 2048, (2, 2, 16, 16), "float16"), "slot dtype 'float16'"),
        (SlotDescriptor(0, 2048, (2, 2, 8, 32), "bfloat16"), "slot shape"),
        (SlotDescriptor(1, 2048, (2, 2, 16, 16), "bfloat16"), "not aligned"),
    ]
    for slot, message in cases:
        with pytest.raises(ProtocolError, match=message):
            slot.check(1 << 20, (2, 2, 16, 16), "bfloat16", 2)


def test_reply_parsers_reject_malformed_replies() -> None:
    assert wire.parse_register_response({"shm_name": "x", "pool_size": 4}) == ("x", 4)
    with pytest.raises(ProtocolError):
        wire.parse_register_response({"shm_name": 1, "pool_size": 4})
    with pytest.raises(ProtocolError, match="do not match"):
        wire.parse_prepare_store({"context": {"slots": [], "chunk_indices": [0]}})
    with pytest.raises(ProtocolError, match="malformed slot"):
        wire.parse_prepare_store({"context": {"slots": [{"offset": "0", "length": 1, "shape": [], "dtype": "x"}],
                                              "chunk_indices": [0]}})  # fmt: skip
    assert wire.parse_prepare_retrieve({"success": False, "data": b"", "context": {}}) == (False, b"", [])


_MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=40)
    | st.binary(max_size=300)
    | st.binary(max_size=70).map(bytearray),
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=examples(300), deadline=None)
@given(_MSGPACK_VALUES)
def test_packb_is_byte_identical_to_msgpack_python(value: object) -> None:
    """The request encoder (a reused msgspec encoder) writes exactly what
    ``msgpack.packb(value, use_bin_type=True)`` writes, for every kind of value a
    request carries (ints at every width boundary, NaN, bytes-likes, nesting)."""
    assert wire.packb(value) == msgpack.packb(value, use_bin_type=True)


@pytest.mark.parametrize("value", [0, 127, 128, -32, -33, 255, 256, 2**16, 2**32, 2**63, -(2**63), 2**64 - 1])
def test_packb_int_boundaries(value: int) -> None:
    assert wire.packb(value) == msgpack.packb(value, use_bin_type=True)
    assert wire.packb([value, Op.LOOKUP]) == msgpack.packb([value, int(Op.LOOKUP)], use_bin_type=True)


def test_a_large_prepare_retrieve_reply_is_decoded_without_copying_its_data() -> None:
    # A large reply arrives as a view of its ZMQ frame; its inline KV stays that view.
    data = bytes(range(256)) * 1024
    frame = bytearray(msgpack.packb({"success": True, "data": data, "context": {"x": 1}}, use_bin_type=True))
    for op in (int(Op.PREPARE_RETRIEVE), "prepare_retrieve"):
        value = wire.Reply(7, op, memoryview(frame)).value()
        ok, got, slots = wire.parse_prepare_retrieve(value)
        assert (ok, slots) == (True, [])
        assert isinstance(got, memoryview) and got.obj is frame
        assert bytes(got) == data
    # Another op's reply, or a reply as bytes, is decoded as before (bytes).
    assert wire.Reply(7, int(Op.LOOKUP), memoryview(frame)).value()["data"] == data
    assert type(wire.Reply(7, int(Op.PREPARE_RETRIEVE), bytes(frame)).value()["data"]) is bytes


def test_a_malformed_large_prepare_retrieve_reply_is_refused_as_before() -> None:
    for reply in (
        {"data": b"x" * 70000},
        {"success": 1, "data": b"x"},
        {"success": True, "data": "text"},
        [1],
    ):
        frame = memoryview(msgpack.packb(reply, use_bin_type=True))
        with pytest.raises(ProtocolError, match="prepare_retrieve reply"):
            wire.parse_prepare_retrieve(wire.Reply(7, int(Op.PREPARE_RETRIEVE), frame).value())
    with pytest.raises(ProtocolError, match="malformed msgpack payload"):
        wire.Reply(7, int(Op.PREPARE_RETRIEVE), memoryview(b"\xc1")).value()
