"""benchmarks/bench_facade.py --trace against the real server: its wrappers still find
the facade's hand-over points, every phase is timed on every call, and the library is
left as it was."""

from __future__ import annotations

import importlib
from typing import Any

from harness.real_server import RealLMCacheServer
from lmcache_async import _connection as connection, sync_client


def test_trace_times_every_phase_and_restores_the_library(real_server_shm: RealLMCacheServer) -> None:
    bench: Any = importlib.import_module("benchmarks.bench_facade")
    before = (
        sync_client._LoopThread.submit,
        sync_client._LoopCall._start,
        sync_client._LoopCall._finish,
        sync_client._WakingSelector.wake_all,
        connection.Connection._send,
    )
    result = bench.trace_noop(real_server_shm.url, real_server_shm.http_url, 40)
    assert list(result) == [label for label, _, _ in bench.TRACE_PHASES]
    for label, v in result.items():
        assert 0 <= v["p10_us"] <= v["median_us"] <= v["p90_us"], label
    whole = result["whole Client.noop()"]["median_us"]
    assert result["request queued -> call finished on the loop (the round trip)"]["median_us"] < whole
    after = (
        sync_client._LoopThread.submit,
        sync_client._LoopCall._start,
        sync_client._LoopCall._finish,
        sync_client._WakingSelector.wake_all,
        connection.Connection._send,
    )
    assert after == before
