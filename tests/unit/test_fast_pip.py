"""harness/fast_pip.py: pip's configuration handed to uv as its environment, the uv found,
and the fallback to pip when uv fails (no package is installed here: a stand-in python)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness import fast_pip

PIP_CONFIG_LIST = """\
:env:.cert='/etc/ssl/certs/ca.crt'
:env:.find-links='/opt/wheels /opt/more'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/ignored/by/env'
"""


def test_pip_config_prefers_the_environment_over_files(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        assert args[1:] == ["-m", "pip", "config", "list"]
        return subprocess.CompletedProcess(args, 0, PIP_CONFIG_LIST, "")

    monkeypatch.setattr(subprocess, "run", run)
    assert fast_pip.pip_config("python") == {
        "cert": "/etc/ssl/certs/ca.crt",
        "find-links": "/opt/wheels /opt/more",
        "constraint": "/etc/xdg/pip/constraints.txt",
        "extra-index-url": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
    }


def test_uv_gets_the_same_sources_and_compiles_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "UV_FIND_LINKS",
        "UV_INDEX",
        "UV_CONSTRAINT",
        "UV_DEFAULT_INDEX",
        "UV_COMPILE_BYTECODE",
        "SSL_CERT_FILE",
    ):
        monkeypatch.delenv(var, raising=False)
    config = {
        "cert": "/c.crt",
        "find-links": "/opt/wheels /opt/more",
        "constraint": "/etc/c.txt",
        "extra-index-url": "file:///a file:///b",
    }
    env = fast_pip.uv_environment(config, compile_bytecode=True)
    assert {k: env[k] for k in env if k.startswith("UV_") or k == "SSL_CERT_FILE"} == {
        "UV_FIND_LINKS": "/opt/wheels,/opt/more",
        "UV_INDEX": "file:///a file:///b",
        "UV_CONSTRAINT": "/etc/c.txt",
        "SSL_CERT_FILE": "/c.crt",
        "UV_INDEX_STRATEGY": "unsafe-best-match",
        "UV_NO_PROGRESS": "1",
        "UV_COMPILE_BYTECODE": "1",
    }
    assert "UV_COMPILE_BYTECODE" not in fast_pip.uv_environment(config, compile_bytecode=False)


def test_a_failing_uv_falls_back_to_pip_with_the_same_arguments(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log = tmp_path / "calls"
    stand_in = tmp_path / "python"  # records its arguments; `-m pip config list` prints nothing
    stand_in.write_text(
        f"#!{sys.executable}\nimport sys\nopen({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
    )
    stand_in.chmod(0o755)
    monkeypatch.setenv("UV", "/bin/false")
    assert fast_pip.main([str(stand_in), "-q", "--no-compile", "six==1.17.0"]) == 0
    assert log.read_text().splitlines() == [
        "-m pip config list",
        "-m pip install --disable-pip-version-check --no-input -q --no-compile six==1.17.0",
    ]
