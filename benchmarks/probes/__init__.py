"""One-off investigations: each answers one question about where time goes or what a
design choice costs, and its conclusion lives in the docs' prose (the design notes, the
guides, the benchmark page's notes), not in a section of the SDK comparison. A probe may
reach the library's internals (wrapping private functions, switching code paths off) to
measure them; each says how in its docstring. Run from the repository root as
``.venv/bin/python -m benchmarks.probes.<name>``.
"""
