"""The benchmarks, a package in two tiers (``README.md`` here): ``suite/``, the comparison
with the official SDK that ``make bench`` runs and renders into ``docs/benchmarks.md``, and
``probes/``, one-off investigations. Run each module from the repository root as
``.venv/bin/python -m benchmarks.<tier>.<name>`` (``make bench``, ``make smoke``), so that
``benchmarks.*``, ``lmcache_async`` and ``harness`` import without ``sys.path`` edits.

``sdk_bench_worker.py`` and ``sdk_remap_worker.py`` are the exception: they run as scripts
with an lmcache venv's python, started by :class:`benchmarks.harness.SDKBench` and
``benchmarks.suite.bench_remap_batch.SDKRemap``, which put ``harness/`` on their ``PYTHONPATH``.
"""
