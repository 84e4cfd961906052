"""Packaging metadata: the licence as PEP 639 declares it, and what the sdist ships.

Building an sdist needs the build backend from an index (build isolation), so these
tests read the configuration instead; building it by hand:
``python -m build --sdist`` (in a venv that has ``build``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tomllib
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt, unmodified.
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def _pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def test_license_is_an_spdx_expression_with_its_file() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    # the deprecated trove classifier may not accompany an SPDX expression
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_license_file_is_the_apache_2_text() -> None:
    text = (ROOT / "LICENSE").read_bytes()
    assert text.startswith(b"\n                                 Apache License\n")
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256


def test_build_backend_understands_spdx_licenses() -> None:
    # setuptools reads `license = "<SPDX>"` and `license-files` from 77.0.0 on (PEP
    # 639); 77.0.3 fixed its first releases' regressions. Older ones reject the string.
    system = _pyproject()["build-system"]
    assert system["build-backend"] == "setuptools.build_meta"
    (setuptools,) = [r for r in map(Requirement, system["requires"]) if r.name == "setuptools"]
    assert not setuptools.specifier.contains("77.0.2")
    assert setuptools.specifier.contains("77.0.3")


def test_sdist_ships_the_docs_and_the_whole_test_tree() -> None:
    # setuptools alone ships only tests/test*.py (none: the tests live in tests/<kind>/),
    # no docs/ and no harness/; MANIFEST.in adds the three trees whole.
    commands = [
        line.split()
        for line in (ROOT / "MANIFEST.in").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert ["graft", "docs"] in commands
    assert ["graft", "tests"] in commands
    assert ["graft", "harness"] in commands
    removing = [c for c in commands if c[0] in {"prune", "exclude", "recursive-exclude", "global-exclude"}]
    assert removing == [["global-exclude", "*.py[cod]"]]
    assert (ROOT / "docs" / "internals" / "compatibility.md").is_file()
    assert (ROOT / "harness" / "real_server.py").is_file()


# ---- harness/build_lmcache_venv.sh: what a build prints -----------------------

BUILD_SCRIPT = ROOT / "harness" / "build_lmcache_venv.sh"
# pip's conflict report after the server dependencies' install, as a 0.5.6 build prints
# it (20 such lines in all): lmcache's dependencies that step 2's --no-deps left out.
RESOLVER_HEADER = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages "
    "that are installed. This behaviour is the source of the following dependency conflicts."
)
SKIPPED_DEPS = [
    "lmcache 0.5.6 requires aiofile, which is not installed.",
    "lmcache 0.5.6 requires cupy-cuda13x, which is not installed.",
    'lmcache 0.5.6 requires grpcio-observability==1.78.0; platform_system == "Linux", which is not installed.',
]
# A base interpreter whose `-m venv DIR` makes a "venv" with this script as its python,
# which succeeds silently except for the server dependencies' install (the pip call that
# names fastapi): that one prints $FAKE_PIP_OUTPUT on stderr and exits $FAKE_PIP_RC.
FAKE_PYTHON = """#!/usr/bin/env bash
if [[ "$1 $2" == "-m venv" ]]; then
    mkdir -p "$3/bin" && touch "$3/pyvenv.cfg" "$3/bin/lmcache" && cp "$0" "$3/bin/python"
    exec chmod +x "$3/bin/lmcache"
fi
if [[ " $* " == *" fastapi "* ]]; then
    echo "$FAKE_PIP_OUTPUT" >&2
    exit "$FAKE_PIP_RC"
fi
"""


def _build_with_fake_pip(
    tmp_path: Path, pip_output: list[str], pip_rc: int = 0
) -> tuple[int, list[str], str]:
    """Runs the build script for 0.5.6 into ``tmp_path/venv`` with the fake interpreter;
    returns its exit status, its stderr lines and the last line of its stdout."""
    base = tmp_path / "python3"
    base.write_text(FAKE_PYTHON)
    base.chmod(0o755)
    env = {
        **os.environ,
        "LMCACHE_VENV": str(tmp_path / "venv"),
        "LMCACHE_BASE_PYTHON": str(base),
        "TMPDIR": str(tmp_path),  # the script's lock file
        "FAKE_PIP_OUTPUT": "\n".join(pip_output),
        "FAKE_PIP_RC": str(pip_rc),
    }
    env.pop("LMCACHE_GENERATION", None)
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    stdout = proc.stdout.splitlines()
    return proc.returncode, proc.stderr.splitlines(), stdout[-1] if stdout else ""


SKIPPED_NOTE = (
    "build_lmcache_venv.sh: pip reports 3 dependencies of lmcache 0.5.6 as not installed: "
    "expected, they are left out on purpose (CUDA and optional packages that the server and SDK "
    "do not need on CPU)"
)


def test_build_script_folds_the_report_of_lmcaches_skipped_dependencies(tmp_path: Path) -> None:
    rc, stderr, python = _build_with_fake_pip(tmp_path, [RESOLVER_HEADER, *SKIPPED_DEPS])
    assert rc == 0
    assert python == str(tmp_path / "venv" / "bin" / "python")
    assert stderr == [
        f"build_lmcache_venv.sh: building the lmcache 0.5.6 venv at {tmp_path / 'venv'}",
        "build_lmcache_venv.sh: pip install torch==2.13.0",
        "build_lmcache_venv.sh: pip install --no-deps lmcache==0.5.6",
        "build_lmcache_venv.sh: pip install server dependencies",
        SKIPPED_NOTE,
        stderr[-1],
    ]
    assert stderr[-1].startswith("build_lmcache_venv.sh: done in ")


def test_build_script_keeps_every_other_conflict_and_line(tmp_path: Path) -> None:
    incompatible = "lmcache 0.5.6 requires numpy<=2.2.6, but you have numpy 2.3.0 which is incompatible."
    other_missing = "torch 2.13.0 requires sympy>=1.13.3, which is not installed."
    rc, stderr, _ = _build_with_fake_pip(
        tmp_path,
        ["Some pip notice", RESOLVER_HEADER, SKIPPED_DEPS[0], incompatible, SKIPPED_DEPS[1], other_missing],
    )
    assert rc == 0
    assert stderr[3:9] == [
        "build_lmcache_venv.sh: pip install server dependencies",
        "Some pip notice",
        RESOLVER_HEADER,
        incompatible,
        other_missing,
        SKIPPED_NOTE.replace("reports 3", "reports 2"),
    ]


def test_build_script_fails_with_pips_errors_shown(tmp_path: Path) -> None:
    errors = [
        "ERROR: Could not find a version that satisfies the requirement fastapi==99 (from versions: none)",
        "ERROR: No matching distribution found for fastapi==99",
    ]
    rc, stderr, python = _build_with_fake_pip(tmp_path, errors, pip_rc=1)
    assert rc == 1
    assert python == ""
    assert stderr[3:6] == ["build_lmcache_venv.sh: pip install server dependencies", *errors]
    assert stderr[6].startswith(
        "build_lmcache_venv.sh: ERROR: pip install server dependencies failed (command: "
    )
    assert len(stderr) == 7
    assert not (tmp_path / "venv" / ".lmcache_async_stamp").exists()
