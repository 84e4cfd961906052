"""Argument types and shared flags of the ``lmcache-async`` subcommands.

* :func:`parse_token_spec`, :func:`parse_byte_size`: the ``SPEC`` and ``BYTES`` syntaxes,
  and their ``argparse`` ``type=`` wrappers;
* :func:`token_range`: a range of token ids, checked against the id bound and
  :data:`MAX_TOKENS` before it is built;
* :func:`server_parent`: the flags every server command takes (``--url``, ``--http-url``,
  ``--timeout``, ``--json`` and the geometry flags, :func:`add_geometry_args`);
* :func:`add_token_args`: ``--token-start N --num-tokens N`` or ``--tokens SPEC``;
* :func:`explicit_geometry`, :func:`checked_tokens`, :func:`checked_range`,
  :func:`checked_salt`, :func:`checked_model`: command-line values checked before any
  server is contacted, as :class:`~lmcache_async.cli.runner.UsageError` (exit code 2).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from lmcache_async._base.timeouts import check_timeout
from lmcache_async._protocol.wire import (
    MAX_TOKEN,
    MAX_TOKENS,
    validate_cache_salt,
    validate_model_name,
    validate_tokens,
)
from lmcache_async.cli.runner import DEFAULT_HTTP_URL, DEFAULT_URL, UsageError

if TYPE_CHECKING:  # imported where used: it imports torch, which parsing must not pay
    from lmcache_async.geometry import KVGeometry

__all__ = [
    "MAX_TOKENS",
    "PACKAGE_DTYPES",
    "add_geometry_args",
    "add_token_args",
    "byte_size",
    "checked_model",
    "checked_range",
    "checked_salt",
    "checked_tokens",
    "explicit_geometry",
    "non_negative_int",
    "parse_byte_size",
    "parse_token_spec",
    "port_number",
    "positive_int",
    "server_parent",
    "timeout_seconds",
    "token_range",
    "token_spec",
    "tokens_from_args",
]

PACKAGE_DTYPES: Final = ("float32", "float16", "bfloat16")

#: The most tokens a token list the command line builds may have: a ``SPEC``,
#: ``--token-start`` with ``--num-tokens`` (or make-package's chunks), a side of a
#: ``remap-batch`` line given as ``{"start", "count"}`` or a ``SPEC``. Checked before the
#: list is built (2**22 ids are about 150 MB as a list; a lookup of that many peaks at
#: about 400 MB of memory). The library's own bound (:data:`lmcache_async._protocol.wire.MAX_TOKENS`),
#: so the command line refuses exactly what the library would.

_RANGE: Final = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")
_SIZE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def _check_ids(start: int, end: int) -> None:
    """Refuse ``range(start, end)`` if it holds an id at or past 2**32, naming the first
    such id (as :func:`~lmcache_async._protocol.wire.validate_tokens` would)."""
    if end > start and end > MAX_TOKEN:
        raise ValueError(f"token id {max(start, MAX_TOKEN)} is outside [0, 2**32)")


def _check_count(count: int) -> None:
    if count > MAX_TOKENS:
        raise ValueError(f"{count} tokens; at most {MAX_TOKENS} are accepted")


def token_range(start: int, count: int) -> range:
    """``range(start, start + count)``, checked before anything is built.

    Raises:
        ValueError: an id at or past 2**32 (the first one named), or more than
            :data:`MAX_TOKENS` tokens.
    """
    _check_ids(start, start + count)
    _check_count(count)
    return range(start, start + count)


def parse_token_spec(spec: str) -> list[int]:
    """Token ids from ``"0:1024"`` (a half-open range), ``"1,2,3"`` or a mix such as
    ``"0:16,100:116,7"``.

    Raises:
        ValueError: an empty or malformed spec, a range whose end precedes its start, an id
            at or past 2**32, or more than :data:`MAX_TOKENS` tokens in all (all checked
            before the list is built).
    """
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in parts):
        raise ValueError(f"empty token list in {spec!r}")
    spans: list[range] = []
    for part in parts:
        m = _RANGE.match(part)
        if m:
            start, end = int(m.group(1)), int(m.group(2))
            if end < start:
                raise ValueError(f"range {part!r} ends before it starts")
        elif part.isdigit():
            start = int(part)
            end = start + 1
        else:
            raise ValueError(f"{part!r} is neither a token id nor a range START:END")
        _check_ids(start, end)
        spans.append(range(start, end))
    _check_count(sum(map(len, spans)))
    tokens: list[int] = []
    for span in spans:
        tokens.extend(span)
    return tokens


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


# --------------------------------------------------------------------------- argparse types


def token_spec(text: str) -> list[int]:
    """``type=`` of a ``SPEC`` flag."""
    try:
        return parse_token_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def byte_size(text: str) -> int:
    """``type=`` of a ``BYTES`` flag."""
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    """``type=`` of an int flag that must be >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """``type=`` of an int flag that must be >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    """A port number in 0..65535 (0: a free one), checked while parsing (argparse's error
    names the subcommand and the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number in 0..65535 (0: a free one)")
    return value


def timeout_seconds(text: str) -> float | None:
    """``type=`` of ``--timeout``: seconds > 0, or ``none``/``inf`` for no deadline.

    The value is checked by the library's one timeout validator
    (:func:`lmcache_async._base.timeouts.check_timeout`); 0, which would fail every call at
    once, is refused here too.
    """
    if text.strip().lower() in ("none", "inf"):
        return None
    try:
        value = check_timeout(float(text))
    except ValueError:
        value = -1.0
    if value is not None and not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds (or 'none'), got {text!r}")
    return value


# --------------------------------------------------------------------------- shared flags


def server_parent() -> argparse.ArgumentParser:
    """A parent parser with the flags of every command that talks to a server."""
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
        type=timeout_seconds,
        default=60.0,
        metavar="SECONDS",
        help="deadline of each server operation ('none': wait forever; default 60)",
    )
    g.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    add_geometry_args(p)
    return p


