"""What observing operations costs: client CPU per operation on the concurrent
small-retrieve case with instrumentation off, with the hook only, and with OpenTelemetry
spans and metrics, in the same run.

    .venv/bin/python -m benchmarks.suite.bench_observe [--prompts 256] [--rounds 5]
        [--concurrency 8 64] [--json]

Starts a real LMCache 0.5.6 server (SHM, chunk 256), stores ``--prompts`` one-chunk
prompts (2 layers x 1 KV head x 128, bf16: 256 KiB each, as ``bench_concurrent``) and
retrieves them all with ``c`` tasks on one client (``bench_concurrent.ours``), with three
clients open side by side on the same server:

* ``off``: no observers (the default);
* ``hook``: one observer whose callbacks do nothing (the cost of the records);
* ``otel``: OpenTelemetry SDK providers: a ``TracerProvider`` with a
  ``BatchSpanProcessor`` whose exporter drops the spans, and a ``MeterProvider`` with an
  in-memory reader (every span and every metric recorded; none sent anywhere). Its
  observer also times its own two callbacks (``time.thread_time``): their CPU per
  operation, a direct figure that the noise of a busy machine disturbs less than the
  difference of two whole-process figures;
* ``otel_sampled``: the same with the tracer sampling one trace in ten
  (``ParentBased(TraceIdRatioBased(0.1))``, as a service would run it; the metrics
  stay complete).

Client CPU per operation = ``time.process_time()`` of this process over the run / prompts
(every thread of it, the span processor's included; the server is another process). The
order of the three runs rotates from round to round; round 0 warms up and is not counted.
Reported per concurrency: each run's median µs CPU/op, and per round the ratio
``hook / off`` and ``otel / off`` (median and range; 1.05 = 5 % more CPU per operation).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

import lmcache_async as lmc
from benchmarks.harness import server_python, settle, spread
from benchmarks.suite.bench_concurrent import CS, GEOM, ours
from harness.real_server import RealLMCacheServer
from lmcache_async.otel import OpenTelemetryObserver

MODEL = "bench-observe"
RUNS = ("off", "hook", "otel", "otel_sampled")
#: The sampled run keeps one trace in ten (its metrics stay complete).
SAMPLED_RATIO = 0.1


class _Nothing:
    """An observer that does nothing: what the records themselves cost."""

    def operation_started(self, op: lmc.Operation) -> None:
        return None

    def operation_ended(self, op: lmc.Operation) -> None:
        return None


class _Timed(OpenTelemetryObserver):
    """The OpenTelemetry observer, with the CPU time its two callbacks take (the calling
    thread's), so their own cost per operation is measured directly, apart from the noise
    of the whole process."""

    def __init__(self, tracer_provider: Any, meter_provider: Any) -> None:
        super().__init__(tracer_provider, meter_provider)
        self.cpu = 0.0
        self.calls = 0

    def operation_started(self, op: lmc.Operation) -> Any:
        t = time.thread_time()
        try:
            return super().operation_started(op)
        finally:
            self.cpu += time.thread_time() - t

    def operation_ended(self, op: lmc.Operation) -> None:
        t = time.thread_time()
        try:
            super().operation_ended(op)
        finally:
            self.cpu += time.thread_time() - t
            self.calls += 1


class _Drop(SpanExporter):
    """An exporter that drops the spans (the export's cost is the application's)."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


async def _measure(srv: RealLMCacheServer, prompts: int, rounds: int, conc: list[int]) -> dict[str, Any]:
    raw: dict[int, dict[str, list[float]]] = {c: {r: [] for r in RUNS} for c in conc}
    kv = torch.randn(GEOM.kv_shape(CS), dtype=torch.float32).to(GEOM.dtype)
    stored = [20_000_000 + i * 1000 for i in range(prompts)]
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(_Drop()))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    sampled_provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(SAMPLED_RATIO)))
    sampled_provider.add_span_processor(BatchSpanProcessor(_Drop()))
    sampled_meter = MeterProvider(metric_readers=[InMemoryMetricReader()])
    opts: dict[str, Any] = {"geometry": GEOM, "timeout": 300}
    timed = _Timed(tracer_provider, meter_provider)
    timed_sampled = _Timed(sampled_provider, sampled_meter)
    callbacks: dict[int, list[float]] = {c: [] for c in conc}
    callbacks_sampled: dict[int, list[float]] = {c: [] for c in conc}
    clients = {
        "off": lmc.AsyncClient(srv.url, srv.http_url, MODEL, **opts),
        "hook": lmc.AsyncClient(srv.url, srv.http_url, MODEL, observers=[_Nothing()], **opts),
        "otel": lmc.AsyncClient(srv.url, srv.http_url, MODEL, observers=[timed], **opts),
        "otel_sampled": lmc.AsyncClient(srv.url, srv.http_url, MODEL, observers=[timed_sampled], **opts),
    }
    try:
        for client in clients.values():
            await client.open()
            assert client.transfer == "shm", client.transfer
        settled = await settle()
        await ours(clients["off"], "store", stored, kv, 8)
        for rnd in range(rounds + 1):
            order = RUNS[rnd % len(RUNS) :] + RUNS[: rnd % len(RUNS)]
            for c in conc:
                for run in order:
                    observer, into = (
                        (timed, callbacks) if run == "otel" else (timed_sampled, callbacks_sampled)
                    )
                    before, calls = observer.cpu, observer.calls
                    _elapsed, cpu = await ours(clients[run], "retrieve", stored, kv, c)
                    if rnd:
                        raw[c][run].append(cpu / prompts)
                        if run in ("otel", "otel_sampled"):
                            assert observer.calls - calls == prompts, (observer.calls - calls, prompts)
                            into[c].append((observer.cpu - before) / prompts)
            print(f"  observe: round {rnd}{' (warm-up)' if rnd == 0 else ''} done", file=sys.stderr)
        server_version = srv.get_json("/lmc_version")
    finally:
        for client in clients.values():
            await client.aclose()
        for provider in (tracer_provider, meter_provider, sampled_provider, sampled_meter):
            provider.shutdown()
    rows = []
    for c in conc:
        data = raw[c]
        rows.append(
            {
                "concurrency": c,
                **{f"{r}_cpu_us_per_op": spread(data[r], scale=1e6, digits=1) for r in RUNS},
                "hook_vs_off": spread(
                    [h / o for h, o in zip(data["hook"], data["off"], strict=True)], digits=3
                ),
                "otel_vs_off": spread(
                    [t / o for t, o in zip(data["otel"], data["off"], strict=True)], digits=3
                ),
                "otel_sampled_vs_off": spread(
                    [t / o for t, o in zip(data["otel_sampled"], data["off"], strict=True)], digits=3
                ),
                "otel_sampled_callbacks_cpu_us_per_op": spread(callbacks_sampled[c], scale=1e6, digits=1),
                "otel_sampled_callbacks_vs_off": spread(
                    [b / o for b, o in zip(callbacks_sampled[c], data["off"], strict=True)], digits=3
                ),
                "otel_callbacks_cpu_us_per_op": spread(callbacks[c], scale=1e6, digits=1),
                "otel_callbacks_vs_off": spread(
                    [b / o for b, o in zip(callbacks[c], data["off"], strict=True)], digits=3
                ),
            }
        )
    return {
        "case": "concurrent small retrieve (one 256-token chunk = 256 KiB per op), SHM",
        "server_version": server_version,
        "prompts": prompts,
        "rounds": rounds,
        "prefault_wait_s": settled,
        "sampled_ratio": SAMPLED_RATIO,
        "rows": rows,
    }


