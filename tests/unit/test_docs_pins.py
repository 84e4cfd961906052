"""The documentation build's versions are pinned whole, and its targets run it.

`make docs` (which `make test`, hence CI, and `make check` run) builds the site with
``--strict``: a new griffe or mkdocstrings-python that reads a docstring differently turns a
green tree red (issue 30: four griffe warnings broke a clean clone's build). So every
distribution that the ``docs`` extra resolves is pinned exactly in ``constraints/tools.txt``.
The resolution is read from the installed metadata, so this test runs where the docs extra is
installed (`make test` installs it before pytest) and is skipped elsewhere.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints" / "tools.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints/tools.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = version
    return pins


def _docs_extra() -> list[Requirement]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    return [Requirement(r) for r in extras["docs"]]


def _resolved(roots: list[Requirement]) -> dict[str, str]:
    """Name -> installed version of each distribution the requirements pull in, transitively."""
    seen: dict[str, str] = {}
    todo = [(r.name, set(r.extras)) for r in roots]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen:
            continue
        dist = md.distribution(name)
        seen[key] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((req.name, set(req.extras)))
    return seen


def test_the_docs_extra_is_what_the_build_needs() -> None:
    names: dict[str, Requirement] = {str(canonicalize_name(r.name)): r for r in _docs_extra()}
    assert set(names) == {"mkdocs", "mkdocstrings"}
    assert names["mkdocstrings"].extras == {"python"}


def test_every_distribution_of_the_docs_build_is_pinned_at_its_installed_version() -> None:
    try:
        resolved = _resolved(_docs_extra())
    except md.PackageNotFoundError as e:
        pytest.skip(f"the docs extra is not installed ({e}): `make docs` installs it")
    pins = _pins()
    # the parts whose versions change how a page renders, named so the test cannot pass empty
    for core in ("mkdocs", "mkdocstrings", "mkdocstrings-python", "griffelib", "mkdocs-autorefs"):
        assert core in resolved
    unpinned = sorted(n for n in resolved if n not in pins)
    assert unpinned == [], f"pin these in constraints/tools.txt: {unpinned}"
    moved = {n: (pins[n], v) for n, v in resolved.items() if pins[n] != v}
    assert moved == {}, f"installed versions differ from the pins (pin, installed): {moved}"


def test_make_test_and_make_check_build_the_docs_strictly() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in ("test", "check"):
        deps = re.search(rf"^{target}:(.*)$", makefile, re.M)
        assert deps is not None and "docs" in deps.group(1).split(), target
    assert re.search(r"^docs:.*\n\t\$\(BIN\)/mkdocs build --strict ", makefile, re.M)
    assert (ROOT / ".ci" / "run").read_text().splitlines()[-1] == "make test"


def test_the_demo_needs_only_the_package() -> None:
    """`make demo` installs the package alone (issue 30: the test extra was 1.9 GB)."""
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"^demo: (.*)$", makefile, re.M)
    assert demo is not None and demo.group(1).split() == ["$(BASE_STAMP)"]
    base = re.search(r"^\$\(BASE_STAMP\):.*\n((?:\t.*\n)+)", makefile, re.M)
    assert base is not None
    assert "$(FAST) -c $(TOOLS) -e . $(TORCH)" in base.group(1)
    assert "[test" not in base.group(1)


def test_contributing_lists_every_make_target() -> None:
    """CONTRIBUTING's table of `make` targets names exactly the Makefile's .PHONY targets."""
    phony = re.search(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert phony is not None
    listed = re.findall(r"^\| `make ([a-z-]+)` \|", (ROOT / "CONTRIBUTING.md").read_text(), re.M)
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(phony.group(1).split())
