"""The scheduler examples in examples/: the Kubernetes Indexed Job manifest and the Slurm
array script are parsed, the command each runs is lmcache-async's own parser's
``remap-batch --shard auto``, every task gets its own shard, and the command is the one
docs/guides/deployment.md shows."""

from __future__ import annotations

import re
import shlex
import shutil
import string
import subprocess

import pytest
import yaml

from harness.real_server import REPO_ROOT
from lmcache_async.cli import build_parser
from lmcache_async.cli.sharding import SHARD_COUNT_VAR, AutoShard, Shard, shard_from_env

MANIFEST = REPO_ROOT / "examples" / "k8s-indexed-job.yaml"
SLURM = REPO_ROOT / "examples" / "slurm-array.sh"
RAY = REPO_ROOT / "examples" / "ray_remap.py"
GUIDE = REPO_ROOT / "docs" / "guides" / "deployment.md"


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in a container's command."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def test_kubernetes_indexed_job_runs_one_shard_per_index() -> None:
    job = yaml.safe_load(MANIFEST.read_text())
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    count = spec["completions"]
    assert count == spec["parallelism"] == 4
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env[SHARD_COUNT_VAR]["value"] == str(count)  # the count Kubernetes does not export
    assert env["HOST_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    command: list[str] = container["command"]
    assert command[:2] == ["lmcache-async", "remap-batch"]

    shards = []
    for index in range(count):
        pod_env = {"JOB_COMPLETION_INDEX": str(index), SHARD_COUNT_VAR: str(count), "HOST_IP": "10.0.0.5"}
        args = build_parser().parse_args([k8s_expand(c, pod_env) for c in command[1:]])
        assert (args.command, args.shard, args.resume, args.json) == ("remap-batch", AutoShard(), True, True)
        assert (args.url, args.http_url) == ("tcp://10.0.0.5:5555", "http://10.0.0.5:8080")
        assert str(args.report) == f"/data/reports/report-{index}.jsonl"
        shard, source = shard_from_env(pod_env)
        assert source == f"{shard} from Kubernetes Indexed Job (JOB_COMPLETION_INDEX)"
        shards.append(shard)
    assert shards == [Shard(i, count) for i in range(1, count + 1)]
    # The guide shows this exact command.
    assert shlex.join(command) in GUIDE.read_text()


def slurm_script() -> tuple[dict[str, str], list[str]]:
    """The ``#SBATCH`` options and the ``srun`` command of the Slurm example."""
    options: dict[str, str] = {}
    srun: list[str] = []
    for line in SLURM.read_text().splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            options[key] = value
        elif line.startswith("srun "):
            srun = shlex.split(line)[1:]
    return options, srun


def test_slurm_array_runs_one_shard_per_task() -> None:
    if shutil.which("bash"):
        check = subprocess.run(["bash", "-n", str(SLURM)], capture_output=True, text=True, check=False)
        assert (check.returncode, check.stderr) == (0, "")
    options, srun = slurm_script()
    low, high = (int(x) for x in options["--array"].split("-"))
    assert (low, high) == (0, 3)
    assert srun[:2] == ["lmcache-async", "remap-batch"]
    shards = []
    for task in range(low, high + 1):
        env = {
            "SLURM_ARRAY_TASK_ID": str(task),
            "SLURM_ARRAY_TASK_MIN": str(low),
            "SLURM_ARRAY_TASK_MAX": str(high),
            "SLURM_ARRAY_TASK_COUNT": str(high - low + 1),
        }
        argv = [string.Template(a).substitute(env) for a in srun[1:]]
        args = build_parser().parse_args(argv)
        assert (args.command, args.shard, args.resume) == ("remap-batch", AutoShard(), True)
        assert str(args.report) == f"reports/report-{task}.jsonl"
        shards.append(shard_from_env(env)[0])
    assert shards == [Shard(i, 4) for i in range(1, 5)]
    line = next(ln for ln in SLURM.read_text().splitlines() if ln.startswith("srun "))
    assert line in GUIDE.read_text()


def test_ray_example_arguments() -> None:
    """The Ray script's command line (running it needs a cluster: the Ray tests of
    tests/system/test_multi_host.py run what it calls)."""
    pytest.importorskip("ray")
    text = "10.0.0.5=tcp://10.0.0.5:5555,http://10.0.0.5:8080"
    expected = ("10.0.0.5", ("tcp://10.0.0.5:5555", "http://10.0.0.5:8080"))
    import importlib.util

    spec = importlib.util.spec_from_file_location("ray_remap_example", RAY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_server(text) == expected
    args = module.build_parser().parse_args(
        [
            "pairs.jsonl",
            "--model-name",
            "m",
            "--output",
            "out/run-2",
            "--resume-from",
            "out/run-1",
            "--server",
            text,
        ]
    )
    assert (args.server, args.resume_from, args.actors, args.batch_size) == (
        [expected],
        ["out/run-1"],
        2,
        256,
    )
    with pytest.raises(SystemExit):
        module.build_parser().parse_args(["p", "--model-name", "m", "--output", "o", "--server", "10.0.0.5"])
