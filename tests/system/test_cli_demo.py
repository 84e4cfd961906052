"""``lmcache-async demo`` and ``lmcache-async serve``, run as the user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import zmq

from lmcache_async._protocol.wire import Op, packb
from lmcache_async.cli import main
from lmcache_async.testing import EmbeddedServer

REPO = Path(__file__).resolve().parents[2]
#: A small geometry so each run takes about a second beyond the interpreter start.
SMALL = ["--chunk-size", "16", "--chunks", "3", "--layers", "2", "--kv-heads", "2", "--head-dim", "8"]
STEPS = [
    ("store source", 48),
    ("retrieve source", 48),
    ("lookup target (before remap)", 0),
    ("remap source -> target", 48),
    ("lookup target", 48),
    ("retrieve target", 48),
]


def run_cli(*args: str, timeout: float = 100.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmcache_async", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_report(report: dict[str, Any], *, transfer: str) -> None:
    assert report["ok"] is True
    assert report["target_equals_source"] is True
    assert report["source_roundtrip_equal"] is True
    assert report["transfer"] == transfer
    assert (report["tokens"], report["chunk_size"], report["changed_tokens"]) == (48, 16, 3)
    assert report["kv_shape"] == [2, 2, 48, 16]
    assert [(s["step"], s["tokens"]) for s in report["steps"]] == STEPS
    assert all(s["equal"] for s in report["steps"] if "equal" in s)
    assert all(isinstance(s["ms"], float) for s in report["steps"])


def test_demo_exits_0_and_reports_equal_kv() -> None:
    proc = run_cli("demo", *SMALL, "--dtype", "float32")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lmcache-async demo on embedded server (shm)" in proc.stdout
    assert "OK: the target prompt's KV equals the source's bitwise" in proc.stdout
    assert proc.stdout.count("bitwise equal to the source KV") == 2


def run_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``lmcache-async ARGS`` through ``main`` in this process (no interpreter or torch
    start-up); (exit code, stdout, stderr). The demo runs as a subprocess above."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_json_on_a_pickle_server(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_in_process(capsys, "demo", *SMALL, "--mode", "pickle", "--json")
    assert code == 0, out + err
    report = json.loads(out)
    check_report(report, transfer="pickle")
    assert report["server"]["embedded"] is True and report["server"]["mode"] == "pickle"
    assert report["geometry"]["dtype"] == "bfloat16"


def test_demo_against_a_running_server_with_explicit_geometry(capsys: pytest.CaptureFixture[str]) -> None:
    with EmbeddedServer.start_in_thread(chunk_size=16, size_bytes=4 << 20) as srv:
        remote = ["--url", srv.url, "--http-url", srv.http_url, "--model", "remote-model"]
        code, out, err = run_in_process(capsys, "demo", *remote, *SMALL[2:], "--json")
        assert code == 0, out + err
        report = json.loads(out)
        check_report(report, transfer="shm")
        assert report["server"] == {"url": srv.url, "http_url": srv.http_url, "embedded": False, "mode": None}
        status = srv.status()
        # the demo ended its sessions, consumed its lookups and unregistered
        assert (status["active_sessions"], status["active_prefetch_jobs"]) == (0, 0)
        assert status["registered_non_cuda_instance_ids"] == []
        assert status["lmcache_async_embedded"]["resident_objects"] == 6  # source + target


def test_demo_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--url", "tcp://127.0.0.1:1"]) == 2
    assert "--url and --http-url go together" in capsys.readouterr().err
    assert main(["demo", "--chunks", "0"]) == 2
    assert "--chunks must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--size", "lots"]) == 2
    assert "cannot parse size 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_starts_answers_and_stops_on_a_signal_leaving_no_segment(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmcache_async",
            "serve",
            "--port",
            "0",
            "--http-port",
            "0",
            "--chunk-size",
            "16",
            "--size",
            "8MB",
            "--model",
            "served",
            "--layers",
            "2",
            "--kv-heads",
            "2",
            "--head-dim",
            "8",
            "--json",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    segment = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        info = json.loads(line)
        segment = info["shm_segment"]
        assert info["mode"] == "shm" and info["chunk_size"] == 16 and info["models"] == ["served"]
        assert os.stat(segment).st_size == 8 << 20
        with urllib.request.urlopen(info["http_url"] + "/status", timeout=10) as resp:
            status = json.loads(resp.read())
        (entry,) = status["cache_context_meta"].values()
        assert entry["model_name"] == "served"
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(info["url"])
            sock.send_multipart([packb(1), packb(Op.NOOP)])
            assert sock.poll(10000)
            assert sock.recv_multipart() == [packb(1), packb(24), packb("OK")]
        finally:
            sock.close(linger=0)
            ctx.term()
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert not os.path.exists(segment)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        if segment is not None and os.path.exists(segment):
            os.unlink(segment)


def test_serve_generation_057() -> None:
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "lmcache_async", "serve", "--port", "0", "--http-port", "0",
            "--chunk-size", "16", "--size", "8MB", "--mode", "pickle", "--generation", "0.5.7", "--json",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        info = json.loads(line)
        assert (info["generation"], info["mode"], info["shm_segment"]) == ("0.5.7", "pickle", None)
        assert "protocol" not in info
        with urllib.request.urlopen(info["http_url"] + "/lmc_version", timeout=10) as resp:
            assert json.loads(resp.read()) == "0.5.7rc3.dev0"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_serve_refuses_an_unknown_generation(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--generation", "0.5.8"])
    assert exc.value.code == 2
    assert "invalid choice: '0.5.8' (choose from '0.5.6', '0.5.7')" in capsys.readouterr().err


def test_serve_has_no_protocol_alias(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--protocol", "0.5.7"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --protocol 0.5.7" in capsys.readouterr().err
