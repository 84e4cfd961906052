"""``pip install`` into a virtual environment, through uv where it can.

Usage: ``python harness/fast_pip.py TARGET_PYTHON [pip install arguments...]``

uv installs the same packages as pip, from the same indexes, in a fraction of the time
(the test venv: ~11 s instead of ~130 s on the 2-vCPU machine; pip spends it unpacking
and compiling). It is used when one is found: ``$UV``, the ``uv`` of the project's
``.venv`` (``make venv`` installs it first, pinned in ``constraints/tools.txt``), or one
on ``PATH``. pip's own configuration (``pip config list``: the index, extra indexes,
find-links, constraints, certificate) is handed to uv as its environment variables, so
the machine's package sources and caps apply to both. Where no uv is found, or uv fails,
the same arguments go to ``TARGET_PYTHON -m pip install`` (a failure is then pip's).

The arguments are the subset of pip's that both take: ``-q``, ``-c FILE``, ``-e PATH``,
``--no-deps``, requirement specifiers; and pip's ``--no-compile``. Without it the
installed modules are compiled to bytecode, as pip does (most of pip's time): with
``PYTHONDONTWRITEBYTECODE`` set, a process would otherwise compile every module it
imports again. With it, nothing is compiled at install; run the venv's processes with
``PYTHONDONTWRITEBYTECODE`` empty and each module imported is compiled once, on first
import (``make test`` does so: its venvs import a fraction of what they install).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: pip's configuration keys -> uv's environment variables.
UV_OF_PIP = {
    "index-url": "UV_DEFAULT_INDEX",
    "extra-index-url": "UV_INDEX",
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
}


def pip_config(python: str) -> dict[str, str]:
    """pip's effective settings (``:env:`` over files), by key, from ``pip config list``."""
    out = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    found: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        if not sep:
            continue
        scope, _, key = name.rpartition(".")
        rank = 1 if scope == ":env:" else 0
        if key not in found or rank >= found[key][0]:
            found[key] = (rank, value.strip().strip("'\""))
    return {key: value for key, (_, value) in found.items()}


def uv_environment(config: dict[str, str], compile_bytecode: bool) -> dict[str, str]:
    env = dict(os.environ)
    for key, var in UV_OF_PIP.items():
        if config.get(key):
            sep = "," if var == "UV_FIND_LINKS" else " "  # uv reads find-links comma-separated
            env[var] = sep.join(config[key].split())
    if config.get("cert"):
        env.setdefault("SSL_CERT_FILE", config["cert"])
    env["UV_INDEX_STRATEGY"] = "unsafe-best-match"  # pip's rule: the best version of any index
    env.setdefault("UV_NO_PROGRESS", "1")
    if compile_bytecode:
        env["UV_COMPILE_BYTECODE"] = "1"
    return env


def find_uv() -> str | None:
    for candidate in (os.environ.get("UV"), str(REPO / ".venv" / "bin" / "uv"), shutil.which("uv")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    python, args = argv[0], argv[1:]
    uv = find_uv()
    if uv is not None:
        command = [uv, "pip", "install", "--python", python, *(a for a in args if a != "--no-compile")]
        env = uv_environment(pip_config(python), compile_bytecode="--no-compile" not in args)
        if subprocess.call(command, env=env) == 0:
            return 0
        print("fast_pip: uv failed; the same install with pip", file=sys.stderr)
    return subprocess.call(
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *args]
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
