"""The public namespace: ``__all__`` lists exactly the public names, and they import."""

from __future__ import annotations

import ast
from pathlib import Path

import lmcache_async


def test_all_matches_the_namespace() -> None:
    # The names that import torch are resolved on first use (PEP 562): use each first.
    assert all(hasattr(lmcache_async, name) for name in lmcache_async.__all__)
    public = {
        name
        for name, value in vars(lmcache_async).items()
        if not name.startswith("_") and getattr(value, "__module__", "").startswith("lmcache_async")
    }
    assert set(lmcache_async.__all__) - {"__version__"} == public
    assert lmcache_async.__version__ == "0.1.0"


def test_every_error_and_the_default_sentinel_are_exported() -> None:
    from lmcache_async import errors
    from lmcache_async._base import timeouts as _defaults

    assert set(errors.__all__) <= set(lmcache_async.__all__)
    assert all(getattr(lmcache_async, name) is getattr(errors, name) for name in errors.__all__)
    assert lmcache_async.DEFAULT is _defaults.DEFAULT
    assert lmcache_async.DefaultType is _defaults.DefaultType


def test_the_type_checkers_imports_are_the_table() -> None:
    """``__init__``'s ``if TYPE_CHECKING:`` imports (what mypy and IDEs see) name exactly
    the table behind ``__all__`` and the lazy re-exports, each from its module."""
    tree = ast.parse(Path(lmcache_async.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    seen: dict[str, tuple[str, ...]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        assert all(a.asname == a.name for a in node.names)  # explicit re-exports
        seen[node.module] = tuple(a.name for a in node.names)
    assert {m: sorted(n) for m, n in seen.items()} == {
        m: sorted(n) for m, n in lmcache_async._EXPORTS.items()
    }
    assert sorted(lmcache_async.__all__) == sorted(n for names in seen.values() for n in names)
