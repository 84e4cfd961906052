"""The KV-cache subcommands of ``lmcache-async``.

``status``
    Server health, chunk size, transfer mode, the transport a client would use, active
    sessions, and the models an inference engine registered, with their geometry.
``make-package`` / ``store`` / ``lookup`` / ``retrieve``
    The official SDK example script's commands and flags, reading and writing its KV
    package files (a ``torch.save`` of ``{"kv", "model_name", "tokens", "cache_salt"}``,
    loaded with ``torch.load(weights_only=True)`` only).
``remap`` / ``remap-batch``
    One remap from the command line; a JSONL file of pairs with a progress bar, a JSONL
    report, bounded concurrency and memory, and ``--resume``.

Every server command takes ``--url`` (ZMQ), ``--http-url``, ``--model-name``,
``--timeout``, ``--json`` and the geometry flags ``--num-layers --num-kv-heads --head-dim
--block-size --dtype`` (for servers where no inference engine registered the model;
without them the geometry comes from ``/status``). Errors are one line on stderr
(``lmcache-async <command>: error: ...``) with exit code 1 (2 for usage errors).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import aiohttp
import torch

from lmcache_async.bulk import BatchProgress, ItemResult, RemapPair
from lmcache_async.client import AsyncClient
from lmcache_async.connection import Connection
from lmcache_async.errors import (
    LMCacheConnectionError,
    LMCacheError,
    LMCacheTimeoutError,
    ModelNotRegisteredError,
    ProtocolError,
    TransferError,
)
from lmcache_async.geometry import KVGeometry, dtype_from_name, dtype_name
from lmcache_async.metadata import Metadata
from lmcache_async.sharding import select_shard, shard_arg
from lmcache_async.shm import ShmPool
from lmcache_async.wire import Op

__all__ = ["load_package", "parse_byte_size", "parse_token_spec", "register", "save_package"]

PROG: Final = "lmcache-async"
DEFAULT_URL: Final = "tcp://localhost:5555"
DEFAULT_HTTP_URL: Final = "http://localhost:8080"
PACKAGE_DTYPES: Final = ("float32", "float16", "bfloat16")
SHM_PREFIX: Final = "lmcache_l1_pool_"
#: Model name of the throwaway registration of `status --probe`.
PROBE_MODEL: Final = "lmcache-async-probe"
#: Seconds between two redraws of the progress bar.
_BAR_INTERVAL: Final = 0.1


class CommandError(Exception):
    """A failure reported as one line on stderr; ``code`` is the exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class UsageError(CommandError):
    def __init__(self, message: str) -> None:
        super().__init__(message, 2)


# --------------------------------------------------------------------------- parsing helpers


_RANGE: Final = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_token_spec(spec: str) -> list[int]:
    """Token ids from ``"0:1024"`` (a half-open range), ``"1,2,3"`` or a mix such as
    ``"0:16,100:116,7"``.

    Raises:
        ValueError: an empty or malformed spec, or a range whose end precedes its start.
    """
    tokens: list[int] = []
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in parts):
        raise ValueError(f"empty token list in {spec!r}")
    for part in parts:
        m = _RANGE.match(part)
        if m:
            start, end = int(m.group(1)), int(m.group(2))
            if end < start:
                raise ValueError(f"range {part!r} ends before it starts")
            tokens.extend(range(start, end))
        elif part.isdigit():
            tokens.append(int(part))
        else:
            raise ValueError(f"{part!r} is neither a token id nor a range START:END")
    return tokens


_SIZE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_byte_size(text: str) -> int:
    """``"1073741824"``, ``"512M"``, ``"2GiB"``, ``"1.5g"`` -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a byte size: {text!r} (e.g. 1073741824, 512M, 2GiB)")
    scale = 1024 ** " kmgt".index(m.group(2).lower() or " ")
    value = int(float(m.group(1)) * scale)
    if value < 1:
        raise ValueError(f"byte size must be at least 1, got {text!r}")
    return value


def _token_spec(text: str) -> list[int]:
    try:
        return parse_token_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _timeout(text: str) -> float | None:
    if text.lower() in ("none", "inf"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds (or 'none'), got {text!r}")
    return value


# --------------------------------------------------------------------------- packages


@dataclass(frozen=True, slots=True)
class Package:
    """A KV package file: ``kv`` ``[2, L, T, D]`` for ``tokens`` of ``model_name``."""

    kv: torch.Tensor
    model_name: str
    tokens: list[int]
    cache_salt: str


def load_package(path: str | os.PathLike[str]) -> Package:
    """Read a KV package written by the official example's ``make-package`` (or ours).

    Only ``torch.load(..., weights_only=True)`` is used: a file that needs anything but
    tensors, strings, ints, lists and dicts is refused.

    Raises:
        CommandError: unreadable, not a package, or inconsistent.
    """
    try:
        obj = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CommandError(f"{path}: no such file") from None
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CommandError(f"{path}: not a loadable KV package ({first})") from None
    if not isinstance(obj, dict):
        raise CommandError(f"{path}: not a KV package (a {type(obj).__name__}, not a dict)")
    missing = [k for k in ("kv", "model_name", "tokens") if k not in obj]
    if missing:
        raise CommandError(f"{path}: not a KV package (missing {', '.join(missing)})")
    kv, model, tokens, salt = obj["kv"], obj["model_name"], obj["tokens"], obj.get("cache_salt", "")
    if not isinstance(kv, torch.Tensor) or kv.dim() not in (3, 4):
        raise CommandError(f"{path}: 'kv' must be a [2, L, T, D] tensor")
    if not isinstance(model, str) or not isinstance(salt, str):
        raise CommandError(f"{path}: 'model_name' and 'cache_salt' must be strings")
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    if not isinstance(tokens, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise CommandError(f"{path}: 'tokens' must be a list of ints")
    axis = kv.dim() - 2
    if kv.shape[axis] != len(tokens):
        raise CommandError(f"{path}: 'kv' holds {kv.shape[axis]} tokens but 'tokens' has {len(tokens)}")
    return Package(kv, model, list(tokens), salt)


def save_package(path: str | os.PathLike[str], package: Package) -> None:
    """Write ``package`` in the official example's format."""
    torch.save(
        {
            "kv": package.kv.contiguous(),
            "model_name": package.model_name,
            "tokens": list(package.tokens),
            "cache_salt": package.cache_salt,
        },
        path,
    )


