"""The 0.5.7 inline payload (msgpack TensorEnvelope): exact bytes, bitwise round trips,
every malformed or hostile input refused with ProtocolError before any allocation."""

from __future__ import annotations

import os
import struct
import subprocess
import tracemalloc
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from harness.real_server import LMCACHE_QUIET_ENV
from lmcache_async._protocol.payload.tensor_envelope import (
    MAX_RANK,
    MAX_TENSORS,
    decode_tensor_envelope,
    encode_tensor_envelope,
)
from lmcache_async.errors import ProtocolError
from tests.plugins.hypothesis_budget import examples

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.uint8, torch.float8_e4m3fn]
SHAPE = (2, 2, 4, 3)


def _tensors(
    n: int = 3, dtype: torch.dtype = torch.bfloat16, shape: tuple[int, ...] = SHAPE
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return [(torch.randn(shape, generator=gen) * 10).to(dtype) for _ in range(n)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (bitwise comparison for every dtype, NaN and float8 too)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))  # fresh, stride 1
    return flat.view(torch.uint8)


def _payload(tensors: list[torch.Tensor]) -> bytes:
    frame = encode_tensor_envelope(tensors)
    out = msgpack.unpackb(bytes(frame))  # the frame is one msgpack bin holding the envelope
    assert isinstance(out, bytes)
    return out


def test_the_bytes_are_the_servers_typed_envelope() -> None:
    t = torch.arange(6, dtype=torch.int16).view(2, 3)
    payload = _payload([t])
    assert payload == (
        b"\x82\xa7version\x01\xa7tensors\x91"
        b"\x83\xa5dtype\xa5int16\xa5shape\x92\x02\x03\xa4data\xc4\x0c" + t.numpy().tobytes()
    )
    assert msgpack.unpackb(payload) == {
        "version": 1,
        "tensors": [{"dtype": "int16", "shape": [2, 3], "data": t.numpy().tobytes()}],
    }
    frame = encode_tensor_envelope([t])
    assert bytes(frame[:5]) == b"\xc6" + struct.pack(">I", len(payload))  # always bin32
    assert encode_tensor_envelope([t], msgpack_bin=False) == payload


@settings(max_examples=examples(60), deadline=None)
@given(
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 5), min_size=0, max_size=5),
    st.integers(0, 4),
    st.booleans(),
)
def test_round_trip_is_bitwise(dtype: torch.dtype, shape: list[int], count: int, strided: bool) -> None:
    base = (torch.rand([*shape, 2]) * 100).to(dtype)
    tensors = [base[..., 0] if strided else base[..., 0].contiguous() for _ in range(count)]
    got = decode_tensor_envelope(_payload(tensors), count=count, shape=tuple(shape), dtype=dtype)
    assert len(got) == count
    for g, w in zip(got, tensors, strict=True):
        assert g.dtype == dtype
        assert tuple(g.shape) == tuple(shape)
        assert torch.equal(_bits(g), _bits(w))


def _frame(
    dtype: object = "bfloat16", shape: object = (2, 2, 4, 3), data: object = None
) -> dict[str, object]:
    if data is None:
        data = bytes(2 * 2 * 4 * 3 * 2)
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape, "data": data}


