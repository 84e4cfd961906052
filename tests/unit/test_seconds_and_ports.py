"""The shared checks of durations (``_base.timeouts.check_duration``: the fleet's TTLs and
deadlines, the routing service's deadline) and of port numbers on the command line
(``cli.arguments.port_number``: ``serve`` and ``route``), refusals word for word."""

from __future__ import annotations

import argparse
import math

import pytest

from lmcache_async._base.timeouts import check_duration
from lmcache_async.cli.arguments import port_number


def test_a_duration_is_a_finite_number_of_seconds_above_zero() -> None:
    assert check_duration(2, "ttl") == 2.0 and isinstance(check_duration(2, "ttl"), float)
    assert check_duration(0.25, "deadline") == 0.25
    for bad in (0, -1, math.nan, math.inf, True, "1", None):
        with pytest.raises(ValueError, match=r"^ttl must be a finite number of seconds > 0, got ") as info:
            check_duration(bad, "ttl")
        assert str(info.value) == f"ttl must be a finite number of seconds > 0, got {bad!r}"


def test_a_port_is_0_to_65535() -> None:
    assert [port_number(t) for t in ("0", "8100", "65535")] == [0, 8100, 65535]
    for text, message in [
        ("65536", "65536 is not a port number in 0..65535 (0: a free one)"),
        ("-1", "-1 is not a port number in 0..65535 (0: a free one)"),
        ("http", "'http' is not a port number"),
        ("80.5", "'80.5' is not a port number"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError) as info:
            port_number(text)
        assert str(info.value) == message
