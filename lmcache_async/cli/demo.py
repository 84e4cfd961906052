"""``lmcache-async serve`` (the embedded server) and ``lmcache-async demo`` (the KV remap demo).

``serve`` runs :class:`~lmcache_async.testing.EmbeddedServer` in the foreground until
SIGINT/SIGTERM, then removes its SHM segment.

``demo`` runs the KV remap flow end to end: it stores random KV under a source prompt,
retrieves it (checked bitwise), builds a target prompt of the same length that differs
only in a few leading tokens (so nothing of it is cached: chunk keys chain over the whole
prefix), stores the source KV under the target with :meth:`AsyncClient.remap`, looks the
target up and retrieves it, and checks that the target's KV equals the source's bitwise.
It starts an embedded server unless ``--url``/``--http-url`` point at a running one.
Exit code 0 only when the target's KV equals the source's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

from lmcache_async.cli.arguments import port_number
from lmcache_async.errors import LMCacheError

# torch, the client and the embedded server are imported by the commands (where used):
# building the parser (``--help``) does not pay torch's ~2 s import.
if TYPE_CHECKING:
    import torch

    from lmcache_async.geometry import KVGeometry
    from lmcache_async.testing.server import EmbeddedServer, ModelSpec

__all__ = ["register"]

T = TypeVar("T")

#: ``--generation``'s choices: :data:`lmcache_async.testing.GENERATIONS` (tests/system/
#: test_cli_startup.py checks they are equal), named here because importing
#: lmcache_async.testing imports torch.
GENERATIONS: Final = ("0.5.6", "0.5.7")

DEFAULT_MODEL = "lmcache-async-demo"
_VOCAB = 32000


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``serve`` and ``demo`` subcommands."""
    serve = subparsers.add_parser(
        "serve",
        help="run the embedded LMCache-compatible server in the foreground",
        description=(
            "Run the embedded LMCache-compatible MP server (ZMQ + HTTP) until SIGINT/SIGTERM "
            "(a serve started with & by a non-interactive shell ignores SIGINT: stop it with SIGTERM). "
            "It serves the engine-driven protocol of the LMCache 0.5.6 MP server, or of the "
            "0.5.7 generation with --generation 0.5.7; see docs/guides/testing-your-code.md for the "
            "differences."
        ),
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    serve.add_argument(
        "--port", type=port_number, default=5555, help="ZMQ port (0: a free one; default 5555)"
    )
    serve.add_argument(
        "--http-port", type=port_number, default=8080, help="HTTP port (0: a free one; default 8080)"
    )
    serve.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (default 256)")
    serve.add_argument("--mode", choices=("shm", "pickle"), default="shm", help="transfer mode (default shm)")
    serve.add_argument(
        "--generation",
        choices=GENERATIONS,
        default="0.5.6",
        help="LMCache server generation whose wire to speak (default 0.5.6)",
    )
    serve.add_argument(
        "--size", default="1GB", help="L1 byte budget, e.g. 1073741824, 512MB, 2GB (default 1GB)"
    )
    serve.add_argument("--prefault", action="store_true", help="back the whole pool with memory at start")
    serve.add_argument("--shm-name", default=None, help="SHM segment name (default: a unique one)")
    serve.add_argument("--instance-id", default=None, help="/config mp.instance_id (default: a uuid4)")
    _model_args(serve, model_default=None)
    serve.add_argument("--json", action="store_true", help="print the endpoints as one JSON line")
    serve.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    serve.set_defaults(func=_serve)

    demo = subparsers.add_parser(
        "demo",
        help="run the KV remap demo (on an embedded server unless --url is given)",
        description=(
            "Store random KV under a source prompt, retrieve it, remap it to a target prompt "
            "that differs in a few leading tokens, retrieve the target and check that its "
            "KV equals the source's bitwise. Starts an embedded server unless --url and "
            "--http-url are given. Exit code 0 only if the target's KV equals the source's."
        ),
    )
    demo.add_argument(
        "--url",
        default=None,
        help="ZMQ endpoint of a running server (with --http-url; --model and the geometry flags "
        "then describe the KV and are passed as geometry=)",
    )
    demo.add_argument("--http-url", default=None, help="HTTP endpoint of a running server (needs --url)")
    _model_args(demo, model_default=DEFAULT_MODEL)
    demo.add_argument("--chunks", type=int, default=4, help="prompt length in chunks (default 4)")
    demo.add_argument(
        "--chunk-size", type=int, default=256, help="embedded server's chunk size (default 256)"
    )
    demo.add_argument(
        "--mode",
        choices=("shm", "pickle"),
        default="shm",
        help="embedded server's transfer mode (default shm)",
    )
    demo.add_argument(
        "--transfer", choices=("auto", "shm", "pickle"), default="auto", help="client transfer (default auto)"
    )
    demo.add_argument(
        "--size", default=None, help="embedded server's L1 budget (default: what the demo needs)"
    )
    demo.add_argument("--changed-tokens", type=int, default=3, help="leading tokens that differ (default 3)")
    demo.add_argument("--seed", type=int, default=0, help="random seed of tokens and KV (default 0)")
    demo.add_argument(
        "--timeout", type=float, default=60.0, help="deadline of each operation in s (default 60)"
    )
    demo.add_argument("--json", action="store_true", help="print the report as JSON")
    demo.set_defaults(func=_demo)


def _model_args(parser: argparse.ArgumentParser, *, model_default: str | None) -> None:
    what = "the model to declare (shown in /status)" if model_default is None else "model name"
    parser.add_argument("--model", default=model_default, help=what)
    parser.add_argument("--layers", type=int, default=32, help="transformer layers (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads per worker (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size (default 128)")
    parser.add_argument("--block-size", type=int, default=16, help="engine block size (default 16)")
    parser.add_argument("--dtype", default="bfloat16", help="KV dtype (default bfloat16)")


def _usage(message: str) -> int:
    print(f"lmcache-async: error: {message}", file=sys.stderr)
    return 2


def _model_spec(args: argparse.Namespace) -> ModelSpec:
    from lmcache_async.testing.server import ModelSpec

    return ModelSpec(
        args.model,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype=args.dtype,
    )


# --------------------------------------------------------------------------- serve


def _serve(args: argparse.Namespace) -> int:
    from lmcache_async.testing.server import EmbeddedServer, parse_size

    try:
        size = parse_size(args.size)
        models = [_model_spec(args)] if args.model else []
        server = EmbeddedServer(
            host=args.host,
            port=args.port,
            http_port=args.http_port,
            chunk_size=args.chunk_size,
            mode=args.mode,
            size_bytes=size,
            shm_name=args.shm_name if args.mode == "shm" else None,
            models=models,
            instance_id=args.instance_id,
            prefault=args.prefault,
            generation=args.generation,
        )
    except ValueError as exc:
        return _usage(str(exc))
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(_serve_async(server, args))


async def _serve_async(server: EmbeddedServer, args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await server.start()
        except (OSError, RuntimeError) as exc:  # includes zmq.ZMQError (port taken)
            print(f"lmcache-async serve: cannot start: {exc}", file=sys.stderr)
            return 1
        try:
            _print_endpoints(server, args)
            await stop.wait()
        finally:
            await server.stop()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    if not args.json:
        print("stopped", flush=True)
    return 0


def _print_endpoints(server: EmbeddedServer, args: argparse.Namespace) -> None:
    info: dict[str, Any] = {
        "url": server.url,
        "http_url": server.http_url,
        "mode": server.mode,
        "generation": server.generation,
        "chunk_size": server.chunk_size,
        "size_bytes": server.size_bytes,
        "shm_segment": server.shm_segment,
        "models": [m.name for m in server.models],
    }
    if args.json:
        print(json.dumps(info), flush=True)
        return
    lines = [
        f"lmcache-async embedded server: generation {server.generation}, mode {server.mode}, "
        f"chunk size {server.chunk_size}, L1 {_mib(server.size_bytes)}",
        f"  url:       {server.url}",
        f"  http_url:  {server.http_url}",
    ]
    if server.shm_segment:
        lines.append(f"  shm:       {server.shm_segment}")
    for m in server.models:
        lines.append(
            f"  model:     {m.name} ({m.num_layers} layers, {m.num_kv_heads} KV heads x {m.head_dim}, "
            f"{m.dtype}, block {m.block_size})"
        )
    lines.append("  stop with Ctrl-C (SIGINT) or SIGTERM")
    print("\n".join(lines), flush=True)


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------------- demo


def _demo(args: argparse.Namespace) -> int:
    from lmcache_async.geometry import dtype_from_name
    from lmcache_async.testing.server import parse_size

    if (args.url is None) != (args.http_url is None):
        return _usage("--url and --http-url go together")
    for name in ("chunks", "chunk_size", "layers", "kv_heads", "head_dim", "block_size", "changed_tokens"):
        if getattr(args, name) < 1:
            return _usage(f"--{name.replace('_', '-')} must be >= 1")
    if args.timeout <= 0:
        return _usage("--timeout must be positive")
    try:
        dtype = dtype_from_name(args.dtype)
        if args.size is not None:
            parse_size(args.size)
        _model_spec(args)
    except ValueError as exc:
        return _usage(str(exc))
    try:
        report = asyncio.run(_demo_async(args, dtype))
    except (LMCacheError, OSError, RuntimeError, ValueError) as exc:
        message = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, LMCacheError) and args.url is not None:
            import aiohttp

            from lmcache_async.cli.runner import _unreachable

            if isinstance(exc.__cause__, aiohttp.ClientConnectorError):
                message = _unreachable(args, exc)  # as `status` says it: "connection refused"
        if args.json:
            print(json.dumps({"ok": False, "error": message}))
        else:
            print(f"lmcache-async demo: {message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_render(report))
    return 0 if report["ok"] else 1


def bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same shape, dtype and bytes (NaN payloads included)."""
    import torch

    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


async def _timed(fn: Callable[[], Awaitable[T]]) -> tuple[T, float]:
    t0 = time.perf_counter()
    value = await fn()
    return value, (time.perf_counter() - t0) * 1000.0


def _random_kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    import torch

    gen = torch.Generator().manual_seed(seed)
    try:
        return torch.randn(shape, generator=gen, dtype=dtype)
    except (RuntimeError, TypeError):  # dtypes randn cannot produce directly
        return torch.randn(shape, generator=gen).to(dtype)


async def _demo_async(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    import torch

    from lmcache_async.client import AsyncClient
    from lmcache_async.testing.server import EmbeddedServer, parse_size

    spec = _model_spec(args)
    async with contextlib.AsyncExitStack() as stack:
        server: EmbeddedServer | None = None
        geometry: KVGeometry | None
        if args.url is None:
            chunk_bytes = math.prod(spec.layout(args.chunk_size).shape) * dtype.itemsize
            needed = (2 * args.chunks + 2) * (-(-chunk_bytes // 4096) * 4096)
            size = parse_size(args.size) if args.size is not None else max(needed, 16 << 20)
            server = EmbeddedServer(
                chunk_size=args.chunk_size, mode=args.mode, size_bytes=size, models=[spec], prefault=True
            )
            await stack.enter_async_context(server)
            url, http_url = server.url, server.http_url
            geometry = None  # derived from /status, where the server declares the model
        else:
            url, http_url = args.url, args.http_url
            geometry = spec.geometry()
        client = AsyncClient(
            url, http_url, args.model, geometry=geometry, timeout=args.timeout, transfer=args.transfer
        )
        await stack.enter_async_context(client)
        geom = client.geometry
        cs = client.chunk_size
        n = args.chunks * cs
        changed = min(args.changed_tokens, n)
        gen = torch.Generator().manual_seed(args.seed)
        source = torch.randint(0, _VOCAB, (n,), generator=gen).tolist()
        target = list(source)
        for i in range(changed):
            target[i] = (source[i] + 1 + i) % _VOCAB
        kv = _random_kv(geom.kv_shape(n), geom.dtype, args.seed)

        steps: list[dict[str, Any]] = []
        stored, ms = await _timed(lambda: client.store(kv, source))
        steps.append({"step": "store source", "tokens": n if stored else 0, "stored_new": stored, "ms": ms})
        got, ms = await _timed(lambda: client.retrieve(source))
        src_hit = 0 if got is None else got.shape[geom.token_axis]
        src_equal = bitwise_equal(got, kv)
        steps.append({"step": "retrieve source", "tokens": src_hit, "equal": src_equal, "ms": ms})
        del got
        before, ms = await _timed(lambda: client.lookup(target))
        steps.append({"step": "lookup target (before remap)", "tokens": before, "ms": ms})
        remap, ms = await _timed(lambda: client.remap(source, target))
        steps.append(
            {
                "step": "remap source -> target",
                "tokens": remap.stored_tokens,
                "retrieved_tokens": remap.retrieved_tokens,
                "stored_new": remap.stored_new,
                "ms": ms,
            }
        )
        after, ms = await _timed(lambda: client.lookup(target))
        steps.append({"step": "lookup target", "tokens": after, "ms": ms})
        got, ms = await _timed(lambda: client.retrieve(target))
        dst_hit = 0 if got is None else got.shape[geom.token_axis]
        dst_equal = bitwise_equal(got, kv)
        steps.append({"step": "retrieve target", "tokens": dst_hit, "equal": dst_equal, "ms": ms})
        transfer = client.transfer
    return {
        "ok": dst_equal,
        "server": {
            "url": url,
            "http_url": http_url,
            "embedded": server is not None,
            "mode": server.mode if server is not None else None,
        },
        "model": args.model,
        "geometry": {
            "num_layers": geom.num_layers,
            "num_kv_heads": geom.num_kv_heads,
            "head_dim": geom.head_dim,
            "dtype": str(geom.dtype).removeprefix("torch."),
            "block_size": geom.block_size,
        },
        "transfer": transfer,
        "chunk_size": cs,
        "tokens": n,
        "changed_tokens": changed,
        "kv_shape": list(kv.shape),
        "kv_bytes": kv.numel() * kv.element_size(),
        "steps": steps,
        "source_roundtrip_equal": src_equal,
        "target_equals_source": dst_equal,
    }


def _render(report: dict[str, Any]) -> str:
    srv = report["server"]
    where = f"embedded server ({srv['mode']})" if srv["embedded"] else "server"
    g = report["geometry"]
    lines = [
        f"lmcache-async demo on {where} at {srv['url']} (transfer {report['transfer']})",
        f"  model {report['model']}: {g['num_layers']} layers, {g['num_kv_heads']} KV heads x "
        f"{g['head_dim']}, {g['dtype']}; {report['tokens']} tokens = "
        f"{report['tokens'] // report['chunk_size']} chunks of {report['chunk_size']}; "
        f"KV {list(report['kv_shape'])} = {_mib(report['kv_bytes'])}",
        f"  target prompt: the source with its first {report['changed_tokens']} token(s) changed",
        "",
        f"  {'step':<30} {'tokens':>8} {'ms':>10}",
    ]
    for step in report["steps"]:
        extra = ""
        if "equal" in step:
            extra = "  bitwise equal to the source KV" if step["equal"] else "  NOT equal to the source KV"
        if "retrieved_tokens" in step:
            extra = f"  ({step['retrieved_tokens']} retrieved, stored_new={step['stored_new']})"
        elif "stored_new" in step and not step["stored_new"]:
            extra = "  (already cached)"
        lines.append(f"  {step['step']:<30} {step['tokens']:>8} {step['ms']:>10.1f}{extra}")
    verdict = (
        "OK: the target prompt's KV equals the source's bitwise"
        if report["ok"]
        else "FAILED: the target prompt's KV does not equal the source's"
    )
    lines += ["", verdict]
    return "\n".join(lines)
