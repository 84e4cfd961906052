"""benchmarks/suite/bench_compose.py runs end to end (tiny geometry, embedded server), and
its CUDA case skips cleanly where there is no CUDA. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.suite import bench_compose


def test_the_cpu_case_runs_on_an_embedded_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench_compose.main(["--embedded", "--layers", "1", "--iters", "1", "--transfer", "pickle", "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert (result["case"], result["transfer"], result["target_chunks"], result["iters"]) == (
        "cpu",
        "pickle",
        16,
        1,
    )
    assert set(result["seconds"]) == {"remap", "rotation", "compose"}
    assert result["remap_plus_rotation_over_compose"]["n"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
def test_the_cuda_case_skips_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_compose.main(["--cuda"]) == 0
    assert "CUDA is not available here; nothing measured" in capsys.readouterr().err
