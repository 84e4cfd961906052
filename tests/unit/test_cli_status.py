"""``lmcache-async status``'s transport prediction reads ``/config`` as the client does
(``_server_config.expected_pool``): where the client goes inline, the CLI never says SHM."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_async._protocol.server_config import ServerConfig, expected_pool
from lmcache_async.cli.status import _predict_transport

SIZE = 1 << 16


@pytest.fixture
def segment() -> Iterator[str]:
    """A mappable ``/dev/shm/lmcache_l1_pool_<name>`` of SIZE bytes; its bare name."""
    bare = f"lmcache-async-status-{uuid.uuid4().hex[:12]}"
    path = f"/dev/shm/lmcache_l1_pool_{bare}"
    with open(path, "wb") as f:
        f.truncate(SIZE)
    try:
        yield bare
    finally:
        os.unlink(path)


def _config(shm_name: str, *, l1_count: int = 1, **memory: Any) -> dict[str, Any]:
    mem = {"shm_name": shm_name, "size_in_bytes": SIZE, "use_lazy": False, "devdax_path": None, **memory}
    l1 = {"memory_config": mem}
    return {
        "mp": {"chunk_size": 16, "supported_transfer_mode": "engine_driven"},
        "storage_manager": {"l1_manager_config": l1, "l1_manager_configs": [l1] * l1_count},
    }


def test_a_mappable_pool_is_predicted_shm(segment: str) -> None:
    config = _config(segment)
    seg = f"lmcache_l1_pool_{segment}"
    assert _predict_transport(config, "engine_driven") == {
        "mode": "shm",
        "how": "predicted from /config and a map attempt",
        "segment": f"/dev/shm/{seg}",
        "detail": f"/dev/shm/{seg} (0.00 GiB) maps",
    }
    assert ServerConfig.parse(config).expected_pool == expected_pool(config) == (seg, SIZE)


@pytest.mark.parametrize(
    "why",
    ["devdax", "two L1 managers", "lazy", "no shm_name"],
)
def test_where_the_client_expects_no_pool_the_cli_predicts_inline(segment: str, why: str) -> None:
    # The segment exists and maps: before the CLI read /config as the client does, it
    # predicted SHM for the devdax and multi-L1 servers, where the client goes inline.
    config = {
        "devdax": _config(segment, devdax_path="/dev/dax0.0"),
        "two L1 managers": _config(segment, l1_count=2),
        "lazy": _config(segment, use_lazy=True),
        "no shm_name": _config(""),
    }[why]
    assert ServerConfig.parse(config).expected_pool == ("", 0)
    assert _predict_transport(config, "auto") == {
        "mode": "pickle",
        "how": "predicted from /config and a map attempt",
        "detail": "the server has no SHM pool",
    }


def test_a_pool_this_host_cannot_map_is_predicted_stores_only() -> None:
    bare = f"lmcache-async-status-absent-{uuid.uuid4().hex[:12]}"
    seg = f"lmcache_l1_pool_{bare}"
    assert _predict_transport(_config(bare), "engine_driven") == {
        "mode": "pickle",
        "how": "predicted from /config and a map attempt",
        "segment": f"/dev/shm/{seg}",
        "detail": (
            "stores only: the server keeps its KV in SHM this host cannot map (cannot open shared "
            f"memory /dev/shm/{seg}: [Errno 2] No such file or directory: '/dev/shm/{seg}')"
        ),
    }


def test_a_server_without_engine_driven_transfers_predicts_nothing(segment: str) -> None:
    assert _predict_transport(_config(segment), "disabled") == {
        "mode": None,
        "how": "predicted from /config and a map attempt",
        "detail": "the server does not serve engine-driven clients",
    }
