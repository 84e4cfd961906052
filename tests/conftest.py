"""The test suite's hooks; its fixtures come from the plugins in tests/plugins/ (see
tests/README.md for where each kind of test lives and how to run a subset).

* ``tests.plugins.hypothesis_budget``: the ``check`` hypothesis profile, and the one named
  by ``LMCACHE_ASYNC_HYPOTHESIS_PROFILE``, loaded before the test modules are imported.
* ``tests.plugins.real_servers``: the real LMCache servers (0.5.6 and 0.5.7rc3, built into
  their own venvs by harness/build_lmcache_venv.sh), with the hooks that serve them: the
  ``real_server`` marker on every test that uses one, the venvs built before the first
  test, the servers' log tails after a failed test.
* ``tests.plugins.clients``: the embedded servers, the contract suite's server matrix
  (``server``, ``SERVER_CONFIGS``) and an open client on it (``client``).

Plain helpers and constants (``SMALL_GEOMETRY``, ``unique_model``, ``peek``, ...) are in
tests/helpers.py; nothing imports this file.
"""

from __future__ import annotations

import signal

import pytest

pytest_plugins = (
    "tests.plugins.hypothesis_budget",
    "tests.plugins.real_servers",
    "tests.plugins.clients",
)


def pytest_configure(config: pytest.Config) -> None:
    """Tests send SIGINT to child processes (a script's Ctrl-C, the CLI's interrupted
    batch) and expect Python's KeyboardInterrupt there. A child inherits an *ignored*
    SIGINT, and Python then keeps ignoring it: that is how a run started in the
    background by a non-interactive shell (``cmd &``, which ignores SIGINT) begins. A
    handled SIGINT is reset to the default on exec, so handling it here gives every
    child (and every xdist worker's children) the default disposition back."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