def add_geometry_args(p: argparse.ArgumentParser) -> None:
    """The geometry flags (read by :func:`explicit_geometry`)."""
    geo = p.add_argument_group("geometry (for a model no inference engine registered; default: from /status)")
    geo.add_argument("--num-layers", type=positive_int, metavar="L")
    geo.add_argument("--num-kv-heads", type=positive_int, metavar="NH")
    geo.add_argument("--head-dim", type=positive_int, metavar="HS")
    geo.add_argument(
        "--block-size", type=positive_int, metavar="BS", help="tokens per engine block (default 16)"
    )
    geo.add_argument("--dtype", choices=PACKAGE_DTYPES, help="element type (default bfloat16)")


def add_token_args(p: argparse.ArgumentParser) -> None:
    """``--token-start N`` with ``--num-tokens N``, or ``--tokens SPEC``."""
    g = p.add_argument_group("tokens (consecutive ids, as in the official example, or a list)")
    g.add_argument("--token-start", type=non_negative_int, default=0, metavar="N")
    x = g.add_mutually_exclusive_group(required=True)
    x.add_argument("--num-tokens", type=non_negative_int, metavar="N")
    x.add_argument("--tokens", type=token_spec, metavar="SPEC", help="e.g. 0:1024 or 5,6,7 or 0:16,100:116")


# --------------------------------------------------------------------------- checked values


def explicit_geometry(args: argparse.Namespace) -> KVGeometry | None:
    """The geometry of the flags, or None when none was given (UsageError if partial)."""
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
    from lmcache_async.geometry import KVGeometry, dtype_from_name

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


def checked_model(name: str, flag: str = "--model-name") -> str:
    """A model name the server accepts (not empty, no ``@``), else UsageError."""
    try:
        return validate_model_name(name)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{flag}: {exc}") from None


def checked_salt(salt: str, flag: str = "--cache-salt") -> str:
    """A cache salt the server accepts, else UsageError naming ``flag``."""
    try:
        return validate_cache_salt(salt, flag)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def checked_tokens(tokens: Sequence[int], flag: str) -> list[int]:
    """Token ids in ``[0, 2**32)``, else UsageError naming ``flag``."""
    try:
        return validate_tokens(tokens, flag)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def checked_range(start: int, count: int, flags: str) -> range:
    """:func:`token_range`, else UsageError naming ``flags``."""
    try:
        return token_range(start, count)
    except ValueError as exc:
        raise UsageError(f"{flags}: {exc}") from None


def tokens_from_args(args: argparse.Namespace) -> list[int]:
    """The tokens of :func:`add_token_args`' flags, checked (UsageError)."""
    if args.tokens is not None:
        return checked_tokens(args.tokens, "--tokens")
    flags = "--token-start/--num-tokens"
    return checked_tokens(checked_range(args.token_start, args.num_tokens, flags), flags)
