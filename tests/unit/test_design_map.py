"""The internals map (the layer table at the top of ``docs/internals/design.md``) is the
import contract and the tree: every module of ``lmcache_async`` once, the layers in the
order of ``[tool.importlinter]``'s ``layers`` contract, no name that is not in the tree.

The rule of the table: its second column names modules in backticks, without the
``lmcache_async.`` prefix; a top-level module by its name (``_wire``), a subpackage as a
whole with a trailing slash (``_ops/``), its modules described in the third column only.
A row whose first column is a number is that layer of the contract (1 = the top); a row
marked ``—`` holds the modules outside the layers (the package itself, ``testing/``).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lmcache_async"
DESIGN = ROOT / "docs" / "internals" / "design.md"


def tree() -> set[str]:
    """The names the table must hold: top-level modules, and subpackages as ``name/``."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    packages = {f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    return modules | packages


def rows_of(head: str) -> list[tuple[str, list[str]]]:
    """A table's rows: (first column, the module names of the second), in order."""
    rows = []
    for line in head.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or cells[0] in ("layer", "---"):
            continue
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return rows


def table() -> list[tuple[str, list[str]]]:
    """The map's rows (the first table of the page, above the tiers' own)."""
    text = DESIGN.read_text()
    return rows_of(text[: text.index("\n### ")])


def tier_tables() -> dict[str, list[tuple[str, list[str]]]]:
    """Each private tier's table (``### `_engine/` ``, ...), by the tier's name."""
    text = DESIGN.read_text()
    head = text[text.index("\n### ") : text.index("\n## ")]
    parts = re.split(r"^### `([^`]+)/`$", head, flags=re.MULTILINE)
    return {name: rows_of(body) for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def tier_tree(tier: str) -> set[str]:
    folder = PACKAGE / tier
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    return modules | {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()}


def contract_layers() -> list[set[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    names = tree()
    layers = []
    for layer in contract["layers"]:
        row = set()
        for dotted in layer.split("|"):
            name = dotted.strip().removeprefix("lmcache_async.")
            row.add(f"{name}/" if f"{name}/" in names else name)
        layers.append(row)
    return layers


def test_each_tier_table_is_its_contract_top_to_bottom() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = {
        c["containers"][0].removeprefix("lmcache_async."): c["layers"]
        for c in config["tool"]["importlinter"]["contracts"]
        if "containers" in c
    }
    tables = tier_tables()
    assert (
        sorted(tables)
        == sorted(contracts)
        == sorted(n.rstrip("/") for n in tree() if n.startswith("_") and n.endswith("/"))
    )
    for tier, rows in tables.items():
        names = tier_tree(tier)
        expected = [
            {f"{m.strip()}/" if f"{m.strip()}/" in names else m.strip() for m in layer.split("|")}
            for layer in contracts[tier]
        ]
        assert [first for first, _ in rows] == [str(i) for i in range(1, len(rows) + 1)], tier
        assert [set(listed) for _, listed in rows] == expected, tier
        assert set().union(*expected) == names, tier


def test_the_map_has_rows() -> None:
    rows = table()
    assert len(rows) == len(contract_layers()) + 2
    assert all(names for _, names in rows)


def test_every_module_appears_exactly_once() -> None:
    listed = [name for _, names in table() for name in names]
    assert sorted(listed) == sorted(set(listed)), "a module is listed twice"
    assert set(listed) == tree()


def test_the_layers_are_the_import_contract_top_to_bottom() -> None:
    rows = table()
    numbered = [(first, set(names)) for first, names in rows if first.isdigit()]
    assert [int(first) for first, _ in numbered] == list(range(1, len(numbered) + 1))
    assert [names for _, names in numbered] == contract_layers()


def test_the_rows_outside_the_layers_hold_exactly_the_modules_outside_the_contract() -> None:
    outside = {name for first, names in table() if not first.isdigit() for name in names}
    in_layers = set().union(*contract_layers())
    assert outside == tree() - in_layers
    assert {first for first, _ in table() if not first.isdigit()} == {"—"}


def test_no_name_in_the_map_is_missing_from_the_tree() -> None:
    stale = {name for _, names in table() for name in names} - tree()
    assert not stale, f"names the tree does not have: {sorted(stale)}"
    text = DESIGN.read_text()
    for gone in ("_operations.py", "inline_codec", "cuda_hooks", "AsyncClient._operations"):
        assert gone not in text, gone
