"""The ``lmcache-async`` command line.

Each group of subcommands lives in its own module with a ``register(subparsers)``
function that adds its parsers and sets ``func`` (``(args) -> int``, the exit code):

* :mod:`lmcache_async.cli.demo` -- ``demo`` (the KV remap demo) and ``serve`` (the embedded server);
* :mod:`lmcache_async.cli.status` -- ``status``;
* :mod:`lmcache_async.cli.operations` -- ``make-package``, ``store``, ``lookup``,
  ``retrieve``, ``remap`` (KV package files: :mod:`lmcache_async.cli.package_file`);
* :mod:`lmcache_async.cli.batch` -- ``remap-batch``, with its report, resume and progress line;
* :mod:`lmcache_async.cli.route` -- ``route`` (the routing service over a fleet,
  :mod:`lmcache_async.fleet.service`).

They share :mod:`lmcache_async.cli.arguments` (argument types and the common flags) and
:mod:`lmcache_async.cli.runner` (one-line errors, exit codes, output, connecting).

Exit codes: 0 success, 1 operation failed (e.g. server unreachable), 2 usage error,
130 interrupted.

Telemetry: where a standard ``OTEL_*`` variable names an exporter or an endpoint
(:data:`OTEL_SWITCHES`) and ``OTEL_SDK_DISABLED`` is not ``true``, the commands' clients
record spans and metrics (:func:`lmcache_async.otel.instrument`) through the global
OpenTelemetry providers, which ``opentelemetry-instrument lmcache-async ...`` configures
from those variables. Without them nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from lmcache_async._version import __version__

__all__ = ["OTEL_SWITCHES", "build_parser", "instrument_from_environment", "main"]

#: The ``OTEL_*`` variables that turn the commands' telemetry on (any one, non-empty).
OTEL_SWITCHES = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)

_MODULES = (
    "lmcache_async.cli.demo",
    "lmcache_async.cli.status",
    "lmcache_async.cli.operations",
    "lmcache_async.cli.batch",
    "lmcache_async.cli.route",
)


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), with a hint for an option whose value
    starts with ``-`` and a digit (``--tokens -5:3``: argparse reads ``-5:3`` as an option)."""

    #: The words being parsed (set by :func:`main`; the hint needs the value).
    argv: Sequence[str] = ()

    def error(self, message: str) -> NoReturn:
        match = re.fullmatch(r"argument (\S+): expected one argument", message)
        if match:
            names = match.group(1).split("/")
            words = list(_Parser.argv)
            for i, word in enumerate(words[:-1]):
                if word in names and re.match(r"-\d", words[i + 1]):
                    message += (
                        f" (a value that starts with '-' is read as an option: write {word}={words[i + 1]})"
                    )
                    break
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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


def instrument_from_environment(environ: Mapping[str, str]) -> bool:
    """Turn telemetry on for the clients made from now on if ``environ`` asks for it (see
    the module's documentation); True when it did. Without the ``otel`` extra it says so
    on stderr and goes on without."""
    wanted = any(environ.get(name, "").strip() not in ("", "none") for name in OTEL_SWITCHES)
    if not wanted or environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    try:
        from lmcache_async.otel import instrument
    except ImportError as exc:
        print(f"OTEL_* is set but OpenTelemetry is not installed ({exc}): no telemetry", file=sys.stderr)
        return False
    instrument()
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    instrument_from_environment(os.environ)
    parser = build_parser()
    _Parser.argv = tuple(sys.argv[1:] if argv is None else argv)
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
