"""A same-hour A/B of two commits on suite sections: did a change slow anything down?

    .venv/bin/python -m benchmarks.probes.ab --base REV [--sections single_shm facade]
        [--rounds 2] [--full] [--out FILE]

The base commit is checked out into a temporary worktree (its ``.venv`` and LMCache venvs
are this checkout's, linked); the working tree is the head. The sections run alternately
(base, head, base, head, ...: ``--rounds`` each), every run a fresh
``python -m benchmarks.suite --no-render`` process (quick profile unless ``--full``) with
that tree first on ``PYTHONPATH``. Each section runs the official SDK beside our client in
the same process tree, so the comparison is made on **ratios to the SDK of the same run**
(single-operation sections: the SDK's time over ours, higher is better) or on our
client's own median per case in microseconds (lower is better) (facade, whose cases
have no SDK side: the blocking ``Client`` and the ``AsyncClient`` of one run); a load
change between runs moves both sides of a ratio, not the A/B.

Prints one row per (section, case): base and head (the median over the rounds of each
run's median), and head/base; writes them as JSON to ``--out`` (default:
``benchmarks/results/<version>/ab-<base>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import stamp

REPO = Path(__file__).resolve().parents[2]
LINKED = (".venv", ".lmcache-venv", ".lmcache-venv-057")


def _worktree(rev: str, into: Path) -> Path:
    tree = into / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
    for name in LINKED:
        if (REPO / name).exists():
            (tree / name).symlink_to(REPO / name)
    return tree


def _run(tree: Path, sections: list[str], out: Path, full: bool) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("BENCH_QUICK", None)
    cmd = [str(REPO / ".venv/bin/python"), "-m", "benchmarks.suite", "--no-render", "--out", str(out)]
    cmd += ["--sections", *sections] + ([] if full else ["--quick"])
    subprocess.run(cmd, cwd=tree, env=env, check=True)


def _cases(section: str, doc: dict[str, Any]) -> dict[str, float]:
    """One figure per case: for the single-operation sections the run's speed-up over the
    SDK (SDK time / ours: higher is better), for the facade our client's time (lower is
    better)."""
    res = doc["result"]
    if section in ("single_shm", "single_pickle"):
        return {f"{r['op']} x{r['chunks']} (SDK/ours)": float(r["ratio"]["median"]) for r in res["rows"]}
    if section == "facade":
        out: dict[str, float] = {}
        for case, row in res["cases"].items():
            for key in ("async_us", "sync_us"):
                if isinstance(row, dict) and key in row:
                    out[f"{case} {key.removesuffix('_us')} (us)"] = float(row[key]["median"])
        return out
    raise SystemExit(f"ab: no comparison defined for section {section!r}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--sections", nargs="+", default=["single_shm", "facade"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="the full profile (default: quick)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    base_rev = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", args.base],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    figures: dict[str, dict[str, dict[str, list[float]]]] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lmcache-ab-") as tmp:
        base = _worktree(base_rev, Path(tmp))
        try:
            for rnd in range(args.rounds):
                for side, tree in (("base", base), ("head", REPO)):
                    out = Path(tmp) / f"{side}-{rnd}"
                    print(f"ab: round {rnd + 1}/{args.rounds}, {side}", file=sys.stderr, flush=True)
                    _run(tree, args.sections, out, args.full)
                    for section in args.sections:
                        doc = json.loads((out / f"{section}.json").read_text())
                        for case, value in _cases(section, doc).items():
                            figures.setdefault(section, {}).setdefault(case, {}).setdefault(side, []).append(
                                value
                            )
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    rows: list[dict[str, Any]] = []
    for section, cases in figures.items():
        for case, sides in cases.items():
            b, h = statistics.median(sides["base"]), statistics.median(sides["head"])
            rows.append({"section": section, "case": case, "base": b, "head": h, "head_over_base": h / b,
                         "base_runs": sides["base"], "head_runs": sides["head"]})  # fmt: skip
    width = max(len(r["case"]) for r in rows)
    print(f"{'section':<12} {'case':<{width}} {'base':>10} {'head':>10} {'head/base':>9}")
    for r in rows:
        print(
            f"{r['section']:<12} {r['case']:<{width}} {r['base']:>10.3f} {r['head']:>10.3f} {r['head_over_base']:>9.3f}"
        )
    doc = {"probe": "ab", "base": base_rev, "stamp": stamp(), "rounds": args.rounds,
           "profile": "full" if args.full else "quick", "seconds": round(time.monotonic() - t0, 1), "rows": rows}  # fmt: skip
    out_file = args.out or REPO / "benchmarks/results" / _version() / f"ab-{base_rev}.json"
    out_file.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"ab: written {out_file}", file=sys.stderr)
    return 0


def _version() -> str:
    from lmcache_async import __version__

    return __version__


if __name__ == "__main__":
    raise SystemExit(main())
