"""benchmarks/suite/bench_facade.py --trace against the real server: every point its phases
name is one the library's trace hook passes (it raises for a point never passed), every
phase is timed on every call, and the hook is off again afterwards."""

from __future__ import annotations

import importlib
from typing import Any

from harness.real_server import RealLMCacheServer
from lmcache_async._base import trace as _trace


def test_trace_times_every_phase_and_turns_the_hook_off(real_server_shm: RealLMCacheServer) -> None:
    bench: Any = importlib.import_module("benchmarks.suite.bench_facade")
    result = bench.trace_noop(real_server_shm.url, real_server_shm.http_url, 40)
    assert list(result) == [label for label, _, _ in bench.TRACE_PHASES]
    for label, v in result.items():
        assert 0 <= v["p10_us"] <= v["median_us"] <= v["p90_us"], label
    whole = result["whole Client.noop()"]["median_us"]
    assert result["request queued -> call finished on the loop (the round trip)"]["median_us"] < whole
    assert _trace.hook is None
