"""benchmarks/suite/render.py: the benchmark page generator (no server; synthetic results)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def render() -> Any:
    # Imported by name: the tests reach its internals through Any.
    return importlib.import_module("benchmarks.suite.render")


def _spread(x: float) -> dict[str, float]:
    return {"median": x, "min": x, "max": x, "n": 1}


STAMP = {
    "date_utc": "2026-12-02 16:00 UTC",
    "commit": "abc1234",
    "cpu_model": "Test CPU",
    "cpus": 2,
    "memory_gib": 24.0,
    "loadavg_1m": 0.1,
    "loadavg_1m_end": 0.2,
    "python": "3.11.7",
    "torch": "2.13.0",
    "torch_threads": 2,
    "omp_num_threads": None,
    "lmcache_async": "0.1.0",
    "generation": "0.5.6",
    "lmcache": "0.5.6",
    "profile": "full",
    "seconds": 12.0,
}


def _row(op: str, chunks: int, sdk: float, ours: float) -> dict[str, Any]:
    return {
        "op": op,
        "chunks": chunks,
        "bytes": chunks * 32 * 2**20,
        "sdk_s": _spread(sdk),
        "ours_s": _spread(ours),
        "sdk_cpu_s": _spread(sdk / 2),
        "ours_cpu_s": _spread(ours / 2),
        "ratio": _spread(sdk / ours),
    }


def _write_results(tmp: Path) -> Path:
    results = tmp / "results"
    results.mkdir()
    single = {
        "section": "single_shm",
        "stamp": STAMP,
        "params": {},
        "result": {
            "transfer": "shm",
            "server_version": "0.5.6",
            "geometry": "test geometry",
            "iters": 8,
            "rounds": 3,
            "prefault_wait_s": 0.5,
            "rows": [_row("store", 1, 0.015, 0.010), _row("retrieve", 4, 0.080, 0.100)],
        },
    }
    (results / "single_shm.json").write_text(json.dumps(single))
    cuda = {"device": "GPU X", "rows": [{"case": "retrieve_out", "chunks": 16, "ms": _spread(12.5)}]}
    (results / "cuda_h200.json").write_text(json.dumps(cuda))
    return results


def test_ratios_read_the_same_way_and_behind_is_said(render: Any, tmp_path: Path) -> None:
    results = _write_results(tmp_path)
    text = render.render(results, tmp_path / "notes", tmp_path / "img")
    assert "| store, 1 chunk (32 MiB) | 15.00 ms | 10.00 ms | **1.50x** |" in text
    assert (
        "| retrieve, fresh tensor, 4 chunks (128 MiB) | 80.00 ms | 100.00 ms | 0.80x **(behind)** |" in text
    )
    assert "* single_shm: retrieve, fresh tensor, 4 chunks (128 MiB) at 0.80x\n" in text
    assert render.WHY_PLACEHOLDER.format(key="single_shm") in text
    # a full-profile run on an idle machine is not flagged as a sample
    assert "Sample figures" not in text
    assert "Not measured in this run (`.venv/bin/python -m benchmarks.suite.bench_concurrent`)." in text
    assert (
        "| every single-operation case ≥ 1.0x the SDK (shm, server 0.5.6) | worst: retrieve 4 chunk(s) 0.80x | **not met** |"
        in text
    )


def test_notes_are_placed_in_their_section_and_replace_the_placeholder(render: Any, tmp_path: Path) -> None:
    results = _write_results(tmp_path)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "single_shm.md").write_text("Because the 4-chunk retrieve allocates twice.\n")
    (notes / "rtt.md").write_text("RTT notes.\n")
    text = render.render(results, notes, tmp_path / "img")
    assert (
        "at 0.80x.\n\nBecause the 4-chunk retrieve allocates twice.\n\n## Single operations, pickle" in text
    )
    assert render.WHY_PLACEHOLDER.format(key="single_shm") not in text
    # the rtt section is not measured: its notes stay, under its "not measured" line
    assert (
        "Not measured in this run (`.venv/bin/python -m benchmarks.suite.bench_rtt`).\n\nRTT notes.\n" in text
    )
    assert text.count("<!--") == 1  # the "generated" header, nothing kept from an earlier page


def test_the_same_results_and_notes_render_the_same_page_and_unused_notes_are_named(
    render: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = _write_results(tmp_path)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "single_shm-0.5.7.md").write_text("No 0.5.7 results in this run.\n")
    text = render.render(results, notes, tmp_path / "img")
    assert render.render(results, notes, tmp_path / "img") == text
    assert "No 0.5.7 results" not in text
    assert "notes not on the page (no such section): single_shm-0.5.7\n" in capsys.readouterr().err


def test_quick_profile_is_marked_as_a_sample(render: Any, tmp_path: Path) -> None:
    results = _write_results(tmp_path)
    doc = json.loads((results / "single_shm.json").read_text())
    doc["stamp"]["profile"] = "quick"
    (results / "single_shm.json").write_text(json.dumps(doc))
    text = render.render(results, tmp_path / "notes", tmp_path / "img")
    assert "> **Sample figures, not for publication.** 1 of the sections below" in text


def test_gpu_json_is_rendered_as_tables(render: Any, tmp_path: Path) -> None:
    results = _write_results(tmp_path)
    text = render.render(results, tmp_path / "notes", tmp_path / "img")
    gpu = text[text.index("## GPU") :]
    assert "### `cuda_h200.json`" in gpu
    assert "| device | GPU X |" in gpu
    assert "| case | chunks | ms |\n|---|---|---|\n| retrieve_out | 16 | 12.5 (12.5-12.5) |" in gpu


def test_every_import_in_benchmarks_resolves_from_the_repo_root() -> None:
    """benchmarks/ is a package run as ``python -m benchmarks.X`` with no sys.path edits:
    every import in it, also one inside a function (the suite imports the renderer only
    at the end of a run), names a module importable from the repository root."""
    import ast
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    missing = []
    siblings = {p.stem for p in (root / "benchmarks").rglob("*.py")}
    # (third-party imports are not checked: matplotlib is only in the bench extra)
    for path in sorted((root / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [(a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [(node.module, node.lineno)]
            else:
                continue
            for name, line in names:
                top = name.split(".")[0]
                # a sibling imported by its bare name only works through a sys.path edit
                # (benchmarks/harness.py's name is also the repository root's harness/)
                bare_sibling = top in siblings and not (root / top / "__init__.py").is_file()
                unresolved = (
                    top in ("benchmarks", "harness", "tests", "lmcache_async")
                    and importlib.util.find_spec(name) is None
                )
                if bare_sibling or unresolved:
                    missing.append(f"{path.name}:{line} {name}")
    assert missing == []


def test_bench_cuda_json_is_summarised_against_the_link_and_the_sdk(render: Any, tmp_path: Path) -> None:
    results = _write_results(tmp_path)

    def fig(gbps: float, ms: float) -> dict[str, float]:
        return {"median_s": ms / 1e3, "gbps": gbps, "min_s": ms / 1e3, "max_s": ms / 1e3}

    size = {
        "bytes": 16 << 25,
        "raw_pinned_d2h": fig(50.0, 10.0),
        "raw_pinned_h2d": fig(40.0, 12.5),
        "shm_pinned_store": fig(40.0, 12.5),
        "shm_pinned_retrieve_out": fig(30.0, 16.7),
        "shm_pinned_store__copy_part": fig(49.0, 10.2),
        "sdk_store": fig(2.0, 250.0),
        "sdk_retrieve": fig(6.0, 83.0),
        "pickle_store": fig(0.3, 1600.0),
    }
    (results / "cuda_h200.json").write_text(json.dumps({"device": "GPU X", "chunks16": size}))
    text = render.render(results, tmp_path / "notes", tmp_path / "img")
    gpu = text[text.index("## GPU") :]
    assert "| device | GPU X |" in gpu
    assert "| 16 chunks (512 MiB) | store from CUDA | retrieve into CUDA `out=` |" in gpu
    assert (
        "| **lmcache_async, SHM, pinned pool: whole call** | 40.0 GB/s, 12.50 ms = 80% of the link, "
        "20.0x the SDK's path | 30.0 GB/s, 16.70 ms = 75% of the link, 5.0x the SDK's path |"
    ) in gpu
    assert "| lmcache_async, the copy phase of those calls | 49.0 GB/s, 10.20 ms |  |" in gpu
    assert (
        "| the SDK's path, emulated (`kv.cpu()` / `.cuda()`) | 2.0 GB/s, 250.00 ms | 6.0 GB/s, 83.00 ms |"
        in gpu
    )
    assert "not comparable with the rows above) | 0.3 GB/s, 1600.00 ms |  |" in gpu
    assert "pageable" not in gpu  # no figures, no row


QUALITY_JSON = Path(__file__).resolve().parents[1] / "results" / "0.1.0" / "quality.json"


def _quality_doc() -> dict[str, Any]:
    """The published quality.json in the current shape: a token F1 per method (distinct
    synthetic values, so the test holds whichever run published the file), the targets
    without greedy agreement, the verdict's F1."""
    doc: dict[str, Any] = json.loads(QUALITY_JSON.read_text())
    res = doc["result"]
    f1 = iter(range(100))
    for table in [
        *res["quality"]["by_protocol"].values(),
        res["quality"]["methods"],
        res["heldout"]["methods"],
    ]:
        for name, m in table.items():
            m["token_f1"] = 1.0 if name == "full" else round(0.5 + next(f1) / 100, 4)
    res["targets"] = {"accuracy_points_below_full": 2.0, "ttft_ratio_2k": 0.4}
    res["verdict"].pop("greedy_agreement_met", None)
    res["verdict"]["token_f1"] = res["heldout"]["methods"][res["heldout"]["method"]]["token_f1"]
    return doc


