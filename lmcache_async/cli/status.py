"""``lmcache-async status``: is the server up, and how would a client talk to it.

Health (``/healthcheck`` and a ZMQ ``noop``), version, chunk size, the server's
``--supported-transfer-mode``, the transport a client would use (predicted from
``/config`` and a map attempt, or with ``--probe`` asked of the server), sessions and
prefetch jobs in flight, engine-driven registrations, and the models an inference engine
registered, with their geometry. Exit code 1 when the server is unhealthy or does not
answer the ``noop``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any, Final

from lmcache_async._protocol.server_config import POOL_PREFIX, expected_pool, mp_section
from lmcache_async._protocol.wire import Op
from lmcache_async._transport.connection import Connection
from lmcache_async._transport.metadata import Metadata
from lmcache_async._transport.shm_segment import map_segment
from lmcache_async.cli.arguments import server_parent
from lmcache_async.cli.runner import command, connect_client, emit, one_line, run_async, table
from lmcache_async.errors import HybridLayoutError, LMCacheError, ProtocolError, TransferError

# torch (through lmcache_async.geometry) is imported only to decode the geometry of the
# models an engine registered, and by --probe: a health check does not pay its ~2 s.

__all__ = ["PROBE_MODEL", "SHM_PREFIX", "register", "server_version"]

SHM_PREFIX: Final = POOL_PREFIX
#: Model name of the throwaway registration of `status --probe`.
PROBE_MODEL: Final = "lmcache-async-probe"


async def _status(args: argparse.Namespace) -> int:
    meta = Metadata(args.http_url, ttl=0)
    try:
        healthy = await meta.healthcheck(timeout=args.timeout)
        config = await meta.config(timeout=args.timeout)
        status = await meta.status(timeout=args.timeout)
        version = await server_version(args.http_url, args.timeout)
    finally:
        await meta.close()
    mp = mp_section(config)
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
        emit(args, data, rows)
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
            cells = [
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
            for line in table(header, cells):
                print(f"  {line}")
    return 0 if healthy and zmq_ok else 1


def _mode_note(mode: str) -> str:
    if mode in ("auto", "engine_driven"):
        return "serves this client"
    return "does NOT serve engine-driven clients; start it with --supported-transfer-mode auto"


async def server_version(http_url: str, timeout: float | None) -> str | None:
    """The server's ``GET /lmc_version`` (a JSON string such as ``"0.5.6"``), or None when
    it does not answer that in time (the version is informational only).

    Cancellation: the request is abandoned and its connection closed.
    """
    meta = Metadata(http_url, ttl=0)
    try:
        with contextlib.suppress(LMCacheError, ValueError):
            return await meta.version(timeout=timeout)
        return None
    finally:
        await meta.close()


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
    # The client's own reading of /config (several L1 managers, a lazy pool or a DAX
    # device mean no SHM pool), so the prediction cannot differ from what it does.
    name, size = expected_pool(config) or ("", 0)
    segment = name.lstrip("/")
    if not segment or size <= 0:
        return {"mode": "pickle", "how": how, "detail": "the server has no SHM pool"}
    try:
        map_segment(segment, size)[1].close()  # ShmPool's own checks, without torch
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
    import torch

    from lmcache_async.geometry import KVGeometry

    name = PROBE_MODEL
    geometry = KVGeometry(1, 1, 8, torch.bfloat16, block_size=chunk_size)
    how = f"probed: registered {name!r} and unregistered it"
    try:
        client = await connect_client(args, name, geometry)
    except LMCacheError as exc:
        return {"mode": None, "how": how, "detail": f"registration failed: {one_line(str(exc))}"}
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
        from lmcache_async.geometry import KVGeometry, dtype_name

        row: dict[str, Any] = {
            "model_name": str(entry.get("model_name")),
            "world_size": entry.get("world_size", 1),
        }
        try:
            g = KVGeometry.from_context_meta(entry)
        except (ProtocolError, HybridLayoutError, ValueError, TypeError) as exc:
            row["error"] = one_line(str(exc))
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


def register(subparsers: Any) -> None:
    """Add ``status`` to the ``lmcache-async`` parser."""
    server = server_parent()

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
    p.set_defaults(func=command(run_async(_status)))
