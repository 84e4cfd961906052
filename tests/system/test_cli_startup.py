"""``lmcache-async`` starts without torch where no command needs tensors.

``import lmcache_async`` imports its torch-using names on first use (PEP 562), and the CLI
imports torch in the commands that move KV: ``--help``, ``--version``, every subcommand's
``--help`` and ``status`` (of a server no engine registered a model on) never import it,
which saves ~2-3 s of start-up on each. Checked in fresh interpreters: this process has
torch already.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

import lmcache_async
import lmcache_async.cli.demo
from lmcache_async.cli import build_parser
from lmcache_async.cli.demo import GENERATIONS
from lmcache_async.testing import GENERATIONS as EMBEDDED_GENERATIONS

#: Imports each argv's ``main`` in one fresh interpreter and prints, per argv, whether torch
#: was imported by then (argparse's --help/--version exit through SystemExit).
_CHILD = """
import contextlib, io, sys
from lmcache_async.cli import main
for argv in [a.split() for a in sys.argv[1:]]:
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main(argv)
    assert out.getvalue(), argv
    print(" ".join(argv), "torch" in sys.modules)
"""


def _imported_modules(importtime_stderr: str) -> set[str]:
    """The module names of ``python -X importtime``'s report."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime_stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def test_help_does_not_import_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lmcache_async", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: lmcache-async ")
    modules = _imported_modules(proc.stderr)
    # The report is read (the command modules, imported by importlib.import_module, are not in it).
    assert {"lmcache_async", "lmcache_async.cli", "lmcache_async.cli.runner", "argparse"} <= modules
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    assert "numpy" not in modules


def test_no_subcommand_help_imports_torch() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    argvs = ["--version", *(f"{name} --help" for name in sub.choices)]
    assert len(argvs) == 1 + 10  # every command: serve, demo, status, make-package, ..., remap-batch, route
    proc = subprocess.run([sys.executable, "-c", _CHILD, *argvs], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{argv} False" for argv in argvs]


def test_status_does_not_import_torch(embedded_server_shm: Any) -> None:
    srv = embedded_server_shm
    argv = ["status", "--url", srv.url, "--http-url", srv.http_url, "--json"]
    script = (
        "import sys\nfrom lmcache_async.cli import main\n"
        "code = main(sys.argv[1:])\nprint('torch' in sys.modules)\nsys.exit(code)"
    )
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    *report, torch_imported = proc.stdout.splitlines()
    assert torch_imported == "False"
    assert '"mode": "shm"' in "\n".join(report)  # the SHM segment was mapped (without torch)


def test_the_lazy_names_resolve_to_their_modules() -> None:
    from lmcache_async import bulk, client, geometry, sync_client

    assert lmcache_async.AsyncClient is client.AsyncClient
    assert lmcache_async.connect is client.connect
    assert lmcache_async.Client is sync_client.Client
    assert lmcache_async.KVGeometry is geometry.KVGeometry
    assert lmcache_async.RemapPair is bulk.RemapPair
    assert set(lmcache_async.__all__) <= set(dir(lmcache_async))
    # Submodules are attributes on first use, as when the package imported them eagerly.
    assert lmcache_async.bulk is bulk and lmcache_async.sync_client is sync_client
    assert lmcache_async.hf.__name__ == "lmcache_async.hf"  # type: ignore[attr-defined]
    try:
        lmcache_async.NoSuchName  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert str(exc) == "module 'lmcache_async' has no attribute 'NoSuchName'"
    else:
        raise AssertionError("no AttributeError")


def test_demo_generation_choices_are_the_embedded_servers() -> None:
    assert GENERATIONS == EMBEDDED_GENERATIONS
    assert not hasattr(lmcache_async.cli.demo, "PROTOCOLS")