def test_the_quality_section_renders_its_tables_the_targets_and_the_published_figures(
    render: Any, tmp_path: Path
) -> None:
    results = _write_results(tmp_path)
    text = render.render(results, tmp_path / "notes", tmp_path / "img")
    assert f"Not measured in this run (`{render.COMMANDS['quality']}`)." in text
    doc = _quality_doc()
    (results / "quality.json").write_text(json.dumps(doc))
    text = render.render(results, tmp_path / "notes", tmp_path / "img")
    assert "\n## Composed prompts on a trained model: quality and time to first token\n" in text
    q = doc["result"]["quality"]
    assert f"greedy answers of up to {q['new_tokens']} tokens." in text
    for protocol, where in (("alone", "alone at position 0"), ("prefix", "behind the system prompt")):
        for name, how in (("blend_0.15", "KV deviation"), ("query_0.15", "the question's attention")):
            m = q["by_protocol"][protocol][name]
            row = (
                f"| selective repair 15 %, by {how} (`compose_and_blend`) | {where} | "
                f"{m['recomputed_share'] * 100:.1f} % | {m['accuracy']:.2f} | {m['token_f1']:.2f} | "
                f"{m['greedy_agreement']:.2f} | {m['first_token_agreement']:.2f} | {m['kl_mean']:.3f} |"
            )
            assert row in text
    m = q["by_protocol"]["alone"]["floor_noise0.01"]
    assert (
        f"| noise floor: the full prefill's KV + Gaussian noise of 1 % of its std | - | 0.0 % | "
        f"{m['accuracy']:.2f} | {m['token_f1']:.2f} | {m['greedy_agreement']:.2f} |"
    ) in text
    assert "| accuracy | token F1 to full | greedy agreement | first-token agreement |" in text
    assert "| noise floor: the full prefill's KV rounded to bfloat16 | - | 0.0 % |" in text
    full = q["by_protocol"]["alone"]["full"]
    assert f"| full prefill | - | 100.0 % | {full['accuracy']:.2f} | 1.00 | 1.00 | 1.00 | 0.000 |" in text
    assert text.count("| full prefill | - |") == 1
    assert "selective repair 0 %" not in text  # bitwise the plain composition: one row
    t = doc["result"]["ttft"]["2048"]
    assert f"| {t['prompt_tokens']} ({t['documents']} documents) | {t['ms']['full']:.0f} ms |" in text
    v = doc["result"]["verdict"]
    assert "greedy agreement >=" not in text  # reported, not a target: in neither target table
    met = "met" if v["accuracy_met"] else "**not met**"
    assert (
        "| composed prompts, <= 15 % recomputed: accuracy within 2 points of full | "
        f"{v['accuracy_points_below_full']:g} points below | {met} |"
    ) in text
    assert (
        f"Reported beside, not targets: token F1 to the full prefill's answers {v['token_f1']:.2f}, "
        f"greedy agreement {v['greedy_agreement'] * 100:.0f} %"
    ) in text
    dev = q["by_protocol"][v["protocol"]][v["method"]]
    assert (
        f"there, token F1 {dev['token_f1']:.2f} and greedy agreement {v['dev_greedy_agreement'] * 100:.0f} %"
        in text
    )
    assert "| CacheBlend (Yao et al., EuroSys 2025) |" in text and "| EPIC (Hu et al., ICML 2025) |" in text
    assert render.render(results, tmp_path / "notes", tmp_path / "img") == text


