"""Single operations of ``lmcache-async``: ``make-package``, ``store``, ``lookup``,
``retrieve`` and ``remap``.

``make-package``/``store``/``lookup``/``retrieve`` are the official SDK example script's
commands and flags, reading and writing its KV package files
(:mod:`lmcache_async.cli.package_file`). ``remap`` is one pair of
:meth:`~lmcache_async.AsyncClient.remap_many`.

Every value from the command line or a package (model name, salt, token ids, geometry)
is checked before any server is contacted; a bad one is a one-line error, never a
traceback: exit code 2 for a flag, 1 for a package file. So is an ``--output`` file that
cannot be written (no such directory, a directory): exit code 1, as for a failed write.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache_async._transport.metadata import Metadata
from lmcache_async.cli.arguments import (
    PACKAGE_DTYPES,
    add_token_args,
    checked_model,
    checked_range,
    checked_salt,
    explicit_geometry,
    non_negative_int,
    positive_int,
    server_parent,
    token_spec,
    tokens_from_args,
)
from lmcache_async.cli.runner import (
    CommandError,
    UsageError,
    chunks,
    command,
    connect_client,
    emit,
    run_async,
    salt_text,
)
from lmcache_async.errors import ModelNotRegisteredError

# torch, the package files and the geometry are imported by the commands that use them:
# building the parser (``--help``) does not pay torch's ~2 s import.
if TYPE_CHECKING:
    from lmcache_async.cli.package_file import Package
    from lmcache_async.geometry import KVGeometry

__all__ = ["register"]


# --------------------------------------------------------------------------- make-package


def _make_package(args: argparse.Namespace) -> int:
    import torch

    from lmcache_async.cli.package_file import Package, check_output, save_package
    from lmcache_async.geometry import dtype_from_name

    model = checked_model(args.model_name)
    salt = checked_salt(args.cache_salt)
    dtype = dtype_from_name(args.dtype)  # one of PACKAGE_DTYPES (argparse choices)
    num_tokens = args.chunk_size * args.num_chunks
    tokens = list(checked_range(args.token_start, num_tokens, "--token-start/--chunk-size/--num-chunks"))
    check_output(args.output)
    # Same generator use as the official example, so equal flags give equal bytes.
    torch.manual_seed(args.seed)
    kv = torch.randn((2, args.num_layers, num_tokens, args.hidden_dim), dtype=dtype)
    save_package(args.output, Package(kv, model, tokens, salt))
    data = {
        "output": str(args.output),
        "model_name": model,
        "cache_salt": salt,
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


# --------------------------------------------------------------------------- store


async def _store(args: argparse.Namespace) -> int:
    from lmcache_async.cli.package_file import load_package
    from lmcache_async.geometry import dtype_name

    model = None if args.model_name is None else checked_model(args.model_name)
    salt = None if args.cache_salt is None else checked_salt(args.cache_salt)
    geometry = explicit_geometry(args)
    pkg = load_package(args.input)
    model = model or pkg.model_name
    salt = pkg.cache_salt if salt is None else salt
    how = "flags"
    if geometry is None:
        geometry, how = await _package_geometry(args, model, pkg)
    want = geometry.kv_shape(len(pkg.tokens))
    if tuple(pkg.kv.shape) != want or pkg.kv.dtype != geometry.dtype:
        raise CommandError(
            f"{args.input}: kv is {list(pkg.kv.shape)} {dtype_name(pkg.kv.dtype)}, but the geometry "
            f"({how}) needs {list(want)} {dtype_name(geometry.dtype)}"
        )
    client = await connect_client(args, model, geometry)
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
        ("cache salt", salt_text(salt)),
        ("tokens", str(len(pkg.tokens))),
        ("stored", f"{chunks(stored, cs)}, {state}"),
        ("transfer", transfer),
        ("geometry", how),
    ]
    emit(args, data, rows)
    return 0


async def _package_geometry(args: argparse.Namespace, model: str, pkg: Package) -> tuple[KVGeometry, str]:
    """The model's geometry from ``/status``; else the package's shape (one head of D)."""
    from lmcache_async.geometry import KVGeometry

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


# --------------------------------------------------------------------------- lookup, retrieve


async def _lookup(args: argparse.Namespace) -> int:
    model = checked_model(args.model_name)
    salt = checked_salt(args.cache_salt)
    tokens = tokens_from_args(args)
    client = await connect_client(args, model, explicit_geometry(args))
    try:
        hit = await client.lookup(tokens, salt)
        cs = client.chunk_size
    finally:
        await client.aclose()
    data = {
        "model_name": model,
        "cache_salt": salt,
        "num_tokens": len(tokens),
        "hit_tokens": hit,
        "chunk_size": cs,
    }
    rows = [
        ("model", model),
        ("cache salt", salt_text(salt)),
        ("tokens", str(len(tokens))),
        ("cached", f"{chunks(hit, cs)} of {len(tokens) // cs * cs} looked up"),
    ]
    emit(args, data, rows)
    return 0


async def _retrieve(args: argparse.Namespace) -> int:
    from lmcache_async.cli.package_file import Package, check_output, save_package
    from lmcache_async.geometry import dtype_name

    model = checked_model(args.model_name)
    salt = checked_salt(args.cache_salt)
    tokens = tokens_from_args(args)
    check_output(args.output)
    client = await connect_client(args, model, explicit_geometry(args))
    try:
        kv = await client.retrieve(tokens, salt)
        cs = client.chunk_size
        axis = client.geometry.token_axis
    finally:
        await client.aclose()
    hit = 0 if kv is None else kv.shape[axis]
    written: str | None = None
    if kv is not None:
        save_package(args.output, Package(kv, model, tokens[:hit], salt))
        written = str(args.output)
    data = {
        "model_name": model,
        "cache_salt": salt,
        "num_tokens": len(tokens),
        "hit_tokens": hit,
        "output": written,
        "shape": None if kv is None else list(kv.shape),
        "dtype": None if kv is None else dtype_name(kv.dtype),
    }
    rows = [
        ("model", model),
        ("cache salt", salt_text(salt)),
        ("tokens", str(len(tokens))),
        ("retrieved", chunks(hit, cs)),
        (
            "output",
            f"{written} (shape {tuple(kv.shape)}, {kv.dtype})" if kv is not None else "none written (miss)",
        ),
    ]
    emit(args, data, rows)
    return 0


# --------------------------------------------------------------------------- remap


def _side(spec: list[int] | None, package: Path | None) -> tuple[list[int], str | None]:
    """Tokens of one side of a remap, and the salt of its package (None: no package)."""
    if spec is not None:
        return spec, None
    assert package is not None  # argparse: one of the two is required
    from lmcache_async.cli.package_file import load_package

    pkg = load_package(package)
    return pkg.tokens, pkg.cache_salt


async def _remap(args: argparse.Namespace) -> int:
    from lmcache_async.bulk import RemapPair

    model = checked_model(args.model_name)
    salt_flag = None if args.cache_salt is None else checked_salt(args.cache_salt)
    tsalt_flag = (
        None
        if args.target_cache_salt is None
        else checked_salt(args.target_cache_salt, "--target-cache-salt")
    )
    geometry = explicit_geometry(args)
    src, src_pkg_salt = _side(args.source_tokens, args.source_package)
    dst, dst_pkg_salt = _side(args.target_tokens, args.target_package)
    # Salts: the flag, else the side's package, else (target) the source's.
    salt = salt_flag if salt_flag is not None else src_pkg_salt or ""
    target_salt = tsalt_flag if tsalt_flag is not None else dst_pkg_salt
    try:
        pair = RemapPair(src, dst, salt, target_salt)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    client = await connect_client(args, model, geometry)
    try:
        result = await client.remap_many([pair], concurrency=1, return_exceptions=False)
        cs = client.chunk_size
    finally:
        await client.aclose()
    item = result[0]
    data = {
        "model_name": model,
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
        f"{chunks(item.stored_tokens, cs)}, {'new' if item.stored_new else 'already cached'}"
        if item.hit
        else "nothing (source not cached)"
    )
    rows = [
        ("model", model),
        ("source", f"{len(src)} tokens, salt {salt_text(pair.cache_salt)}"),
        ("target", f"{len(dst)} tokens, salt {salt_text(pair.target_salt)}"),
        ("retrieved", chunks(item.retrieved_tokens, cs)),
        ("stored", stored),
    ]
    emit(args, data, rows)
    return 0


# --------------------------------------------------------------------------- parsers


def register(subparsers: Any) -> None:
    """Add ``make-package``, ``store``, ``lookup``, ``retrieve`` and ``remap`` to the
    ``lmcache-async`` parser."""
    server = server_parent()

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
    p.add_argument("--chunk-size", type=positive_int, required=True)
    p.add_argument("--num-chunks", type=positive_int, required=True)
    p.add_argument("--num-layers", type=positive_int, required=True)
    p.add_argument("--hidden-dim", type=positive_int, required=True)
    p.add_argument("--dtype", choices=PACKAGE_DTYPES, default="bfloat16")
    p.add_argument("--token-start", type=non_negative_int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=command(_make_package))

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
    p.set_defaults(func=command(run_async(_store)))

    p = subparsers.add_parser("lookup", parents=[server], help="length of the cached prefix of some tokens")
    p.add_argument("--model-name", required=True)
    p.add_argument("--cache-salt", default="")
    add_token_args(p)
    p.set_defaults(func=command(run_async(_lookup)))

    p = subparsers.add_parser(
        "retrieve",
        parents=[server],
        help="retrieve the cached prefix of some tokens into a package file",
        description="Retrieve the KV of the longest cached prefix and write it as a KV package.",
    )
    p.add_argument("--model-name", required=True)
    p.add_argument("--cache-salt", default="")
    p.add_argument("--output", type=Path, required=True, help="package file to write (only on a hit)")
    add_token_args(p)
    p.set_defaults(func=command(run_async(_retrieve)))

    p = subparsers.add_parser(
        "remap",
        parents=[server],
        help="store the KV of one source prompt under a target prompt",
        description=(
            "Retrieve the source's KV (as far as the target can take it, in whole chunks) "
            "and store it under the target's first tokens. Salts: --cache-salt, else the "
            "source package's; --target-cache-salt, else the target package's, else the "
            "source's."
        ),
    )
    p.add_argument("--model-name", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--source-tokens", type=token_spec, metavar="SPEC", help="e.g. 0:1024 or 1,2,3")
    src.add_argument(
        "--source-package",
        type=Path,
        metavar="FILE",
        help="take the source tokens (and salt) from a package",
    )
    dst = p.add_mutually_exclusive_group(required=True)
    dst.add_argument("--target-tokens", type=token_spec, metavar="SPEC")
    dst.add_argument(
        "--target-package",
        type=Path,
        metavar="FILE",
        help="take the target tokens (and salt) from a package",
    )
    p.add_argument(
        "--cache-salt", default=None, help="salt of the source (default: the source package's, or none)"
    )
    p.add_argument(
        "--target-cache-salt",
        default=None,
        help="salt of the target (default: the target package's, else the source's)",
    )
    p.set_defaults(func=command(run_async(_remap)))
