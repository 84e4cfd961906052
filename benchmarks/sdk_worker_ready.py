"""The ready line of the benchmark SDK workers (run in an lmcache venv, stdlib only).

The test helpers (harness/workers.py) check that a worker runs the lmcache
generation they asked for, from ``lmcache_version`` and ``generation`` in its ready line.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any


def installed_lmcache() -> tuple[str, str]:
    """``(version, generation)`` of this venv's lmcache: 0.5.6 ships as the ``lmcache``
    distribution, 0.5.7rc3 as ``lmcache-cli``."""
    for dist in ("lmcache", "lmcache-cli"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version, "0.5.6" if version == "0.5.6" else "0.5.7"
    raise RuntimeError("no lmcache distribution is installed in this venv")


def ready_line(worker: str) -> dict[str, Any]:
    version, generation = installed_lmcache()
    return {
        "ok": True,
        "ready": True,
        "pid": os.getpid(),
        "worker": worker,
        "lmcache_version": version,
        "generation": generation,
    }
