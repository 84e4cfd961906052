"""The benchmark suite, a package: run each script from the repository root as
``.venv/bin/python -m benchmarks.<name>`` (``make bench``, ``make smoke``), so that
``benchmarks.*``, ``lmcache_async`` and ``harness`` import without ``sys.path`` edits.

``sdk_bench_worker.py`` and ``sdk_remap_worker.py`` are the exception: they run as scripts
with an lmcache venv's python, started by :class:`benchmarks.harness.SDKBench` and
``bench_remap_batch.SDKRemap``, which put ``harness/`` on their ``PYTHONPATH``.
"""