def test_a_quality_result_measured_before_the_token_f1_renders_a_dash_in_its_column(render: Any) -> None:
    doc = _quality_doc()
    res = doc["result"]
    for table in [
        *res["quality"]["by_protocol"].values(),
        res["quality"]["methods"],
        res["heldout"]["methods"],
    ]:
        for m in table.values():
            del m["token_f1"]
    del res["verdict"]["token_f1"]
    text = render.quality_tables(doc)
    full = res["quality"]["by_protocol"]["alone"]["full"]
    assert f"| full prefill | - | 100.0 % | {full['accuracy']:.2f} | - | 1.00 | 1.00 | 0.000 |" in text
    assert "Reported beside, not targets: token F1 to the full prefill's answers -, greedy agreement" in text


def test_the_guide_block_between_the_quality_markers_is_replaced_and_nothing_else(
    render: Any, tmp_path: Path
) -> None:
    doc = _quality_doc()
    guide = tmp_path / "guide.md"
    before, after = "# Guide\n\nText before.\n\n", "\n\nText after.\n"
    guide.write_text(f"{before}{render.QUALITY_BEGIN}\nold table\n{render.QUALITY_END}{after}")
    assert render.write_guide_tables(doc, guide) is True
    text = guide.read_text()
    assert (
        text == f"{before}{render.QUALITY_BEGIN}\n\n{render.quality_tables(doc)}\n{render.QUALITY_END}{after}"
    )
    assert "old table" not in text
    assert render.write_guide_tables(doc, guide) is True and guide.read_text() == text  # again: the same
    assert render.write_guide_tables(None, guide) is False and guide.read_text() == text
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    assert render.write_guide_tables(doc, plain) is False and plain.read_text() == "no markers\n"


