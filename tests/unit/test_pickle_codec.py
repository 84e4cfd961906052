"""The pickle transport's payload: hand-written encoding readable by pickle.loads (what
the real server runs), restricted decoding that refuses anything but plain tensors."""

from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lmcache_async._protocol.payload.pickle_tensors import decode_tensor_list, encode_tensor_list
from lmcache_async.errors import ProtocolError, UnsafePayloadError
from tests.plugins.hypothesis_budget import examples

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.uint8]


@settings(max_examples=examples(60), deadline=None)
@given(
    st.sampled_from(DTYPES),
    st.lists(st.integers(1, 5), min_size=1, max_size=4),
    st.integers(1, 3),
    st.booleans(),
)
def test_round_trip_through_pickle_loads_and_the_restricted_decoder(
    dtype: torch.dtype, shape: list[int], count: int, strided: bool
) -> None:
    base = (torch.rand([*shape[:-1], shape[-1] * 2]) * 100).to(dtype)
    tensors = [base[..., ::2] if strided else base[..., : shape[-1]] for _ in range(count)]
    frame = encode_tensor_list(tensors)
    payload = msgpack.unpackb(bytes(frame))  # the frame is one msgpack bin
    for decoded in (pickle.loads(payload), decode_tensor_list(payload, count=count, dtype=dtype)):
        assert len(decoded) == count
        for got, want in zip(decoded, tensors, strict=True):
            assert got.dtype == dtype
            assert got.is_contiguous()
            assert torch.equal(got, want)


def test_decodes_torchs_own_pickles() -> None:
    tensors = [torch.randn(2, 3, 4).to(torch.bfloat16), torch.randn(2, 3, 4).to(torch.bfloat16)]
    for protocol in (2, 3, 4, 5):
        got = decode_tensor_list(pickle.dumps(tensors, protocol=protocol), count=2, shape=(2, 3, 4))
        assert all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))


def test_data_is_aligned_in_the_frame() -> None:
    t = torch.arange(4096, dtype=torch.float32)
    frame = encode_tensor_list([t, t])
    raw = t.numpy().tobytes()
    assert bytes(frame).find(raw) % 64 == 0


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


def test_refuses_code(tmp_path: Path) -> None:
    marker = tmp_path / "x"
    with pytest.raises(UnsafePayloadError, match="posix.mkdir, which is not allowed"):
        decode_tensor_list(pickle.dumps([_Evil(str(marker))]))
    assert not marker.exists()


def test_refuses_views_beyond_their_storage() -> None:
    # A storage of 4 floats rebuilt as a 1000-element tensor.
    class Oversized:
        def __reduce__(self) -> tuple[Any, ...]:
            storage = torch.zeros(4).untyped_storage()
            return (
                torch._utils._rebuild_tensor_v2,
                (torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.float32, _internal=True),  # type: ignore[no-untyped-call]
                 0, (1000,), (1,), False, collections.OrderedDict()),
            )  # fmt: skip

    with pytest.raises(UnsafePayloadError, match="tensor view exceeds its storage"):
        decode_tensor_list(pickle.dumps([Oversized()]))


def test_refuses_non_lists_and_mismatches() -> None:
    with pytest.raises(UnsafePayloadError, match="not a list of tensors"):
        decode_tensor_list(pickle.dumps({"a": 1}))
    with pytest.raises(UnsafePayloadError, match="malformed pickle"):
        decode_tensor_list(b"\x80\x04garbage")
    t = torch.zeros(2, 2)
    with pytest.raises(ProtocolError, match="expected 2 tensors, got 1"):
        decode_tensor_list(pickle.dumps([t]), count=2)
    with pytest.raises(ProtocolError, match=r"tensor dtype torch.float32 != expected torch.bfloat16"):
        decode_tensor_list(pickle.dumps([t]), dtype=torch.bfloat16)


def test_refuses_unsupported_dtypes_on_encode() -> None:
    with pytest.raises(ValueError, match="cannot pickle dtype torch.complex64"):
        encode_tensor_list([torch.zeros(2, dtype=torch.complex64)])


def _frame_range(buf: bytearray) -> tuple[int, int]:
    start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    return start, start + len(buf)


def test_decoding_a_received_frame_copies_no_data() -> None:
    # A received ZMQ frame is writable memory: the tensors are views of it (the data was
    # copied three times before: into a bytes, into torch.load's storage, into place).
    tensors = [torch.randn(2, 4, 16, 8).to(torch.bfloat16) for _ in range(3)]
    frame = bytearray(msgpack.unpackb(bytes(encode_tensor_list(tensors))))
    got = decode_tensor_list(memoryview(frame), count=3, shape=(2, 4, 16, 8), dtype=torch.bfloat16)
    start, end = _frame_range(frame)
    for g, want in zip(got, tensors, strict=True):
        assert torch.equal(g, want)
        assert start <= g.data_ptr() and g.data_ptr() + g.numel() * g.element_size() <= end
    assert len({g.data_ptr() for g in got}) == 3
    del frame  # the tensors keep the memory alive
    assert all(torch.equal(g, want) for g, want in zip(got, tensors, strict=True))


def test_decoding_immutable_bytes_gives_tensors_of_their_own() -> None:
    t = torch.arange(64, dtype=torch.float32)
    payload = msgpack.unpackb(bytes(encode_tensor_list([t])))
    assert type(payload) is bytes
    (got,) = decode_tensor_list(payload, count=1)
    got.fill_(-1)  # writing it never touches the immutable payload
    (again,) = decode_tensor_list(payload, count=1)
    assert torch.equal(again, t)


def test_refuses_persistent_ids_in_the_outer_pickle() -> None:
    for payload in (b"\x80\x04](K\x00Qe.", b"\x80\x02](P0\ne."):
        with pytest.raises(UnsafePayloadError, match="persistent ids are not allowed in the outer pickle"):
            decode_tensor_list(payload)


def test_refuses_storage_blobs_that_are_not_one_legacy_storage() -> None:
    from lmcache_async._protocol.payload import pickle_tensors as pickle_codec

    meta = pickle_codec._blob_meta(torch.float32, 4, "0")
    good = pickle_codec._BLOB_HEAD + meta + bytes(16)
    assert pickle_codec._load_storage(good).dtype == torch.float32
    bad_magic = pickle.dumps(1, protocol=2) + good[len(pickle.dumps(pickle_codec._MAGIC, protocol=2)) :]
    with pytest.raises(UnsafePayloadError, match="not a legacy torch.save stream"):
        pickle_codec._load_storage(bad_magic)
    wrong_count = good[: -(16 + 8)] + (5).to_bytes(8, "little") + bytes(20)
    with pytest.raises(UnsafePayloadError, match="element count does not match"):
        pickle_codec._load_storage(wrong_count)
    other_key = pickle_codec._BLOB_HEAD + meta.replace(
        pickle.dumps(["0"], protocol=2), pickle.dumps(["1"], protocol=2)
    )
    with pytest.raises(UnsafePayloadError, match="exactly one storage"):
        pickle_codec._load_storage(other_key + bytes(16))
    with pytest.raises(UnsafePayloadError, match="storage blob must be bytes"):
        pickle_codec._load_storage("text")
