"""OpenTelemetry spans and metrics of the client's operations, built on the observer hook
(:mod:`lmcache_async.observe`). Needs the ``otel`` extra (``opentelemetry-api``); this
module is imported only when OpenTelemetry is asked for, by
``AsyncClient(..., tracer_provider=..., meter_provider=...)`` or :func:`instrument`.

Spans: one ``CLIENT`` span per operation, named after it (``lookup``, ``retrieve``,
``store``, ``remap``, ``retrieve_many``, ``store_many``, ``remap_many``), after the
OpenTelemetry database-client conventions:

* ``db.system.name`` = ``lmcache``, ``db.operation.name``, ``db.namespace`` (the model),
  ``server.address``, ``server.port``, ``error.type`` (the exception's class name, on a
  failure, timeout or cancellation; the status is then ``ERROR``);
* ``lmcache.transport``, ``lmcache.server_generation``, ``lmcache.chunk_size``,
  ``lmcache.cache_salt_hash`` (never the salt), ``lmcache.tokens.asked``,
  ``lmcache.tokens.hit``, ``lmcache.tokens.stored``, ``lmcache.chunks``,
  ``lmcache.bytes_moved``, ``lmcache.stored_new``, ``lmcache.items`` (a bulk job),
  ``lmcache.outcome`` and ``lmcache.request_ids``: the server-side request ids, which the
  LMCache server's own spans carry as ``session_id`` and its log lines name, so a
  client span joins the server's.

With ``phases=True`` each operation's span has a child span per phase (``lookup``,
``prefetch wait``, ``prepare``, ``copy``, ``commit``). A bulk job's span is the parent of
its items' spans; a pickle remap's span the parent of
its retrieve's and store's. Otherwise a span's parent is the caller's current span.

Metrics (instrument names; the Prometheus exporter writes dots as underscores and adds
the unit and ``_total``):

* ``db.client.operation.duration`` (histogram, s) by ``db.operation.name``,
  ``lmcache.outcome`` and ``error.type``, besides ``db.system.name``, ``server.address``,
  ``server.port``;
* ``lmcache.client.tokens.asked`` / ``.hit`` / ``.stored`` (counters, ``{token}``) and
  ``lmcache.client.bytes_moved`` (counter, By) by operation: counted on the operations that
  talk to the server (a bulk job's items, not the job, so nothing is counted twice);
* ``lmcache.client.errors`` (counter) by operation and ``error.type``;
* ``lmcache.client.operations.in_flight`` (up-down counter) by operation.

Privacy: token ids and cache salts are never given to OpenTelemetry (the hook's records do
not hold them); the salt only as a 12-hex-digit hash, on spans, never on metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

from lmcache_async._version import __version__
from lmcache_async.observe import Operation, add_observer, remove_observer

__all__ = ["DURATION_BUCKETS", "OpenTelemetryObserver", "instrument", "uninstrument"]

#: The histogram's bucket boundaries in seconds (the conventions' advice for
#: ``db.client.operation.duration``).
DURATION_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)

_SCOPE: Final = "lmcache_async"


class OpenTelemetryObserver:
    """An :class:`~lmcache_async.observe.Observer` that turns operations into spans and
    metrics (see the module's documentation).

    Args:
        tracer_provider: where spans go (default: the global one, which records nothing
            until the application sets one).
        meter_provider: where metrics go (default: the global one).
        phases: also a child span (``INTERNAL``) per phase of each operation: ``lookup``,
            ``prefetch wait``, ``prepare``, ``copy``, ``commit`` (see
            :attr:`Operation.phases <lmcache_async.observe.Operation.phases>`).
    """

    def __init__(
        self, tracer_provider: Any = None, meter_provider: Any = None, *, phases: bool = False
    ) -> None:
        #: Read by the client: its operations note their phases for this observer.
        self.wants_phases = bool(phases)
        self._tracer = trace.get_tracer(_SCOPE, __version__, tracer_provider=tracer_provider)
        meter = metrics.get_meter(_SCOPE, __version__, meter_provider=meter_provider)
        self._duration = meter.create_histogram(
            "db.client.operation.duration",
            unit="s",
            description="Duration of lmcache_async operations, as the caller waited",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
        )
        # The counters and the in-flight count are kept here as plain numbers per operation
        # name and read by the meter when it collects (observable instruments): an
        # operation costs a few additions, not an SDK call per instrument.
        #: Per operation name: [operations in flight, tokens asked, hit, stored, bytes moved].
        self._totals: dict[str, list[int]] = {}
        self._errors = meter.create_counter(
            "lmcache.client.errors", unit="{error}", description="Operations that failed, by error type"
        )
        meter.create_observable_up_down_counter(
            "lmcache.client.operations.in_flight",
            [self._reader(0)],
            unit="{operation}",
            description="Operations running",
        )
        for i, (name, unit, description) in enumerate(
            (
                ("lmcache.client.tokens.asked", "{token}", "Tokens given to operations"),
                ("lmcache.client.tokens.hit", "{token}", "Tokens found cached"),
                ("lmcache.client.tokens.stored", "{token}", "Tokens covered by stores"),
                ("lmcache.client.bytes_moved", "By", "Bytes of KV copied to or from the server"),
            ),
            start=1,
        ):
            meter.create_observable_counter(name, [self._reader(i)], unit=unit, description=description)
        #: A span's first attributes, made once per operation name and client.
        self._starts: dict[tuple[Any, ...], dict[str, Any]] = {}
        #: The duration's attributes, made once per (operation, outcome, error type, server).
        self._labels: dict[tuple[str, str, str | None, str, int | None], dict[str, Any]] = {}

    def _reader(self, index: int) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """The callback of an observable instrument: total ``index`` per operation name
        (skipped while 0, so a counter appears with its first token)."""

        def read(_options: CallbackOptions) -> Iterable[Observation]:
            return [
                Observation(totals[index], {"db.operation.name": name})
                for name, totals in list(self._totals.items())
                if totals[index] or index == 0
            ]

        return read

    def __repr__(self) -> str:
        return "<lmcache_async.otel.OpenTelemetryObserver>"

    def operation_started(self, op: Operation) -> trace.Span:
        """Start the operation's span (the parent's span, or the current one, its parent)."""
        parent = op.parent.state.get(self) if op.parent is not None else None
        context = trace.set_span_in_context(parent) if parent is not None else None
        attributes = self._start_attributes(op)
        if op.cache_salt_hash is not None:
            attributes = {**attributes, "lmcache.cache_salt_hash": op.cache_salt_hash}
        totals = self._totals.get(op.name)
        if totals is None:
            totals = self._totals[op.name] = [0, 0, 0, 0, 0]
        totals[0] += 1
        return self._tracer.start_span(op.name, context=context, kind=SpanKind.CLIENT, attributes=attributes)

    def _start_attributes(self, op: Operation) -> dict[str, Any]:
        """The attributes a span starts with but the salt's hash, made once per operation
        name and client (the SDK copies them: the dict is shared, never changed)."""
        key = (
            op.name,
            op.model_name,
            op.server_address,
            op.server_port,
            op.transport,
            op.server_generation,
            op.chunk_size,
        )
        found = self._starts.get(key)
        if found is None:
            found = {
                "db.system.name": "lmcache",
                "db.operation.name": op.name,
                "db.namespace": op.model_name,
                "server.address": op.server_address,
            }
            if op.server_port is not None:
                found["server.port"] = op.server_port
            if op.transport is not None:
                found["lmcache.transport"] = op.transport
            if op.server_generation is not None:
                found["lmcache.server_generation"] = op.server_generation
            if op.chunk_size is not None:
                found["lmcache.chunk_size"] = op.chunk_size
            self._starts[key] = found
        return found

    def operation_ended(self, op: Operation) -> None:
        """End the span with the operation's facts; record its metrics."""
        span: trace.Span | None = op.state.get(self)
        totals = self._totals[op.name]
        totals[0] -= 1
        if span is not None and not span.is_recording():  # sampled out: nothing to add
            span.end()
        elif span is not None:
            facts: dict[str, Any] = {
                "lmcache.tokens.asked": op.tokens_asked,
                "lmcache.tokens.hit": op.tokens_hit,
                "lmcache.tokens.stored": op.tokens_stored,
                "lmcache.chunks": op.chunks,
                "lmcache.bytes_moved": op.bytes_moved,
                "lmcache.outcome": op.outcome or "error",
                "lmcache.request_ids": tuple(op.request_ids),
            }
            if op.stored_new is not None:
                facts["lmcache.stored_new"] = op.stored_new
            if op.items is not None:
                facts["lmcache.items"] = op.items
            if op.error_type is not None:
                facts["error.type"] = op.error_type
                span.set_status(Status(StatusCode.ERROR, op.error_type))
            span.set_attributes(facts)
            if op.phases:
                inside = trace.set_span_in_context(span)
                for name, start, end in op.phases:
                    child = self._tracer.start_span(
                        name, context=inside, kind=SpanKind.INTERNAL, start_time=start
                    )
                    child.end(end_time=end)
            span.end()
        outcome = op.outcome or "error"
        key = (op.name, outcome, op.error_type, op.server_address, op.server_port)
        labels = self._labels.get(key)
        if labels is None:
            labels = self._labels[key] = {
                "db.system.name": "lmcache",
                "db.operation.name": op.name,
                "server.address": op.server_address,
                "lmcache.outcome": outcome,
            }
            if op.server_port is not None:
                labels["server.port"] = op.server_port
            if op.error_type is not None:
                labels["error.type"] = op.error_type
        self._duration.record(op.duration or 0.0, labels)
        if op.children:
            return  # its children were counted
        totals[1] += op.tokens_asked
        totals[2] += op.tokens_hit
        totals[3] += op.tokens_stored
        totals[4] += op.bytes_moved
        if op.error_type is not None:
            self._errors.add(1, {"db.operation.name": op.name, "error.type": op.error_type})


_instrumented: OpenTelemetryObserver | None = None


def instrument(
    tracer_provider: Any = None, meter_provider: Any = None, *, phases: bool = False
) -> OpenTelemetryObserver:
    """Give every client made from now on spans and metrics (an
    :class:`OpenTelemetryObserver`, through :func:`~lmcache_async.observe.add_observer`).

    Args:
        tracer_provider: default: the global ``TracerProvider`` (the one an
            ``opentelemetry-instrument`` run configures from the ``OTEL_*`` variables).
        meter_provider: default: the global ``MeterProvider`` (likewise).
        phases: a child span per phase of each operation (see :class:`OpenTelemetryObserver`).

    Returns:
        The observer (calling again replaces it).
    """
    global _instrumented
    uninstrument()
    _instrumented = OpenTelemetryObserver(tracer_provider, meter_provider, phases=phases)
    add_observer(_instrumented)
    return _instrumented


def uninstrument() -> None:
    """Undo :func:`instrument` for clients made from now on."""
    global _instrumented
    if _instrumented is not None:
        remove_observer(_instrumented)
        _instrumented = None
