"""``lmcache-async route``: the routing service (:mod:`lmcache_async.fleet.service`) over a
fleet of LMCache servers, in the foreground until SIGINT/SIGTERM.

Each ``--server URL,HTTP_URL`` is one LMCache server (every one must be up at start);
``--redis URL`` shares the fleet's index with every replica naming the same Redis and
``--namespace`` (default: the model name). When it listens, it prints one line on stdout
(with ``--json``, a JSON object) naming its address; ``stopped`` when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from collections import Counter
from typing import Any

from lmcache_async._protocol.urls import check_zmq_url
from lmcache_async.cli.arguments import (
    add_geometry_args,
    checked_model,
    explicit_geometry,
    port_number,
    timeout_seconds,
)
from lmcache_async.cli.runner import CommandError, UsageError, command, one_line, run_async
from lmcache_async.errors import LMCacheError

__all__ = ["register", "server_pair"]


def server_pair(text: str) -> tuple[str, str]:
    """``type=`` of ``--server``: ``URL,HTTP_URL`` (a ZMQ URL, then an http(s) URL)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(
            f"expected URL,HTTP_URL (e.g. tcp://host:5555,http://host:8080), got {text!r}"
        )
    url, http_url = parts
    try:
        check_zmq_url(url, "the server's URL")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not http_url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"the server's HTTP URL must start with http://, got {http_url!r}")
    return url, http_url


def _seconds(text: str) -> float:
    value = timeout_seconds(text)
    if value is None:
        raise argparse.ArgumentTypeError("a request needs a deadline: give seconds > 0")
    return value


async def _route(args: argparse.Namespace) -> int:
    servers: list[tuple[str, str]] = args.server
    dup = [u for u, n in Counter(u for u, _ in servers).items() if n > 1]
    if dup:
        raise UsageError(f"--server names {dup[0]} twice")
    if args.namespace is not None and args.redis is None:
        raise UsageError("--namespace needs --redis")
    model = checked_model(args.model_name)
    geometry = explicit_geometry(args)
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from aiohttp import web

    from lmcache_async.fleet import Fleet, RedisIndex
    from lmcache_async.fleet.service import create_app

    index = None
    if args.redis is not None:
        try:
            index = RedisIndex(args.redis, args.namespace or model, deadline=args.redis_deadline)
        except ImportError as exc:
            raise CommandError(
                f"--redis needs the fleet extra (pip install 'lmcache-async[fleet]'): {exc}"
            ) from None
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:
        fleet = Fleet(
            servers, model, index=index, geometry=geometry, timeout=args.timeout, fanout=args.fanout
        )
        try:
            await fleet.open()
        except LMCacheError as exc:
            raise CommandError(one_line(str(exc))) from None
        try:
            app = create_app(fleet, deadline=args.deadline)
            return await _serve(web, app, args, fleet, index)
        finally:
            await fleet.aclose()
    finally:
        if index is not None:
            await index.aclose()


async def _serve(web: Any, app: Any, args: argparse.Namespace, fleet: Any, index: Any) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(app, access_log=None)
    try:
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        try:
            await site.start()
        except OSError as exc:
            raise CommandError(f"cannot listen on {args.host}:{args.port}: {one_line(str(exc))}") from None
        port = runner.addresses[0][1]
        info = {
            "url": f"http://{args.host}:{port}",
            "servers": fleet.servers,
            "index": "memory" if index is None else f"redis {args.redis} namespace {index.namespace}",
        }
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            print(
                f"lmcache-async route: serving {info['url']} over {len(fleet.servers)} servers "
                f"(index: {info['index']}); stop with Ctrl-C (SIGINT) or SIGTERM",
                flush=True,
            )
        await stop.wait()
    finally:
        await runner.cleanup()
        for sig in signals:
            loop.remove_signal_handler(sig)
    print("stopped", flush=True)
    return 0


def register(subparsers: Any) -> None:
    """Add ``route`` to the ``lmcache-async`` parser."""
    p = subparsers.add_parser(
        "route",
        help="run the routing service over a fleet of servers (HTTP)",
        description=(
            "Serve POST /score ({'tokens': [...], 'cache_salt': ''} -> each server's cached prefix "
            "and the server to use), GET /healthz and GET /metrics over a fleet of LMCache servers, "
            "until SIGINT/SIGTERM. Replicas naming the same --redis and --namespace share one index."
        ),
    )
    p.add_argument(
        "--server",
        type=server_pair,
        action="append",
        required=True,
        metavar="URL,HTTP_URL",
        help="an LMCache server: its ZMQ and HTTP URLs (repeat for each server)",
    )
    p.add_argument("--model-name", required=True, help="the model whose KV the servers hold")
    p.add_argument(
        "--redis", default=None, metavar="URL", help="share the index on this Redis (redis://host:6379/0)"
    )
    p.add_argument(
        "--namespace",
        default=None,
        metavar="NS",
        help="the shared index's namespace (default: the model name)",
    )
    p.add_argument(
        "--redis-deadline",
        type=_seconds,
        default=0.5,
        metavar="SECONDS",
        help="deadline of each Redis call; past it the request fans out (default 0.5)",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8100, help="port (0: a free one; default 8100)")
    p.add_argument(
        "--deadline",
        type=_seconds,
        default=2.0,
        metavar="SECONDS",
        help="each request's deadline (default 2)",
    )
    p.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=10.0,
        metavar="SECONDS",
        help="deadline of each server operation, opening included (default 10)",
    )
    p.add_argument(
        "--fanout",
        choices=("auto", "always", "never"),
        default="auto",
        help="ask the servers (lookup): on an index miss of the first chunk (auto), always, or never",
    )
    p.add_argument("--json", action="store_true", help="print the listening line as JSON")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    add_geometry_args(p)
    p.set_defaults(func=command(run_async(_route)))
