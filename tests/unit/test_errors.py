"""The error tree (lmcache_async/errors.py), the DEFAULT sentinel and the timeout validator
(lmcache_async/_base/timeouts.py). No server needed."""

from __future__ import annotations

import asyncio
import builtins
import inspect
import math
import pickle
import re

import pytest

import lmcache_async as lmc
from lmcache_async import bulk, errors
from lmcache_async._base.timeouts import DEFAULT, DefaultType, check_timeout, resolve_timeout


def _drawn_tree() -> dict[str, set[str]]:
    """The parents (drawn above it, or named "also ...") of every class in the errors
    module's docstring."""
    lines = (errors.__doc__ or "").splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "LMCacheError")
    parents: dict[str, set[str]] = {}
    stack: list[tuple[int, str]] = []
    for line in lines[start:]:
        if not line.strip():
            break
        m = re.search(r"([A-Z]\w*Error)\b(.*)$", line)
        assert m is not None, line
        name, rest, depth = m.group(1), m.group(2), m.start(1)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        named = parents.setdefault(name, set())
        if stack:
            named.add(stack[-1][1])
        named.update(re.findall(r"also (\w+Error)", rest))
        stack.append((depth, name))
    return parents


def test_the_drawn_tree_is_the_class_tree() -> None:
    drawn = _drawn_tree()
    classes = {
        name: obj
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, errors.LMCacheError)
    }
    warnings = {name for name in errors.__all__ if issubclass(getattr(errors, name), Warning)}
    assert warnings == {"UnknownServerVersionWarning"}
    assert set(drawn) == set(classes) == set(errors.__all__) - warnings
    for name, parents in drawn.items():
        for parent in parents:
            assert issubclass(classes[name], classes.get(parent) or getattr(builtins, parent)), (name, parent)
        direct = {b.__name__ for b in classes[name].__bases__ if issubclass(b, errors.LMCacheError)}
        assert direct == {p for p in parents if p in classes}, name
    assert drawn["LMCacheError"] == set()


def test_state_errors_keep_their_old_bases() -> None:
    # Catchable as before: ClientClosedError as a connection error, SyncUsageError as a
    # RuntimeError; and every misuse as one ClientStateError.
    assert issubclass(lmc.ClientClosedError, lmc.LMCacheConnectionError)
    assert issubclass(lmc.ClientClosedError, ConnectionError)
    for cls in (
        lmc.ClientClosedError,
        lmc.ClientNotOpenError,
        lmc.WrongEventLoopError,
        lmc.ForkedClientError,
        lmc.SyncUsageError,
        lmc.LoopThreadCallError,
        lmc.ForkedSyncClientError,
    ):
        assert issubclass(cls, lmc.ClientStateError) and issubclass(cls, RuntimeError), cls
        assert issubclass(cls, lmc.LMCacheError)
    assert issubclass(lmc.ForkedSyncClientError, lmc.ForkedClientError)
    assert "SyncUsageError" not in lmc.sync_client.__all__  # one home: lmcache_async.errors


@pytest.mark.parametrize(
    "err",
    [
        lmc.ClientStateError("open() on a client that is open"),
        lmc.ClientClosedError("the client is closed"),
        lmc.ClientNotOpenError("the client is new"),
        lmc.WrongEventLoopError("another loop"),
        lmc.ForkedClientError("forked", 1234),
        lmc.SyncUsageError("boom", "forked"),
        lmc.LoopThreadCallError("from the loop"),
        lmc.ForkedSyncClientError("forked facade", 99),
        lmc.LMCacheTimeoutError("lookup", 1.5, request_id=7),
        lmc.ModelNotRegisteredError("m", ["a", "b"]),
    ],
    ids=lambda e: type(e).__name__,
)
def test_every_error_pickles_with_its_attributes(err: lmc.LMCacheError) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    assert vars(back) == vars(err)


def test_state_error_attributes() -> None:
    assert lmc.LoopThreadCallError("x").reason == "loop_thread"
    forked = lmc.ForkedSyncClientError("y", 42)
    assert (forked.reason, forked.owner_pid, str(forked)) == ("forked", 42, "y")
    assert lmc.ForkedClientError("z", 7).owner_pid == 7


