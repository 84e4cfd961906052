"""How every ``lmcache-async`` subcommand runs: errors, exit codes, output, connecting.

* :class:`CommandError` (exit code 1) and :class:`UsageError` (exit code 2) are reported
  as one line on stderr, ``lmcache-async COMMAND: error: MESSAGE``; so are the library's
  own errors (:func:`command` maps them), never a traceback.
* :func:`emit` prints a result as an aligned table, or as JSON with ``--json``.
* :func:`connect_client` opens an :class:`~lmcache_async.AsyncClient` from the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Final

import aiohttp

from lmcache_async._protocol.urls import check_zmq_url
from lmcache_async.errors import (
    LMCacheConnectionError,
    LMCacheError,
    LMCacheTimeoutError,
    ModelNotRegisteredError,
)

if TYPE_CHECKING:  # imported where used: they import torch, which --help must not pay
    from lmcache_async.client import AsyncClient
    from lmcache_async.geometry import KVGeometry

__all__ = [
    "DEFAULT_HTTP_URL",
    "DEFAULT_URL",
    "PROG",
    "CommandError",
    "UsageError",
    "chunks",
    "command",
    "connect_client",
    "emit",
    "one_line",
    "run_async",
    "salt_text",
    "table",
]

PROG: Final = "lmcache-async"
DEFAULT_URL: Final = "tcp://localhost:5555"
DEFAULT_HTTP_URL: Final = "http://localhost:8080"


class CommandError(Exception):
    """A failure reported as one line on stderr; ``code`` is the exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class UsageError(CommandError):
    """A bad command line (exit code 2), found before any server is contacted."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 2)


# --------------------------------------------------------------------------- output


def emit(args: argparse.Namespace, data: dict[str, Any], rows: Sequence[tuple[str, str]]) -> None:
    """``--json``: ``data`` as indented JSON; otherwise ``rows`` as an aligned table."""
    if args.json:
        print(json.dumps(data, indent=2))
        return
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        print(f"{key:<{width}}  {value}".rstrip())


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """``rows`` under ``header`` in aligned columns, one string per line."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]
    ]


def salt_text(salt: str) -> str:
    """A salt for the readable output: ``'s1'``, or ``'' (none)``."""
    return repr(salt) if salt else "'' (none)"


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(text.split())


def chunks(n: int, cs: int) -> str:
    """``"48 tokens (3 chunks)"``."""
    c = n // cs
    return f"{n} tokens ({c} chunk{'s' if c != 1 else ''})"


# --------------------------------------------------------------------------- connecting


async def connect_client(
    args: argparse.Namespace, model_name: str, geometry: KVGeometry | None
) -> AsyncClient:
    """An open client of ``--url``/``--http-url`` with ``--timeout``.

    Raises:
        As :meth:`AsyncClient.open`; :func:`command` reports each as one line.
    """
    from lmcache_async.client import AsyncClient

    client = AsyncClient(args.url, args.http_url, model_name, geometry=geometry, timeout=args.timeout)
    await client.open()
    return client


def _unreachable(args: argparse.Namespace, exc: LMCacheError) -> str:
    """A one-line message for a server that cannot be reached (or does not answer)."""
    cause = exc.__cause__
    if isinstance(exc, LMCacheTimeoutError):
        where = args.http_url if exc.operation.startswith("GET") else args.url
        return f"the LMCache server at {where} did not answer {exc.operation} within {exc.elapsed:.1f} s"
    if isinstance(cause, aiohttp.ClientConnectorError):
        os_error = cause.os_error
        if isinstance(os_error, ConnectionRefusedError):
            reason = "connection refused"
        else:
            reason = one_line(os_error.strerror or str(os_error)) or type(os_error).__name__
        return f"cannot reach the LMCache server at {args.http_url}: {reason}"
    return one_line(str(exc))


def _model_error(exc: ModelNotRegisteredError) -> str:
    known = ", ".join(repr(m) for m in exc.registered) if exc.registered else "none"
    return (
        f"model {exc.model_name!r} is not registered on the server (registered: {known}); "
        "pass --num-layers, --num-kv-heads and --head-dim (and --block-size, --dtype)"
    )


def _check_urls(args: argparse.Namespace) -> None:
    if args.url.startswith(("http://", "https://")):
        raise UsageError(
            f"--url is the ZMQ endpoint (e.g. {DEFAULT_URL}); give the HTTP endpoint {args.url} as --http-url"
        )
    try:
        check_zmq_url(args.url, "--url")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not args.http_url.startswith(("http://", "https://")):
        raise UsageError(f"--http-url must start with http://, got {args.http_url!r}")


# --------------------------------------------------------------------------- running


def run_async(
    body: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
) -> Callable[[argparse.Namespace], int]:
    """``body`` (a coroutine function) as a plain command function, run with ``asyncio.run``."""

    def run(args: argparse.Namespace) -> int:
        return asyncio.run(body(args))

    return run


def command(body: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``body`` with the URL check, the one-line error reports and exit codes of every
    command: :class:`CommandError` (its code), the library's errors (1), ``OSError`` (1).

    ``KeyboardInterrupt`` is left to :func:`lmcache_async.cli.main` (exit code 130).
    """

    def func(args: argparse.Namespace) -> int:
        try:
            if hasattr(args, "url"):
                _check_urls(args)
            return body(args)
        except CommandError as exc:
            code, message = exc.code, str(exc)
        except ModelNotRegisteredError as exc:
            code, message = 1, _model_error(exc)
        except (LMCacheConnectionError, LMCacheTimeoutError) as exc:
            code, message = 1, _unreachable(args, exc)
        except LMCacheError as exc:
            code, message = 1, one_line(str(exc))
        except OSError as exc:
            code, message = 1, one_line(str(exc))
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return code

    return func
