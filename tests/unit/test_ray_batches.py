"""lmcache_async.ray without a Ray cluster: where an actor finds its server, one batch
through :class:`RemapBatches` on the embedded server (the rows, bitwise targets), and the
resume filter. The Ray Data jobs themselves run in tests/system/test_multi_host.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lmcache_async import Client
from lmcache_async._base.pair_key import pair_key
from tests.helpers import (
    SESSION_CHUNK_SIZE as CS,
    SMALL_GEOMETRY as GEOM,
    fresh_tokens,
    random_kv,
    unique_model,
)

ray_mod = pytest.importorskip("lmcache_async.ray")
# Ray's own deprecation notices on import are not this project's.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")

A = ("tcp://10.0.0.5:5555", "http://10.0.0.5:8080")


def test_server_for_node() -> None:
    servers = {"10.0.0.5": A}
    assert ray_mod.server_for_node("10.0.0.5", servers) == A
    with pytest.raises(ValueError, match=r"^no LMCache server") as info:
        ray_mod.server_for_node("10.0.0.6", servers)
    assert str(info.value) == "no LMCache server is given for node 10.0.0.6 (servers has ['10.0.0.5'])"
    env = {"LMCACHE_ASYNC_URL": A[0], "LMCACHE_ASYNC_HTTP_URL": A[1]}
    assert ray_mod.server_for_node("10.0.0.7", None, env) == A
    for missing in ("LMCACHE_ASYNC_URL", "LMCACHE_ASYNC_HTTP_URL"):
        with pytest.raises(ValueError, match=r"^node 10.0.0.7") as info:
            ray_mod.server_for_node("10.0.0.7", None, {k: v for k, v in env.items() if k != missing})
        assert str(info.value) == (
            "node 10.0.0.7: set LMCACHE_ASYNC_URL and LMCACHE_ASYNC_HTTP_URL to its LMCache server's "
            "URLs (or pass servers={node_ip: (url, http_url)})"
        )


def test_one_batch_rows_and_targets(embedded_server_shm: Any) -> None:
    srv = embedded_server_shm
    model = unique_model("ray-batch")
    sources = [fresh_tokens(2 * CS) for _ in range(4)]
    targets = [fresh_tokens(2 * CS) for _ in range(4)]
    kvs = [random_kv(GEOM, 2 * CS) for _ in range(4)]
    sources[3] = [-1] * (2 * CS)  # invalid: refused before anything is sent
    with Client(srv.url, srv.http_url, model, geometry=GEOM) as c:
        assert c.store(kvs[0], sources[0], cache_salt="s") is True
        assert c.store(kvs[1], sources[1]) is True  # pair 2's source is never stored: a miss
    remap = ray_mod.RemapBatches(
        model,
        servers={"10.0.0.5": (srv.url, srv.http_url)},
        node_ip="10.0.0.5",
        client_options={"geometry": GEOM},
    )
    # As Ray Data hands a batch over: equal-length token lists as one 2-D array, strings
    # and nulls as object arrays.
    batch = {
        "id": np.array([10, 11, 12, 13]),
        "source": np.array(sources, dtype=np.int64),
        "target": np.array(targets, dtype=np.int64),
        "cache_salt": np.array(["s", "", "", ""], dtype=object),
        "target_cache_salt": np.array([None, None, "t", None], dtype=object),
    }
    first = remap(batch).to_pylist()
    bpt = GEOM.bytes_per_token
    common = {"error_type": None, "error": None, "server": srv.url}
    assert first == [
        {"key": pair_key(sources[0], targets[0], "s", None), "id": "10", "status": "hit",
         "retrieved_tokens": 2 * CS, "stored_tokens": 2 * CS, "bytes": 4 * CS * bpt,
         "stored_new": True, "already_cached": False, **common},
        {"key": pair_key(sources[1], targets[1], "", None), "id": "11", "status": "hit",
         "retrieved_tokens": 2 * CS, "stored_tokens": 2 * CS, "bytes": 4 * CS * bpt,
         "stored_new": True, "already_cached": False, **common},
        {"key": pair_key(sources[2], targets[2], "", "t"), "id": "12", "status": "miss",
         "retrieved_tokens": 0, "stored_tokens": 0, "bytes": 0,
         "stored_new": False, "already_cached": False, **common},
        {"key": pair_key(sources[3], targets[3], "", None), "id": "13", "status": "error",
         "retrieved_tokens": 0, "stored_tokens": 0, "bytes": 0, "stored_new": False, "already_cached": False,
         "error_type": "ValueError", "error": "source_tokens: token id -1 is outside [0, 2**32)",
         "server": srv.url},
    ]  # fmt: skip
    # The same batch again (a retried batch): the same hits, now already cached.
    again = remap(batch).to_pylist()
    assert [(r["status"], r["stored_new"], r["already_cached"]) for r in again] == [
        ("hit", False, True),
        ("hit", False, True),
        ("miss", False, False),
        ("error", False, False),
    ]
    with Client(srv.url, srv.http_url, model, geometry=GEOM) as c:
        got = c.retrieve(targets[0], cache_salt="s")
        assert got is not None and torch.equal(got, kvs[0])
        got = c.retrieve(targets[1])
        assert got is not None and torch.equal(got, kvs[1])
    # Ragged token lists (an object array of arrays) and no optional columns.
    ragged = {
        "source": np.array([np.array(sources[1]), np.array(sources[1][:CS])], dtype=object),
        "target": np.array([np.array(fresh_tokens(2 * CS)), np.array(fresh_tokens(CS))], dtype=object),
    }
    rows = remap(ragged).to_pylist()
    assert [(r["id"], r["status"], r["retrieved_tokens"], r["stored_new"]) for r in rows] == [
        (None, "hit", 2 * CS, True),
        (None, "hit", CS, True),
    ]
    # Pairs for which nothing can be stored: errors (so a resume retries them), not misses.
    short = {
        "source": np.array([np.array(sources[1]), np.array([], dtype=np.int64)], dtype=object),
        "target": np.array([np.array(fresh_tokens(CS - 1)), np.array([], dtype=np.int64)], dtype=object),
    }
    rows = remap(short).to_pylist()
    assert [(r["status"], r["error_type"], r["error"], r["stored_tokens"]) for r in rows] == [
        ("error", "ValueError",
         f"invalid pair: the target has {CS - 1} tokens, fewer than one chunk ({CS}): nothing would be stored", 0),
        ("error", "ValueError", "invalid pair: the source is empty", 0),
    ]  # fmt: skip
    assert ray_mod.done_keys(rows) == set()
    remap.client.close()


def test_done_keys_and_the_resume_filter() -> None:
    rows = [{"key": "a", "status": "hit"}, {"key": "b", "status": "miss"}, {"key": "c", "status": "error"}]
    assert ray_mod.done_keys(rows) == {"a", "b"}
    sources = [[1, 2], [3, 4], [5, 6]]
    targets = [[7, 8], [9, 10], [11, 12]]
    done = {pair_key(sources[0], targets[0], "", None), pair_key(sources[2], targets[2], "x", "y")}
    batch = {
        "source": np.array(sources),
        "target": np.array(targets),
        "cache_salt": np.array(["", "", "x"], dtype=object),
        "target_cache_salt": np.array([None, None, "y"], dtype=object),
        "id": np.array([0, 1, 2]),
    }
    kept = ray_mod._drop(done)(batch)
    assert kept["id"].tolist() == [1]
    assert kept["source"].tolist() == [[3, 4]]
