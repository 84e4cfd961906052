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

A bulk job's span is the parent of its items' spans; a pickle remap's span the parent of
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

from typing import Any, Final

from opentelemetry import metrics, trace
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
    """

    def __init__(self, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        self._tracer = trace.get_tracer(_SCOPE, __version__, tracer_provider=tracer_provider)
        meter = metrics.get_meter(_SCOPE, __version__, meter_provider=meter_provider)
        self._duration = meter.create_histogram(
            "db.client.operation.duration",
            unit="s",
            description="Duration of lmcache_async operations, as the caller waited",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
        )
        self._asked = meter.create_counter(
            "lmcache.client.tokens.asked", unit="{token}", description="Tokens given to operations"
        )
        self._hit = meter.create_counter(
            "lmcache.client.tokens.hit", unit="{token}", description="Tokens found cached"
        )
        self._stored = meter.create_counter(
            "lmcache.client.tokens.stored", unit="{token}", description="Tokens covered by stores"
        )
        self._bytes = meter.create_counter(
            "lmcache.client.bytes_moved", unit="By", description="Bytes of KV copied to or from the server"
        )
        self._errors = meter.create_counter(
            "lmcache.client.errors", unit="{error}", description="Operations that failed, by error type"
        )
        self._in_flight = meter.create_up_down_counter(
            "lmcache.client.operations.in_flight", unit="{operation}", description="Operations running"
        )

    def __repr__(self) -> str:
        return "<lmcache_async.otel.OpenTelemetryObserver>"

    def operation_started(self, op: Operation) -> trace.Span:
        """Start the operation's span (the parent's span, or the current one, its parent)."""
        parent = op.parent.state.get(self) if op.parent is not None else None
        context = trace.set_span_in_context(parent) if parent is not None else None
        attributes: dict[str, Any] = {
            "db.system.name": "lmcache",
            "db.operation.name": op.name,
            "db.namespace": op.model_name,
            "server.address": op.server_address,
        }
        if op.server_port is not None:
            attributes["server.port"] = op.server_port
        if op.transport is not None:
            attributes["lmcache.transport"] = op.transport
        if op.server_generation is not None:
            attributes["lmcache.server_generation"] = op.server_generation
        if op.chunk_size is not None:
            attributes["lmcache.chunk_size"] = op.chunk_size
        if op.cache_salt_hash is not None:
            attributes["lmcache.cache_salt_hash"] = op.cache_salt_hash
        self._in_flight.add(1, {"db.operation.name": op.name})
        return self._tracer.start_span(op.name, context=context, kind=SpanKind.CLIENT, attributes=attributes)

    def operation_ended(self, op: Operation) -> None:
        """End the span with the operation's facts; record its metrics."""
        span: trace.Span | None = op.state.get(self)
        self._in_flight.add(-1, {"db.operation.name": op.name})
        if span is not None:
            span.set_attributes(
                {
                    "lmcache.tokens.asked": op.tokens_asked,
                    "lmcache.tokens.hit": op.tokens_hit,
                    "lmcache.tokens.stored": op.tokens_stored,
                    "lmcache.chunks": op.chunks,
                    "lmcache.bytes_moved": op.bytes_moved,
                    "lmcache.outcome": op.outcome or "error",
                    "lmcache.request_ids": tuple(op.request_ids),
                }
            )
            if op.stored_new is not None:
                span.set_attribute("lmcache.stored_new", op.stored_new)
            if op.items is not None:
                span.set_attribute("lmcache.items", op.items)
            if op.error_type is not None:
                span.set_attribute("error.type", op.error_type)
                span.set_status(Status(StatusCode.ERROR, op.error_type))
            span.end()
        common: dict[str, Any] = {
            "db.system.name": "lmcache",
            "db.operation.name": op.name,
            "server.address": op.server_address,
            "lmcache.outcome": op.outcome or "error",
        }
        if op.server_port is not None:
            common["server.port"] = op.server_port
        if op.error_type is not None:
            common["error.type"] = op.error_type
        self._duration.record(op.duration or 0.0, common)
        if op.children:
            return  # its children were counted
        by_op = {"db.operation.name": op.name}
        if op.tokens_asked:
            self._asked.add(op.tokens_asked, by_op)
        if op.tokens_hit:
            self._hit.add(op.tokens_hit, by_op)
        if op.tokens_stored:
            self._stored.add(op.tokens_stored, by_op)
        if op.bytes_moved:
            self._bytes.add(op.bytes_moved, by_op)
        if op.error_type is not None:
            self._errors.add(1, {"db.operation.name": op.name, "error.type": op.error_type})


_instrumented: OpenTelemetryObserver | None = None


def instrument(tracer_provider: Any = None, meter_provider: Any = None) -> OpenTelemetryObserver:
    """Give every client made from now on spans and metrics (an
    :class:`OpenTelemetryObserver`, through :func:`~lmcache_async.observe.add_observer`).

    Args:
        tracer_provider, meter_provider: default: the global providers (those an
            ``opentelemetry-instrument`` run configures from the ``OTEL_*`` variables).

    Returns:
        The observer (calling again replaces it).
    """
    global _instrumented
    uninstrument()
    _instrumented = OpenTelemetryObserver(tracer_provider, meter_provider)
    add_observer(_instrumented)
    return _instrumented


def uninstrument() -> None:
    """Undo :func:`instrument` for clients made from now on."""
    global _instrumented
    if _instrumented is not None:
        remove_observer(_instrumented)
        _instrumented = None