# --------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), (0, 0.0), (3, 3.0), (2.5, 2.5), (math.inf, None), (10**30, 1e30)],
)
def test_check_timeout_accepts(value: object, expected: float | None) -> None:
    got = check_timeout(value)
    assert got == expected and (got is None or type(got) is float)


@pytest.mark.parametrize("value", [-1, -0.5, -math.inf, math.nan])
def test_check_timeout_refuses_a_bad_number(value: object) -> None:
    message = f"deadline must be a non-negative number of seconds or None, got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_timeout(value, "deadline")


@pytest.mark.parametrize("value", [True, False, "5", b"5", [1], object()])
def test_check_timeout_refuses_what_is_not_a_number_with_a_type_error(value: object) -> None:
    message = f"deadline must be a number of seconds (int or float) or None, got {type(value).__name__}"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        check_timeout(value, "deadline")
    message = f"grace must be a number of seconds (int or float), got {type(value).__name__}"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        check_timeout(value, "grace", allow_none=False)


def test_a_string_timeout_is_refused_by_the_client_constructors_with_a_type_error() -> None:
    message = "timeout must be a number of seconds (int or float) or None, got str"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        lmc.AsyncClient("tcp://127.0.0.1:9", "http://127.0.0.1:9", "m", timeout="5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        lmc.Client("tcp://127.0.0.1:9", "http://127.0.0.1:9", "m", timeout="5")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [None, math.inf, -1, math.nan])
def test_check_timeout_without_none(value: object) -> None:
    message = f"cleanup_grace must be a finite non-negative number of seconds, got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_timeout(value, "cleanup_grace", allow_none=False)
    assert check_timeout(4, "cleanup_grace", allow_none=False) == 4.0


def test_default_is_a_typed_singleton() -> None:
    assert lmc.DEFAULT is DEFAULT is DefaultType.DEFAULT
    assert list(DefaultType) == [DEFAULT]
    assert repr(DEFAULT) == "DEFAULT"
    assert pickle.loads(pickle.dumps(DEFAULT)) is DEFAULT
    assert not hasattr(bulk, "CLIENT_DEFAULT")  # one name: lmcache_async.DEFAULT
    timeout: float | DefaultType | None = DEFAULT
    assert resolve_timeout(timeout, 60.0) == 60.0
    assert resolve_timeout(None, 60.0) is None
    assert resolve_timeout(1, 60.0) == 1.0
    with pytest.raises(
        ValueError, match=r"^timeout must be a non-negative number of seconds or None, got nan$"
    ):
        resolve_timeout(math.nan, 60.0)


def test_bulk_and_facade_refuse_a_bad_timeout_before_anything_is_sent() -> None:
    # Nothing listens on port 9: a call that got as far as the network would fail
    # differently (and the facade's constructor would try to connect).
    client = lmc.AsyncClient("tcp://127.0.0.1:9", "http://127.0.0.1:9", "m")  # not opened: no I/O
    for job in (bulk.remap_many, bulk.store_many, bulk.retrieve_many):
        with pytest.raises(
            ValueError, match=r"^timeout must be a non-negative number of seconds or None, got nan$"
        ):
            asyncio.run(job(client, [], timeout=math.nan))
    with pytest.raises(
        ValueError, match=r"^timeout must be a non-negative number of seconds or None, got -1$"
    ):
        lmc.Client("tcp://127.0.0.1:9", "http://127.0.0.1:9", "m", timeout=-1)
    with pytest.raises(
        ValueError, match=r"^timeout must be a non-negative number of seconds or None, got nan$"
    ):
        lmc.Client("tcp://127.0.0.1:9", "http://127.0.0.1:9", "m", timeout=math.nan)
    with pytest.raises(
        ValueError, match=r"^cleanup_grace must be a finite non-negative number of seconds, got -2$"
    ):
        lmc.Client("tcp://127.0.0.1:9", "http://127.0.0.1:9", "m", cleanup_grace=-2)
