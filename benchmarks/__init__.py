"""The benchmarks, a package in two tiers (``README.md`` here): ``suite/``, the comparison
with the official SDK that ``make bench`` runs and renders into ``docs/benchmarks.md``, and
``probes/``, one-off investigations. Run each module from the repository root as
``.venv/bin/python -m benchmarks.<tier>.<name>`` (``make bench``, ``make smoke``), so that
``benchmarks.*``, ``lmcache_async`` and ``harness`` import without ``sys.path`` edits.

The official SDK's side of the comparison runs in ``harness/sdk_worker.py`` (with an lmcache
venv's python), driven through :class:`harness.workers.SDKWorker`.
"""