def test_the_suite_runs_the_quality_section_without_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    run = importlib.import_module("benchmarks.suite.run")
    bench_quality = importlib.import_module("benchmarks.suite.bench_quality")
    assert "quality" in run.ALL_SECTIONS and "quality" not in run.SHM_SECTIONS
    calls: list[dict[str, Any]] = []

    def section(**kw: Any) -> dict[str, Any]:
        calls.append(kw)
        return {"ok": True}

    monkeypatch.setattr(bench_quality, "section", section)
    for profile in ("quick", "full"):
        prof = run.PROFILES[profile]
        assert run._run_section("quality", None, None, Path("python"), prof, "0.5.6") == {"ok": True}
    assert calls == [run.PROFILES["quick"]["quality"], run.PROFILES["full"]["quality"]]
    assert calls[1] == {"sets": 50, "new_tokens": 16, "contexts": [1024, 2048, 4096], "reps": 2}


def _ms(x: float) -> dict[str, float]:
    return {"median_ms": x, "min_ms": x, "max_ms": x, "n": 3}


def test_gpu_serving_json_is_rendered_with_its_targets(render: Any, tmp_path: Path) -> None:
    results = _write_results(tmp_path)
    serving = {
        "card": "NVIDIA H100 80GB HBM3",
        "reps": 3,
        "prompts": {
            "2048": {"kv_bytes": 268435456, "full": _ms(60.0), "hf": _ms(33.0), "raw": _ms(31.0),
                     "limit": _ms(30.0), "hf_over_limit": 1.1, "hf_over_full": 0.55},
            "8192": {"kv_bytes": 1073741824, "full": _ms(260.0), "hf": _ms(72.0), "raw": _ms(70.0),
                     "limit": _ms(60.0), "hf_over_limit": 1.2, "hf_over_full": 72 / 260},
        },
        "compose": {
            "8192x4": {"context": 8192, "documents": 4, "target_tokens": 8208, "full": _ms(260.0),
                       "plain": {**_ms(70.0), "over_full": 70 / 260},
                       "deviation_15": {**_ms(140.0), "over_full": 140 / 260},
                       "query_15": {**_ms(120.0), "over_full": 120 / 260}},
        },
    }  # fmt: skip
    (results / "cuda_serving_h100.json").write_text(json.dumps(serving))
    text = render.render(results, tmp_path / "notes", tmp_path / "img")
    gpu = text[text.index("## GPU") :]
    assert (
        "### Serving from the cache against recomputing, NVIDIA H100 80GB HBM3 (`cuda_serving_h100.json`)"
        in gpu
    )
    assert "| 2,048 | 60.0 | **33.0** | 31.0 | 30.0 | 1.10x | 0.55x |" in gpu
    assert "| 8,208 | 4 | 260 | 70 (0.27x) | 140 (0.54x) | 120 (0.46x) |" in gpu
    head = text[: text.index("## GPU")]
    card = "GPU (NVIDIA H100 80GB HBM3)"
    assert (
        f"| {card}: a cached prompt through `hf` <= 1.15x the limit at every context from 2k | at most 1.20x | **not met** |"
        in head
    )
    assert (
        f"| {card}: composed prompt, 15 % recomputed, <= 0.5x the full prefill at 8k | 0.46x (worst of 4 and 8 documents, the faster selection) | met |"
        in head
    )
    assert (
        f"| {card}: composed prompt, 15 % recomputed, <= 0.35x the full prefill at 32k | - | not measured |"
        in head
    )
    assert (
        f"| {card}: composed prompt, plain composition, <= 0.3x the full prefill at 8k | 0.27x (worst of 4 and 8 documents) | met |"
        in head
    )
