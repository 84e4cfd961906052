"""Arguments of the routing helpers, refused before anything is sent (QA-5 m5, m7):
``Fleet.store(server=...)`` and ``chunk_hashes``'s chunk size."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from lmcache_async.fleet import Fleet
from lmcache_async.hashing import chunk_hashes
from tests.helpers import SMALL_GEOMETRY, random_kv

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("server", "error", "message"),
    [
        (True, TypeError, "server must be a server's URL (str) or None, got bool"),
        (0, TypeError, "server must be a server's URL (str) or None, got int"),
        (1.0, TypeError, "server must be a server's URL (str) or None, got float"),
        ("tcp://127.0.0.1:3", ValueError, "server 'tcp://127.0.0.1:3' is not in this fleet"),
    ],
)
async def test_fleet_store_refuses_a_bad_server_before_sending(
    server: Any, error: type, message: str
) -> None:
    # Never opened: a call that got past the check would fail on the closed client.
    fleet = Fleet(
        [("tcp://127.0.0.1:1", "http://127.0.0.1:1"), ("tcp://127.0.0.1:2", "http://127.0.0.1:2")],
        "m",
        geometry=SMALL_GEOMETRY,
    )
    kv = random_kv(SMALL_GEOMETRY, 16)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        await fleet.store(kv, list(range(16)), server=server)
    assert fleet._routed == {"tcp://127.0.0.1:1": 0, "tcp://127.0.0.1:2": 0}


@pytest.mark.parametrize("chunk_size", [256.0, "256", None, 0, -16, True, torch.tensor(256)])
def test_chunk_hashes_refuses_a_chunk_size_that_is_not_an_int(chunk_size: Any) -> None:
    message = f"chunk_size must be an int >= 1, got {chunk_size!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        chunk_hashes(list(range(512)), chunk_size)