def _decode(obj: object, count: int = 1) -> list[torch.Tensor]:
    raw = obj if isinstance(obj, bytes) else msgpack.packb(obj, use_bin_type=True)
    return decode_tensor_envelope(raw, count=count, shape=SHAPE, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"version": 2, "tensors": [_frame()]}, "version 2 "),
        ({"version": 1}, "has 1 fields, expected version and tensors"),
        ({"version": 1, "tensors": [_frame()], "extra": 1}, "has 3 fields"),
        ({"version": 1, "groups": [_frame()]}, "unexpected field 'groups'"),
        ({"version": 1, "tensors": []}, "holds 0 tensors, expected 1"),
        ({"version": 1, "tensors": [_frame(), _frame()]}, "holds 2 tensors, expected 1"),
        ({"version": 1, "tensors": [_frame(dtype="float16")]}, "dtype float16 != expected bfloat16"),
        ({"version": 1, "tensors": [_frame(dtype="complex_evil")]}, "unsupported dtype 'complex_evil'"),
        ({"version": 1, "tensors": [_frame(shape=(2, 2, 4, 4))]}, r"shape \[2, 2, 4, 4\] != expected"),
        ({"version": 1, "tensors": [_frame(shape=[1] * (MAX_RANK + 1))]}, "rank 17"),
        ({"version": 1, "tensors": [_frame(shape=[2, -2, 4, 3])]}, "is negative"),
        ({"version": 1, "tensors": [_frame(shape=[2, 2.0, 4, 3])]}, "must be a non-negative int"),
        ({"version": 1, "tensors": [_frame(data=b"\x00" * 95)]}, "holds 95 bytes, expected 96"),
        ({"version": 1, "tensors": [_frame(data="text")]}, "data must be bin"),
        ({"version": 1, "tensors": [{"dtype": "bfloat16", "shape": [2, 2, 4, 3]}]}, "has 2 fields"),
        ({"version": 1, "tensors": [{**_frame(), "x": 1}]}, "has 4 fields"),
        ([1, [_frame()]], "must be a map"),
        ({"version": "1", "tensors": [_frame()]}, "version must be a non-negative int"),
        ({"version": True, "tensors": [_frame()]}, "version must be a non-negative int"),
    ],
)
def test_malformed_envelopes_are_refused(obj: object, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        _decode(obj)


def test_repeated_and_trailing_fields_are_refused() -> None:
    good = msgpack.packb({"version": 1, "tensors": [_frame()]}, use_bin_type=True)
    with pytest.raises(ProtocolError, match="1 trailing bytes"):
        _decode(good + b"\xc0")
    twice = b"\x82\xa7version\x01\xa7version\x01"
    with pytest.raises(ProtocolError, match="unexpected field 'version'"):
        _decode(twice)
    frame = b"\x83\xa5dtype\xa8bfloat16\xa5dtype\xa8bfloat16\xa4data\xc4\x00"
    with pytest.raises(ProtocolError, match="repeats field 'dtype'"):
        _decode(b"\x82\xa7version\x01\xa7tensors\x91" + frame)
    with pytest.raises(ProtocolError, match="truncated"):
        _decode(good[:-1])


def test_non_canonical_msgpack_forms_are_read() -> None:
    """msgspec accepts any header width; so does this decoder (map16, str8, uint64, int8)."""
    data = bytes(range(96))
    payload = (
        b"\xde\x00\x02\xd9\x07version\xd0\x01\xda\x00\x07tensors\xdc\x00\x01"
        b"\xdf\x00\x00\x00\x03\xa5dtype\xa8bfloat16\xa5shape\xdd\x00\x00\x00\x04"
        b"\xcf" + (2).to_bytes(8, "big") + b"\xcd\x00\x02\xce\x00\x00\x00\x04\x03"
        b"\xa4data\xc6\x00\x00\x00\x60" + data
    )
    (t,) = _decode(payload)
    assert t.view(torch.uint8).flatten().tolist() == list(range(96))


@pytest.mark.parametrize(
    "payload",
    [
        b"\x82\xa7version\x01\xa7tensors\xdd\xff\xff\xff\xff",  # 4 billion tensors
        b"\x82\xa7version\x01\xa7tensors\x91\x83\xa5dtype\xa8bfloat16\xa5shape\xdd\xff\xff\xff\xff",
        b"\x82\xa7version\x01\xa7tensors\x91\x83\xa4data\xc6\x7f\xff\xff\xff",  # 2 GiB claimed, absent
        b"\x82\xdb\xff\xff\xff\xff",  # a 4 GiB key
        b"\xdf\xff\xff\xff\xff",  # a map of 4 billion fields
    ],
)
def test_huge_claims_are_refused_without_allocating(payload: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            _decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_expected_count_beyond_the_limit_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="count must be in"):
        decode_tensor_envelope(b"", count=MAX_TENSORS + 1, shape=SHAPE, dtype=torch.bfloat16)


def test_encode_limits() -> None:
    with pytest.raises(ValueError, match="rank <= 16, got 17"):
        encode_tensor_envelope([torch.zeros([1] * 17)])


_VALID = _payload(_tensors(2))


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    try:
        got = decode_tensor_envelope(data, count=2, shape=SHAPE, dtype=torch.bfloat16)
    except ProtocolError:
        return
    assert len(got) == 2 and all(tuple(t.shape) == SHAPE for t in got)


@settings(max_examples=examples(400), deadline=None)
@given(st.data())
def test_mutated_valid_envelopes_decode_or_raise_protocol_error(data: st.DataObject) -> None:
    raw = bytearray(_VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        got = decode_tensor_envelope(bytes(raw[:cut]), count=2, shape=SHAPE, dtype=torch.bfloat16)
    except ProtocolError:
        return
    assert len(got) == 2 and all(t.dtype == torch.bfloat16 and tuple(t.shape) == SHAPE for t in got)


_LMCACHE_CODEC = """
import sys, torch
from lmcache.v1.multiprocess.transfer_context.tensor_wire import decode_tensors, encode_tensors
ours = open(sys.argv[1], "rb").read()
got = decode_tensors(ours, expected_shape=torch.Size([2, 2, 4, 3]), expected_dtype=torch.bfloat16,
                     expected_count=3)
want = torch.arange(3 * 48, dtype=torch.float32).view(3, 2, 2, 4, 3).to(torch.bfloat16)
assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), "decoded tensors differ"
sys.stdout.buffer.write(encode_tensors(list(want)))
"""


@pytest.mark.real_server
def test_lmcache_0_5_7_reads_ours_and_writes_the_same_bytes(lmcache057_python: Path, tmp_path: Path) -> None:
    """lmcache's own codec decodes our envelope to the same tensors, and encodes the same
    tensors to exactly our bytes."""
    want = torch.arange(3 * 48, dtype=torch.float32).view(3, 2, 2, 4, 3).to(torch.bfloat16)
    ours = _payload(list(want))
    path = tmp_path / "envelope.bin"
    path.write_bytes(ours)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(LMCACHE_QUIET_ENV)
    done = subprocess.run(
        [str(lmcache057_python), "-c", _LMCACHE_CODEC, str(path)],
        capture_output=True,
        timeout=100,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout == ours
