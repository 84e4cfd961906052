"""Packaging metadata: the licence as PEP 639 declares it, and what the sdist ships.

Building an sdist needs the build backend from an index (build isolation), so these
tests read the configuration instead; building it by hand:
``python -m build --sdist`` (in a venv that has ``build``).
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
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
    # setuptools alone ships tests/test*.py (not conftest.py or tests/support/) and no
    # docs/; MANIFEST.in adds both trees whole.
    commands = [
        line.split()
        for line in (ROOT / "MANIFEST.in").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert ["graft", "docs"] in commands
    assert ["graft", "tests"] in commands
    removing = [c for c in commands if c[0] in {"prune", "exclude", "recursive-exclude", "global-exclude"}]
    assert removing == [["global-exclude", "*.py[cod]"]]
    assert (ROOT / "docs" / "compatibility.md").is_file()
    assert (ROOT / "tests" / "support" / "real_server.py").is_file()
