"""benchmarks/suite/bench_fleet.py end to end on tiny parameters: the index part (no
server), then the whole section on its two real servers, rendered into its page section.
No timing is asserted; the counts and the shapes are."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from benchmarks.harness import server_python


def test_the_index_part_counts_and_measures() -> None:
    bench: Any = importlib.import_module("benchmarks.suite.bench_fleet")
    res = bench._index_part(4000, 1, lookups=20)
    assert (res["chunks"], res["servers"], res["prompt_tokens"], res["inserted_into_full"]) == (
        4000,
        8,
        4096,
        800,
    )
    assert [(r["chunk_size"], r["prompt_chunks"]) for r in res["rows"]] == [(16, 256), (256, 16)]
    assert res["tracemalloc_bytes_per_chunk"] > 8 and res["getsizeof_bytes_per_chunk"] > 8
    for r in res["rows"]:
        assert r["lookup_us"]["n"] == 1 and r["walk_hit_us"]["median"] > 0


def test_the_section_runs_on_two_real_servers_and_renders(tmp_path: Path) -> None:
    bench: Any = importlib.import_module("benchmarks.suite.bench_fleet")
    render: Any = importlib.import_module("benchmarks.suite.render")
    res = bench.section(python=server_python("0.5.6"), events=64, rounds=1, prompts=2, index_chunks=2000)
    ev, fl = res["events"], res["fleet"]
    assert (ev["events"], ev["stores"], ev["live"]["resyncs"]) == (64, 1, 0)
    assert [r["max_events"] for r in ev["replay_per_s"]] == [1, 16, 256, 1024]
    assert all(r["events_per_s"]["n"] == 1 for r in ev["replay_per_s"])
    assert fl["prompts"] == 2 and set(fl["us_per_retrieve"]) == {"routed", "lookup_all", "retrieve_all"}
    assert set(fl["vs_routed"]) == {"lookup_all", "retrieve_all"}
    stamp = {
        "date_utc": "2026-12-04 21:00 UTC",
        "commit": "abc1234",
        "profile": "quick",
        "generation": "0.5.6",
        "seconds": 1.0,
        "loadavg_1m": 0.1,
        "loadavg_1m_end": 0.1,
        "cpus": 2,
    }
    page = render.Page({}, render.Plots(tmp_path))
    page.fleet({"section": "fleet", "stamp": stamp, "params": {}, "result": res})
    text = "".join(page.parts)
    assert "## KV events and the fleet" in text
    assert "64 `stored` events from engine-path stores" in text
    assert "| routed (`Fleet.retrieve`) |" in text