# --------------------------------------------------------------------------- output


def _emit(args: argparse.Namespace, data: dict[str, Any], rows: Sequence[tuple[str, str]]) -> None:
    """``--json``: ``data`` as indented JSON; otherwise ``rows`` as an aligned table."""
    if args.json:
        print(json.dumps(data, indent=2))
        return
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        print(f"{key:<{width}}  {value}".rstrip())


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]
    ]


def _salt(salt: str) -> str:
    return repr(salt) if salt else "'' (none)"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _chunks(n: int, cs: int) -> str:
    c = n // cs
    return f"{n} tokens ({c} chunk{'s' if c != 1 else ''})"


# --------------------------------------------------------------------------- connecting


def _check_url(args: argparse.Namespace) -> None:
    if args.url.startswith(("http://", "https://")):
        raise UsageError(
            f"--url is the ZMQ endpoint (e.g. {DEFAULT_URL}); give the HTTP endpoint {args.url} as --http-url"
        )
    if "://" not in args.url:
        raise UsageError(f"--url must look like tcp://host:port, got {args.url!r}")
    if not args.http_url.startswith(("http://", "https://")):
        raise UsageError(f"--http-url must start with http://, got {args.http_url!r}")


def _explicit_geometry(args: argparse.Namespace) -> KVGeometry | None:
    core = {"--num-layers": args.num_layers, "--num-kv-heads": args.num_kv_heads, "--head-dim": args.head_dim}
    given = [k for k, v in core.items() if v is not None]
    extra = args.block_size is not None or args.dtype is not None
    if not given and not extra:
        return None
    if len(given) != len(core):
        missing = ", ".join(k for k in core if k not in given)
        raise UsageError(
            f"an explicit geometry needs --num-layers, --num-kv-heads and --head-dim (missing {missing})"
        )
    try:
        return KVGeometry(
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            dtype=dtype_from_name(args.dtype or "bfloat16"),
            block_size=args.block_size or 16,
        )
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _unreachable(args: argparse.Namespace, exc: LMCacheError) -> CommandError:
    """A one-line message for a server that cannot be reached (or does not answer)."""
    cause = exc.__cause__
    if isinstance(exc, LMCacheTimeoutError):
        where = args.http_url if exc.operation.startswith("GET") else args.url
        return CommandError(
            f"the LMCache server at {where} did not answer {exc.operation} within {exc.elapsed:.1f} s"
        )
    if isinstance(cause, aiohttp.ClientConnectorError):
        os_error = cause.os_error
        if isinstance(os_error, ConnectionRefusedError):
            reason = "connection refused"
        else:
            reason = _one_line(os_error.strerror or str(os_error)) or type(os_error).__name__
        return CommandError(f"cannot reach the LMCache server at {args.http_url}: {reason}")
    return CommandError(_one_line(str(exc)))


def _model_error(exc: ModelNotRegisteredError) -> CommandError:
    known = ", ".join(repr(m) for m in exc.registered) if exc.registered else "none"
    return CommandError(
        f"model {exc.model_name!r} is not registered on the server (registered: {known}); "
        "pass --num-layers, --num-kv-heads and --head-dim (and --block-size, --dtype)"
    )


async def _connect(
    args: argparse.Namespace, model_name: str, geometry: KVGeometry | None = None
) -> AsyncClient:
    client = AsyncClient(
        args.url,
        args.http_url,
        model_name,
        geometry=geometry if geometry is not None else _explicit_geometry(args),
        timeout=args.timeout,
    )
    await client.open()
    return client


