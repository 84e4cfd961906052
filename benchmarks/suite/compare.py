"""Two runs of the suite side by side (an A/B of two commits, run in the same hour):

    .venv/bin/python -m benchmarks.suite.compare DIR_A DIR_B [--sections single_shm ...]

``DIR_A`` and ``DIR_B`` hold the JSON a run wrote (``python -m benchmarks.suite --out DIR
--no-render``). For each section both have, prints a Markdown table of the medians: the
single-operation sections' lmcache_async time and its ratio to the official SDK (SDK time
/ ours, measured in the same run), the concurrency section's operations per second of both
clients, and the facade's per-call times. The last column is B / A of the ratio or rate
(or A / B of a time): 1.00 is no change, above 1 is B faster.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SECTIONS = ("single_shm", "single_pickle", "concurrent", "facade")


def _load(directory: Path, section: str) -> dict[str, Any] | None:
    path = directory / f"{section}.json"
    if not path.exists():
        return None
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _single(a: dict[str, Any], b: dict[str, Any]) -> Iterator[str]:
    yield "| op | chunks | ours A (ms) | ours B (ms) | vs SDK A | vs SDK B | B / A |"
    yield "|---|---|---|---|---|---|---|"
    rows_b = {(r["op"], r["chunks"]): r for r in b["result"]["rows"]}
    for ra in a["result"]["rows"]:
        rb = rows_b.get((ra["op"], ra["chunks"]))
        if rb is None:
            continue
        xa, xb = ra["ratio"]["median"], rb["ratio"]["median"]
        ta, tb = ra["ours_s"]["median"] * 1e3, rb["ours_s"]["median"] * 1e3
        yield f"| {ra['op']} | {ra['chunks']} | {ta:.2f} | {tb:.2f} | {xa:.2f}x | {xb:.2f}x | {xb / xa:.2f} |"


def _concurrent(a: dict[str, Any], b: dict[str, Any]) -> Iterator[str]:
    yield "| op | client | concurrency | ops/s A | ops/s B | B / A |"
    yield "|---|---|---|---|---|---|"
    rows_b = {(r["op"], r["who"], r["concurrency"]): r for r in b["result"]["rows"]}
    for ra in a["result"]["rows"]:
        rb = rows_b.get((ra["op"], ra["who"], ra["concurrency"]))
        if rb is None:
            continue
        # The "ratio" rows: ours against the SDK's best, in the same run.
        key, unit = ("tput_vs_sdk_best", "x") if ra["who"] == "ratio" else ("ops_per_s", "")
        oa, ob = ra[key]["median"], rb[key]["median"]
        yield f"| {ra['op']} | {ra['who']} | {ra['concurrency']} | {oa:.2f}{unit} | {ob:.2f}{unit} | {ob / oa:.2f} |"


def _facade(a: dict[str, Any], b: dict[str, Any]) -> Iterator[str]:
    yield "| case | sync A (us) | sync B (us) | async A (us) | async B (us) | sync A / B |"
    yield "|---|---|---|---|---|---|"
    cases_b = b["result"]["cases"]
    for name, ca in a["result"]["cases"].items():
        cb = cases_b.get(name)
        if cb is None:
            continue
        if "sync_us" in ca:
            sa, sb = ca["sync_us"]["median"], cb["sync_us"]["median"]
            aa, ab = ca["async_us"]["median"], cb["async_us"]["median"]
            yield f"| {name} | {sa:.0f} | {sb:.0f} | {aa:.0f} | {ab:.0f} | {sa / sb:.2f} |"
        else:  # a rate (calls/s): B / A is the speed-up
            sa, sb = ca["sync_calls_per_s"]["median"], cb["sync_calls_per_s"]["median"]
            aa, ab = ca["async_calls_per_s"]["median"], cb["async_calls_per_s"]["median"]
            yield f"| {name} (calls/s) | {sa:.0f} | {sb:.0f} | {aa:.0f} | {ab:.0f} | {sb / sa:.2f} |"


def compare(dir_a: Path, dir_b: Path, sections: tuple[str, ...] = SECTIONS) -> Iterator[str]:
    """The Markdown lines of the comparison of the sections both directories hold."""
    for section in sections:
        a, b = _load(dir_a, section), _load(dir_b, section)
        if a is None or b is None:
            continue
        yield f"### {section}: A {a['stamp']['commit']} ({a['stamp']['profile']}), B {b['stamp']['commit']}"
        yield ""
        table = _facade if section == "facade" else _concurrent if section == "concurrent" else _single
        yield from table(a, b)
        yield ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dir_a", type=Path)
    parser.add_argument("dir_b", type=Path)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    args = parser.parse_args(argv)
    lines = list(compare(args.dir_a, args.dir_b, tuple(args.sections)))
    if not lines:
        parser.error("the two directories have no section in common")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
