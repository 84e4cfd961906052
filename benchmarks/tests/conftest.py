"""The benchmark suite's self-tests (the suite's scripts run end to end, its comparison and
rendering are exact): the library's test plugins serve them, so ``make test`` runs them
with the library's suite (``testpaths`` in pyproject.toml) and the same fixtures."""

from __future__ import annotations

pytest_plugins = (
    "tests.plugins.hypothesis_budget",
    "tests.plugins.real_servers",
    "tests.plugins.clients",
)
