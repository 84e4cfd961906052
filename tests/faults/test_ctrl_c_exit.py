"""Ctrl-C in a script that uses the blocking ``Client`` in a ``with`` block: SIGINT to the
script's process while an operation waits on a server that
stopped answering (SIGSTOP) makes the process exit within a bound, with no "Unclosed
client session" noise; with a server that answers, at once.

The bound asserted is :data:`EXIT_BOUND_S`: the facade's close on an interrupt waits at
most ``lmcache_async.sync_client._INTERRUPT_CLOSE`` (1.5 s) for the client's close, then the
interpreter exits; the margin covers a loaded 2-core machine. Measured figures are printed
(``-s``) and recorded in docs/reports/reliability.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from harness.real_server import REPO_ROOT

SCRIPT = Path(__file__).with_name("ctrl_c_script.py")
#: The exit bound asserted (measured: 2.2-2.4 s with a hung server, 0.5-1.7 s with one that
#: answers, 2.9-3.3 s for a client never closed, whose close the exit hook bounds at 2.5 s).
EXIT_BOUND_S = {"with": 4.0, "open": 5.0}
#: What the script may take to start, connect and store once (a loaded machine).
READY_TIMEOUT_S = 60.0
NOISE = (
    "Unclosed client session",
    "Unclosed connector",
    "Task was destroyed but it is pending",
    "ResourceWarning",
)


@contextmanager
def _script(srv: Any, style: str) -> Iterator[subprocess.Popen[str]]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-X", "dev", str(SCRIPT), srv.url, srv.http_url, style],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()  # its pid only
        proc.wait(10)


def _wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    line = ""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline().strip()  # READY comes after connect + one store
        if line == "READY":
            return
    raise AssertionError(f"the script did not get ready (last line {line!r}, rc {proc.poll()})")


def _interrupt_and_time(proc: subprocess.Popen[str]) -> tuple[float, str]:
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError("the script did not exit within 30 s of SIGINT") from None
    return time.monotonic() - start, err


@pytest.mark.parametrize("module_real_server", [{"mode": "shm"}], ids=["shm"], indirect=True)
@pytest.mark.parametrize(("style", "server"), [("with", "hung"), ("with", "answering"), ("open", "hung")])
def test_ctrl_c_exits_within_the_bound_and_quietly(module_real_server: Any, style: str, server: str) -> None:
    """``with``: the block's close is bounded; ``open`` (the client never closed): the exit
    hook's close is bounded (it warns that the client was never closed). One server of this
    module's for the three (each script is a new client; a hung server is resumed after)."""
    srv = module_real_server
    with _script(srv, style) as proc:
        _wait_ready(proc)
        if server == "hung":
            os.kill(srv.pid, signal.SIGSTOP)  # the next operation waits on a server that hangs
        try:
            time.sleep(0.5)
            elapsed, err = _interrupt_and_time(proc)
        finally:
            if server == "hung":
                os.kill(srv.pid, signal.SIGCONT)
    print(f"\n[ctrl-c, {style}, {server} server] SIGINT -> exit: {elapsed:.2f}s (rc {proc.returncode})")
    assert proc.returncode == -signal.SIGINT  # KeyboardInterrupt left the script
    assert "KeyboardInterrupt" in err
    for noise in NOISE if style == "with" else NOISE[:3]:  # "open": a ResourceWarning is due
        assert noise not in err, err[-3000:]
    assert elapsed < EXIT_BOUND_S[style], err[-3000:]


def test_children_of_the_test_run_handle_sigint_whatever_the_run_inherited() -> None:
    """The premise of the tests above: a child started by this run turns SIGINT into
    KeyboardInterrupt, also when the run itself was started with SIGINT ignored (in the
    background of a non-interactive shell; tests/conftest.py's ``pytest_configure`` undoes that)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.strip() == "True"


def test_a_run_started_with_sigint_ignored_still_interrupts_its_children() -> None:
    """The same, end to end: a pytest run started with SIGINT ignored runs the check above."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    code = (
        "import signal, subprocess, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "sys.exit(subprocess.call([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', "
        "'-p', 'no:randomly', '-p', 'no:xdist', '-m', 'not real_server', '--no-cov', "
        "'tests/faults/test_ctrl_c_exit.py::test_children_of_the_test_run_handle_sigint_whatever_the_run_inherited']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
