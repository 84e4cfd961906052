"""The ``lmcache-async`` command line.

Each group of subcommands lives in its own module with a ``register(subparsers)``
function that adds its parsers and sets ``func`` (``(args) -> int``, the exit code):

* :mod:`lmcache_async.cli.demo` -- ``demo`` (the KV remap demo) and ``serve`` (the embedded server);
* :mod:`lmcache_async.cli.status` -- ``status``;
* :mod:`lmcache_async.cli.operations` -- ``make-package``, ``store``, ``lookup``,
  ``retrieve``, ``remap`` (KV package files: :mod:`lmcache_async.cli.package_file`);
* :mod:`lmcache_async.cli.batch` -- ``remap-batch``, with its report, resume and progress line.

They share :mod:`lmcache_async.cli.arguments` (argument types and the common flags) and
:mod:`lmcache_async.cli.runner` (one-line errors, exit codes, output, connecting).

Exit codes: 0 success, 1 operation failed (e.g. server unreachable), 2 usage error,
130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lmcache_async._version import __version__

__all__ = ["build_parser", "main"]

_MODULES = (
    "lmcache_async.cli.demo",
    "lmcache_async.cli.status",
    "lmcache_async.cli.operations",
    "lmcache_async.cli.batch",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-async",
        description="Async-first client for the LMCache MP server's KV-cache API.",
    )
    parser.add_argument("--version", action="version", version=f"lmcache-async {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0 if not argv and argv is not None else 2
    try:
        code: int = func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