def section(srv: RealLMCacheServer, *, prompts: int, rounds: int, concurrency: list[int]) -> dict[str, Any]:
    """Run the case on ``srv``; blocks until done (each call: a 300 s deadline)."""
    return asyncio.run(_measure(srv, prompts, rounds, concurrency))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    python: Path = server_python("0.5.6")
    t0 = time.perf_counter()
    with RealLMCacheServer("shm", venv_python=python, chunk_size=CS, l1_size_gb=2) as srv:
        result = section(srv, prompts=args.prompts, rounds=args.rounds, concurrency=args.concurrency)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['case']}: {result['prompts']} prompts, {result['rounds']} rounds, medians [range]")
    for r in result["rows"]:
        cpu = "  ".join(f"{k}: {r[f'{k}_cpu_us_per_op']['median']} µs" for k in RUNS)
        print(f"  c{r['concurrency']:<3} CPU/op  {cpu}")
        print(f"        OpenTelemetry callbacks alone: {r['otel_callbacks_cpu_us_per_op']['median']} µs/op")
        for k in (
            "hook_vs_off",
            "otel_vs_off",
            "otel_callbacks_vs_off",
            "otel_sampled_vs_off",
            "otel_sampled_callbacks_vs_off",
        ):
            s = r[k]
            print(f"        {k}: {s['median']}x [{s['min']} .. {s['max']}]")


if __name__ == "__main__":
    main()
