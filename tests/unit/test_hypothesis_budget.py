"""tests/plugins/hypothesis_budget.py: the check profile runs a quarter of every test's examples."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

from tests.plugins.hypothesis_budget import examples


@pytest.fixture
def restore_profile() -> Iterator[None]:
    name = settings.get_current_profile_name()
    yield
    settings.load_profile(name)


@pytest.mark.usefixtures("restore_profile")
def test_the_check_profile_runs_a_quarter_and_never_zero() -> None:
    settings.load_profile("check")
    assert settings().max_examples == 25
    assert [examples(n) for n in (400, 200, 150, 60, 3, 1)] == [100, 50, 37, 15, 1, 1]


@pytest.mark.usefixtures("restore_profile")
def test_the_default_profile_runs_what_each_test_asks_for() -> None:
    settings.load_profile("default")
    assert settings().max_examples == 100
    assert [examples(n) for n in (400, 200, 150, 60, 1)] == [400, 200, 150, 60, 1]


def test_no_test_asks_for_zero_examples() -> None:
    with pytest.raises(ValueError, match="at least one example, not 0"):
        examples(0)
