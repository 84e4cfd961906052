"""The fleet's prefix index (sans-IO): longest prefix per server, removal, resync, the
memory bound."""

from __future__ import annotations

import pytest

from lmcache_async.fleet import PrefixIndex
from lmcache_async.hashing import chunk_hashes


def _h(n: int, seed: int = 0) -> list[bytes]:
    return chunk_hashes([seed] + list(range(n * 4 - 1)), 4)


def test_longest_prefix_per_server() -> None:
    idx = PrefixIndex()
    hs = _h(5)
    idx.add(0, hs[:3])
    idx.add(1, hs)
    idx.add(2, hs[1:])  # no first chunk: no prefix
    assert idx.prefix_chunks(hs, 0b111) == {0: 3, 1: 5}
    assert idx.prefix_chunks(hs, 0b001) == {0: 3}
    assert idx.prefix_chunks(hs[:2], 0b111) == {0: 2, 1: 2}
    assert idx.prefix_chunks(_h(5, seed=9), 0b111) == {}
    assert len(idx) == 5


def test_remove_and_forget() -> None:
    idx = PrefixIndex()
    hs = _h(4)
    idx.add(0, hs)
    idx.add(1, hs)
    idx.remove(0, hs[2:3])
    assert idx.prefix_chunks(hs, 0b11) == {0: 2, 1: 4}
    assert idx.forget_server(1) == 4
    assert idx.prefix_chunks(hs, 0b11) == {0: 2}
    assert len(idx) == 3  # the chunk nobody holds is gone
    idx.remove(0, hs)
    assert len(idx) == 0


def test_the_bound_drops_the_oldest() -> None:
    idx = PrefixIndex(max_chunks=3)
    hs = _h(5)
    idx.add(0, hs)
    assert len(idx) == 3 and idx.evicted == 2
    assert idx.prefix_chunks(hs, 1) == {}  # the first chunks were dropped
    assert idx.prefix_chunks(hs[2:], 1) == {0: 3}
    with pytest.raises(ValueError, match="^max_chunks must be an int >= 1, got 0$"):
        PrefixIndex(0)


def test_a_full_index_drops_a_64th_at_a_time() -> None:
    idx = PrefixIndex(max_chunks=128)
    hs = _h(130)
    idx.add(0, hs[:128])
    assert len(idx) == 128 and idx.evicted == 0
    idx.add(0, hs[128:129])  # full: the 2 oldest (128 // 64) go, then the new one is added
    assert len(idx) == 127 and idx.evicted == 2
    assert idx.prefix_chunks(hs[:3], 1) == {}
    assert idx.prefix_chunks(hs[2:], 1) == {0: 127}
    idx.add(0, hs[:1])
    assert len(idx) == 128 and idx.evicted == 2
