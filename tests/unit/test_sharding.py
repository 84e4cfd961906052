"""Unit tests of lmcache_async.cli.sharding (the pure part of remap-batch --shard)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, strategies as st

from lmcache_async.cli.sharding import Shard, parse_shard, select_shard, shard_of


@pytest.mark.parametrize(
    ("text", "index", "count"),
    [("1/1", 1, 1), ("1/4", 1, 4), ("4/4", 4, 4), (" 2 / 3 ", 2, 3), ("10/12", 10, 12)],
)
def test_parse_shard(text: str, index: int, count: int) -> None:
    shard = parse_shard(text)
    assert shard == Shard(index, count)
    assert str(shard) == f"{index}/{count}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0/4", "shard index must be in 1..4, got 0"),
        ("5/4", "shard index must be in 1..4, got 5"),
        ("1/0", "shard count must be >= 1, got 0"),
        ("1", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got '1'"),
        ("a/b", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got 'a/b'"),
        ("-1/4", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got '-1/4'"),
        ("1/4/2", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got '1/4/2'"),
        ("", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got ''"),
    ],
)
def test_parse_shard_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^(shard|a shard)") as info:
        parse_shard(text)
    assert str(info.value) == message


def test_shard_type_errors() -> None:
    with pytest.raises(TypeError, match="shard index must be an int, got bool"):
        Shard(True, 2)
    with pytest.raises(TypeError, match="a shard is a string 'I/N', got int"):
        parse_shard(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shard count must be an int >= 1, got 0"):
        shard_of("k", 0)


def test_shard_of_is_the_documented_hash() -> None:
    # The documented function, written out: first 8 bytes of SHA-256, big-endian, mod N, + 1.
    for key in ("", "abc", "0123456789abcdef0123", "päir"):
        digest = hashlib.sha256(key.encode()).digest()
        for n in (1, 2, 3, 7, 64):
            assert shard_of(key, n) == int.from_bytes(digest[:8], "big") % n + 1
    # Fixed values, so a change of the function (which would re-shard running jobs) fails.
    assert [shard_of(f"pair-{i}", 4) for i in range(12)] == [1, 3, 3, 2, 3, 2, 4, 2, 2, 4, 4, 4]
    assert (shard_of("abc", 4), shard_of("abc", 7)) == (3, 3)


@given(st.lists(st.text(max_size=12), max_size=60), st.integers(min_value=1, max_value=9))
def test_shards_partition_the_input(keys: list[str], n: int) -> None:
    items = list(enumerate(keys))
    parts = [select_shard(items, Shard(i, n), key=lambda it: it[1]) for i in range(1, n + 1)]
    # Disjoint, complete, each in input order.
    assert sorted(x for part in parts for x in part) == items
    for part in parts:
        assert part == sorted(part)
    # Identical keys share a shard.
    for part in parts:
        inside = {k for _, k in part}
        assert all(k not in inside for other in parts if other is not part for _, k in other)


@given(st.lists(st.text(max_size=12), unique=True, max_size=40), st.integers(min_value=1, max_value=6))
def test_shard_does_not_depend_on_position(keys: list[str], n: int) -> None:
    shard = Shard(1, n)
    forward = select_shard(keys, shard, key=str)
    backward = select_shard(list(reversed(keys)), shard, key=str)
    assert forward == list(reversed(backward))
    assert select_shard(keys, None, key=str) == keys


def test_shards_are_balanced_enough() -> None:
    keys = [hashlib.sha256(str(i).encode()).hexdigest()[:20] for i in range(4000)]
    sizes = [len(select_shard(keys, Shard(i, 4), key=str)) for i in range(1, 5)]
    assert sum(sizes) == 4000
    assert min(sizes) > 900  # 1000 expected each; a broken hash puts everything in one
