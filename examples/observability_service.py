"""An asyncio service that uses lmcache_async with OpenTelemetry: its spans go to the
console, its metrics to a Prometheus endpoint.

Each request of the service looks for its prompt's KV in LMCache and, on a miss, computes
it (random numbers stand in for the engine's prefill) and stores it; the request is a span
of the service (``handle-request``) and the client's ``retrieve`` and ``store`` spans are
its children. A bulk job (``retrieve_many``) at the end is one parent span with a child per
prompt. The metrics (``db_client_operation_duration_seconds``,
``lmcache_client_tokens_hit_total``, ...) are served by ``prometheus_client`` over HTTP
through the OpenTelemetry Prometheus exporter.

Run it (without ``--url`` it starts an embedded server, ``lmcache_async.testing``, in
this process)::

    pip install 'lmcache-async[otel]' opentelemetry-sdk opentelemetry-exporter-prometheus
    python examples/observability_service.py --metrics-port 9464 --linger 60
    curl -s http://127.0.0.1:9464/metrics | grep lmcache

Once the requests are served it prints ``metrics: http://127.0.0.1:PORT/metrics`` and keeps
serving the metrics for ``--linger`` seconds. tests/system/test_observability.py runs it
and scrapes that endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Iterator, Sequence

import torch
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from prometheus_client import CollectorRegistry, start_http_server

from lmcache_async import AsyncClient, KVGeometry
from lmcache_async.otel import OpenTelemetryObserver

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)


async def handle(client: AsyncClient, prompt: Sequence[int]) -> torch.Tensor:
    """One request: the prompt's KV from LMCache, or computed and stored."""
    kv = await client.retrieve(prompt)
    if kv is None:
        kv = torch.randn(GEOMETRY.kv_shape(len(prompt))).to(GEOMETRY.dtype)  # the "prefill"
        await client.store(kv, prompt)
    return kv


@contextlib.contextmanager
def endpoints(url: str | None, http_url: str | None) -> Iterator[tuple[str, str]]:
    """The server's endpoints: the given ones, or an embedded server's (chunk size 16)."""
    if url is not None and http_url is not None:
        yield url, http_url
        return
    from lmcache_async.testing import EmbeddedServer

    server = EmbeddedServer.start_in_thread(chunk_size=16, mode="pickle")
    try:
        yield server.url, server.http_url
    finally:
        server.stop()


async def main(args: argparse.Namespace) -> None:
    resource = Resource.create({"service.name": "kv-service"})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    registry = CollectorRegistry()
    meter_provider = MeterProvider(
        resource=resource, metric_readers=[PrometheusMetricReader(registry=registry)]
    )
    httpd, _thread = start_http_server(args.metrics_port, addr="127.0.0.1", registry=registry)
    tracer = tracer_provider.get_tracer("kv-service")
    prompts = [list(range(1000 * p, 1000 * p + 48)) for p in range(1, 3)]
    try:
        with endpoints(args.url, args.http_url) as (url, http_url):
            async with AsyncClient(
                url,
                http_url,
                args.model,
                geometry=GEOMETRY,
                observers=[OpenTelemetryObserver(tracer_provider, meter_provider)],
            ) as client:
                for i in range(args.requests):
                    with tracer.start_as_current_span("handle-request"):
                        await handle(client, prompts[i % len(prompts)])
                await client.retrieve_many(prompts)
        print(f"metrics: http://127.0.0.1:{httpd.server_port}/metrics", flush=True)
        await asyncio.sleep(args.linger)
    finally:
        httpd.shutdown()
        tracer_provider.shutdown()
        meter_provider.shutdown()


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="the server's ZMQ endpoint (default: an embedded server)")
    p.add_argument("--http-url", help="the server's HTTP endpoint")
    p.add_argument("--model", default="observability-example")
    p.add_argument("--requests", type=int, default=4, help="requests the service handles (default 4)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (default: a free one)")
    p.add_argument("--linger", type=float, default=0.0, help="seconds to keep serving metrics at the end")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
