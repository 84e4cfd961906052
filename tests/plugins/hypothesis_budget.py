"""How many examples the property tests run: the hypothesis profiles, and the helper
that scales a test's own ``max_examples`` with the loaded profile.

* ``"default"`` (hypothesis' own; ``"ci"`` under CI, which hypothesis loads itself when it
  sees ``CI=true``): 100 examples per test, and every test that asks for more or fewer
  (``max_examples=examples(400)``) gets exactly what it asks for. ``make test`` runs this.
* ``"check"``: a quarter of that, for ``make check`` (the tests not marked real_server, in
  under a minute): 25 examples per test, ``examples(400)`` gives 100, never fewer than 1.

Pick a profile with pytest's ``--hypothesis-profile=check`` (hypothesis' own option) or
the environment variable :data:`PROFILE_ENV` (read when this plugin is imported, which
tests/conftest.py does through ``pytest_plugins``; the option wins when both are given).
The profile is loaded before the test modules are imported, so :func:`examples` in a
``@settings(...)`` decorator sees it.
"""

from __future__ import annotations

import os

from hypothesis import settings

#: Examples per test under hypothesis' default profile.
FULL_EXAMPLES = 100
#: The ``check`` profile runs this fraction of the full budget (1/4).
CHECK_DIVISOR = 4
#: The environment variable that names the profile to load (``check``, ``default``, ``ci``).
PROFILE_ENV = "LMCACHE_ASYNC_HYPOTHESIS_PROFILE"

settings.register_profile("check", max_examples=FULL_EXAMPLES // CHECK_DIVISOR)
# pytest's --hypothesis-profile, applied after this import, wins over the environment.
if os.environ.get(PROFILE_ENV):
    settings.load_profile(os.environ[PROFILE_ENV])


def examples(full: int) -> int:
    """``full`` examples under the default profile, scaled by the loaded profile's budget
    (``max_examples`` / :data:`FULL_EXAMPLES`): a quarter under ``check``; at least 1."""
    if full < 1:
        raise ValueError(f"a test runs at least one example, not {full}")
    return max(1, full * settings().max_examples // FULL_EXAMPLES)
