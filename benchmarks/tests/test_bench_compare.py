"""benchmarks.suite.compare: two runs' medians side by side, B / A per row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.suite.compare import compare, main


def _stamp(commit: str) -> dict[str, str]:
    return {"commit": commit, "profile": "full"}


def _med(x: float) -> dict[str, float]:
    return {"median": x}


def _write(directory: Path, commit: str, scale: float) -> None:
    directory.mkdir()
    single = {
        "section": "single_shm",
        "stamp": _stamp(commit),
        "result": {
            "rows": [{"op": "store", "chunks": 4, "ours_s": _med(0.02 / scale), "ratio": _med(1.5 * scale)}]
        },
    }
    concurrent = {
        "section": "concurrent",
        "stamp": _stamp(commit),
        "result": {
            "rows": [
                {"op": "retrieve", "who": "ours", "concurrency": 8, "ops_per_s": _med(400 * scale)},
                {"op": "retrieve", "who": "ratio", "concurrency": 8, "tput_vs_sdk_best": _med(2.0 * scale)},
            ]
        },
    }
    facade = {
        "section": "facade",
        "stamp": _stamp(commit),
        "result": {
            "cases": {
                "noop": {"sync_us": _med(200 / scale), "async_us": _med(100 / scale)},
                "noop x8": {"sync_calls_per_s": _med(5000 * scale), "async_calls_per_s": _med(9000 * scale)},
            }
        },
    }
    for doc in (single, concurrent, facade):
        (directory / f"{doc['section']}.json").write_text(json.dumps(doc))


def test_every_row_says_b_over_a(tmp_path: Path) -> None:
    _write(tmp_path / "a", "aaaaaaa", 1.0)
    _write(tmp_path / "b", "bbbbbbb", 2.0)
    lines = list(compare(tmp_path / "a", tmp_path / "b"))
    assert lines == [
        "### single_shm: A aaaaaaa (full), B bbbbbbb",
        "",
        "| op | chunks | ours A (ms) | ours B (ms) | vs SDK A | vs SDK B | B / A |",
        "|---|---|---|---|---|---|---|",
        "| store | 4 | 20.00 | 10.00 | 1.50x | 3.00x | 2.00 |",
        "",
        "### concurrent: A aaaaaaa (full), B bbbbbbb",
        "",
        "| op | client | concurrency | ops/s A | ops/s B | B / A |",
        "|---|---|---|---|---|---|",
        "| retrieve | ours | 8 | 400.00 | 800.00 | 2.00 |",
        "| retrieve | ratio | 8 | 2.00x | 4.00x | 2.00 |",
        "",
        "### facade: A aaaaaaa (full), B bbbbbbb",
        "",
        "| case | sync A (us) | sync B (us) | async A (us) | async B (us) | sync A / B |",
        "|---|---|---|---|---|---|",
        "| noop | 200 | 100 | 100 | 50 | 2.00 |",
        "| noop x8 (calls/s) | 5000 | 10000 | 9000 | 18000 | 2.00 |",
        "",
    ]


def test_directories_with_no_section_in_common_are_an_error(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    _write(tmp_path / "b", "b", 1.0)
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path / "a"), str(tmp_path / "b")])
    assert info.value.code == 2