def _sync(
    body: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        return asyncio.run(body(args))

    return run


def _runner(body: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``body`` run with the one-line error handling and exit codes of every command."""

    def func(args: argparse.Namespace) -> int:
        try:
            if hasattr(args, "url"):
                _check_url(args)
            return body(args)
        except CommandError as exc:
            code, message = exc.code, str(exc)
        except ModelNotRegisteredError as exc:
            code, message = 1, str(_model_error(exc))
        except (LMCacheConnectionError, LMCacheTimeoutError) as exc:
            code, message = 1, str(_unreachable(args, exc))
        except LMCacheError as exc:
            code, message = 1, _one_line(str(exc))
        except OSError as exc:
            code, message = 1, _one_line(str(exc))
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return code

    return func


# --------------------------------------------------------------------------- status


async def _status(args: argparse.Namespace) -> int:
    meta = Metadata(args.http_url, ttl=0)
    try:
        healthy = await meta.healthcheck(timeout=args.timeout)
        config = await meta.config(timeout=args.timeout)
        status = await meta.status(timeout=args.timeout)
        version = await _version(meta, args.timeout)
    finally:
        await meta.close()
    mp = Metadata.mp_section(config)
    chunk_size = mp.get("chunk_size")
    mode = str(mp.get("supported_transfer_mode", "?"))
    zmq_ok, rtt = await _noop(args.url, min(args.timeout or 5.0, 5.0))
    if args.probe:
        transport = await _probe_transport(args, chunk_size if isinstance(chunk_size, int) else 16)
    else:
        transport = _predict_transport(config, mode)
    models = _models(status)
    clients = _engine_clients(status)
    model_info: dict[str, Any] | None = None
    if args.model_name:
        model_info = next((m for m in models if m["model_name"] == args.model_name), None)
    data: dict[str, Any] = {
        "http_url": args.http_url,
        "url": args.url,
        "healthy": healthy,
        "zmq_reachable": zmq_ok,
        "noop_rtt_ms": None if rtt is None else round(rtt * 1e3, 3),
        "version": version,
        "chunk_size": chunk_size,
        "supported_transfer_mode": mode,
        "transport": transport,
        "server_instance_id": mp.get("instance_id"),
        "active_sessions": status.get("active_sessions"),
        "active_prefetch_jobs": status.get("active_prefetch_jobs"),
        "models": models,
        "engine_driven_clients": clients,
    }
    if args.model_name:
        data["model"] = {"model_name": args.model_name, "registered": model_info is not None}
    rows = [
        ("server", f"{args.http_url} ({'healthy' if healthy else 'UNHEALTHY'})"),
        ("zmq", f"{args.url} ({'answers noop' if zmq_ok else 'NO ANSWER to noop'})"),
        ("version", str(version)),
        ("chunk size", f"{chunk_size} tokens"),
        ("transfer mode", f"{mode} ({_mode_note(mode)})"),
        ("transport", f"{transport['mode'] or 'none'}: {transport['detail']} [{transport['how']}]"),
        (
            "sessions",
            f"{status.get('active_sessions')} active, {status.get('active_prefetch_jobs')} prefetch jobs",
        ),
        ("clients", f"{len(clients)} engine-driven registration{'s' if len(clients) != 1 else ''}"),
    ]
    if args.model_name:
        rows.append(("model", f"{args.model_name} ({'registered' if model_info else 'not registered'})"))
    rows.append(("models", "none registered by an inference engine" if not models else f"{len(models)}"))
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _emit(args, data, rows)
        if models:
            header = [
                "model",
                "world",
                "layers",
                "kv heads",
                "head dim",
                "dtype",
                "block",
                "mla",
                "bytes/token",
            ]
            table = [
                [
                    m["model_name"],
                    str(m["world_size"]),
                    *(
                        [
                            str(m["num_layers"]),
                            str(m["num_kv_heads"]),
                            str(m["head_dim"]),
                            m["dtype"],
                            str(m["block_size"]),
                            "yes" if m["use_mla"] else "no",
                            str(m["bytes_per_token"]),
                        ]
                        if "error" not in m
                        else [f"(cannot decode: {m['error']})", "", "", "", "", "", ""]
                    ),
                ]
                for m in models
            ]
            for line in _table(header, table):
                print(f"  {line}")
    return 0 if healthy and zmq_ok else 1


def _mode_note(mode: str) -> str:
    if mode in ("auto", "engine_driven"):
        return "serves this client"
    return "does NOT serve engine-driven clients; start it with --supported-transfer-mode auto"


async def _version(meta: Metadata, timeout: float | None) -> str | None:
    with contextlib.suppress(LMCacheError):
        code, doc = await meta._get_json("/lmc_version", timeout)
        if code == 200 and isinstance(doc, str):
            return doc
    return None


async def _noop(url: str, timeout: float) -> tuple[bool, float | None]:
    conn = Connection(url)
    try:
        await conn.open()
        t0 = time.perf_counter()
        reply = await conn.call(Op.NOOP, (), timeout=timeout)
        return reply.value() == "OK", time.perf_counter() - t0
    except LMCacheError:
        return False, None
    finally:
        await conn.close()


def _predict_transport(config: dict[str, Any], mode: str) -> dict[str, Any]:
    """What a client would use, from ``/config`` and an attempt to map the segment.

    The server's register reply is the only authoritative answer (``--probe`` asks it);
    this reads the *effective* L1 memory config (the server rewrites it when ``/dev/shm``
    is too small or allocation is lazy) and tries to map the segment it names.
    """
    how = "predicted from /config and a map attempt"
    if mode not in ("auto", "engine_driven"):
        return {"mode": None, "how": how, "detail": "the server does not serve engine-driven clients"}
    memory: dict[str, Any] = {}
    with contextlib.suppress(AttributeError, TypeError, KeyError):
        memory = dict(config["storage_manager"]["l1_manager_config"]["memory_config"])
    shm_name = memory.get("shm_name") or ""
    size = memory.get("size_in_bytes")
    if not shm_name or memory.get("use_lazy") or not isinstance(size, int) or size <= 0:
        return {"mode": "pickle", "how": how, "detail": "the server has no SHM pool"}
    bare = str(shm_name).lstrip("/")
    segment = bare if bare.startswith(SHM_PREFIX) else SHM_PREFIX + bare
    try:
        ShmPool(segment, size).close()
    except TransferError as exc:
        return {
            "mode": "pickle",
            "how": how,
            "segment": f"/dev/shm/{segment}",
            "detail": f"stores only: the server keeps its KV in SHM this host cannot map ({exc})",
        }
    return {
        "mode": "shm",
        "how": how,
        "segment": f"/dev/shm/{segment}",
        "detail": f"/dev/shm/{segment} ({size / 2**30:.2f} GiB) maps",
    }


async def _probe_transport(args: argparse.Namespace, chunk_size: int) -> dict[str, Any]:
    """Register a throwaway engine-driven context and ask the server (authoritative)."""
    name = PROBE_MODEL
    geometry = KVGeometry(1, 1, 8, torch.bfloat16, block_size=chunk_size)
    how = f"probed: registered {name!r} and unregistered it"
    try:
        client = await _connect(args, name, geometry)
    except LMCacheError as exc:
        return {"mode": None, "how": how, "detail": f"registration failed: {_one_line(str(exc))}"}
    try:
        mode = client.transfer
        detail = "the server's SHM pool maps" if mode == "shm" else "the server offers no SHM pool"
        return {"mode": mode, "how": how, "detail": detail}
    finally:
        await client.aclose()


def _models(status: dict[str, Any]) -> list[dict[str, Any]]:
    meta = status.get("cache_context_meta") or {}
    out: list[dict[str, Any]] = []
    if not isinstance(meta, dict):
        return out
    for entry in meta.values():
        if not isinstance(entry, dict):
            continue
        row: dict[str, Any] = {
            "model_name": str(entry.get("model_name")),
            "world_size": entry.get("world_size", 1),
        }
        try:
            g = KVGeometry.from_context_meta(entry)
        except (ProtocolError, ValueError, TypeError) as exc:
            row["error"] = _one_line(str(exc))
        else:
            row.update(
                num_layers=g.num_layers,
                num_kv_heads=g.num_kv_heads,
                head_dim=g.head_dim,
                dtype=dtype_name(g.dtype),
                block_size=g.block_size,
                use_mla=g.use_mla,
                bytes_per_token=g.bytes_per_token,
            )
        out.append(row)
    return sorted(out, key=lambda r: r["model_name"])


def _engine_clients(status: dict[str, Any]) -> list[dict[str, Any]]:
    meta = status.get("non_cuda_context_meta") or {}
    if not isinstance(meta, dict):
        return []
    return [
        {
            "instance_id": str(k),
            **{f: v.get(f) for f in ("model_name", "world_size", "block_size", "use_mla")},
        }
        for k, v in sorted(meta.items())
        if isinstance(v, dict)
    ]


# --------------------------------------------------------------------------- packages: commands


def _make_package(args: argparse.Namespace) -> int:
    try:
        dtype = dtype_from_name(args.dtype)
    except ValueError as exc:
        print(f"{PROG} make-package: error: {exc}", file=sys.stderr)
        return 2
    num_tokens = args.chunk_size * args.num_chunks
    tokens = list(range(args.token_start, args.token_start + num_tokens))
    # Same generator use as the official example, so equal flags give equal bytes.
    torch.manual_seed(args.seed)
    kv = torch.randn((2, args.num_layers, num_tokens, args.hidden_dim), dtype=dtype)
    try:
        save_package(args.output, Package(kv, args.model_name, tokens, args.cache_salt))
    except OSError as exc:
        print(f"{PROG} make-package: error: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    data = {
        "output": str(args.output),
        "model_name": args.model_name,
        "cache_salt": args.cache_salt,
        "shape": list(kv.shape),
        "dtype": args.dtype,
        "token_start": args.token_start,
        "num_tokens": num_tokens,
    }
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(f"wrote {args.output} with shape {tuple(kv.shape)} and dtype {kv.dtype}")
    return 0


async def _store(args: argparse.Namespace) -> int:
    pkg = load_package(args.input)
    model = args.model_name or pkg.model_name
    salt = pkg.cache_salt if args.cache_salt is None else args.cache_salt
    geometry = _explicit_geometry(args)
    how = "flags"
    if geometry is None:
        geometry, how = await _package_geometry(args, model, pkg)
    want = geometry.kv_shape(len(pkg.tokens))
    if tuple(pkg.kv.shape) != want or pkg.kv.dtype != geometry.dtype:
        raise CommandError(
            f"{args.input}: kv is {list(pkg.kv.shape)} {dtype_name(pkg.kv.dtype)}, but the geometry "
            f"({how}) needs {list(want)} {dtype_name(geometry.dtype)}"
        )
    client = await _connect(args, model, geometry)
    try:
        new = await client.store(pkg.kv, pkg.tokens, salt)
        cs, transfer = client.chunk_size, client.transfer
    finally:
        await client.aclose()
    stored = len(pkg.tokens) // cs * cs
    data = {
        "input": str(args.input),
        "model_name": model,
        "cache_salt": salt,
        "num_tokens": len(pkg.tokens),
        "stored_tokens": stored,
        "stored_new": new,
        "transfer": transfer,
        "geometry_from": how,
    }
    state = "new" if new else "already cached" if stored else "nothing stored: less than one chunk"
    rows = [
        ("model", model),
        ("cache salt", _salt(salt)),
        ("tokens", str(len(pkg.tokens))),
        ("stored", f"{_chunks(stored, cs)}, {state}"),
        ("transfer", transfer),
        ("geometry", how),
    ]
    _emit(args, data, rows)
    return 0


async def _package_geometry(args: argparse.Namespace, model: str, pkg: Package) -> tuple[KVGeometry, str]:
    """The model's geometry from ``/status``; else the package's shape (one head of D)."""
    meta = Metadata(args.http_url, ttl=0)
    try:
        status = await meta.status(timeout=args.timeout)
    finally:
        await meta.close()
    try:
        return KVGeometry.from_status(status, model), "/status"
    except ModelNotRegisteredError:
        pass
    kv = pkg.kv
    if kv.dim() != 4:
        raise CommandError(f"{args.input}: an MLA package needs --num-layers, --num-kv-heads, --head-dim")
    try:
        g = KVGeometry(
            num_layers=kv.shape[1], num_kv_heads=1, head_dim=kv.shape[3], dtype=kv.dtype, block_size=16
        )
    except (TypeError, ValueError) as exc:
        raise CommandError(f"{args.input}: {exc}") from None
    return g, "package (model not in /status)"


def _tokens_from_args(args: argparse.Namespace) -> list[int]:
    if args.tokens is not None:
        return list(args.tokens)
    return list(range(args.token_start, args.token_start + args.num_tokens))


async def _lookup(args: argparse.Namespace) -> int:
    tokens = _tokens_from_args(args)
    client = await _connect(args, args.model_name)
    try:
        hit = await client.lookup(tokens, args.cache_salt)
        cs = client.chunk_size
    finally:
        await client.aclose()
    data = {
        "model_name": args.model_name,
        "cache_salt": args.cache_salt,
        "num_tokens": len(tokens),
        "hit_tokens": hit,
        "chunk_size": cs,
    }
    rows = [
        ("model", args.model_name),
        ("cache salt", _salt(args.cache_salt)),
        ("tokens", str(len(tokens))),
        ("cached", f"{_chunks(hit, cs)} of {len(tokens) // cs * cs} looked up"),
    ]
    _emit(args, data, rows)
    return 0


async def _retrieve(args: argparse.Namespace) -> int:
    tokens = _tokens_from_args(args)
    client = await _connect(args, args.model_name)
    try:
        kv = await client.retrieve(tokens, args.cache_salt)
        cs = client.chunk_size
        axis = client.geometry.token_axis
    finally:
        await client.aclose()
    hit = 0 if kv is None else kv.shape[axis]
    written: str | None = None
    if kv is not None:
        save_package(args.output, Package(kv, args.model_name, tokens[:hit], args.cache_salt))
        written = str(args.output)
    data = {
        "model_name": args.model_name,
        "cache_salt": args.cache_salt,
        "num_tokens": len(tokens),
        "hit_tokens": hit,
        "output": written,
        "shape": None if kv is None else list(kv.shape),
        "dtype": None if kv is None else dtype_name(kv.dtype),
    }
    rows = [
        ("model", args.model_name),
        ("cache salt", _salt(args.cache_salt)),
        ("tokens", str(len(tokens))),
        ("retrieved", _chunks(hit, cs)),
        (
            "output",
            f"{written} (shape {tuple(kv.shape)}, {kv.dtype})" if kv is not None else "none written (miss)",
        ),
    ]
    _emit(args, data, rows)
    return 0


# --------------------------------------------------------------------------- remap


def _pair_tokens(spec: list[int] | None, package: Path | None, what: str) -> list[int]:
    if spec is not None:
        return spec
    assert package is not None, what
    return load_package(package).tokens


async def _remap(args: argparse.Namespace) -> int:
    src = _pair_tokens(args.source_tokens, args.source_package, "source")
    dst = _pair_tokens(args.target_tokens, args.target_package, "target")
    try:
        pair = RemapPair(src, dst, args.cache_salt, args.target_cache_salt)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    client = await _connect(args, args.model_name)
    try:
        result = await client.remap_many([pair], concurrency=1, return_exceptions=False)
        cs = client.chunk_size
    finally:
        await client.aclose()
    item = result[0]
    data = {
        "model_name": args.model_name,
        "cache_salt": pair.cache_salt,
        "target_cache_salt": pair.target_salt,
        "source_tokens": len(src),
        "target_tokens": len(dst),
        "retrieved_tokens": item.retrieved_tokens,
        "stored_tokens": item.stored_tokens,
        "stored_new": item.stored_new,
        "hit": item.hit,
    }
    stored = (
        f"{_chunks(item.stored_tokens, cs)}, {'new' if item.stored_new else 'already cached'}"
        if item.hit
        else "nothing (source not cached)"
    )
    rows = [
        ("model", args.model_name),
        ("source", f"{len(src)} tokens, salt {_salt(pair.cache_salt)}"),
        ("target", f"{len(dst)} tokens, salt {_salt(pair.target_salt)}"),
        ("retrieved", _chunks(item.retrieved_tokens, cs)),
        ("stored", stored),
    ]
    _emit(args, data, rows)
    return 0


@dataclass(slots=True)
class _Line:
    """One line of a remap-batch input file."""

    line: int
    key: str
    pair: Any = None  # what is handed to remap_many (validated there)
    error: str | None = None  # a line that could not even be read


def _tokens_field(value: object, name: str) -> object:
    if isinstance(value, dict):
        if set(value) != {"start", "count"}:
            raise ValueError(f"{name} as an object needs exactly 'start' and 'count'")
        start, count = value["start"], value["count"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (start, count)):
            raise ValueError(f"{name}: 'start' and 'count' must be ints >= 0")
        return list(range(start, start + count))
    if isinstance(value, str):
        return parse_token_spec(value)
    return value  # a list (or garbage, which remap_many reports)


def read_pairs(path: Path) -> Iterator[_Line]:
    """The pairs of a remap-batch file, one per non-blank line (``#`` starts a comment)."""
    with open(path, encoding="utf-8") as fh:
        for number, raw in enumerate(fh, 1):
            text = raw.strip()
            if not text or text.startswith("#"):
                continue
            try:
                obj = json.loads(text)
                if not isinstance(obj, dict):
                    raise ValueError("a line must be a JSON object")
                unknown = set(obj) - {"source", "target", "cache_salt", "target_cache_salt", "id"}
                if unknown:
                    raise ValueError(f"unknown keys {sorted(unknown)}")
                if "source" not in obj or "target" not in obj:
                    raise ValueError("a line needs 'source' and 'target'")
                src = _tokens_field(obj["source"], "source")
                dst = _tokens_field(obj["target"], "target")
                salt = obj.get("cache_salt", "")
                tsalt = obj.get("target_cache_salt")
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                yield _Line(number, _key(text), error=f"invalid pair: {_one_line(str(exc))}")
                continue
            canon = json.dumps([src, dst, salt, tsalt], separators=(",", ":"), default=str)
            yield _Line(number, _key(canon), pair=(src, dst, salt, tsalt))


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _done_keys(report: Path) -> set[str]:
    """Keys of pairs a previous report shows finished without error (hit or miss)."""
    done: set[str] = set()
    if not report.exists():
        return done
    with open(report, encoding="utf-8") as fh:
        for raw in fh:
            with contextlib.suppress(ValueError):
                row = json.loads(raw)
                if isinstance(row, dict) and row.get("status") in ("hit", "miss"):
                    done.add(str(row.get("key")))
    return done


def _row(line: _Line, item: ItemResult | None) -> dict[str, Any]:
    if item is None:
        return {
            "line": line.line,
            "key": line.key,
            "status": "error",
            "retrieved_tokens": 0,
            "stored_tokens": 0,
            "stored_new": False,
            "error": line.error,
            "elapsed": 0.0,
        }
    error = None if item.error is None else f"{type(item.error).__name__}: {_one_line(str(item.error))}"
    return {
        "line": line.line,
        "key": line.key,
        "status": "error" if error else "hit" if item.hit else "miss",
        "retrieved_tokens": item.retrieved_tokens,
        "stored_tokens": item.stored_tokens,
        "stored_new": item.stored_new,
        "error": error,
        "elapsed": round(item.elapsed, 6),
    }


class _ProgressBar:
    """A one-line progress bar redrawn in place on a terminal (stderr)."""

    def __init__(self, stream: IO[str], total: int, skipped: int) -> None:
        self.stream = stream
        self.total = total
        self.skipped = skipped
        self._last = 0.0

    def update(self, p: BatchProgress, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < _BAR_INTERVAL and p.done < p.total:
            return
        self._last = now
        self.stream.write("\r" + render_progress(p, self.skipped) + "\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def render_progress(p: BatchProgress, skipped: int = 0, width: int = 24) -> str:
    """The progress line: bar, counts, bytes moved and throughput."""
    frac = p.done / p.total if p.total else 1.0
    filled = int(frac * width)
    rate = p.bytes_moved / p.elapsed / 1e9 if p.elapsed > 0 else 0.0
    skip = f"  skipped {skipped}" if skipped else ""
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {p.done}/{p.total} {frac:4.0%}"
        f"  hits {p.hits}  misses {p.misses}  failed {p.failures}{skip}"
        f"  {p.bytes_moved / 1e9:.2f} GB  {rate:.2f} GB/s"
    )


def _remap_batch(args: argparse.Namespace) -> int:
    if args.resume and args.report is None:
        raise UsageError("--resume needs --report FILE (the report of the previous run)")
    try:
        lines = select_shard(read_pairs(args.file), args.shard, key=lambda ln: ln.key)
    except FileNotFoundError:
        raise CommandError(f"{args.file}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"{args.file}: {_one_line(str(exc))}") from None
    done = _done_keys(args.report) if args.resume else set()
    todo = [ln for ln in lines if ln.key not in done]
    with contextlib.ExitStack() as stack:
        report: IO[str] | None = None
        if args.report is not None:
            report = stack.enter_context(open(args.report, "a" if args.resume else "w", encoding="utf-8"))
        return asyncio.run(_run_remap_batch(args, lines, todo, report))


async def _run_remap_batch(
    args: argparse.Namespace, lines: list[_Line], todo: list[_Line], report: IO[str] | None
) -> int:
    skipped = len(lines) - len(todo)
    bad = [ln for ln in todo if ln.error is not None]
    work = [ln for ln in todo if ln.error is None]
    show_bar = sys.stderr.isatty() if args.progress is None else args.progress
    bar = _ProgressBar(sys.stderr, len(work), skipped) if show_bar and work else None
    failures: list[str] = []
    for ln in bad:
        _write_row(report, _row(ln, None))
        failures.append(f"line {ln.line}: {ln.error}")

    def progress(p: BatchProgress) -> None:
        ln = work[p.item.index]
        row = _row(ln, p.item)
        _write_row(report, row)
        if row["error"]:
            failures.append(f"line {ln.line}: {row['error']}")
        if bar is not None:
            bar.update(p)

    client = await _connect(args, args.model_name)
    try:
        cs = client.chunk_size
        result = await client.remap_many(
            [ln.pair for ln in work],
            concurrency=args.concurrency,
            max_bytes_in_flight=args.max_bytes_in_flight,
            progress=progress,
        )
    finally:
        if bar is not None:
            bar.close()
        await client.aclose()
    s = result.summary
    total_failures = s.failures + len(bad)
    data = {
        "file": str(args.file),
        "pairs": len(lines),
        "skipped": skipped,
        "run": len(todo),
        "hits": s.hits,
        "misses": s.misses,
        "failures": total_failures,
        "stored_new": s.stored_new,
        "retrieved_tokens": s.retrieved_tokens,
        "stored_tokens": s.stored_tokens,
        "bytes_moved": s.bytes_moved,
        "elapsed": round(s.elapsed, 6),
        "gb_per_s": round(s.gb_per_s, 4),
        "peak_bytes_in_flight": s.peak_bytes_in_flight,
        "report": None if args.report is None else str(args.report),
    }
    rows = [
        (
            "pairs",
            f"{len(lines)} ({skipped} skipped: done in the previous report)"
            if args.resume
            else str(len(lines)),
        ),
        ("hits", str(s.hits)),
        ("misses", str(s.misses)),
        ("failures", str(total_failures)),
        ("retrieved", _chunks(s.retrieved_tokens, cs)),
        ("stored", f"{_chunks(s.stored_tokens, cs)}, {s.stored_new} new"),
        ("moved", f"{s.bytes_moved} bytes"),
        ("elapsed", f"{s.elapsed:.3f} s ({s.gb_per_s:.2f} GB/s)"),
    ]
    if args.report is not None:
        rows.append(("report", str(args.report)))
    _emit(args, data, rows)
    for message in failures[:5]:
        print(f"{PROG} remap-batch: failed: {message}", file=sys.stderr)
    if len(failures) > 5:
        more = "see the report" if args.report else "use --report FILE for all"
        print(f"{PROG} remap-batch: ... and {len(failures) - 5} more failures ({more})", file=sys.stderr)
    return 1 if total_failures else 0


def _write_row(report: IO[str] | None, row: dict[str, Any]) -> None:
    if report is not None:
        report.write(json.dumps(row, separators=(",", ":")) + "\n")
        report.flush()


# --------------------------------------------------------------------------- parsers


def _server_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("server")
    g.add_argument("--url", default=DEFAULT_URL, help=f"ZMQ endpoint of the server (default {DEFAULT_URL})")
    g.add_argument(
        "--http-url",
        default=DEFAULT_HTTP_URL,
        help=f"HTTP endpoint of the server (default {DEFAULT_HTTP_URL})",
    )
    g.add_argument(
        "--timeout",
        type=_timeout,
        default=60.0,
        metavar="SECONDS",
        help="deadline of each server operation ('none': wait forever; default 60)",
    )
    g.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    geo = p.add_argument_group("geometry (for a model no inference engine registered; default: from /status)")
    geo.add_argument("--num-layers", type=_positive_int, metavar="L")
    geo.add_argument("--num-kv-heads", type=_positive_int, metavar="NH")
    geo.add_argument("--head-dim", type=_positive_int, metavar="HS")
    geo.add_argument(
        "--block-size", type=_positive_int, metavar="BS", help="tokens per engine block (default 16)"
    )
    geo.add_argument("--dtype", choices=PACKAGE_DTYPES, help="element type (default bfloat16)")
    return p


def _add_token_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tokens (consecutive ids, as in the official example, or a list)")
    g.add_argument("--token-start", type=_non_negative_int, default=0, metavar="N")
    x = g.add_mutually_exclusive_group(required=True)
    x.add_argument("--num-tokens", type=_non_negative_int, metavar="N")
    x.add_argument("--tokens", type=_token_spec, metavar="SPEC", help="e.g. 0:1024 or 5,6,7 or 0:16,100:116")


def register(subparsers: Any) -> None:
    """Add ``status``, ``make-package``, ``store``, ``lookup``, ``retrieve``, ``remap`` and
    ``remap-batch`` to the ``lmcache-async`` parser."""
    server = _server_parent()

    p = subparsers.add_parser(
        "status",
        parents=[server],
        help="server health, chunk size, transport, registered models",
        description=(
            "Show the server's health, chunk size and transfer mode, the transport a client "
            "would use, sessions in flight and the models registered by an inference engine "
            "(with their KV geometry). The transport is predicted from /config and an attempt "
            "to map the SHM segment; --probe asks the server instead, by registering (and "
            "unregistering) a throwaway engine-driven context."
        ),
    )
    p.add_argument("--model-name", default=None, help="also say whether this model is registered")
    p.add_argument("--probe", action="store_true", help="register a throwaway context to learn the transport")
    p.set_defaults(func=_runner(_sync(_status)))

    p = subparsers.add_parser(
        "make-package",
        help="write a toy KV package file (no server needed)",
        description=(
            "Write a KV package (torch.save of kv, model_name, tokens, cache_salt) of random "
            "values, exactly as the official SDK example's make-package does."
        ),
    )
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--model-name", required=True)
    p.add_argument("--cache-salt", default="")
    p.add_argument("--chunk-size", type=_positive_int, required=True)
    p.add_argument("--num-chunks", type=_positive_int, required=True)
    p.add_argument("--num-layers", type=_positive_int, required=True)
    p.add_argument("--hidden-dim", type=_positive_int, required=True)
    p.add_argument("--dtype", choices=PACKAGE_DTYPES, default="bfloat16")
    p.add_argument("--token-start", type=_non_negative_int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_make_package)

    p = subparsers.add_parser(
        "store",
        parents=[server],
        help="store a KV package file",
        description=(
            "Store the KV of a package file. The model and salt come from the package unless "
            "--model-name/--cache-salt are given. Geometry: the flags, else /status, else the "
            "package's own shape (one head of the whole hidden size, block size 16)."
        ),
    )
    p.add_argument("--input", type=Path, required=True, help="the KV package file")
    p.add_argument("--model-name", default=None, help="override the package's model name")
    p.add_argument("--cache-salt", default=None, help="override the package's cache salt")
    p.set_defaults(func=_runner(_sync(_store)))

    p = subparsers.add_parser("lookup", parents=[server], help="length of the cached prefix of some tokens")
    p.add_argument("--model-name", required=True)
    p.add_argument("--cache-salt", default="")
    _add_token_args(p)
    p.set_defaults(func=_runner(_sync(_lookup)))

    p = subparsers.add_parser(
        "retrieve",
        parents=[server],
        help="retrieve the cached prefix of some tokens into a package file",
        description="Retrieve the KV of the longest cached prefix and write it as a KV package.",
    )
    p.add_argument("--model-name", required=True)
    p.add_argument("--cache-salt", default="")
    p.add_argument("--output", type=Path, required=True, help="package file to write (only on a hit)")
    _add_token_args(p)
    p.set_defaults(func=_runner(_sync(_retrieve)))

    p = subparsers.add_parser(
        "remap",
        parents=[server],
        help="store the KV of one source prompt under a target prompt",
        description=(
            "Retrieve the source's KV (as far as the target can take it, in whole chunks) "
            "and store it under the target's first tokens."
        ),
    )
    p.add_argument("--model-name", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--source-tokens", type=_token_spec, metavar="SPEC", help="e.g. 0:1024 or 1,2,3")
    src.add_argument(
        "--source-package", type=Path, metavar="FILE", help="take the source tokens from a package"
    )
    dst = p.add_mutually_exclusive_group(required=True)
    dst.add_argument("--target-tokens", type=_token_spec, metavar="SPEC")
    dst.add_argument(
        "--target-package", type=Path, metavar="FILE", help="take the target tokens from a package"
    )
    p.add_argument("--cache-salt", default="", help="salt of the source")
    p.add_argument("--target-cache-salt", default=None, help="salt of the target (default: the source's)")
    p.set_defaults(func=_runner(_sync(_remap)))

    p = subparsers.add_parser(
        "remap-batch",
        parents=[server],
        help="remap every pair of a JSONL file",
        description=(
            'Remap the pairs of a JSONL file, one per line: {"source": [ids] | {"start": A, '
            '"count": N} | "A:B", "target": ..., "cache_salt": "", "target_cache_salt": ""}. '
            "Blank lines and lines starting with # are ignored. Exit code 1 if any pair failed."
        ),
    )
    p.add_argument("file", type=Path, metavar="FILE.jsonl")
    p.add_argument("--model-name", required=True)
    p.add_argument("--concurrency", type=_positive_int, default=8, help="pairs in flight (default 8)")
    p.add_argument(
        "--max-bytes-in-flight",
        type=_byte_size,
        default=1 << 30,
        metavar="BYTES",
        help="memory budget for KV buffers, e.g. 512M, 2G (default 1G)",
    )
    p.add_argument("--report", type=Path, metavar="FILE", help="write one JSON line per pair")
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip pairs the --report file shows done (hit or miss) and append to it",
    )
    p.add_argument(
        "--shard",
        type=shard_arg,
        metavar="I/N",
        help="run only shard I of N (1-based; by pair identity, see docs/deployment.md); "
        "give each shard its own --report",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    p.set_defaults(func=_runner(_remap_batch))
