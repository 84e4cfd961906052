"""The public namespace: ``__all__`` lists exactly the public names, and they import."""

from __future__ import annotations

import lmcache_async


def test_all_matches_the_namespace() -> None:
    public = {
        name
        for name, value in vars(lmcache_async).items()
        if not name.startswith("_") and getattr(value, "__module__", "").startswith("lmcache_async")
    }
    assert set(lmcache_async.__all__) - {"__version__"} == public
    assert all(hasattr(lmcache_async, name) for name in lmcache_async.__all__)
    assert lmcache_async.__version__ == "0.1.0"
