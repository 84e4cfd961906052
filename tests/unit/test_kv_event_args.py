"""``kv_events()`` arguments refused before anything is sent (exact messages, no server:
an unopened client), the subscription's name in messages, and the embedded server, which
has no KV events and no LMCache chunk hashes: both refused at once, with advice that fits
it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import lmcache_async as lmc
from lmcache_async._protocol.wire import Op, op_name
from tests.helpers import SMALL_GEOMETRY, unique_model

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"reconnect_timeout": float("nan")}, ValueError,
         "reconnect_timeout must be a finite number >= 0 seconds or None (for ever), got nan"),
        ({"reconnect_timeout": float("inf")}, ValueError,
         "reconnect_timeout must be a finite number >= 0 seconds or None (for ever), got inf"),
        ({"reconnect_timeout": -1}, ValueError,
         "reconnect_timeout must be a finite number >= 0 seconds or None (for ever), got -1"),
        ({"reconnect_timeout": "5"}, TypeError, "reconnect_timeout must be a number of seconds or None, got str"),
        ({"reconnect_timeout": True}, TypeError, "reconnect_timeout must be a number of seconds or None, got bool"),
        ({"ping_interval": True}, TypeError, "ping_interval must be a number of seconds, got bool"),
        ({"ping_interval": "5"}, TypeError, "ping_interval must be a number of seconds, got str"),
        ({"ping_interval": float("nan")}, ValueError, "ping_interval must be in (0, 30] seconds, got nan"),
        ({"ping_interval": 0}, ValueError, "ping_interval must be in (0, 30] seconds, got 0"),
        ({"model_name": "a\0b"}, ValueError, "model_name must not contain '\\x00': 'a\\x00b'"),
        ({"model_name": ""}, ValueError, "model_name must not be empty"),
    ],
)  # fmt: skip
async def test_bad_arguments_are_refused_before_anything_is_sent(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    c = lmc.AsyncClient("tcp://127.0.0.1:1", "http://127.0.0.1:1", "m", geometry=SMALL_GEOMETRY)
    with pytest.raises(error) as info:
        await anext(c.kv_events(**kwargs))
    assert str(info.value) == message


def test_the_subscription_is_named_by_its_operation_name() -> None:
    assert op_name(Op.SUBSCRIBE_KV_EVENTS) == "subscribe_kv_events"
    assert op_name("subscribe_kv_events") == "subscribe_kv_events"
    assert op_name(Op.LOOKUP) == op_name(8) == "lookup"
    assert op_name(-1) == "op#-1"  # an id on the wire: no operation has it


async def test_the_embedded_server_refuses_events_and_chunk_hashes_at_once(
    embedded_server_pickle: Any,
) -> None:
    srv = embedded_server_pickle
    dropped = srv.status()["lmcache_async_embedded"]["dropped_requests"]
    async with lmc.AsyncClient(srv.url, srv.http_url, unique_model("ev"), geometry=SMALL_GEOMETRY) as c:
        start = time.monotonic()
        with pytest.raises(lmc.KVEventsDisabledError) as info:
            await asyncio.wait_for(anext(c.kv_events()), 5)
        assert time.monotonic() - start < 1.0
        assert str(info.value) == (
            f"{srv.url} is lmcache_async's embedded server (lmcache_async.testing, `lmcache-async serve`, "
            "`make demo`), which publishes no KV events: follow the events of a real LMCache server "
            "(`lmcache server`, docs/guides/routing.md)"
        )
        advice = (
            f"{srv.http_url} hashes chunks with 'blake2b': it is lmcache_async's embedded server "
            "(lmcache_async.testing, `lmcache-async serve`, `make demo`), which has no LMCache chunk "
            "hashes; use a real LMCache server (`lmcache server`, its default --hash-algorithm blake3) "
            "for chunk hashes, KV-event routing or targeted deletes"
        )
        with pytest.raises(lmc.UnsupportedHashAlgorithmError) as hinfo:
            await c.delete([1] * 16)
        assert str(hinfo.value) == advice
        with pytest.raises(lmc.UnsupportedHashAlgorithmError) as hinfo:
            lmc.chunk_hashes([1] * 16, c)
        assert str(hinfo.value) == advice
        assert srv.status()["lmcache_async_embedded"]["dropped_requests"] == dropped  # nothing was sent
