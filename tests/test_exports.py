"""The public namespace: ``__all__`` lists exactly the public names, and they import."""

from __future__ import annotations

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
    from lmcache_async import _defaults, errors

    assert set(errors.__all__) <= set(lmcache_async.__all__)
    assert all(getattr(lmcache_async, name) is getattr(errors, name) for name in errors.__all__)
    assert lmcache_async.DEFAULT is _defaults.DEFAULT
    assert lmcache_async.DefaultType is _defaults.DefaultType
