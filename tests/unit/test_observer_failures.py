"""A raising observer is logged once (with its traceback) and then counted; a slow one
is warned of once; neither reaches the caller. Driven through the client's own
observation wrapper (``_observing.observed``), no server needed."""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time

import pytest

import lmcache_async
from lmcache_async import observe, otel
from lmcache_async._engine.observing import observed
from lmcache_async._engine.ops.calls import CALLS
from lmcache_async.observe import Operation

LOGGER = "lmcache_async._engine.observing"


class Broken:
    def __repr__(self) -> str:
        return "<Broken>"

    def operation_started(self, op: Operation) -> None:
        raise RuntimeError("bug at start")

    def operation_ended(self, op: Operation) -> None:
        raise RuntimeError("bug at end")


class Slow:
    def __repr__(self) -> str:
        return "<Slow>"

    def operation_started(self, op: Operation) -> None:
        time.sleep(2 * observe.SLOW_CALLBACK_S)

    def operation_ended(self, op: Operation) -> None:
        time.sleep(2 * observe.SLOW_CALLBACK_S)


class Quiet:
    def operation_started(self, op: Operation) -> None:
        return None

    def operation_ended(self, op: Operation) -> None:
        return None


async def _run(observers: list[object], n: int) -> None:
    async def work() -> int:
        return 7

    for _ in range(n):
        op = Operation("lookup", "127.0.0.1", 1, "m")
        assert await observed(observers, op, work, lambda o, r: None) == 7  # type: ignore[arg-type]
        assert op.outcome == "ok"


def test_a_raising_observer_is_logged_once_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    broken, other = Broken(), Broken()
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        asyncio.run(_run([broken, Quiet()], 5))
        asyncio.run(_run([other], 1))
    records = [r for r in caplog.records if r.name == LOGGER]
    warnings = [r for r in records if r.levelno == logging.WARNING]
    debugs = [r for r in records if r.levelno == logging.DEBUG]
    assert [r.getMessage() for r in warnings] == [
        "observer <Broken> failed at the start of lookup: RuntimeError('bug at start') (its later "
        "failures are counted, not logged: lmcache_async.observe.observer_failures)"
    ] * 2
    assert all(r.exc_info is not None and r.exc_info[0] is RuntimeError for r in warnings)
    assert len(debugs) == 9 + 1 and all(r.exc_info is None for r in debugs)
    assert (
        debugs[0].getMessage()
        == "observer <Broken> failed at the end of lookup (failure 2): RuntimeError('bug at end')"
    )
    assert observe.observer_failures(broken) == 10
    assert observe.observer_failures(other) == 2
    assert observe.observer_failures(Quiet()) == 0


def test_a_slow_observer_is_warned_of_once(caplog: pytest.LogCaptureFixture) -> None:
    slow = Slow()
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        asyncio.run(_run([slow, Quiet()], 3))
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert message.startswith("observer <Slow> is slow: its operation_started took ")
    assert message.endswith(
        " ms, over the 5 ms threshold (lmcache_async.observe.SLOW_CALLBACK_S); callbacks run "
        "on the event loop and must not block (warned once per observer)"
    )
    assert observe.observer_failures(slow) == 0


def test_removal_is_top_level() -> None:
    assert lmcache_async.remove_observer is observe.remove_observer
    assert lmcache_async.uninstrument is otel.uninstrument
    quiet = Quiet()
    lmcache_async.add_observer(quiet)
    assert quiet in observe.observers()
    lmcache_async.remove_observer(quiet)
    assert quiet not in observe.observers()


def test_the_documented_operation_names_are_the_call_classes_and_the_bulk_jobs() -> None:
    """``Operation.name``'s documented names: one per call class, and the bulk jobs."""
    doc = inspect.getdoc(Operation) or ""
    text = doc[doc.index("name:") : doc.index("server_address:")]
    bulk = {n for n, _ in inspect.getmembers(lmcache_async.AsyncClient) if n.endswith("_many")}
    assert sorted(re.findall(r'``"(\w+)"``', text)) == sorted({c.name for c in CALLS} | bulk)
