"""Render ``docs/benchmarks.md`` and its plots (``docs/img/bench_*.png``) from the JSON results
and the hand-written notes.

    .venv/bin/python -m benchmarks.suite.render [--results benchmarks/results/<version>]
        [--notes benchmarks/suite/notes] [--doc docs/benchmarks.md] [--img-dir docs/img]

(``make bench`` runs it after the suite; ``make bench-render`` runs it alone.) Reads every
``<results>/*.json`` written by the suite (``rtt``, ``facade``, ``concurrent``, ``single_shm``,
``single_pickle``, ``fresh``, ``untouched``, ``remap``, ``compose``, ``observe``, ``fleet``;
``*-0.5.7.json`` for the next server generation) and
any ``cuda*.json`` (from ``benchmarks/probes/bench_cuda.py``, rendered generically as
tables). A section whose JSON is missing is listed as not measured.

The page is generated whole: nothing in it is edited by hand, and the same JSON and notes
render it again byte for byte. The prose a human wrote lives in ``<notes>/<key>.md``, one
file per section (``intro``, ``single_shm``, ``single_pickle``, ``single_shm-0.5.7``, ...,
``concurrent``, ``fresh``, ``untouched``, ``remap``, ``facade``, ``rtt``, ``cuda``), placed at the end of
that section; a section where lmcache_async is behind and that has no notes says that its
"why" is still to be written, and where. A notes file that no section on the page uses is
named on stderr.

Every ratio on the page reads the same way: above 1.0 lmcache_async is ahead of the official
SDK, below 1.0 it is behind, and the page says so ("behind"). Plots need matplotlib (the
``bench`` extra); without it the page is rendered with tables only and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from benchmarks.suite import NOTES_DIR, RESULTS_DIR

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"

#: Where a section is behind and has no notes (``{key}``: the section's notes key).
WHY_PLACEHOLDER = (
    "_Why lmcache_async is not ahead here: to be written by a human after a quiet-machine run, "
    "in `benchmarks/suite/notes/{key}.md`._\n"
)

COMMANDS = {
    "rtt": ".venv/bin/python -m benchmarks.suite.bench_rtt",
    "facade": ".venv/bin/python -m benchmarks.suite.bench_facade",
    "concurrent": ".venv/bin/python -m benchmarks.suite.bench_concurrent",
    "single_shm": ".venv/bin/python -m benchmarks.suite.bench_client --mode shm",
    "single_pickle": ".venv/bin/python -m benchmarks.suite.bench_client --mode pickle",
    "fresh": ".venv/bin/python -m benchmarks.suite.bench_fresh",
    "untouched": ".venv/bin/python -m benchmarks.suite.bench_untouched",
    "remap": ".venv/bin/python -m benchmarks.suite.bench_remap_batch",
    "compose": ".venv/bin/python -m benchmarks.suite.bench_compose",
    "observe": ".venv/bin/python -m benchmarks.suite.bench_observe",
    "fleet": ".venv/bin/python -m benchmarks.suite.bench_fleet",
}


# --------------------------------------------------------------------------- formatting


def ratio(r: dict[str, Any] | float | None, *, mark: bool = True) -> str:
    """``1.23x`` (bold when ahead), ``0.87x (behind)``; a spread shows its range."""
    if r is None:
        return "n/a"
    med = r["median"] if isinstance(r, dict) else float(r)
    rng = f" ({r['min']:.2f}-{r['max']:.2f})" if isinstance(r, dict) and r.get("n", 1) > 1 else ""
    if not mark:
        return f"{med:.2f}x{rng}"
    if med >= 1.0:
        return f"**{med:.2f}x**{rng}"
    return f"{med:.2f}x{rng} **(behind)**"


def ms(s: dict[str, Any]) -> str:
    return f"{s['median'] * 1e3:.2f} ms"


def us(s: dict[str, Any]) -> str:
    return f"{s['median'] * 1e6:.0f} µs"


def mib(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB"


def inv(s: dict[str, Any]) -> dict[str, Any]:
    """1/x of a spread (min and max swap)."""
    return {"median": 1 / s["median"], "min": 1 / s["max"], "max": 1 / s["min"], "n": s.get("n", 1)}


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def stamp_line(doc: dict[str, Any]) -> str:
    s = doc["stamp"]
    load = f"load {s.get('loadavg_1m')}" + (f" → {s['loadavg_1m_end']}" if "loadavg_1m_end" in s else "")
    return (
        f"_Measured {s['date_utc']}, commit `{s['commit']}`, server {doc['result'].get('server_version', s['generation'])}, "
        f"{s.get('profile', '?')} profile, {s.get('seconds', '?')} s, {load} on {s['cpus']} CPUs. "
        f"Command: `{COMMANDS.get(doc['section'], 'make bench')}` (or `make bench`)._\n"
    )


# --------------------------------------------------------------------------- plots


class Plots:
    """matplotlib when available (Agg backend, PNG files); otherwise records why not."""

    def __init__(self, img_dir: Path) -> None:
        self.img_dir = img_dir
        self.error: str | None = None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            self.error = f"matplotlib is not installed ({exc}); `pip install -e '.[bench]'`"
            self.plt: Any = None
        else:
            self.plt = plt
            img_dir.mkdir(parents=True, exist_ok=True)

    def save(self, fig: Any, name: str) -> str:
        path = self.img_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        self.plt.close(fig)
        return f"![{name}](img/{name})\n\n"

    def cuda_scaling(self, data: dict[str, Any]) -> str:
        """GB/s against calls in flight (``bench_cuda_scaling.py``)."""
        if self.plt is None:
            return ""
        from benchmarks.suite.bench_cuda_scaling import plot

        name = "bench_cuda_scaling.png"
        plot(data, self.img_dir / name)
        return f"![{name}](img/{name})\n\n"

    def single(self, doc: dict[str, Any], name: str) -> str:
        if self.plt is None:
            return ""
        rows = [r for r in doc["result"]["rows"] if r["op"] != "pair_tiny"]
        ops = ["store", "retrieve", "retrieve_out"]
        fig, axes = self.plt.subplots(1, 3, figsize=(13, 4), sharey=True)
        for ax, op in zip(axes, ops, strict=True):
            sel = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
            if not sel:
                continue
            x = [r["bytes"] / 2**20 for r in sel]
            series = [
                ("official SDK", "sdk_s", "tab:gray", "s"),
                ("lmcache_async", "ours_s", "tab:blue", "o"),
            ]
            if op == "retrieve_out":
                series.append(("copy_ (floor)", "copy_s", "tab:green", "^"))
            for label, key, color, marker in series:
                med = [r[key]["median"] * 1e3 for r in sel]
                lo = [m - r[key]["min"] * 1e3 for m, r in zip(med, sel, strict=True)]
                hi = [r[key]["max"] * 1e3 - m for m, r in zip(med, sel, strict=True)]
                ax.errorbar(x, med, yerr=[lo, hi], label=label, color=color, marker=marker, capsize=3)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(x, [f"{v:g}" for v in x])
            ax.set_xlabel("payload (MiB)")
            title = {"retrieve_out": "retrieve into out= (SDK: fresh tensor)"}.get(op, op)
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("latency per call (ms), median, bars = range")
        axes[0].legend()
        fig.suptitle(
            f"Single operations, {doc['result']['transfer']}, server {doc['result']['server_version']}"
        )
        return self.save(fig, name)

    def concurrent(self, doc: dict[str, Any], name: str) -> str:
        if self.plt is None:
            return ""
        res = doc["result"]
        ops = [op for op in ("retrieve", "store") if any(r["op"] == op for r in res["rows"])]
        fig, axes = self.plt.subplots(len(ops), 2, figsize=(11, 3.6 * len(ops)), squeeze=False)
        for i, op in enumerate(ops):
            for j, (key, ylabel) in enumerate(
                (("ops_per_s", "operations / s"), ("cpu_us_per_op", "client CPU µs / op"))
            ):
                ax = axes[i][j]
                for who, label, color, marker in (
                    ("ours", "lmcache_async: 1 AsyncClient, N tasks", "tab:blue", "o"),
                    ("sdk", "official SDK: 1 context, N threads", "tab:gray", "s"),
                ):
                    sel = sorted(
                        (r for r in res["rows"] if r["op"] == op and r["who"] == who),
                        key=lambda r: r["concurrency"],
                    )
                    x = [r["concurrency"] for r in sel]
                    med = [r[key]["median"] for r in sel]
                    lo = [m - r[key]["min"] for m, r in zip(med, sel, strict=True)]
                    hi = [r[key]["max"] - m for m, r in zip(med, sel, strict=True)]
                    ax.errorbar(x, med, yerr=[lo, hi], label=label, color=color, marker=marker, capsize=3)
                ax.set_xscale("log", base=2)
                ticks = sorted({r["concurrency"] for r in res["rows"]})
                ax.set_xticks(ticks, [str(t) for t in ticks])
                ax.set_xlabel("concurrency N")
                ax.set_ylabel(ylabel)
                ax.set_ylim(bottom=0)
                ax.set_title(f"{op}, {res['prompts']} x {mib(res['chunk_bytes'])}")
                ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=8)
        return self.save(fig, name)

    def remap(self, doc: dict[str, Any], name: str) -> str:
        if self.plt is None:
            return ""
        rows = doc["result"]["rows"]
        fig, ax = self.plt.subplots(figsize=(6.5, 3.5))
        labels = [
            "SDK loop" if r["who"] == "sdk" else r["who"].replace("ours_c", "remap_many c=") for r in rows
        ]
        vals = [r["pairs_per_s"] for r in rows]
        colors = ["tab:gray" if r["who"] == "sdk" else "tab:blue" for r in rows]
        ax.bar(labels, vals, color=colors)
        ax.set_ylabel("pairs / s (median)")
        ax.set_title(f"{doc['result']['pairs']} remaps of {doc['result']['mib_per_prompt']} MiB")
        ax.grid(True, axis="y", alpha=0.3)
        return self.save(fig, name)


# --------------------------------------------------------------------------- sections


class Page:
    def __init__(self, notes: dict[str, str], plots: Plots) -> None:
        self.notes_text = notes
        self.plots = plots
        self.parts: list[str] = []
        self.behind: list[str] = []  # "section: case" where a ratio < 1
        self.targets: list[tuple[str, str, str]] = []
        self.placed: set[str] = set()

    def add(self, text: str) -> None:
        self.parts.append(text)

    def notes(self, key: str) -> None:
        """The hand-written notes of section ``key`` (``<notes>/<key>.md``), if any, as a
        paragraph of their own."""
        self.placed.add(key)
        body = self.notes_text.get(key, "").strip("\n")
        if body:
            if "".join(self.parts)[-2:] != "\n\n":
                self.add("\n")
            self.add(body + "\n")

    def why(self, section: str, behind: list[str]) -> None:
        """Where lmcache_async is behind: says so, and that the "why" is still to be
        written when the section has no notes."""
        if behind:
            self.behind += [f"{section}: {b}" for b in behind]
            self.add(f"lmcache_async is **behind** the official SDK here: {'; '.join(behind)}.\n\n")
            if not self.notes_text.get(section, "").strip():
                self.add(WHY_PLACEHOLDER.format(key=section))

    def target(self, what: str, measured: str, met: bool | None) -> None:
        self.targets.append((what, measured, {True: "met", False: "**not met**", None: "not measured"}[met]))

    # ------------------------------------------------------------ single operations
    def single(self, doc: dict[str, Any] | None, section: str, title: str, img: str) -> None:
        self.add(f"\n## {title}\n\n")
        if doc is None:
            self.add(f"Not measured in this run (`{COMMANDS.get(section, 'make bench')}`).\n")
            self.notes(section)
            return
        res = doc["result"]
        self.add(stamp_line(doc) + "\n")
        self.add(
            f"Geometry: {res['geometry']}. Medians of {res['rounds']} round(s) of {res['iters']} calls each "
            "(the fixed-cost case: 4x as many), ranges over rounds; the SDK and lmcache_async alternate within "
            "every round. Ratio = SDK time / ours (> 1: lmcache_async is faster). CPU = the client process's "
            "CPU time per call. "
            "Round 0 is an untimed warm-up (a client maps the pool's pages under the slots it uses on "
            "first use; the fresh-client section measures that first use).\n\n"
        )
        rows, behind = [], []
        names = {
            "store": "store",
            "retrieve": "retrieve, fresh tensor",
            "retrieve_out": "retrieve into `out=`",
            "pair_tiny": "store + retrieve, 1-layer x 1-head x 16 geometry (the fixed cost)",
        }
        for r in res["rows"]:
            case = f"{names[r['op']]}, {r['chunks']} chunk{'s' * (r['chunks'] > 1)} ({mib(r['bytes'])})"
            note = ""
            if "vs_copy" in r:
                note = f"`copy_` {ms(r['copy_s'])}; ours / `copy_` = {r['vs_copy']['median']:.2f}"
            rows.append(
                [
                    case,
                    ms(r["sdk_s"]),
                    ms(r["ours_s"]),
                    ratio(r["ratio"]),
                    us(r["sdk_cpu_s"]),
                    us(r["ours_cpu_s"]),
                    note,
                ]
            )
            if r["ratio"]["median"] < 1.0:
                behind.append(f"{case} at {r['ratio']['median']:.2f}x")
        self.add(
            table(
                ["case", "official SDK", "lmcache_async", "SDK / ours", "SDK CPU", "our CPU", "notes"], rows
            )
        )
        self.add("\n" + self.plots.single(doc, img))
        self.why(section, behind)
        self.notes(section)
        if section.startswith("single_"):
            worst = min(res["rows"], key=lambda r: r["ratio"]["median"])
            self.target(
                f"every single-operation case ≥ 1.0x the SDK ({res['transfer']}, server {res['server_version']})",
                f"worst: {worst['op']} {worst['chunks']} chunk(s) {worst['ratio']['median']:.2f}x",
                worst["ratio"]["median"] >= 1.0,
            )
        if section == "single_pickle":
            sel = [r for r in res["rows"] if r["op"] in ("store", "retrieve")]
            if sel:
                w = min(sel, key=lambda r: r["ratio"]["median"])
                self.target(
                    "pickle/inline store and retrieve ≥ 1.5x the SDK",
                    f"worst: {w['op']} {w['chunks']} chunk(s) {w['ratio']['median']:.2f}x",
                    w["ratio"]["median"] >= 1.5,
                )

    # ------------------------------------------------------------ concurrent
    def concurrent(self, doc: dict[str, Any] | None) -> None:
        self.add("\n## Many small operations at once (throughput and client CPU vs concurrency)\n\n")
        if doc is None:
            self.add(f"Not measured in this run (`{COMMANDS['concurrent']}`).\n")
            self.notes("concurrent")
            self.target("concurrent small retrieves: CPU/op ≤ 0.5x the SDK, throughput ≥ 1.2x", "", None)
            return
        res = doc["result"]
        self.add(stamp_line(doc) + "\n")
        self.add(
            f"{res['prompts']} prompts of one {mib(res['chunk_bytes'])} chunk ({res['geometry']}), "
            f"{res['transfer']}: one `AsyncClient` with N tasks vs the official SDK on one context with N "
            "threads. Client CPU = `time.process_time()` of the client's process over the run / operations "
            "(not the server's); round 0 is an untimed warm-up. "
            f"Medians of {res['rounds']} round(s).\n\n"
        )
        rows = [
            [
                r["op"],
                "lmcache_async" if r["who"] == "ours" else "official SDK",
                r["concurrency"],
                f"{r['ops_per_s']['median']:.0f} ({r['ops_per_s']['min']:.0f}-{r['ops_per_s']['max']:.0f})",
                f"{r['cpu_us_per_op']['median']:.0f}",
            ]
            for r in res["rows"]
            if r["who"] != "ratio"
        ]
        self.add(table(["op", "who", "N (tasks / threads)", "ops/s", "client CPU µs/op"], rows))
        self.add("\nAgainst the SDK's best thread count of the same round (> 1: lmcache_async ahead):\n\n")
        rrows: list[list[Any]] = []
        lagging: dict[str, list[str]] = {}
        for r in res["rows"]:
            if r["who"] != "ratio":
                continue
            cpu = inv(r["cpu_vs_sdk_best"])
            rrows.append([r["op"], r["concurrency"], ratio(r["tput_vs_sdk_best"]), ratio(cpu)])
            if r["tput_vs_sdk_best"]["median"] < 1.0:
                lagging.setdefault(f"{r['op']} throughput", []).append(str(r["concurrency"]))
            if cpu["median"] < 1.0:
                lagging.setdefault(f"{r['op']} client CPU per operation", []).append(str(r["concurrency"]))
        behind = [f"{what} at N = {', '.join(ns)}" for what, ns in lagging.items()]
        self.add(table(["op", "N", "throughput, ours / SDK best", "CPU per op, SDK / ours"], rrows))
        self.add("\n" + self.plots.concurrent(doc, "bench_concurrent.png"))
        self.why("concurrent", behind)
        self.notes("concurrent")
        top = [r for r in res["rows"] if r["who"] == "ratio" and r["op"] == "retrieve"]
        if top:
            best = max(top, key=lambda r: r["tput_vs_sdk_best"]["median"])
            cpu = inv(best["cpu_vs_sdk_best"])["median"]
            self.target(
                "concurrent small retrieves: client CPU/op ≤ 0.5x the SDK's",
                f"{1 / cpu:.2f}x at N={best['concurrency']}",
                1 / cpu <= 0.5,
            )
            self.target(
                "concurrent small retrieves: throughput ≥ 1.2x the SDK's best",
                f"{best['tput_vs_sdk_best']['median']:.2f}x at N={best['concurrency']}",
                best["tput_vs_sdk_best"]["median"] >= 1.2,
            )

    # ------------------------------------------------------------ fresh client
    def fresh(self, doc: dict[str, Any] | None) -> None:
        self.add("\n## A fresh client (the first call after connect)\n\n")
        if doc is None:
            self.add(f"Not measured in this run (`{COMMANDS['fresh']}`).\n")
            self.notes("fresh")
            self.target("16-chunk retrieve into out= from the first call: ≥ 2x SDK, ≤ 1.3x copy_", "", None)
            return
        res = doc["result"]
        self.add(stamp_line(doc) + "\n")
        self.add(
            f"A new client, then at once the 16-chunk ({mib(res['bytes'])}) retrieve; server L1 "
            f"{res['l1_gb']} GiB (the pool a new client maps), {res['reps']} repetitions, medians (range). "
            "The SDK has no `out=` (fresh tensors).\n\n"
        )
        o, s = res["ours"], res["sdk"]
        rows = [
            ["connect", ms(s["connect_s"]), ms(o["connect_s"]), ""],
            ["first retrieve", ms(s["first_s"]), ms(o["first_s"]), ratio(res["first_vs_sdk"])],
            ["second retrieve", ms(s["second_s"]), ms(o["second_s"]), ""],
        ]
        if "settled_s" in o:
            rows.append([f"after {res['settle_s']:g} s", "", ms(o["settled_s"]), ""])
        self.add(table(["call", "official SDK", "lmcache_async (into out=)", "SDK / ours"], rows))
        line = (
            f"\n`copy_` of the same bytes into a warm buffer: {ms(res['copy_s'])}; ours / `copy_`: first call "
            f"{res['first_vs_copy']['median']:.2f}, second {res['second_vs_copy']['median']:.2f}"
        )
        if "settled_vs_copy" in res:
            line += f", after {res['settle_s']:g} s {res['settled_vs_copy']['median']:.2f}"
        self.add(line + ".\n\n")
        self.why(
            "fresh",
            [f"first call {res['first_vs_sdk']['median']:.2f}x"] if res["first_vs_sdk"]["median"] < 1 else [],
        )
        self.notes("fresh")
        f_sdk, f_copy = res["first_vs_sdk"]["median"], res["first_vs_copy"]["median"]
        self.target(
            "16-chunk retrieve into out=, first call after connect: ≥ 2x the SDK and ≤ 1.3x copy_",
            f"{f_sdk:.2f}x the SDK, {f_copy:.2f}x copy_",
            f_sdk >= 2 and f_copy <= 1.3,
        )

    # ------------------------------------------------------------ untouched pool pages
    def untouched(self, doc: dict[str, Any] | None) -> None:
        self.add("\n## Pool pages nobody has used yet (a large pool, new prompts)\n\n")
        if doc is None:
            self.add(f"Not measured in this run (`{COMMANDS['untouched']}`).\n")
            self.notes("untouched")
            self.target(
                "store into untouched slots ≥ 1.0x the SDK; retrieve, 4 chunks ≥ 1.2x in every round",
                "",
                None,
            )
            return
        res = doc["result"]
        self.add(stamp_line(doc) + "\n")
        self.add(
            f"Geometry: {res['geometry']}. Each side opens a new client (a fresh mapping of the pool) per "
            f"round and makes {res['iters']} calls; store: fresh prompts into slots whose pages nobody has "
            "written (the pool's pages are given back to the kernel between sides); retrieve: prompts another "
            "process stored, into a new tensor. Medians of "
            f"{res['rounds']} round(s) (ranges over rounds); SDK / ours per round, and over every single call; "
            "minor page faults of each side's process per call (medians).\n\n"
        )
        rows, behind = [], []
        for r in res["rows"]:
            case = f"{r['op']}, {r['chunks']} chunk{'s' * (r['chunks'] > 1)} ({mib(r['bytes'])})"
            rows.append(
                [
                    case,
                    ms(r["sdk_s"]),
                    ms(r["ours_s"]),
                    ratio(r["ratio"]),
                    ratio(r["ratio_all"], mark=False),
                    f"{r['sdk_faults']['median']:.0f} / {r['ours_faults']['median']:.0f}",
                ]
            )
            if r["ratio"]["median"] < 1.0:
                behind.append(f"{case} at {r['ratio']['median']:.2f}x")
        self.add(
            table(
                ["case", "official SDK", "lmcache_async", "SDK / ours", "every call", "faults SDK / ours"],
                rows,
            )
        )
        self.why("untouched", behind)
        self.notes("untouched")
        stores = [r for r in res["rows"] if r["op"] == "store"]
        four = [r for r in res["rows"] if r["op"] == "retrieve" and r["chunks"] == 4]
        if stores:
            w = min(stores, key=lambda r: r["ratio"]["median"])
            self.target(
                "store into untouched slots (1, 4, 16 chunks) ≥ 1.0x the SDK",
                f"worst: {w['chunks']} chunk(s) {w['ratio']['median']:.2f}x",
                w["ratio"]["median"] >= 1.0,
            )
        if four:
            lo = four[0]["ratio"]["min"]
            self.target(
                "retrieve of KV another process stored, 4 chunks, new tensor: ≥ 1.2x the SDK in every round",
                f"lowest round {lo:.2f}x",
                lo >= 1.2,
            )

    # ------------------------------------------------------------ remap
    def remap(self, doc: dict[str, Any] | None) -> None:
        self.add("\n## Bulk remapping (`remap_many`)\n\n")
        if doc is None:
            self.add(f"Not measured in this run (`{COMMANDS['remap']}`).\n")
            self.notes("remap")
            return
        res = doc["result"]
        self.add(stamp_line(doc) + "\n")
        self.add(
            f"{res['pairs']} pairs of {res['tokens_per_prompt']}-token prompts ({res['mib_per_prompt']} MiB of KV "
            f"each), SHM, L1 {res['l1_gb']} GiB; the SDK does `kv = ctx.retrieve(src); ctx.store(kv, dst)` per "
            f"pair; medians of {res['rounds']} round(s); ratio = per-round SDK time / ours.\n\n"
        )
        rows, behind = [], []
        for r in res["rows"]:
            who = "official SDK, loop" if r["who"] == "sdk" else f"`remap_many`, concurrency {r['who'][6:]}"
            rows.append(
                [
                    who,
                    f"{r['median_s']} s",
                    r["pairs_per_s"],
                    r["gb_per_s"],
                    ratio(
                        {
                            "median": r["vs_sdk"],
                            "min": r["vs_sdk_range"][0],
                            "max": r["vs_sdk_range"][1],
                            "n": res["rounds"],
                        }
                    )
                    if "vs_sdk" in r
                    else "1x",
                ]
            )
            if r.get("vs_sdk", 1.0) < 1.0:
                behind.append(f"{who} at {r['vs_sdk']:.2f}x")
        self.add(table(["who", "run", "pairs/s", "GB/s (retrieved + stored)", "vs SDK"], rows))
        self.add("\n" + self.plots.remap(doc, "bench_remap.png"))
        self.why("remap", behind)
        self.notes("remap")

    # ------------------------------------------------------------ compose
    def compose(self, doc: dict[str, Any] | None) -> None:
        self.add("\n## Composition (`compose`) against a remap plus the rotation\n\n")
        if doc is None:
            self.add(f"Not measured in this run (`{COMMANDS['compose']}`).\n")
            self.notes("compose")
            return
        res = doc["result"]
        self.add(stamp_line(doc) + "\n")
        first = res["shm"]
        self.add(
            f"A {first['target_chunks']}-chunk target ({first['mib_per_target']} MiB of KV, {res['layers']} "
            "layers) composed from two parts, the second shifted (its keys rotated), against `remap` of a "
            f"{first['target_chunks']}-chunk prompt plus the rotation of the shifted part alone; "
            f"{res['iters']} iterations a round, {res['rounds']} round(s). No SDK counterpart: the ratio is "
            "(remap + rotation) / compose, per iteration, median.\n\n"
        )
        rows = []
        for transfer in [t for t in ("shm", "pickle") if t in res]:
            r = res[transfer]
            sec = r["seconds"]
            ratio_ = r["remap_plus_rotation_over_compose"]
            rows.append(
                [transfer]
                + [f"{sec[name]['median'] * 1000:.0f} ms" for name in ("remap", "rotation", "compose")]
                + [f"{ratio_['median']:.2f}x ({ratio_['min']:.2f}-{ratio_['max']:.2f})"]
            )
            self.target(
                f"compose >= 0.8x (remap + rotation), CPU, {transfer}",
                f"{ratio_['median']:.2f}x",
                ratio_["median"] >= 0.8,
            )
        self.add(table(["transfer", "remap", "rotation", "compose", "(remap + rotation) / compose"], rows))
        self.notes("compose")

    # ------------------------------------------------------------ observe
    def observe(self, doc: dict[str, Any] | None) -> None:
        self.add("\n## What observing operations costs (hook, OpenTelemetry)\n\n")
        if doc is None:
            self.add(f"Not measured in this run (`{COMMANDS['observe']}`).\n")
            self.notes("observe")
            return
        res = doc["result"]
        self.add(stamp_line(doc) + "\n")
        self.add(
            f"{res['case']}: {res['prompts']} prompts retrieved per run by one client, clients side by "
            "side (no observer; a do-nothing observer; OpenTelemetry SDK providers recording every span "
            "and metric, exported nowhere; the same with one trace in ten sampled), "
            f"{res['rounds']} round(s) in rotating order. Client CPU per "
            "operation (this process, every thread); ratios per round against no observer, median "
            "(range); the OpenTelemetry callbacks alone timed inside them.\n\n"
        )
        rows = []
        for r in res["rows"]:

            def us(key: str, r: dict[str, Any] = r) -> str:
                return f"{r[key]['median']:.0f} µs"

            def x(key: str, r: dict[str, Any] = r) -> str:
                v = r[key]
                return f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"

            rows.append(
                [
                    str(r["concurrency"]),
                    us("off_cpu_us_per_op"),
                    f"{us('hook_cpu_us_per_op')}, {x('hook_vs_off')}",
                    f"{us('otel_cpu_us_per_op')}, {x('otel_vs_off')}",
                    f"{us('otel_callbacks_cpu_us_per_op')}, {x('otel_callbacks_vs_off')}",
                ]
                + (
                    [
                        f"{us('otel_sampled_cpu_us_per_op')}, {x('otel_sampled_vs_off')}",
                        f"{us('otel_sampled_callbacks_cpu_us_per_op')}, {x('otel_sampled_callbacks_vs_off')}",
                    ]
                    if "otel_sampled_vs_off" in r
                    else []
                )
            )
            self.target(
                f"OpenTelemetry spans + metrics <= 1.05x client CPU/op, concurrency {r['concurrency']}",
                f"{r['otel_vs_off']['median']:.2f}x (callbacks alone {r['otel_callbacks_vs_off']['median']:.2f}x)",
                r["otel_vs_off"]["median"] <= 1.05,
            )
        heads = ["in flight", "off", "hook only", "OpenTelemetry", "its callbacks alone"]
        if res["rows"] and "otel_sampled_vs_off" in res["rows"][0]:
            pct = f"{res.get('sampled_ratio', 0.1):.0%}"
            heads += [f"OpenTelemetry, {pct} of traces sampled", "its callbacks alone"]
        self.add(table(heads, rows))
        self.notes("observe")

    # ------------------------------------------------------------ fleet
    def fleet(self, doc: dict[str, Any] | None) -> None:
        self.add("\n## KV events and the fleet (`kv_events`, `PrefixIndex`, `Fleet`)\n\n")
        if doc is None:
            self.add(f"Not measured in this run (`{COMMANDS['fleet']}`).\n")
            self.notes("fleet")
            return
        res = doc["result"]
        self.add(stamp_line(doc) + "\n")

        def rng(v: dict[str, Any], digits: int = 0, unit: str = "") -> str:
            return f"{v['median']:,.{digits}f}{unit} ({v['min']:,.{digits}f}-{v['max']:,.{digits}f})"

        ix = res["index"]
        self.add(
            f"**Prefix index** (no server): {ix['chunks']:,} chunks over {ix['servers']} servers; a "
            f"{ix['prompt_tokens']}-token prompt whose every chunk one server holds (the walk's worst case), "
            f"{ix['lookups_per_round']:,} lookups a round, {ix['rounds']} round(s); the chunk hashes of the "
            "prompt (blake3) and the index walk timed apart. Memory: "
            f"**{ix['tracemalloc_bytes_per_chunk']} bytes per chunk** (`tracemalloc`: traced bytes after the "
            f"fill minus before; `sys.getsizeof` sum: {ix['getsizeof_bytes_per_chunk']}), so "
            f"{ix['tracemalloc_bytes_per_chunk'] * 1e6 / 2**20:.0f} MiB per million chunks. Filling: "
            f"{ix['fill_us_per_chunk']} µs a chunk; inserting into the full index (the oldest dropped): "
            f"{ix['insert_full_us_per_chunk']} µs a chunk.\n\n"
        )
        self.add(
            table(
                ["chunk size", "chunks", "chunk hashes µs", "walk (hit) µs", "walk (miss) µs", "lookup µs"],
                [
                    [
                        str(r["chunk_size"]),
                        str(r["prompt_chunks"]),
                        rng(r["hash_us"], 1),
                        rng(r["walk_hit_us"], 1),
                        rng(r["walk_miss_us"], 2),
                        rng(r["lookup_us"], 1),
                    ]
                    for r in ix["rows"]
                ],
            )
        )
        ev = res.get("events")
        if ev:
            lv = ev["live"]
            self.add(
                f"\n**KV events**, one subscriber, {ev['events']:,} `stored` events from {ev['generator']}. "
                f"Live (batches of {lv['max_events']}): the engine produced {lv['generated_per_s']:,} events/s "
                f"and the subscriber took them in as they came ({lv['consumed_per_s']:,}/s; its last event "
                f"{lv['lag_after_last_store_ms']} ms after the last store returned, negative: before; "
                f"{lv['resyncs']} resyncs). Replay from cursor 0 (the same events, still in the server's "
                f"log): what one subscriber takes in, {ev['rounds']} round(s).\n\n"
            )
            self.add(
                table(
                    ["records a batch (`max_events`)", "events/s"],
                    [[str(r["max_events"]), rng(r["events_per_s"])] for r in ev["replay_per_s"]],
                )
            )
        fl = res.get("fleet")
        if fl:
            us_, vs = fl["us_per_retrieve"], fl["vs_routed"]
            self.add(
                f"\n**Routed retrieve** ({fl['case']}, {fl['prompts']} prompts a round, {fl['rounds']} "
                "round(s), rotating order): `Fleet.retrieve` (the index names the server) against a "
                "`lookup` on every server then the retrieve from the longest hit, and a retrieve from every "
                "server keeping the hit; µs per prompt, and the other way over routed, per round (> 1: "
                "routing is faster).\n\n"
            )
            self.add(
                table(
                    ["", "µs per retrieve", "over routed"],
                    [
                        ["routed (`Fleet.retrieve`)", rng(us_["routed"]), ""],
                        [
                            "lookup on every server, then retrieve",
                            rng(us_["lookup_all"]),
                            rng(vs["lookup_all"], 2, "x"),
                        ],
                        [
                            "retrieve from every server",
                            rng(us_["retrieve_all"]),
                            rng(vs["retrieve_all"], 2, "x"),
                        ],
                    ],
                )
            )
        self.notes("fleet")

    # ------------------------------------------------------------ facade
    def facade(self, doc: dict[str, Any] | None) -> None:
        self.add("\n## The blocking facade (`Client` vs `AsyncClient`)\n\n")
        if doc is None:
            self.add(f"Not measured in this run (`{COMMANDS['facade']}`).\n")
            self.notes("facade")
            self.target("facade hand-over (noop) < 100 µs", "", None)
            return
        res = doc["result"]
        self.add(stamp_line(doc) + "\n")
        self.add(
            f"Small geometry (the payload costs nothing), {res['transfer']}, both clients open at once; "
            f"{res['rounds']} rounds x {res['iters']} calls, median of round medians (range).\n\n"
        )

        def cell(d: dict[str, Any], digits: int = 0) -> str:
            return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}-{d['max']:.{digits}f})"

        rows = []
        for case, v in res["cases"].items():
            if case == "noop x8":
                continue
            rows.append([f"`{case}`", cell(v["async_us"]), cell(v["sync_us"]), cell(v["overhead_us"])])
        self.add(table(["case", "`await AsyncClient.x()` µs", "`Client.x()` µs", "added per call µs"], rows))
        t = res["cases"].get("noop x8")
        if t:
            a, s = t["async_calls_per_s"], t["sync_calls_per_s"]
            self.add(
                f"\n8 tasks on one `AsyncClient`: {cell(a)} `noop`/s; 8 threads on one `Client`: {cell(s)} "
                f"`noop`/s ({s['median'] / a['median']:.0%}).\n\n"
            )
        self.notes("facade")
        over = res["cases"]["noop"]["overhead_us"]["median"]
        self.target(
            "facade hand-over (`noop` through `Client` minus `AsyncClient`) < 100 µs",
            f"{over:.0f} µs",
            over < 100,
        )

    # ------------------------------------------------------------ rtt
    def rtt(self, doc: dict[str, Any] | None) -> None:
        self.add("\n## Round trips: the floor (a bare blocking DEALER)\n\n")
        if doc is None:
            self.add(f"Not measured in this run (`{COMMANDS['rtt']}`).\n")
            self.notes("rtt")
            return
        res = doc["result"]
        self.add(stamp_line(doc) + "\n")
        self.add(
            f"One request at a time, {res['n']} per round (median of the last 80 %), {res['rounds']} rounds "
            "alternating. The bare DEALER is the server's own cost per request plus the least a client adds. "
            "Ratio = bare / ours (> 1: ours is the faster).\n\n"
        )
        rows = [
            [
                f"`{r['request']}`",
                f"{r['blocking_us']['median']:.0f}",
                f"{r['ours_us']['median']:.0f}",
                ratio(r["ratio"], mark=False),
            ]
            for r in res["rows"]
        ]
        self.add(table(["request", "blocking pyzmq µs", "lmcache_async µs", "bare / ours"], rows))
        self.notes("rtt")

    # ------------------------------------------------------------ GPU
    def cuda(self, docs: list[tuple[str, Any]]) -> None:
        self.add("\n## GPU (CUDA tensors in and out)\n\n")
        if not docs:
            self.add(
                "No `cuda*.json` in the results: the GPU figures are measured on a GPU machine with "
                "`benchmarks/probes/bench_cuda.py` and their JSON dropped into `benchmarks/results/<version>/`.\n\n"
            )
        scaling = [(name, data) for name, data in docs if isinstance(data, dict) and "scaling" in data]
        for name, data in docs:
            if (name, data) in scaling:
                continue
            self.add(f"### `{name}`\n\n")
            summary = cuda_summary(data)
            self.add(generic(data) if summary is None else summary)
        self.notes("cuda")
        for name, data in scaling:
            self.add(f"\n### CUDA stores and retrieves under concurrency (`{name}`)\n\n")
            self.add(cuda_scaling_summary(data))
            self.add(self.plots.cuda_scaling(data))
            self.notes("cuda_scaling")


#: The rows of a ``bench_cuda.py`` result, in the order shown: (label, store key, retrieve key).
CUDA_ROWS: Final = (
    ("raw `copy_`, pinned host memory (the link)", "raw_pinned_d2h", "raw_pinned_h2d"),
    ("raw `copy_`, a `/dev/shm` mapping registered like the pool", "raw_regshm_d2h", "raw_regshm_h2d"),
    ("raw `copy_`, pageable host memory", "raw_pageable_d2h", "raw_pageable_h2d"),
    ("**lmcache_async, SHM, pinned pool: whole call**", "shm_pinned_store", "shm_pinned_retrieve_out"),
    ("lmcache_async, the copy phase of those calls", "shm_pinned_store__copy_part", "shm_pinned_retrieve_out__copy_part"),
    ("lmcache_async, SHM, pool left unpinned (the fallback)", "shm_unpinned_store", "shm_unpinned_retrieve_out"),
    ("the SDK's path, emulated (`kv.cpu()` / `.cuda()`)", "sdk_store", "sdk_retrieve"),
    ("lmcache_async, inline transport (embedded server; not comparable with the rows above)", "pickle_store", "pickle_retrieve_out"),
)  # fmt: skip


def cuda_summary(data: Any) -> str | None:
    """A ``bench_cuda.py`` result as two short tables (its stamp; GB/s and ms per case
    and size, lmcache_async's whole calls also as a share of the pinned link and as a
    multiple of the SDK's path), or None for JSON of another shape (shown generically)."""
    if not isinstance(data, dict):
        return None
    sizes = [k for k in ("chunks1", "chunks4", "chunks16") if isinstance(data.get(k), dict)]
    if not sizes:
        return None
    meta = [[k, _cell(v)] for k, v in data.items() if not isinstance(v, (dict, list))]
    out = [table(["field", "value"], meta) + "\n"] if meta else []

    def fig(size: dict[str, Any], key: str, link: str, sdk: str) -> str:
        v = size.get(key)
        if not isinstance(v, dict) or "gbps" not in v or "median_s" not in v:
            return ""
        text = f"{v['gbps']:.1f} GB/s, {v['median_s'] * 1e3:.2f} ms"
        if key.startswith("shm_") and not key.endswith("__copy_part"):
            lk, sk = size.get(link), size.get(sdk)
            if isinstance(lk, dict) and lk.get("gbps"):
                text += f" = {v['gbps'] / lk['gbps']:.0%} of the link"
            if isinstance(sk, dict) and sk.get("gbps"):
                text += f", {v['gbps'] / sk['gbps']:.1f}x the SDK's path"
        return text

    for name in sizes:
        size = data[name]
        n = name.removeprefix("chunks")
        mib = size.get("bytes", 0) / (1 << 20)
        rows = []
        for label, store, retrieve in CUDA_ROWS:
            cells = [
                fig(size, store, "raw_pinned_d2h", "sdk_store"),
                fig(size, retrieve, "raw_pinned_h2d", "sdk_retrieve"),
            ]
            if any(cells):
                rows.append([label, *cells])
        if rows:
            head = f"{n} chunk{'s' if n != '1' else ''} ({mib:.0f} MiB)"
            out.append(table([head, "store from CUDA", "retrieve into CUDA `out=`"], rows) + "\n")
    return "".join(out)


def cuda_scaling_summary(data: dict[str, Any]) -> str:
    """A ``bench_cuda_scaling.py`` result: its stamp, the single calls and the concurrency
    table (GB/s and the share of the pinned copy of the same direction)."""
    meta = [[k, _cell(v)] for k, v in data.items() if not isinstance(v, (dict, list))]
    out = [table(["field", "value"], meta) + "\n"]
    labels = {
        "pinned_d2h": "pinned `copy_` D2H (the link)",
        "pinned_h2d": "pinned `copy_` H2D (the link)",
        "store": "**`store`**",
        "retrieve_out": "**`retrieve(out=)`**",
        "sdk_store": "the SDK's path, emulated: `store(kv.cpu())`",
        "sdk_retrieve": "the SDK's path, emulated: `retrieve().cuda()`",
    }
    rows = []
    for size, row in data["single"].items():
        for key, label in labels.items():
            v = row[key]
            pct = f"{v['pct']:.0%}" if "pct" in v else ""
            rows.append(
                [size.removeprefix("chunks"), label, f"{v['gbps']:.1f}", pct, f"{v['median_s'] * 1e3:.2f}"]
            )
    out.append(table(["chunks", "one call", "GB/s", "of the link", "median ms"], rows) + "\n")
    sc = data["scaling"]
    concs = sorted({int(k.rsplit("_c", 1)[1]) for k in sc if "_c" in k and k.rsplit("_c", 1)[1].isdigit()})
    rows = []
    for op in ("store", "store_many", "retrieve_out", "retrieve_many"):
        cells = [f"{sc[f'{op}_c{c}']['gbps']:.1f} ({sc[f'{op}_c{c}']['pct']:.0%})" for c in concs]
        rows.append([f"`{op}`", *cells])
    rows.append(
        [
            "pinned `copy_` D2H / H2D",
            *[f"{sc['pinned_d2h']['gbps']:.1f} / {sc['pinned_h2d']['gbps']:.1f}"] * len(concs),
        ]
    )
    out.append(table(["16 calls of 4 chunks", *[f"{c} in flight" for c in concs]], rows) + "\n")
    return "".join(out)


def _cell(v: Any) -> str:
    if isinstance(v, dict) and "median" in v:
        rng = f" ({v['min']:.4g}-{v['max']:.4g})" if "min" in v and "max" in v else ""
        return f"{v['median']:.4g}{rng}"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return f"`{json.dumps(v)[:80]}`"
    return str(v)


def generic(data: Any, depth: int = 0) -> str:
    """Any JSON as markdown: lists of objects as tables, scalars as a key/value table."""
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        cols: list[str] = []
        for row in data:
            cols += [k for k in row if k not in cols]
        return table(cols, [[_cell(row.get(c, "")) for c in cols] for row in data]) + "\n"
    if not isinstance(data, dict):
        return f"`{json.dumps(data)[:500]}`\n\n"
    out = []
    scalars = {
        k: v
        for k, v in data.items()
        if not isinstance(v, (list, dict)) or (isinstance(v, dict) and "median" in v)
    }
    if scalars:
        out.append(table(["field", "value"], [[k, _cell(v)] for k, v in scalars.items()]) + "\n")
    for k, v in data.items():
        if k in scalars:
            continue
        if isinstance(v, dict) and v and all(isinstance(x, dict) and "median" not in x for x in v.values()):
            out.append(f"**{k}**\n\n" + generic([{"": kk, **vv} for kk, vv in v.items()], depth + 1))
        elif isinstance(v, (list, dict)) and depth < 3:
            out.append(f"**{k}**\n\n" + generic(v, depth + 1))
        else:
            out.append(f"**{k}**: {_cell(v)}\n\n")
    return "".join(out)


# --------------------------------------------------------------------------- page


def load(results: Path) -> tuple[dict[str, dict[str, Any]], list[tuple[str, Any]]]:
    docs: dict[str, dict[str, Any]] = {}
    cuda: list[tuple[str, Any]] = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if path.name.startswith("cuda"):
            cuda.append((path.name, data))
        elif isinstance(data, dict) and "section" in data:
            docs[path.stem] = data
    return docs, cuda


def load_notes(notes: Path) -> dict[str, str]:
    """``{key: text}`` of every ``<notes>/<key>.md`` (none when the directory is absent)."""
    return {path.stem: path.read_text() for path in sorted(notes.glob("*.md"))}


def render(results: Path, notes: Path, img_dir: Path) -> str:
    """The page from the JSON in ``results`` and the notes in ``notes``; writes the plots
    into ``img_dir``. Names on stderr the notes that no section on the page uses."""
    docs, cuda = load(results)
    notes_text = load_notes(notes)
    page = Page(notes_text, Plots(img_dir))
    stamps = [d["stamp"] for d in docs.values()]
    if stamps:
        s = stamps[0]
        machine = f"{s['cpu_model']}, {s['cpus']} CPUs, {s['memory_gib']} GiB"
        versions = (
            f"Python {s['python']}, torch {s['torch']} ({s['torch_threads']} intra-op threads"
            f"{', OMP_NUM_THREADS=' + s['omp_num_threads'] if s.get('omp_num_threads') else ''}), "
            f"lmcache_async {s['lmcache_async']}, LMCache {s['lmcache']} (server and official SDK)"
        )
        commits = sorted({st["commit"] for st in stamps})
        dates = sorted(st["date_utc"] for st in stamps)
    page.add(
        "# Benchmarks\n\n"
        "<!-- Generated by benchmarks/suite/render.py from benchmarks/results/<version>/*.json and\n"
        "     benchmarks/suite/notes/*.md (`make bench-render`). Do not edit: edit the notes. -->\n\n"
    )
    quick = [d for d in docs.values() if d["stamp"].get("profile") != "full"]
    loaded = [
        d for d in docs.values() if d["stamp"].get("loadavg_1m", 0) > 0.5 * (d["stamp"].get("cpus") or 1)
    ]
    if quick or not docs:
        page.add(
            "> **Sample figures, not for publication.** "
            + (
                f"{len(quick)} of the sections below ran the quick profile (fewer iterations and rounds). "
                if docs
                else "No results yet. "
            )
            + "Run `make bench` on a quiet machine to publish.\n\n"
        )
    elif loaded:
        page.add(
            "> **Measured on a loaded machine.** "
            f"{len(loaded)} of the sections below ran the full profile but started with a 1-minute load "
            "above half the CPUs (the load averages are in each section's stamp). Run `make bench` on a "
            "quiet machine to publish.\n\n"
        )
    page.add(
        "`make bench` regenerates this page: it starts real LMCache servers itself (SHM, and one without "
        "SHM for the inline/pickle transport), runs the official SDK (`lmcache.sdk.kvcache`, in the lmcache "
        "venv, timed inside its own process) and lmcache_async side by side in the same run, alternating "
        "the order, writes `benchmarks/results/<version>/*.json` and renders this page with "
        "`benchmarks/suite/render.py` from them and the notes in `benchmarks/suite/notes/` "
        "(`make bench-render` renders it again alone). "
        "`make bench-quick` (or `BENCH_QUICK=1 make bench`) runs a few-minute subset; "
        "`make bench BENCH_ARGS='--generation 0.5.7'` adds the single-operation sections (SHM and pickle) "
        "against LMCache 0.5.7rc3 (venv `.lmcache-venv-057`, results in `*-0.5.7.json`); the other "
        "sections run against 0.5.6 only. "
        "Each section's own script (named in its stamp) runs it alone. Every ratio reads the "
        "same way: above 1.0 lmcache_async is ahead, below 1.0 it is **behind** (and the page says so).\n\n"
    )
    if stamps:
        page.add(
            table(
                ["", ""],
                [
                    ["machine", machine],
                    ["software", versions],
                    ["commit", ", ".join(f"`{c}`" for c in commits)],
                    ["measured", f"{dates[0]} to {dates[-1]}"],
                ],
            )
        )
    page.notes("intro")
    body_start = len(page.parts)
    page.single(docs.get("single_shm"), "single_shm", "Single operations, SHM", "bench_single_shm.png")
    page.single(
        docs.get("single_pickle"),
        "single_pickle",
        "Single operations, pickle / inline (no SHM)",
        "bench_single_pickle.png",
    )
    for gen_name in sorted(k for k in docs if k.endswith("-0.5.7")):
        sec = gen_name.split("-")[0]
        page.single(
            docs[gen_name],
            gen_name,
            f"Single operations on LMCache 0.5.7, {sec.split('_')[1]}",
            f"bench_{sec}_057.png",
        )
    page.concurrent(docs.get("concurrent"))
    page.fresh(docs.get("fresh"))
    page.untouched(docs.get("untouched"))
    page.remap(docs.get("remap"))
    page.compose(docs.get("compose"))
    page.observe(docs.get("observe"))
    page.fleet(docs.get("fleet"))
    page.facade(docs.get("facade"))
    page.rtt(docs.get("rtt"))
    page.cuda(cuda)
    summary = ["\n## Where lmcache_async stands against its targets\n\n"]
    summary.append(table(["target", "measured", ""], page.targets) if page.targets else "No results.\n")
    if page.behind:
        summary.append("\nBehind the official SDK:\n\n" + "".join(f"* {b}\n" for b in page.behind))
    unused = sorted(set(notes_text) - page.placed)
    if unused:  # e.g. the notes of a 0.5.7 section whose JSON is not in this results directory
        print(f"notes not on the page (no such section): {', '.join(unused)}", file=sys.stderr)
    if page.plots.error:
        summary.append(f"\n_Plots not rendered: {page.plots.error}._\n")
    page.parts[body_start:body_start] = summary
    return "".join(page.parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--notes", type=Path, default=NOTES_DIR)
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--img-dir", type=Path, help="default: img/ next to --doc")
    args = parser.parse_args(argv)
    img_dir = args.img_dir or args.doc.parent / "img"
    text = render(args.results, args.notes, img_dir)
    args.doc.write_text(text)
    print(f"rendered {args.doc} ({len(text)} chars), plots in {img_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
