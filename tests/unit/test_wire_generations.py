"""The wire per server generation: exact frames on 0.5.6 and 0.5.7, version detection."""

from __future__ import annotations

import pytest

from lmcache_async._protocol import wire as wire
from lmcache_async._protocol.wire import GEN_0_5_6, GEN_0_5_7, CacheKey, Op
from lmcache_async.errors import UnknownServerVersionWarning, UnsupportedServerVersionError


def _key(tokens: list[int], end: int | None = None) -> CacheKey:
    return CacheKey(
        model_name="m",
        world_size=1,
        worker_id=None,
        token_ids=tokens,
        start=0,
        end=len(tokens) if end is None else end,
        request_id="r",
    )


def test_a_0_5_7_key_packs_its_tokens_big_endian_uint32() -> None:
    frames = wire.encode_request(7, Op.LOOKUP, [_key([1, 2**32 - 1]).to_wire(GEN_0_5_7), 1], GEN_0_5_7)
    assert [bytes(f) for f in frames] == [
        b"\x07",
        b"\x08",
        b"\x8a\xaamodel_name\xa1m\xaaworld_size\x01\xa9worker_id\xc0"
        b"\xabtoken_bytes\xc4\x08\x00\x00\x00\x01\xff\xff\xff\xff"
        b"\xa5start\x00\xa3end\x02\xaarequest_id\xa1r\xaacache_salt\xa0"
        b"\xafrequest_configs\xc0\xaenum_kv_readers\x01",
        b"\x01",
    ]
    assert "token_ids" not in _key([1]).to_wire(GEN_0_5_7)
    assert _key([1, 2]).to_wire(GEN_0_5_6)["token_ids"] == [1, 2]
    assert wire.pack_token_bytes([0, 258, 2**32 - 1]) == b"\x00\x00\x00\x00\x00\x00\x01\x02\xff\xff\xff\xff"


def test_request_configs_travel_in_the_key_on_both_generations() -> None:
    key = CacheKey("m", 1, 0, [5], 0, 1, "r", request_configs={"lmcache.skip_load": True})
    for gen in (GEN_0_5_6, GEN_0_5_7):
        assert wire.unpackb(wire.packb(key.to_wire(gen)))["request_configs"] == {"lmcache.skip_load": True}


def test_0_5_7_appends_the_new_trailing_frames() -> None:
    key = _key([1, 2]).to_wire(GEN_0_5_7)
    store = wire.encode_request(3, Op.PREPARE_STORE, [key, 5], GEN_0_5_7)
    assert len(store) == 2 + 3 and bytes(store[-1]) == b"\x90"  # skipped_chunks: () (single group)
    free = wire.encode_request(4, Op.FREE_LOOKUP_LOCKS, [key, 1], GEN_0_5_7)
    assert len(free) == 2 + 3 and bytes(free[-1]) == b"\x90"  # extra_ranges: ()
    explicit = wire.encode_request(4, Op.FREE_LOOKUP_LOCKS, [key, 1, [[0, 16]]], GEN_0_5_7)
    assert bytes(explicit[-1]) == b"\x91\x92\x00\x10"
    assert len(wire.encode_request(3, Op.PREPARE_STORE, [key, 5], GEN_0_5_6)) == 4
    for op in (Op.COMMIT_STORE, Op.PREPARE_RETRIEVE, Op.COMMIT_RETRIEVE, Op.LOOKUP, Op.END_SESSION):
        assert GEN_0_5_7.arity(op) == GEN_0_5_6.arity(op) == op.arity
    with pytest.raises(ValueError, match=r"prepare_store takes 3 argument frames, got 4 \(the 0.5.7 wire\)"):
        wire.encode_request(3, Op.PREPARE_STORE, [key, 5, (), ()], GEN_0_5_7)
    with pytest.raises(ValueError, match=r"prepare_store takes 2 argument frames, got 3 \(the 0.5.6 wire\)"):
        wire.encode_request(3, Op.PREPARE_STORE, [key, 5, ()], GEN_0_5_6)


def test_key_prefix_cuts_the_tokens_of_either_encoding() -> None:
    key = _key([1, 2, 3, 4])
    assert GEN_0_5_6.key_prefix(key.to_wire(GEN_0_5_6), 2) == _key([1, 2]).to_wire(GEN_0_5_6)
    assert GEN_0_5_7.key_prefix(key.to_wire(GEN_0_5_7), 2) == _key([1, 2]).to_wire(GEN_0_5_7)


@pytest.mark.parametrize(
    ("version", "generation"),
    [
        ("0.5.6", GEN_0_5_6),
        ("0.5.6.post1", GEN_0_5_6),
        ("0.5.7", GEN_0_5_7),
        ("0.5.7rc3.dev0", GEN_0_5_7),
        ("v0.5.7", GEN_0_5_7),
    ],
)
def test_known_versions_pick_their_generation(version: str, generation: wire.WireGeneration) -> None:
    assert wire.generation_for_version(version) is generation


@pytest.mark.parametrize(
    ("version", "reason"),
    [
        ("0.5.5", "this client speaks lmcache 0.5.6 and 0.5.7"),
        ("0.3.14", "this client speaks lmcache 0.5.6 and 0.5.7"),
        ("banana", "it is not a version number"),
        ("", "it is not a version number"),
    ],
)
def test_unsupported_versions_raise_naming_the_version(version: str, reason: str) -> None:
    with pytest.raises(
        UnsupportedServerVersionError, match=f"unsupported LMCache server version {version!r}: {reason}"
    ):
        wire.generation_for_version(version)


@pytest.mark.parametrize("version", ["0.5.8", "0.6.0rc1", "1.0.0"])
def test_newer_versions_are_best_effort_with_a_warning(version: str) -> None:
    with pytest.warns(UnknownServerVersionWarning, match=f"{version!r} is newer than any this client knows"):
        assert wire.generation_for_version(version) is GEN_0_5_7
