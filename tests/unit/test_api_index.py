"""The hand-kept lists of the public surface agree with the code.

* ``docs/api/index.md``'s table of the names importable from the package lists exactly
  ``lmcache_async._EXPORTS``, each name in the row of its home module and linked there;
* its table of modules, ``mkdocs.yml``'s API nav and ``docs/api/`` hold one page per public
  module (a top-level module or subpackage whose name has no leading ``_``);
* the package docstring names every public module.
"""

from __future__ import annotations

import re
from pathlib import Path

import lmcache_async

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lmcache_async"
INDEX = ROOT / "docs" / "api" / "index.md"


def public_modules() -> set[str]:
    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}
    packages = {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and not p.name.startswith("_")
    }
    return modules | packages


def names_table() -> list[tuple[str, str]]:
    """The rows of the names table: (module cell, names cell)."""
    text = INDEX.read_text()
    block = text[text.index("These names are importable from the package") :]
    rows = []
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and cells[0] not in ("module", "---"):
            rows.append((cells[0], cells[1]))
    return rows


def test_the_names_table_lists_exactly_the_exports_each_in_its_home_row() -> None:
    listed: list[str] = []
    for module_cell, names_cell in names_table():
        if module_cell == "(the package)":
            home = "lmcache_async._version"
            names = re.findall(r"`([^`\]]+)`", names_cell)
        else:
            home = "lmcache_async." + module_cell.strip("`")
            links = re.findall(r"\[`([^`]+)`\]\[([^\]]+)\]", names_cell)
            assert all(target == f"{home}.{name}" for name, target in links), links
            names = [name for name, _ in links]
        assert all(lmcache_async._HOME.get(name) == home for name in names), (module_cell, names)
        listed += names
    assert sorted(listed) == sorted(set(listed)), "a name is listed twice"
    assert set(listed) == set(lmcache_async._HOME)


def test_every_public_module_has_an_api_page_a_nav_entry_and_an_index_row() -> None:
    modules = public_modules()
    pages = {p.stem for p in (ROOT / "docs" / "api").glob("*.md")} - {"index"}
    assert modules <= pages
    nav = (ROOT / "mkdocs.yml").read_text()
    index = INDEX.read_text()
    for module in modules:
        assert f"- lmcache_async.{module}: api/{module}.md" in nav, module
        assert f"| [`lmcache_async.{module}`]({module}.md) |" in index, module
        assert (ROOT / "docs" / "api" / f"{module}.md").read_text().startswith(f"::: lmcache_async.{module}")


def test_the_package_docstring_names_every_public_module() -> None:
    doc = lmcache_async.__doc__ or ""
    passage = doc[doc.index("The public modules are") :]
    named = set(re.findall(r"``([a-z_]+)``", passage[: passage.index(";")]))
    assert named == public_modules()
