"""A hybrid model's registration (several KV groups, as vLLM registers a model that mixes
full attention with sliding-window or Mamba layers) is refused by a client that would
derive its geometry from it, with a ``HybridLayoutError`` naming the groups (issue 40
item 7). The registration is made by lmcache's own engine-side client
(``harness/engine_worker.py``) on the real servers of both generations."""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import pytest

import lmcache_async as lmc
from tests.helpers import unique_model

pytestmark = pytest.mark.anyio

L, NH, HS, BS, NB = 4, 2, 8, 4, 16


@pytest.mark.parametrize("real_server", ["shm"], indirect=True)
@pytest.mark.parametrize("generation", ["0.5.6", "0.5.7"])
async def test_a_hybrid_registration_is_refused_naming_its_groups(real_server: Any, generation: str) -> None:
    from harness.workers import EngineWorker

    model = unique_model("hybrid")
    groups = [
        f"group {i}: layers {layers} (NL_X_TWO_NB_BS_NH_HS, 2 x [2, {NB}, {BS}, {NH}, {HS}], {BS} tokens per block)"
        for i, layers in enumerate(["0-1", "2-3"])
    ]
    message = (
        f"model {model!r} is registered with 2 KV groups (a hybrid model, e.g. attention mixed with "
        f"sliding-window or Mamba layers): {groups[0]}; {groups[1]}. lmcache_async reads and writes "
        "models whose KV is one group, which one KVGeometry describes; it does not guess a geometry "
        "for this one"
    )
    with EngineWorker(real_server) as eng:
        eng.register(
            model,
            num_layers=L,
            num_kv_heads=NH,
            head_dim=HS,
            block_size=BS,
            num_blocks=NB,
            engine_groups=[[0, 1], [2, 3]],
        )
        status = real_server.status()
        layout = status["cache_context_meta"][str(eng.instance_id)]["kv_cache_layout"]
        assert [g["layer_indices"] for g in layout["kernel_groups"]] == [[0, 1], [2, 3]]
        with pytest.raises(lmc.HybridLayoutError, match=f"^{re.escape(message)}$"):
            lmc.KVGeometry.from_status(status, model)
        fds = len(os.listdir("/proc/self/fd"))
        client = lmc.AsyncClient(real_server.url, real_server.http_url, model, timeout=10)
        with pytest.raises(lmc.HybridLayoutError, match=f"^{re.escape(message)}$") as info:
            await client.open()
        assert (info.value.model_name, info.value.groups) == (model, groups)
        assert isinstance(info.value, lmc.ServerError)
        back = pickle.loads(pickle.dumps(info.value))
        assert (type(back), str(back), vars(back)) == (lmc.HybridLayoutError, message, vars(info.value))
        assert client.closed
        assert len(os.listdir("/proc/self/fd")) == fds
        assert client._session.instance_id not in real_server.status()["registered_non_cuda_instance_ids"]


def test_a_hybrid_layout_with_many_groups_lists_eight() -> None:
    group = {"layer_indices": [0, 1, 2, 5], "engine_kv_format": "F" * 100, "tokens_per_block": 16}
    entry = {"model_name": "m", "kv_cache_layout": {"kernel_groups": [group] * 10}}
    with pytest.raises(lmc.HybridLayoutError) as info:
        lmc.KVGeometry.from_context_meta(entry)
    line = f"layers 0-2, 5 ({'F' * 57}..., None, 16 tokens per block)"
    assert info.value.groups == [f"group {i}: {line}" for i in range(8)] + ["and 2 more"]
