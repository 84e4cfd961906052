"""Observability: the operation hook (lmcache_async.observe) and the OpenTelemetry spans and
metrics built on it (lmcache_async.otel), exported through the OpenTelemetry SDK's
in-memory span exporter and metric reader.

Against the embedded server (SHM and pickle) and the real LMCache 0.5.6 server (SHM and
pickle): the span of each operation with its attributes, a miss, a timeout, a cancellation,
a server that dies, a bulk job's parent span, the metrics; against a real server logging at
DEBUG, the join key (the request ids on the span are the sessions the server logged).
Privacy: recognisable token ids and salts reach no span, metric or log record. Cost when
off: a client used without OpenTelemetry never imports it (in a subprocess).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from lmcache_async import AsyncClient, KVPart, LMCacheConnectionError, LMCacheTimeoutError, observe
from lmcache_async.observe import Operation
from lmcache_async.otel import OpenTelemetryObserver
from tests.faults.forwarders import HttpForwarder, ZmqForwarder
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, peek, random_kv, unique_model
from tests.plugins.clients import _embedded

pytestmark = pytest.mark.anyio

CS = 16
BPT = SMALL_GEOMETRY.bytes_per_token
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Telemetry:
    """An OpenTelemetry SDK tracer and meter provider exporting to memory."""

    def __init__(self) -> None:
        self.spans_out = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans_out))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def spans(self) -> list[ReadableSpan]:
        return list(self.spans_out.get_finished_spans())

    def metrics(self) -> MetricsData:
        data = self.reader.get_metrics_data()
        assert data is not None
        return data

    def points(self, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
        """The data points of metric ``name``, by their sorted attributes."""
        found: dict[tuple[tuple[str, Any], ...], Any] = {}
        for rm in self.metrics().resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == name:
                        for p in m.data.data_points:
                            found[tuple(sorted((p.attributes or {}).items()))] = p
        return found

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def otel() -> Iterator[Telemetry]:
    t = Telemetry()
    yield t
    t.shutdown()


@pytest.fixture(
    params=[
        "embedded-shm",
        "embedded-pickle",
        pytest.param("real-shm", marks=pytest.mark.real_server),
        pytest.param("real-pickle", marks=pytest.mark.real_server),
    ]
)
def any_server(request: pytest.FixtureRequest) -> Any:
    kind, mode = request.param.split("-")
    return request.getfixturevalue(f"{kind}_server_{mode}")


def open_client(srv: Any, otel: Telemetry | None = None, **kw: Any) -> AsyncClient:
    if otel is not None:
        kw.setdefault("observers", [OpenTelemetryObserver(otel.tracer_provider, otel.meter_provider)])
    kw.setdefault("timeout", 30)
    return AsyncClient(srv.url, srv.http_url, unique_model(), geometry=SMALL_GEOMETRY, **kw)


def base_attributes(client: AsyncClient, name: str, srv: Any) -> dict[str, Any]:
    port = int(srv.url.rsplit(":", 1)[1])
    return {
        "db.system.name": "lmcache",
        "db.operation.name": name,
        "db.namespace": client.model_name,
        "server.address": "127.0.0.1",
        "server.port": port,
        "lmcache.transport": client.transfer,
        "lmcache.server_generation": "0.5.6",
        "lmcache.chunk_size": CS,
    }


def rids(span: ReadableSpan) -> tuple[str, ...]:
    value = (span.attributes or {})["lmcache.request_ids"]
    assert isinstance(value, tuple)
    return value


def without_rids(span: ReadableSpan) -> dict[str, Any]:
    return {k: v for k, v in (span.attributes or {}).items() if k != "lmcache.request_ids"}


# --------------------------------------------------------------------------- spans


async def test_each_operation_is_a_client_span_with_its_facts(any_server: Any, otel: Telemetry) -> None:
    toks, target = fresh_tokens(50), fresh_tokens(50)  # 3 whole chunks (48 tokens) each
    kv = random_kv(SMALL_GEOMETRY, 50)
    async with open_client(any_server, otel) as c:
        assert await c.store(kv, toks, "s1") is True
        assert await c.lookup(toks, "s1") == 48
        got = await c.retrieve(toks, "s1")
        assert got is not None and torch.equal(got, kv[:, :, :48])
        assert await c.retrieve(fresh_tokens(40)) is None
        res = await c.remap(toks, target, "s1")
        assert (res.retrieved_tokens, res.stored_tokens, res.stored_new) == (48, 48, True)
        base = {
            name: base_attributes(c, name, any_server) for name in ("store", "lookup", "retrieve", "remap")
        }
        pickle = c.transfer == "pickle"
    spans = otel.spans()
    salt = observe.salt_hash("s1")
    assert salt is not None and len(salt) == 12
    by_name = [s.name for s in spans]
    want_names = ["store", "lookup", "retrieve", "retrieve"]
    want_names += ["retrieve", "store", "remap"] if pickle else ["remap"]
    assert by_name == want_names
    assert all(s.kind is SpanKind.CLIENT for s in spans)
    assert all(s.status.status_code is StatusCode.UNSET for s in spans)
    store, lookup, hit, miss = spans[:4]
    common = {"lmcache.cache_salt_hash": salt, "lmcache.tokens.asked": 50}
    assert without_rids(store) == {
        **base["store"],
        **common,
        "lmcache.tokens.hit": 0,
        "lmcache.tokens.stored": 48,
        "lmcache.chunks": 3,
        "lmcache.bytes_moved": 48 * BPT,
        "lmcache.outcome": "ok",
        "lmcache.stored_new": True,
    }
    assert rids(store)[0].startswith("lmca-store-")
    assert without_rids(lookup) == {
        **base["lookup"],
        **common,
        "lmcache.tokens.hit": 48,
        "lmcache.tokens.stored": 0,
        "lmcache.chunks": 3,
        "lmcache.bytes_moved": 0,
        "lmcache.outcome": "ok",
    }
    assert len(rids(lookup)) == 1 and rids(lookup)[0].startswith("lmca-lookup-")
    assert without_rids(hit) == {
        **base["retrieve"],
        **common,
        "lmcache.tokens.hit": 48,
        "lmcache.tokens.stored": 0,
        "lmcache.chunks": 3,
        "lmcache.bytes_moved": 48 * BPT,
        "lmcache.outcome": "ok",
    }
    assert len(rids(hit)) == 1 and rids(hit)[0].startswith("lmca-retrieve-")
    assert without_rids(miss) == {
        **base["retrieve"],
        "lmcache.tokens.asked": 40,
        "lmcache.tokens.hit": 0,
        "lmcache.tokens.stored": 0,
        "lmcache.chunks": 0,
        "lmcache.bytes_moved": 0,
        "lmcache.outcome": "miss",
    }
    remap = spans[-1]
    assert without_rids(remap) == {
        **base["remap"],
        **common,
        "lmcache.tokens.hit": 48,
        "lmcache.tokens.stored": 48,
        "lmcache.chunks": 3,
        "lmcache.bytes_moved": (2 if pickle else 1) * 48 * BPT,
        "lmcache.outcome": "ok",
        "lmcache.stored_new": True,
    }
    if pickle:  # its retrieve and its store are its children
        assert rids(remap) == ()
        for child in spans[4:6]:
            assert child.parent is not None and child.parent.span_id == remap.context.span_id
    else:
        assert [r.split("-")[1] for r in rids(remap)] == ["remap", "remap"]  # the source's, the target's
    roots = spans[:4] + [remap]
    assert all(s.parent is None for s in roots)
    assert len({s.context.trace_id for s in roots}) == 5

    # Metrics: one duration point per (operation, outcome); counters from the operations
    # that talk to the server (a pickle remap's children, not the remap).
    durations = otel.points("db.client.operation.duration")
    port = base["store"]["server.port"]
    counts = {
        (dict(k)["db.operation.name"], dict(k)["lmcache.outcome"]): p.count for k, p in durations.items()
    }
    want_counts = {("store", "ok"): 2 if pickle else 1, ("lookup", "ok"): 1, ("retrieve", "miss"): 1}
    want_counts[("retrieve", "ok")] = 2 if pickle else 1
    want_counts[("remap", "ok")] = 1
    assert counts == want_counts
    assert all(dict(k)["server.port"] == port and dict(k)["db.system.name"] == "lmcache" for k in durations)
    hits = {
        dict(k)["db.operation.name"]: p.value for k, p in otel.points("lmcache.client.tokens.hit").items()
    }
    want_hits = {"lookup": 48, "retrieve": 96} if pickle else {"lookup": 48, "retrieve": 48, "remap": 48}
    assert hits == want_hits
    stored = {
        dict(k)["db.operation.name"]: p.value for k, p in otel.points("lmcache.client.tokens.stored").items()
    }
    assert stored == ({"store": 96} if pickle else {"store": 48, "remap": 48})
    in_flight = {
        dict(k)["db.operation.name"]: p.value
        for k, p in otel.points("lmcache.client.operations.in_flight").items()
    }
    assert set(in_flight.values()) == {0}


async def test_compose_is_one_client_span(any_server: Any, otel: Telemetry) -> None:
    """On SHM a composition is one operation (composed inside the pool, its sessions'
    request ids on the span); on the inline transfer it is the parent of its retrieve and
    its store."""
    toks, target = fresh_tokens(50), fresh_tokens(50)
    kv = random_kv(SMALL_GEOMETRY, 50)
    async with open_client(any_server, otel) as c:
        assert await c.store(kv, toks, "s1") is True
        otel.spans()  # the store's span is not this test's subject
        res = await c.compose(target, [KVPart(toks, 0, 16), KVPart(toks, 16, 48, "s1")], cache_salt="s1")
        assert (res.stored_tokens, res.stored_new, res.missed) == (48, True, ())
        got = await c.retrieve(target, "s1")
        assert got is not None and torch.equal(got, kv[:, :, :48])
        pickle = c.transfer == "pickle"
    spans = [s for s in otel.spans() if s.name != "store" or s.parent is not None]
    compose = next(s for s in spans if s.name == "compose")
    attrs = dict(compose.attributes or {})
    assert compose.parent is None
    assert (attrs["lmcache.tokens.stored"], attrs["lmcache.stored_new"], attrs["lmcache.outcome"]) == (
        48,
        True,
        "ok",
    )
    assert attrs["lmcache.cache_salt_hash"] == observe.salt_hash("s1")
    children = [s for s in spans if s.parent is not None and s.parent.span_id == compose.context.span_id]
    if pickle:
        assert sorted(s.name for s in children) == ["retrieve", "store"]
    else:
        assert children == []
        assert [r.split("-")[1] for r in rids(compose)] == [
            "compose",
            "compose",
        ]  # the source's, the target's


async def test_a_bulk_job_is_the_parent_of_its_items(embedded_server_shm: Any, otel: Telemetry) -> None:
    prompts = [fresh_tokens(32) for _ in range(3)]
    async with open_client(embedded_server_shm, otel) as c:
        for p in prompts[:2]:
            await c.store(random_kv(SMALL_GEOMETRY, 32), p)
        result = await c.retrieve_many(prompts, concurrency=2)
        assert [r.hit for r in result] == [True, True, False]
    spans = otel.spans()
    job = spans[-1]
    assert job.name == "retrieve_many"
    items = [s for s in spans if s.parent is not None and s.parent.span_id == job.context.span_id]
    assert sorted(s.name for s in items) == ["retrieve"] * 3
    assert all(s.context.trace_id == job.context.trace_id for s in items)
    attrs = job.attributes or {}
    assert (attrs["lmcache.items"], attrs["lmcache.tokens.asked"], attrs["lmcache.tokens.hit"]) == (3, 96, 64)
    assert attrs["lmcache.bytes_moved"] == 64 * BPT
    assert rids(job) == ()
    # Counted once: the items' tokens, not the job's again.
    hits = {
        dict(k)["db.operation.name"]: p.value for k, p in otel.points("lmcache.client.tokens.hit").items()
    }
    assert hits == {"retrieve": 64}


async def test_spans_nest_under_the_callers_current_span(
    embedded_server_pickle: Any, otel: Telemetry
) -> None:
    tracer = otel.tracer_provider.get_tracer("app")
    async with open_client(embedded_server_pickle, otel) as c:
        with tracer.start_as_current_span("handle-request") as outer:
            await c.lookup(fresh_tokens(16))
    lookup = otel.spans()[0]
    assert lookup.name == "lookup"
    assert lookup.parent is not None and lookup.parent.span_id == outer.get_span_context().span_id


@pytest.mark.parametrize("mode", ["shm", "pickle"])
async def test_phases_are_child_spans_when_asked_for(mode: str, request: pytest.FixtureRequest) -> None:
    srv = request.getfixturevalue(f"embedded_server_{mode}")
    otel = Telemetry()
    toks = fresh_tokens(40)
    try:
        observer = OpenTelemetryObserver(otel.tracer_provider, phases=True)
        async with open_client(srv, observers=[observer]) as c:
            await c.store(random_kv(SMALL_GEOMETRY, 40), toks)
            await c.retrieve(toks)
            await c.lookup(toks)
        spans = otel.spans()
    finally:
        otel.shutdown()
    tops = [s for s in spans if s.kind is SpanKind.CLIENT]
    kids = {
        t.name: [s for s in spans if s.parent is not None and s.parent.span_id == t.context.span_id]
        for t in tops
    }
    # The embedded server answers lookups in arrival order: the prefetch question rides
    # with the lookup (one "lookup" phase). A pickle store looks up what is cached, commits
    # the rest inline, then checks that it is stored.
    want = {
        "shm": {"store": ["prepare", "copy", "commit"], "retrieve": ["lookup", "prepare", "copy", "commit"]},
        "pickle": {"store": ["lookup", "commit", "lookup"], "retrieve": ["lookup", "prepare", "copy"]},
    }[mode]
    assert {name: [k.name for k in ks] for name, ks in kids.items()} == {**want, "lookup": ["lookup"]}
    for top in tops:
        for child in kids[top.name]:
            assert child.kind is SpanKind.INTERNAL
            assert child.start_time is not None and child.end_time is not None
            assert top.start_time is not None and top.end_time is not None
            assert top.start_time <= child.start_time <= child.end_time <= top.end_time


async def test_without_phases_no_child_spans_are_made(embedded_server_shm: Any, otel: Telemetry) -> None:
    async with open_client(embedded_server_shm, otel) as c:
        await c.retrieve(fresh_tokens(16))
    assert [s.kind for s in otel.spans()] == [SpanKind.CLIENT]


# --------------------------------------------------------------------------- failures


async def test_timeout_and_cancellation_end_the_span_with_an_error(
    embedded_server_shm: Any, otel: Telemetry
) -> None:
    with ZmqForwarder(embedded_server_shm.url) as zf, HttpForwarder(embedded_server_shm.http_url) as hf:
        async with AsyncClient(
            zf.url,
            hf.url,
            unique_model(),
            geometry=SMALL_GEOMETRY,
            timeout=30,
            cleanup_grace=1,
            observers=[OpenTelemetryObserver(otel.tracer_provider, otel.meter_provider)],
        ) as c:
            zf.hold.set()  # the server stops answering
            with pytest.raises(LMCacheTimeoutError):
                await c.retrieve(fresh_tokens(16), timeout=0.3)
            task = asyncio.ensure_future(c.lookup(fresh_tokens(16)))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            zf.hold.clear()
            assert await c.drain(10)
    timed_out, cancelled = otel.spans()
    assert (timed_out.name, cancelled.name) == ("retrieve", "lookup")
    for span, outcome, error in (
        (timed_out, "timeout", "LMCacheTimeoutError"),
        (cancelled, "cancelled", "CancelledError"),
    ):
        attrs = span.attributes or {}
        assert (attrs["lmcache.outcome"], attrs["error.type"]) == (outcome, error)
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == error
        assert len(rids(span)) == 1  # the lookup was sent: its session id is known
    errors = {
        (dict(k)["db.operation.name"], dict(k)["error.type"]): p.value
        for k, p in otel.points("lmcache.client.errors").items()
    }
    assert errors == {("retrieve", "LMCacheTimeoutError"): 1, ("lookup", "CancelledError"): 1}


async def test_a_server_that_died_ends_the_span_with_its_error(otel: Telemetry) -> None:
    srv = _embedded("pickle")
    try:
        async with open_client(srv, otel, timeout=5) as c:
            srv.stop()
            with pytest.raises(LMCacheConnectionError) as caught:
                await c.retrieve(fresh_tokens(16), timeout=2)
    finally:
        srv.stop()
    (span,) = otel.spans()
    attrs = span.attributes or {}
    assert attrs["error.type"] == type(caught.value).__qualname__ == "LMCacheConnectionError"
    # The lookup is on its way when the socket monitor reports the server gone: refused
    # while it waited to go out, or sent and lost, as the loop's order of the two events falls.
    assert re.fullmatch(
        r"lookup: (not connected to tcp://127\.0\.0\.1:\d+ \(the server is down or restarting\)"
        r"|connection to tcp://127\.0\.0\.1:\d+ lost)",
        str(caught.value),
    ), str(caught.value)
    assert attrs["lmcache.outcome"] == "error"
    assert span.status.status_code is StatusCode.ERROR


# --------------------------------------------------------------------------- the hook


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, Operation]] = []

    def operation_started(self, op: Operation) -> int:
        self.events.append(("start", op))
        return len(self.events)

    def operation_ended(self, op: Operation) -> None:
        self.events.append(("end", op))


class Broken:
    def operation_started(self, op: Operation) -> None:
        raise RuntimeError("observer bug")

    def operation_ended(self, op: Operation) -> None:
        raise RuntimeError("observer bug")


async def test_the_hook_sees_each_operation_and_a_broken_observer_harms_nothing(
    embedded_server_pickle: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder()
    toks = fresh_tokens(33)
    kv = random_kv(SMALL_GEOMETRY, 33)
    with caplog.at_level(logging.WARNING, logger="lmcache_async"):
        broken_observer = Broken()
        async with open_client(embedded_server_pickle, observers=[broken_observer, rec]) as c:
            assert await c.store(kv, toks) is True
            got = await c.retrieve(toks)
    assert got is not None and torch.equal(got, kv[:, :, :32])
    assert [(e, op.name) for e, op in rec.events] == [
        ("start", "store"),
        ("end", "store"),
        ("start", "retrieve"),
        ("end", "retrieve"),
    ]
    store, retrieve = rec.events[1][1], rec.events[3][1]
    assert store.state[rec] == 1 and retrieve.state[rec] == 3
    assert (store.tokens_asked, store.tokens_stored, store.chunks, store.stored_new) == (33, 32, 2, True)
    assert (retrieve.tokens_hit, retrieve.bytes_moved, retrieve.outcome) == (32, 32 * BPT, "ok")
    assert store.duration is not None and store.duration > 0
    assert store.cache_salt_hash is None and store.error_type is None
    broken = [r for r in caplog.records if "observer" in r.getMessage()]
    assert len(broken) == 1 and broken[0].levelno == logging.WARNING  # the first failure only
    assert observe.observer_failures(broken_observer) == 4


def test_an_observer_without_the_two_callbacks_is_refused_at_construction(
    embedded_server_pickle: Any,
) -> None:
    with pytest.raises(
        TypeError,
        match=r"^an observer needs operation_started\(op\) and operation_ended\(op\) methods, got object$",
    ):
        open_client(embedded_server_pickle, observers=[object()])
    with pytest.raises(TypeError, match=r"^observers must be a sequence of observers, got Recorder$"):
        open_client(embedded_server_pickle, observers=Recorder())


async def test_add_observer_reaches_clients_made_afterwards(embedded_server_pickle: Any) -> None:
    rec = Recorder()
    before = open_client(embedded_server_pickle)
    observe.add_observer(rec)
    try:
        after = open_client(embedded_server_pickle)
    finally:
        observe.remove_observer(rec)
    async with before, after:
        await before.lookup(fresh_tokens(16))
        await after.lookup(fresh_tokens(16))
    assert [(e, op.model_name) for e, op in rec.events] == [
        ("start", after.model_name),
        ("end", after.model_name),
    ]


# --------------------------------------------------------------------------- privacy


async def test_token_ids_and_salts_reach_no_span_metric_or_log(
    embedded_server_shm: Any, otel: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    toks = [987_650_000 + i for i in range(40)]
    target = [876_540_000 + i for i in range(40)]
    salt = "SALT-Zq8xVw-secret"
    with caplog.at_level(logging.DEBUG, logger="lmcache_async"):
        async with open_client(embedded_server_shm, otel) as c:
            await c.store(random_kv(SMALL_GEOMETRY, 40), toks, salt)
            await c.retrieve(toks, salt)
            await c.lookup(toks, salt)
            await c.remap(toks, target, salt)
            await c.retrieve_many([(toks, salt), (target, salt)])
    exported = "\n".join(s.to_json() for s in otel.spans()) + otel.metrics().to_json()
    logged = "\n".join(f"{r.getMessage()} {r.args!r} {r.__dict__!r}" for r in caplog.records)
    assert len(otel.spans()) == 7 and "lmca-store-" in exported
    for text in (exported, logged):
        assert salt not in text
        assert not re.search(r"98765\d{4}|87654\d{4}", text)
    hashed = observe.salt_hash(salt)
    assert hashed is not None and hashed in exported


# --------------------------------------------------------------------------- cost when off


def test_a_client_without_opentelemetry_never_imports_it() -> None:
    script = textwrap.dedent(
        """
        import asyncio, sys
        from lmcache_async import AsyncClient
        from lmcache_async.testing import EmbeddedServer
        from tests.helpers import SMALL_GEOMETRY, random_kv

        async def main():
            srv = EmbeddedServer.start_in_thread(chunk_size=16, mode="pickle")
            try:
                async with AsyncClient(srv.url, srv.http_url, "m", geometry=SMALL_GEOMETRY) as c:
                    toks = list(range(32))
                    await c.store(random_kv(SMALL_GEOMETRY, 32), toks)
                    assert (await c.retrieve(toks)) is not None
                    await c.retrieve_many([toks])
            finally:
                srv.stop()

        asyncio.run(main())
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
        """
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


# --------------------------------------------------------------------------- the join key


async def test_request_ids_on_the_span_are_the_sessions_the_real_server_logged(
    fresh_real_server: Any, otel: Telemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "DEBUG")  # the server logs each session it creates
    srv = fresh_real_server("shm", chunk_size=CS)
    toks = fresh_tokens(32)
    async with open_client(srv, otel) as c:
        await c.store(random_kv(SMALL_GEOMETRY, 32), toks)
        await c.retrieve(toks)
        await c.lookup(toks)
        assert await c.drain(10)
    logged = set(re.findall(r"Created session for request_id=(\S+)", srv.log_path.read_text()))
    sent = [r for s in otel.spans() for r in rids(s)]
    assert len(sent) == 3
    assert set(sent) <= logged


# --------------------------------------------------------------------------- logs


def client_records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    """The client's log records at ``level`` or above (the embedded server's are its own)."""
    return [
        r
        for r in caplog.records
        if r.name.startswith("lmcache_async")
        and not r.name.startswith("lmcache_async.testing")
        and r.levelno >= level
    ]


async def test_nothing_is_logged_at_info_or_above_on_the_success_path(
    embedded_server_shm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    toks = fresh_tokens(40)
    with caplog.at_level(logging.DEBUG, logger="lmcache_async"):
        async with open_client(embedded_server_shm) as c:
            await c.store(random_kv(SMALL_GEOMETRY, 40), toks)
            await c.retrieve(toks)
            await c.lookup(toks)
            await c.remap(toks, fresh_tokens(40))
            await c.retrieve_many([toks, fresh_tokens(16)])
    assert client_records(caplog, logging.INFO) == []


async def test_a_restarted_server_is_logged_once_per_recovery_at_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    srv = _embedded("pickle")
    port, http_port = int(srv.url.rsplit(":", 1)[1]), int(srv.http_url.rsplit(":", 1)[1])
    toks = fresh_tokens(32)
    try:
        async with open_client(srv, timeout=20) as c:
            assert await c.store(random_kv(SMALL_GEOMETRY, 32), toks) is True
            assert await c.drain(10)  # no cleanup reply of the store is left to be lost
            with caplog.at_level(logging.DEBUG, logger="lmcache_async"):
                srv.stop()
                srv = _embedded("pickle", port=port, http_port=http_port)
                conn = peek(c).conn
                deadline = time.monotonic() + 15
                while not (conn.generation == 1 and conn.connected) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)  # the client notices the loss, then reconnects
                assert await c.lookup(toks) == 0  # the new server is empty: registered again first
                assert await c.store(random_kv(SMALL_GEOMETRY, 32), toks) is True
    finally:
        srv.stop()
    got = [(r.levelno, r.getMessage()) for r in client_records(caplog, logging.INFO)]
    url = f"tcp://127.0.0.1:{port}"
    assert [level for level, _ in got] == [logging.WARNING] * 3
    assert re.fullmatch(rf"disconnected from {re.escape(url)}; failed \d+ in-flight calls", got[0][1])
    assert got[1:] == [
        (logging.WARNING, f"reconnected to {url} (generation 1)"),
        (logging.WARNING, f"re-registering {c.model_name} with {url}"),
    ]


# --------------------------------------------------------------------------- the example


def test_the_example_service_prints_spans_and_serves_prometheus_metrics(tmp_path: Any) -> None:
    """examples/observability_service.py: spans on the console, metrics scraped over HTTP."""
    out = tmp_path / "out.txt"
    env = {**os.environ, "PYTHONPATH": REPO}
    with open(out, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "examples/observability_service.py", "--linger", "60"],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 90
        found = None
        while found is None and time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"^metrics: (http://127\.0\.0\.1:\d+/metrics)$", out.read_text(), re.M)
            time.sleep(0.1)
        assert found is not None, out.read_text()[-3000:]
        with urllib.request.urlopen(found.group(1), timeout=10) as reply:
            scraped = reply.read().decode()
    finally:
        proc.terminate()
        proc.wait(15)
    printed = out.read_text()
    assert printed.count('"name": "handle-request"') == 4
    assert printed.count('"name": "retrieve"') == 6  # 4 requests and the bulk job's 2 items
    assert printed.count('"name": "store"') == 2 and printed.count('"name": "retrieve_many"') == 1

    def value(metric: str, **labels: str) -> float:
        for line in scraped.splitlines():
            name, _, rest = line.partition("{")
            if name == metric and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{metric} {labels} not in the scrape:\n{scraped}")

    duration = "db_client_operation_duration_seconds_count"
    assert (
        value(duration, db_operation_name="retrieve", lmcache_outcome="miss", db_system_name="lmcache") == 2
    )
    assert value(duration, db_operation_name="retrieve", lmcache_outcome="ok") == 4
    assert value(duration, db_operation_name="store", lmcache_outcome="ok") == 2
    assert value(duration, db_operation_name="retrieve_many", lmcache_outcome="ok") == 1
    assert value("lmcache_client_tokens_hit_total", db_operation_name="retrieve") == 4 * 48
    assert value("lmcache_client_tokens_stored_total", db_operation_name="store") == 2 * 48
    assert value("lmcache_client_bytes_moved_bytes_total", db_operation_name="store") == 2 * 48 * BPT
    assert value("lmcache_client_operations_in_flight", db_operation_name="retrieve") == 0


# --------------------------------------------------------------------------- the CLI


def test_the_cli_turns_telemetry_on_from_the_standard_otel_variables() -> None:
    from lmcache_async import otel
    from lmcache_async.cli import instrument_from_environment

    assert instrument_from_environment({}) is False
    assert instrument_from_environment({"OTEL_TRACES_EXPORTER": "none"}) is False
    assert (
        instrument_from_environment({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}) is False
    )
    assert observe.observers() == ()
    try:
        assert instrument_from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}) is True
        (installed,) = observe.observers()
        assert isinstance(installed, otel.OpenTelemetryObserver)
        assert instrument_from_environment({"OTEL_METRICS_EXPORTER": "prometheus"}) is True
        assert len(observe.observers()) == 1  # replaced, not added twice
    finally:
        otel.uninstrument()
    assert observe.observers() == ()


async def test_sampled_out_operations_still_count_in_the_metrics(embedded_server_pickle: Any) -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    otel = Telemetry()
    sampled_out = TracerProvider(sampler=ALWAYS_OFF)
    sampled_out.add_span_processor(SimpleSpanProcessor(otel.spans_out))
    try:
        async with open_client(
            embedded_server_pickle, observers=[OpenTelemetryObserver(sampled_out, otel.meter_provider)]
        ) as c:
            assert await c.lookup(fresh_tokens(32)) == 0
        assert otel.spans() == []
        counts = {
            dict(k)["lmcache.outcome"]: p.count
            for k, p in otel.points("db.client.operation.duration").items()
        }
        assert counts == {"miss": 1}
        asked = {
            dict(k)["db.operation.name"]: p.value
            for k, p in otel.points("lmcache.client.tokens.asked").items()
        }
        assert asked == {"lookup": 32}
    finally:
        sampled_out.shutdown()
        otel.shutdown()


def test_the_blocking_client_takes_the_same_options_and_keeps_the_callers_span(
    embedded_server_pickle: Any, otel: Telemetry
) -> None:
    from lmcache_async import Client

    tracer = otel.tracer_provider.get_tracer("app")
    srv = embedded_server_pickle
    with Client(
        srv.url,
        srv.http_url,
        unique_model(),
        geometry=SMALL_GEOMETRY,
        observers=[OpenTelemetryObserver(otel.tracer_provider)],
    ) as c:
        with tracer.start_as_current_span("outer") as outer:
            assert c.lookup(fresh_tokens(32)) == 0
    lookup, outer_span = otel.spans()
    assert (lookup.name, outer_span.name) == ("lookup", "outer")
    assert lookup.parent is not None and lookup.parent.span_id == outer.get_span_context().span_id
    assert (lookup.attributes or {})["lmcache.outcome"] == "miss"


async def _rebind(mode: str, port: int, http_port: int) -> Any:
    """An embedded server on the ports of one just stopped: libzmq's reaper closes the
    old listening socket in the background, so the port may stay in use a moment (a CI
    run got EADDRINUSE); tried again for at most 10 s."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return _embedded(mode, port=port, http_port=http_port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_a_server_replaced_behind_a_proxy_is_logged_once_at_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    srv = _embedded("pickle")
    port, http_port = int(srv.url.rsplit(":", 1)[1]), int(srv.http_url.rsplit(":", 1)[1])
    toks = fresh_tokens(32)
    try:
        with ZmqForwarder(srv.url) as zf, HttpForwarder(srv.http_url) as hf:
            async with AsyncClient(zf.url, hf.url, unique_model(), geometry=SMALL_GEOMETRY, timeout=20) as c:
                assert await c.store(random_kv(SMALL_GEOMETRY, 32), toks) is True
                assert await c.drain(10)
                with caplog.at_level(logging.DEBUG, logger="lmcache_async"):
                    srv.stop()  # the forwarders keep the client's connections up
                    srv = await _rebind("pickle", port, http_port)
                    await asyncio.sleep(1.2)  # silence: the next operation checks who answers
                    assert await c.lookup(toks) == 0  # the new server is empty
    finally:
        srv.stop()
    got = [(r.levelno, r.getMessage()) for r in client_records(caplog, logging.INFO)]
    assert [level for level, _ in got] == [logging.WARNING] * 3, got
    assert (
        got[0][1]
        == f"the LMCache server behind {zf.url} was replaced (no disconnect seen); registering again"
    )
    assert re.fullmatch(r"retiring registration \d+ \(the server was replaced\): .*", got[1][1])
    assert got[2][1] == f"re-registering {c.model_name} with {zf.url}"
