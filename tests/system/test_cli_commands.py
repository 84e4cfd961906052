"""The KV-cache subcommands of ``lmcache-async`` (lmcache_async/cli/: status.py,
operations.py, package_file.py, batch.py, on arguments.py and runner.py).

Every command runs as a subprocess (``python -m lmcache_async ...``) against the real
LMCache 0.5.6 server (and, where the ``generation`` parameter says so, the 0.5.7rc3 one: a
remap over SHM and inline, and an API-keyed server whose key comes from
``LMCACHE_API_KEY``), and its output is checked exactly (timings excepted); what is refused
before any server is contacted runs in this process through ``main``. KV package
files written by the official example's ``make-package`` are read by our ``store``: the
official script when ``LMCACHE_SDK_EXAMPLE`` names it (it is not part of the lmcache
0.5.6 distribution: ``examples/kvcache_sdk/store_retrieve.py`` of the LMCache
repository), otherwise a writer run in the lmcache venv that does what its
``make-package`` does (``torch.manual_seed``, ``torch.randn``, ``torch.save`` of the dict).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import pickle
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.real_server import RealLMCacheServer, child_env
from harness.workers import EngineWorker
from lmcache_async import AsyncClient
from lmcache_async.cli import build_parser, main
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, random_kv, unique_model

CS = 16
GEOMETRY_FLAGS = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8"]  # SMALL_GEOMETRY
PROG = "lmcache-async"

#: Writes a KV package the way the official example's make-package does (run in the
#: lmcache venv, with its torch): argv = output model salt chunk_size num_chunks
#: num_layers hidden_dim dtype token_start seed.
OFFICIAL_FORMAT_WRITER = """
import sys, torch
out, model, salt, cs, nc, nl, hd, dt, start, seed = sys.argv[1:]
n = int(cs) * int(nc)
torch.manual_seed(int(seed))
kv = torch.randn((2, int(nl), n, int(hd)), dtype=getattr(torch, dt))
torch.save({"kv": kv, "model_name": model, "tokens": list(range(int(start), int(start) + n)),
            "cache_salt": salt}, out)
print(f"wrote {out} with shape {tuple(kv.shape)} and dtype {kv.dtype}")
"""


def cli(*args: str, cwd: Path, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lmcache_async ARGS``; output decoded without newline translation
    (so a progress bar's ``\\r`` stays visible). Without ``COLUMNS``/``LINES`` (readline,
    once imported by the test process, exports them): the progress line is not cut."""
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache_async", *args],
        capture_output=True,
        cwd=str(cwd),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
        env={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
    )
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def cli_many(*argvs: list[str], cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    """:func:`cli` for each argv at once (independent commands: each is ~2.5 s of
    interpreter and torch start-up, which overlap), the results in argv order."""
    with concurrent.futures.ThreadPoolExecutor(len(argvs)) as pool:
        futures = [pool.submit(cli, *argv, cwd=cwd) for argv in argvs]
    return [f.result() for f in futures]


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """:func:`cli`'s result, but ``main`` run in this process: no interpreter or torch
    start-up (~2.5 s). For outputs that a subprocess test of the same command checks too."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([PROG, *args], code, out, err)


def ok(proc: subprocess.CompletedProcess[str], code: int = 0) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == code, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def server_args(srv: RealLMCacheServer) -> list[str]:
    return ["--url", srv.url, "--http-url", srv.http_url, "--timeout", "30"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lines(*rows: tuple[str, str]) -> str:
    width = max(len(k) for k, _ in rows)
    return "".join(f"{k:<{width}}  {v}\n" for k, v in rows)


def write_official_package(
    python: Path, out: Path, model: str, salt: str, num_chunks: int, hidden: int, start: int, seed: int
) -> str:
    """Run the official make-package (or its stand-in, see the module docstring)."""
    example = os.environ.get("LMCACHE_SDK_EXAMPLE")
    args = [
        str(out),
        model,
        salt,
        str(CS),
        str(num_chunks),
        "2",
        str(hidden),
        "bfloat16",
        str(start),
        str(seed),
    ]
    if example:
        cmd = [str(python), example, "make-package", "--output", str(out), "--model-name", model,
               "--cache-salt", salt, "--chunk-size", str(CS), "--num-chunks", str(num_chunks),
               "--num-layers", "2", "--hidden-dim", str(hidden), "--dtype", "bfloat16",
               "--token-start", str(start), "--seed", str(seed)]  # fmt: skip
    else:
        cmd = [str(python), "-c", OFFICIAL_FORMAT_WRITER, *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=str(out.parent), env=child_env(), timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def store_sources(
    srv: RealLMCacheServer, model: str, items: list[tuple[torch.Tensor, list[int], str]]
) -> None:
    async def go() -> None:
        async with AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30) as c:
            result = await c.store_many(items)
            assert result.summary.failures == 0 and result.summary.stored_new == len(items)

    asyncio.run(go())


# --------------------------------------------------------------------------- parser


def test_every_command_has_help_and_the_common_flags() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands: dict[str, argparse.ArgumentParser] = sub.choices
    for name in ("status", "make-package", "store", "lookup", "retrieve", "remap", "remap-batch"):
        assert name in commands
        flags = {s for a in commands[name]._actions for s in a.option_strings}
        assert "--help" in flags and "--json" in flags
        if name != "make-package":
            assert {"--url", "--http-url", "--model-name", "--timeout", "--num-layers", "--num-kv-heads",
                    "--head-dim", "--block-size", "--dtype"} <= flags  # fmt: skip
    official = {"--output", "--model-name", "--cache-salt", "--chunk-size", "--num-chunks", "--num-layers",
                "--hidden-dim", "--dtype", "--token-start", "--seed"}  # fmt: skip
    assert official <= {s for a in commands["make-package"]._actions for s in a.option_strings}
    assert {"--token-start", "--num-tokens", "--cache-salt"} <= {
        s for a in commands["lookup"]._actions for s in a.option_strings
    }
    assert {"--concurrency", "--max-bytes-in-flight", "--report", "--resume", "--progress"} <= {
        s for a in commands["remap-batch"]._actions for s in a.option_strings
    }


# --------------------------------------------------------------------------- packages


@pytest.mark.timeout(300)
def test_official_package_is_stored_looked_up_and_retrieved(
    real_server: RealLMCacheServer, lmcache_python: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # SHM: every command a subprocess, as a user runs it; inline: the same commands and
    # outputs through ``main`` in this process (the transport is what differs).
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return cli(*args, cwd=tmp_path) if real_server.mode == "shm" else in_process(capsys, *args)

    def run_many(*argvs: list[str]) -> list[subprocess.CompletedProcess[str]]:
        if real_server.mode == "shm":
            return cli_many(*argvs, cwd=tmp_path)
        return [in_process(capsys, *argv) for argv in argvs]

    model = unique_model("cli-pkg")
    start = fresh_tokens(1)[0]
    official = tmp_path / "official.pt"
    ours = tmp_path / "ours.pt"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two independent start-ups
        writing = pool.submit(write_official_package, lmcache_python, official, model, "s1", 3, 16, start, 7)
        # Our make-package with the same flags writes the same bytes.
        making = pool.submit(run, "make-package", "--output", str(ours), "--model-name", model,
                             "--cache-salt", "s1", "--chunk-size", "16", "--num-chunks", "3",
                             "--num-layers", "2", "--hidden-dim", "16", "--token-start", str(start),
                             "--seed", "7")  # fmt: skip
    said, made = writing.result(), ok(making.result())
    assert said == f"wrote {official} with shape (2, 2, 48, 16) and dtype torch.bfloat16\n"
    assert made.stdout == f"wrote {ours} with shape (2, 2, 48, 16) and dtype torch.bfloat16\n"
    a = torch.load(official, weights_only=True)
    b = torch.load(ours, weights_only=True)
    assert sorted(a) == sorted(b) == ["cache_salt", "kv", "model_name", "tokens"]
    assert torch.equal(a["kv"].view(torch.int16), b["kv"].view(torch.int16))
    assert (a["model_name"], a["tokens"], a["cache_salt"]) == (b["model_name"], b["tokens"], b["cache_salt"])
    assert a["tokens"] == list(range(start, start + 48))

    # store: model and salt from the package; no registration, so geometry from its shape.
    stored = ok(run("store", *server_args(real_server), "--input", str(official)))
    assert stored.stdout == lines(
        ("model", model),
        ("cache salt", "'s1'"),
        ("tokens", "48"),
        ("stored", "48 tokens (3 chunks), new"),
        ("transfer", real_server.mode),
        ("geometry", "package (model not in /status)"),
    )
    assert stored.stderr == ""
    again = ok(run("store", *server_args(real_server), "--input", str(official), "--json"))
    assert json.loads(again.stdout) == {
        "input": str(official),
        "model_name": model,
        "cache_salt": "s1",
        "num_tokens": 48,
        "stored_tokens": 48,
        "stored_new": False,
        "transfer": real_server.mode,
        "geometry_from": "package (model not in /status)",
    }

    geo = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8"]  # 2 x 8 = the package's 16
    out = tmp_path / "got.pt"
    nothing = tmp_path / "none.pt"
    # Four reads of what is stored, at once (none changes the server's contents).
    looked, unsalted, got, miss = (
        ok(proc)
        for proc in run_many(
            ["lookup", *server_args(real_server), "--model-name", model, "--cache-salt", "s1",
             "--token-start", str(start), "--num-tokens", "40", *geo],
            ["lookup", *server_args(real_server), "--model-name", model, "--tokens",
             f"{start}:{start + 48}", *geo, "--json"],
            ["retrieve", *server_args(real_server), "--model-name", model, "--cache-salt", "s1",
             "--token-start", str(start), "--num-tokens", "60", "--output", str(out), *geo],
            # A miss writes nothing.
            ["retrieve", *server_args(real_server), "--model-name", model, "--token-start",
             str(start), "--num-tokens", "48", "--output", str(nothing), *geo, "--json"],
        )
    )  # fmt: skip
    assert looked.stdout == lines(
        ("model", model),
        ("cache salt", "'s1'"),
        ("tokens", "40"),
        ("cached", "32 tokens (2 chunks) of 32 looked up"),
    )
    assert json.loads(unsalted.stdout) == {
        "model_name": model,
        "cache_salt": "",
        "num_tokens": 48,
        "hit_tokens": 0,
        "chunk_size": CS,
    }

    assert got.stdout == lines(
        ("model", model),
        ("cache salt", "'s1'"),
        ("tokens", "60"),
        ("retrieved", "48 tokens (3 chunks)"),
        ("output", f"{out} (shape (2, 2, 48, 16), torch.bfloat16)"),
    )
    pkg = torch.load(out, weights_only=True)
    assert pkg["model_name"] == model and pkg["cache_salt"] == "s1"
    assert pkg["tokens"] == list(range(start, start + 48))
    assert torch.equal(pkg["kv"], a["kv"])

    assert json.loads(miss.stdout) == {
        "model_name": model,
        "cache_salt": "",
        "num_tokens": 48,
        "hit_tokens": 0,
        "output": None,
        "shape": None,
        "dtype": None,
    }
    assert not nothing.exists()


def test_make_package_json_and_refusal_of_unsafe_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.pt"
    # Through main in this process (make-package runs as a subprocess in the package test).
    made = ok(in_process(capsys, "make-package", "--output", str(out), "--model-name", "m", "--chunk-size",
                         "16", "--num-chunks", "2", "--num-layers", "3", "--hidden-dim", "8", "--dtype",
                         "float16", "--json"))  # fmt: skip
    assert json.loads(made.stdout) == {
        "output": str(out),
        "model_name": "m",
        "cache_salt": "",
        "shape": [2, 3, 32, 8],
        "dtype": "float16",
        "token_start": 0,
        "num_tokens": 32,
    }
    pkg = torch.load(out, weights_only=True)
    assert pkg["kv"].dtype == torch.float16 and pkg["tokens"] == list(range(32))

    # A pickle that would run code is refused by the weights_only loader, before any
    # server is contacted (the URL below is never reached).
    evil = tmp_path / "evil.pt"
    torch.save(
        {"kv": torch.zeros(1), "model_name": "m", "tokens": [1], "cache_salt": "", "x": Path("/")}, evil
    )
    code, stdout, err = run_main(capsys, "store", "--http-url", "http://127.0.0.1:9", "--input", str(evil))
    assert (code, stdout) == (1, "")
    assert err.startswith(
        f"{PROG} store: error: {evil}: not a KV package: it holds objects other than tensors, "
    )
    assert err.count("\n") == 1


# --------------------------------------------------------------------------- remap


def test_remap_one_pair_from_a_package_and_ranges(real_server_shm: RealLMCacheServer, tmp_path: Path) -> None:
    srv = real_server_shm
    model = unique_model("cli-remap")
    src = fresh_tokens(64)
    dst = fresh_tokens(40)
    kv = random_kv(SMALL_GEOMETRY, 64, seed=3)
    store_sources(srv, model, [(kv, src, "")])
    pkg = tmp_path / "src.pt"
    torch.save({"kv": kv, "model_name": model, "tokens": src, "cache_salt": ""}, pkg)
    done = ok(cli("remap", *server_args(srv), *GEOMETRY_FLAGS, "--model-name", model, "--source-package",
                  str(pkg), "--target-tokens", f"{dst[0]}:{dst[0] + 40}", "--target-cache-salt", "t",
                  cwd=tmp_path))  # fmt: skip
    assert done.stdout == lines(
        ("model", model),
        ("source", "64 tokens, salt '' (none)"),
        ("target", "40 tokens, salt 't'"),
        ("retrieved", "32 tokens (2 chunks)"),
        ("stored", "32 tokens (2 chunks), new"),
    )
    listed = ",".join(str(t) for t in dst[:20]) + f",{dst[20]}:{dst[0] + 40}"
    again = ok(cli("remap", *server_args(srv), *GEOMETRY_FLAGS, "--model-name", model, "--source-tokens",
                   f"{src[0]}:{src[0] + 64}", "--target-tokens", listed, "--target-cache-salt", "t", "--json",
                   cwd=tmp_path))  # fmt: skip
    assert json.loads(again.stdout) == {
        "model_name": model,
        "cache_salt": "",
        "target_cache_salt": "t",
        "source_tokens": 64,
        "target_tokens": 40,
        "retrieved_tokens": 32,
        "stored_tokens": 32,
        "stored_new": False,
        "hit": True,
    }

    async def check() -> None:
        async with AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30) as c:
            got = await c.retrieve(dst, "t")
            assert got is not None and torch.equal(got, kv[:, :, :32])

    asyncio.run(check())


@pytest.mark.timeout(300)
def test_remap_batch_report_progress_and_resume(real_server_shm: RealLMCacheServer, tmp_path: Path) -> None:
    srv = real_server_shm
    model = unique_model("cli-batch")
    pool = fresh_tokens(40 * 100)
    src = [pool[k * 100 : k * 100 + 32] for k in range(40)]
    dst = [pool[k * 100 + 50 : k * 100 + 82] for k in range(40)]
    kvs = [random_kv(SMALL_GEOMETRY, 32, seed=k) for k in range(16)]
    store_sources(srv, model, [(kvs[k], src[k], "x" if k == 5 else "") for k in range(16)])

    text = ["# remap batch of the CLI test"]  # line 1
    expect: dict[int, dict[str, Any]] = {}
    for k in range(16):  # lines 2..17: hits, in the three token formats
        n = 20 if k % 4 == 3 else 32  # a 20-token target takes 16 tokens
        forms: list[Any] = [
            {"start": src[k][0], "count": 32},
            src[k],
            f"{src[k][0]}:{src[k][0] + 32}",
        ]
        targets: list[Any] = [{"start": dst[k][0], "count": n}, dst[k][:n], f"{dst[k][0]}:{dst[k][0] + n}"]
        row: dict[str, Any] = {"source": forms[k % 3], "target": targets[k % 3]}
        if k == 5:
            row["cache_salt"] = "x"
            row["target_cache_salt"] = "y"
        text.append(json.dumps(row))
        m = 16 if n == 20 else 32
        expect[k + 2] = {
            "status": "hit",
            "retrieved_tokens": m,
            "stored_tokens": m,
            "stored_new": True,
            "error": None,
        }
    text.append("")  # line 18
    for k in range(16, 19):  # lines 19..21: sources never stored
        text.append(json.dumps({"source": src[k], "target": dst[k]}))
        expect[len(text)] = {
            "status": "miss",
            "retrieved_tokens": 0,
            "stored_tokens": 0,
            "stored_new": False,
            "error": None,
        }
    text.append(json.dumps({"source": src[0], "target": [-1, 2, 3]}))  # line 22
    expect[22] = {"error": "ValueError: target_tokens: token id -1 is outside [0, 2**32)"}
    text.append(json.dumps({"source": {"start": 0, "count": -1}, "target": dst[0]}))  # line 23
    expect[23] = {"error": "invalid pair: source: 'start' and 'count' must be ints >= 0"}
    text.append("not json")  # line 24
    expect[24] = {"error": "invalid pair: Expecting value: line 1 column 1 (char 0)"}
    text.append(json.dumps({"source": src[0], "target": dst[0], "salt": "x"}))  # line 25
    expect[25] = {"error": "invalid pair: unknown keys ['salt']"}
    for line in (22, 23, 24, 25):
        expect[line].update(status="error", retrieved_tokens=0, stored_tokens=0, stored_new=False)
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("\n".join(text) + "\n")
    report = tmp_path / "report.jsonl"
    failure_lines = (
        f"{PROG} remap-batch: failed: line 23: {expect[23]['error']}\n"
        f"{PROG} remap-batch: failed: line 24: {expect[24]['error']}\n"
        f"{PROG} remap-batch: failed: line 25: {expect[25]['error']}\n"
        f"{PROG} remap-batch: failed: line 22: {expect[22]['error']}\n"
    )

    def read_report() -> list[dict[str, Any]]:
        rows = [json.loads(r) for r in report.read_text().splitlines()]
        for r in rows:
            assert isinstance(r.pop("elapsed"), float)
            assert re.fullmatch(r"[0-9a-f]{20}", r.pop("key"))
        return rows

    hit_tokens = sum(v.get("stored_tokens", 0) for v in expect.values())
    assert hit_tokens == 12 * 32 + 4 * 16 == 448

    # Run 1: everything, with a memory budget smaller than one 32-token item (those run
    # alone) and the progress bar forced on.
    first = ok(cli("remap-batch", str(pairs_file), *server_args(srv), *GEOMETRY_FLAGS, "--model-name", model,
                   "--report", str(report), "--concurrency", "4", "--max-bytes-in-flight", "2K", "--progress",
                   "--json", cwd=tmp_path), 1)  # fmt: skip
    summary = json.loads(first.stdout)
    assert isinstance(summary.pop("elapsed"), float) and isinstance(summary.pop("gb_per_s"), float)
    assert summary == {
        "file": str(pairs_file),
        "pairs": 23,
        "skipped": 0,
        "run": 23,
        "hits": 16,
        "misses": 3,
        "failures": 4,
        "stored_new": 16,
        "retrieved_tokens": 448,
        "stored_tokens": 448,
        "bytes_moved": 2 * 448 * SMALL_GEOMETRY.bytes_per_token,
        "peak_bytes_in_flight": 32 * SMALL_GEOMETRY.bytes_per_token,  # an oversized item, alone
        "report": str(report),
        "shard": None,
    }
    bar, rest = first.stderr.split("\n", 1)
    assert re.fullmatch(
        r"(\r\[[#.]{24}\] \d+/20 +\d+%  hits \d+  misses \d+  failed \d+"
        r"  \d+\.\d\d GB  \d+\.\d\d GB/s\x1b\[K)+",
        bar,
    )
    assert bar.rsplit("\r", 1)[1].startswith(
        "[########################] 20/20 100%  hits 16  misses 3  failed 1  0.00 GB  "
    )
    assert rest == failure_lines
    rows = read_report()
    assert len(rows) == 23
    assert {r["line"]: {k: v for k, v in r.items() if k != "line"} for r in rows} == expect

    # Every target holds its source's KV (salted pair under "y").
    async def check() -> None:
        async with AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30) as c:
            got = await c.retrieve_many(
                [(dst[k][: expect[k + 2]["stored_tokens"]], "y" if k == 5 else "") for k in range(16)]
            )
            for k, r in enumerate(got):
                m = expect[k + 2]["stored_tokens"]
                assert r.kv is not None and torch.equal(r.kv, kvs[k][:, :, :m]), k

    asyncio.run(check())

    # Run 2: as if run 1 had been interrupted after lines 2..6 were reported.
    kept = [r for r in report.read_text().splitlines() if json.loads(r)["line"] in (2, 3, 4, 5, 6)]
    assert len(kept) == 5
    report.write_text("\n".join(kept) + "\n")
    second = ok(cli("remap-batch", str(pairs_file), *server_args(srv), *GEOMETRY_FLAGS, "--model-name", model,
                    "--report", str(report), "--resume", "--json", cwd=tmp_path), 1)  # fmt: skip
    summary = json.loads(second.stdout)
    del summary["elapsed"], summary["gb_per_s"], summary["peak_bytes_in_flight"]
    skipped_tokens = sum(expect[line]["stored_tokens"] for line in (2, 3, 4, 5, 6))
    assert summary == {
        "file": str(pairs_file),
        "pairs": 23,
        "skipped": 5,
        "run": 18,
        "hits": 11,
        "misses": 3,
        "failures": 4,
        "stored_new": 0,  # run 1 stored these targets already
        "retrieved_tokens": 448 - skipped_tokens,
        "stored_tokens": 448 - skipped_tokens,
        "bytes_moved": 2 * (448 - skipped_tokens) * SMALL_GEOMETRY.bytes_per_token,
        "report": str(report),
        "shard": None,
    }
    assert second.stderr == failure_lines
    rows = read_report()
    assert len(rows) == 23 and sorted(r["line"] for r in rows) == sorted(expect)

    # Run 3: only the failed lines are left; the readable summary.
    third = ok(cli("remap-batch", str(pairs_file), *server_args(srv), *GEOMETRY_FLAGS, "--model-name", model,
                   "--report", str(report), "--resume", cwd=tmp_path), 1)  # fmt: skip
    out = third.stdout.splitlines(keepends=True)
    assert re.fullmatch(r"elapsed    \d+\.\d{3} s \(\d+\.\d\d GB/s\)\n", out[7])
    del out[7]
    assert "".join(out) == lines(
        ("pairs", "23 (19 skipped: done in the previous report)"),
        ("hits", "0"),
        ("misses", "0"),
        ("failures", "4"),
        ("retrieved", "0 tokens (0 chunks)"),
        ("stored", "0 tokens (0 chunks), 0 new"),
        ("moved", "0 bytes"),
        ("report", str(report)),
    )
    assert third.stderr == failure_lines
    rows = read_report()
    assert len(rows) == 27 and sorted(r["line"] for r in rows[23:]) == [22, 23, 24, 25]


@pytest.mark.timeout(300)
def test_remap_batch_interrupted_exits_130_keeps_its_report_and_cleans_up(
    real_server_shm: RealLMCacheServer, tmp_path: Path
) -> None:
    srv = real_server_shm
    model = unique_model("cli-sigint")
    pool = fresh_tokens(400 * 100)
    src = pool[:48]
    store_sources(srv, model, [(random_kv(SMALL_GEOMETRY, 48, seed=1), src, "")])
    pairs_file = tmp_path / "many.jsonl"
    pairs_file.write_text(
        "".join(
            json.dumps({"source": src, "target": pool[k * 100 : k * 100 + 48]}) + "\n" for k in range(1, 400)
        )
    )
    report = tmp_path / "report.jsonl"
    # The server is shared with the worker's other tests: a session one of them left (a
    # client killed on purpose lives on until the server's TTL) is not this command's.
    before = _wait_sessions(srv, 5.0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache_async", "remap-batch", str(pairs_file), *server_args(srv),
         *GEOMETRY_FLAGS, "--model-name", model, "--report", str(report), "--concurrency", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(tmp_path),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while (not report.exists() or report.read_text().count("\n") < 5) and proc.poll() is None:
            assert time.monotonic() < deadline, "no progress in the report"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 130, err
    assert out == b"" and err == b"interrupted\n"
    rows = [json.loads(r) for r in report.read_text().splitlines()]  # every line complete
    assert 5 <= len(rows) < 399
    assert all(r["status"] == "hit" for r in rows)
    assert _wait_sessions(srv, 30.0, down_to=before) <= before, f"sessions before the command: {before}"


def _wait_sessions(srv: RealLMCacheServer, deadline: float, down_to: int = 0) -> int:
    """The server's active sessions once they are down to ``down_to`` or ``deadline``
    seconds passed."""
    end = time.monotonic() + deadline
    while True:
        n = int(srv.status()["active_sessions"])
        if n <= down_to or time.monotonic() > end:
            return n
        time.sleep(0.05)


# --------------------------------------------------------------------------- status


@pytest.mark.timeout(300)
def test_status_of_a_server_with_an_engine_registration(
    fresh_real_server: Callable[..., RealLMCacheServer],
    lmcache_python: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # status as a subprocess, as a user runs it; the --probe status and the store through
    # ``main`` in this process (each command runs as a subprocess too: status here, store
    # in the package test).
    srv = fresh_real_server("shm")
    size = 2**30
    segment = f"/dev/shm/lmcache_l1_pool_{srv.shm_name}"
    with EngineWorker(srv.url, python=lmcache_python) as eng:
        eng.register("engine-m", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64)
        readable = ok(cli("status", *server_args(srv), "--model-name", "engine-m", cwd=tmp_path))
        assert readable.stdout == lines(
            ("server", f"{srv.http_url} (healthy)"),
            ("zmq", f"{srv.url} (answers noop)"),
            ("version", "0.5.6"),
            ("chunk size", "16 tokens"),
            ("transfer mode", "auto (serves this client)"),
            ("transport", f"shm: {segment} (1.00 GiB) maps [predicted from /config and a map attempt]"),
            ("sessions", "0 active, 0 prefetch jobs"),
            ("clients", "0 engine-driven registrations"),
            ("model", "engine-m (registered)"),
            ("models", "1"),
        ) + (
            "  model     world  layers  kv heads  head dim  dtype     block  mla  bytes/token\n"
            "  engine-m  1      2       2         8         bfloat16  4      no   128\n"
        )
        probed = ok(in_process(capsys, "status", *server_args(srv), "--probe", "--json"))
        data = json.loads(probed.stdout)
        assert data.pop("noop_rtt_ms") > 0
        assert data.pop("server_instance_id") == srv.config()["mp"]["instance_id"]
        assert data == {
            "http_url": srv.http_url,
            "url": srv.url,
            "healthy": True,
            "zmq_reachable": True,
            "version": "0.5.6",
            "chunk_size": 16,
            "supported_transfer_mode": "auto",
            "transport": {
                "mode": "shm",
                "how": "probed: registered 'lmcache-async-probe' and unregistered it",
                "detail": "the server's SHM pool maps",
            },
            "active_sessions": 0,
            "active_prefetch_jobs": 0,
            "models": [
                {
                    "model_name": "engine-m",
                    "world_size": 1,
                    "num_layers": 2,
                    "num_kv_heads": 2,
                    "head_dim": 8,
                    "dtype": "bfloat16",
                    "block_size": 4,
                    "use_mla": False,
                    "bytes_per_token": 128,
                }
            ],
            "engine_driven_clients": [],
        }
        assert srv.status()["non_cuda_context_meta"] == {}  # the probe unregistered

        # Geometry from /status: our store is read back by the inference engine.
        tokens = fresh_tokens(32)
        kv = random_kv(SMALL_GEOMETRY, 32, seed=11)
        pkg = tmp_path / "e.pt"
        torch.save({"kv": kv, "model_name": "engine-m", "tokens": tokens, "cache_salt": ""}, pkg)
        stored = ok(in_process(capsys, "store", *server_args(srv), "--input", str(pkg), "--json"))
        assert json.loads(stored.stdout)["geometry_from"] == "/status"
        got = eng.retrieve(tokens)
        assert got is not None and torch.equal(got, kv)
    json_status = json.loads(ok(cli("status", *server_args(srv), "--json", cwd=tmp_path)).stdout)
    assert json_status["transport"] == {
        "mode": "shm",
        "how": "predicted from /config and a map attempt",
        "segment": segment,
        "detail": f"{segment} ({size / 2**30:.2f} GiB) maps",
    }
    assert json_status["models"] == []  # the engine unregistered on quit


def test_status_of_a_pickle_server(real_server_pickle: RealLMCacheServer, tmp_path: Path) -> None:
    data = json.loads(ok(cli("status", *server_args(real_server_pickle), "--json", cwd=tmp_path)).stdout)
    assert data["transport"] == {
        "mode": "pickle",
        "how": "predicted from /config and a map attempt",
        "detail": "the server has no SHM pool",
    }
    assert (data["healthy"], data["zmq_reachable"], data["chunk_size"]) == (True, True, 16)


# --------------------------------------------------------------------------- errors


def test_unreachable_server_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    http = f"http://127.0.0.1:{port}"
    url = f"tcp://127.0.0.1:{free_port()}"
    for command, extra in (
        ("status", []),
        ("lookup", ["--model-name", "m", "--num-tokens", "32"]),
        ("remap-batch", [str(tmp_path / "pairs.jsonl"), "--model-name", "m", *GEOMETRY_FLAGS]),
    ):
        (tmp_path / "pairs.jsonl").write_text('{"source": "0:16", "target": "16:32"}\n')
        got = run_main(capsys, command, "--url", url, "--http-url", http, *extra)
        assert got == (
            1,
            "",
            f"{PROG} {command}: error: cannot reach the LMCache server at {http}: connection refused\n",
        )


def test_zmq_endpoint_not_answering_is_one_line(real_server_shm: RealLMCacheServer, tmp_path: Path) -> None:
    dead = f"tcp://127.0.0.1:{free_port()}"
    proc = ok(cli("lookup", "--url", dead, "--http-url", real_server_shm.http_url, "--timeout", "2",
                  "--model-name", "m", "--num-tokens", "16", *GEOMETRY_FLAGS, cwd=tmp_path), 1)  # fmt: skip
    assert proc.stdout == ""
    # Nothing listens there: refused within seconds, not "no reply" after the timeout.
    assert re.fullmatch(
        rf"{PROG} lookup: error: cannot connect to {re.escape(dead)}: connection refused"
        r" \(\d+ attempts in \d\.\ds; is the server's ZMQ port right\?\)\n",
        proc.stderr,
    )


def test_usage_errors_exit_2(real_server_shm: RealLMCacheServer, capsys: pytest.CaptureFixture[str]) -> None:
    """Argument handling: through ``main`` in this process (the commands' exit codes as
    processes are checked by the subprocess tests)."""
    srv = real_server_shm
    cases = [
        (
            ["lookup", *server_args(srv), "--model-name", "m", "--num-tokens", "3", "--num-layers", "2"],
            "an explicit geometry needs --num-layers, --num-kv-heads and --head-dim"
            " (missing --num-kv-heads, --head-dim)",
        ),
        (
            ["remap-batch", "x.jsonl", *server_args(srv), "--model-name", "m", "--resume"],
            "--resume needs --report FILE (the report of the previous run)",
        ),
        (
            ["status", "--url", srv.http_url],
            "--url is the ZMQ endpoint (e.g. tcp://localhost:5555); give the HTTP endpoint "
            f"{srv.http_url} as --http-url",
        ),
        (
            ["status", "--url", "tcp://localhost"],
            "--url 'tcp://localhost' has no port (tcp://host:port; the server's --port, often 5555)",
        ),
        (
            ["status", "--url", "tcp://127.0.0.1:70000"],
            "--url 'tcp://127.0.0.1:70000': port '70000' is not a port number in 1..65535",
        ),
    ]
    *procs, bad_range, unregistered = (
        in_process(capsys, *argv)
        for argv in (
            *(argv for argv, _ in cases),
            ["remap", "--model-name", "m", "--source-tokens", "9:3", "--target-tokens", "1"],
            ["lookup", *server_args(srv), "--model-name", "nobody-registered-this", "--num-tokens", "16"],
        )
    )
    for (argv, message), proc in zip(cases, procs, strict=True):
        ok(proc, 2)
        assert (proc.stdout, proc.stderr) == ("", f"{PROG} {argv[0]}: error: {message}\n")
    ok(bad_range, 2)
    assert bad_range.stderr.endswith("error: argument --source-tokens: range '9:3' ends before it starts\n")
    ok(unregistered, 1)
    assert unregistered.stderr.startswith(
        f"{PROG} lookup: error: model 'nobody-registered-this' is not registered on the server (registered: "
    )
    assert unregistered.stderr.endswith(
        "pass --num-layers, --num-kv-heads and --head-dim (and --block-size, --dtype)\n"
    )


# --------------------------------------------------------------------------- found before any server

#: Nothing listens here: a command that got as far as the network would report that
#: instead, so these tests also show that nothing was sent.
NOWHERE = ["--url", "tcp://127.0.0.1:9", "--http-url", "http://127.0.0.1:9"]


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``lmcache-async ARGV`` in this process (fast: no interpreter start); (code, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _package(path: Path, *, tokens: list[int], salt: str = "", model: str = "m") -> Path:
    kv = torch.zeros((2, 2, len(tokens), 16), dtype=torch.bfloat16)
    torch.save({"kv": kv, "model_name": model, "tokens": tokens, "cache_salt": salt}, path)
    return path


def test_bad_salt_model_or_tokens_are_one_line_before_any_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = _package(tmp_path / "good.pt", tokens=list(range(16)))
    negative = _package(tmp_path / "negative.pt", tokens=[5, -1, *range(14)])
    salted = _package(tmp_path / "salted.pt", tokens=list(range(16)), salt="a@b")
    named = _package(tmp_path / "named.pt", tokens=list(range(16)), model="m@x")
    out = str(tmp_path / "out.pt")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"source": "0:16", "target": "16:32"}\n')
    salt_msg = "--cache-salt must not contain '@': 'a@b'"
    model_msg = "--model-name: model_name must not contain '@': 'm@x'"
    cases: list[tuple[list[str], int, str]] = [
        (["lookup", "--model-name", "m", "--cache-salt", "a@b", "--num-tokens", "16"], 2, salt_msg),
        (["retrieve", "--model-name", "m", "--cache-salt", "a@b", "--num-tokens", "16", "--output", out], 2, salt_msg),
        (["store", "--input", str(good), "--cache-salt", "a@b"], 2, salt_msg),
        (["remap", "--model-name", "m", "--source-tokens", "0:16", "--target-tokens", "16:32", "--cache-salt", "a@b"], 2, salt_msg),
        (["remap", "--model-name", "m", "--source-tokens", "0:16", "--target-tokens", "16:32",
          "--target-cache-salt", "x/y"], 2, "--target-cache-salt must not contain '/': 'x/y'"),
        (["make-package", "--output", out, "--model-name", "m", "--cache-salt", "a@b", "--chunk-size", "16",
          "--num-chunks", "1", "--num-layers", "2", "--hidden-dim", "16"], 2, salt_msg),
        (["lookup", "--model-name", "m@x", "--num-tokens", "16"], 2, model_msg),
        (["retrieve", "--model-name", "", "--num-tokens", "16", "--output", out], 2,
         "--model-name: model_name must not be empty"),
        (["store", "--input", str(good), "--model-name", "m@x"], 2, model_msg),
        (["remap", "--model-name", "m@x", "--source-tokens", "0:16", "--target-tokens", "16:32"], 2, model_msg),
        (["remap-batch", str(pairs), "--model-name", "m@x"], 2, model_msg),
        (["lookup", "--model-name", "m", "--token-start", "4294967290", "--num-tokens", "16"], 2,
         "--token-start/--num-tokens: token id 4294967296 is outside [0, 2**32)"),
        (["store", "--input", str(negative)], 1, f"{negative}: 'tokens': token id -1 is outside [0, 2**32)"),
        (["remap", "--model-name", "m", "--source-package", str(negative), "--target-tokens", "0:16"], 1,
         f"{negative}: 'tokens': token id -1 is outside [0, 2**32)"),
        (["store", "--input", str(salted)], 1, f"{salted}: 'cache_salt' must not contain '@': 'a@b'"),
        (["store", "--input", str(named)], 1, f"{named}: model_name must not contain '@': 'm@x'"),
    ]  # fmt: skip
    for argv, code, message in cases:
        extra = NOWHERE if argv[0] != "make-package" else []
        assert run_main(capsys, *argv, *extra) == (code, "", f"{PROG} {argv[0]}: error: {message}\n"), argv
    assert not Path(out).exists()


def test_token_ranges_are_bounded_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A range past the id bound or longer than MAX_TOKENS is refused before its list is
    built (0:99999999999 was a MemoryError traceback; 0:400000000 took 24 GB)."""
    from lmcache_async.cli.arguments import MAX_TOKENS

    assert MAX_TOKENS == 4194304
    out = tmp_path / "out.pt"
    outside = "token id 4294967296 is outside [0, 2**32)"
    too_many = f"5000000 tokens; at most {MAX_TOKENS} are accepted"
    lookup = ["lookup", *NOWHERE, "--model-name", "m"]
    remap = ["remap", *NOWHERE, "--model-name", "m"]
    make = ["make-package", "--output", str(out), "--model-name", "m", "--num-layers", "1", "--hidden-dim",
            "1"]  # fmt: skip
    flag_errors = [  # argparse's usage errors: the argument's type refuses the SPEC
        ([*lookup, "--tokens", "0:99999999999"], f"argument --tokens: {outside}"),
        ([*lookup, "--tokens", "0:16,4294967295:4294967297"], f"argument --tokens: {outside}"),
        ([*lookup, "--tokens", "7,99999999999"], "argument --tokens: token id 99999999999 is outside [0, 2**32)"),
        ([*remap, "--source-tokens", "0:99999999999", "--target-tokens", "0:16"],
         f"argument --source-tokens: {outside}"),
        ([*lookup, "--tokens", "0:5000000"], f"argument --tokens: {too_many}"),
        ([*remap, "--source-tokens", "0:16", "--target-tokens", "0:3000000,9000000:11000000"],
         f"argument --target-tokens: {too_many}"),
    ]  # fmt: skip
    for argv, message in flag_errors:
        proc = in_process(capsys, *argv)
        assert (proc.returncode, proc.stdout) == (2, ""), argv
        assert proc.stderr.endswith(f"{PROG} {argv[0]}: error: {message}\n"), argv
    usage_errors = [  # checked by the command, one line
        ([*lookup, "--num-tokens", "99999999999"], f"--token-start/--num-tokens: {outside}"),
        ([*lookup, "--token-start", "4294967290", "--num-tokens", "16"], f"--token-start/--num-tokens: {outside}"),
        ([*lookup, "--num-tokens", "5000000"], f"--token-start/--num-tokens: {too_many}"),
        (["retrieve", *NOWHERE, "--model-name", "m", "--output", str(out), "--token-start", "7", "--num-tokens",
          "5000000"], f"--token-start/--num-tokens: {too_many}"),
        ([*make, "--token-start", "4294967290", "--chunk-size", "16", "--num-chunks", "1"],
         f"--token-start/--chunk-size/--num-chunks: {outside}"),
        ([*make, "--chunk-size", "1000000", "--num-chunks", "5"], f"--token-start/--chunk-size/--num-chunks: {too_many}"),
    ]  # fmt: skip
    for argv, message in usage_errors:
        assert run_main(capsys, *argv) == (2, "", f"{PROG} {argv[0]}: error: {message}\n"), argv
    assert not out.exists()
    # At the bounds: accepted, so the command goes on to the (absent) server.
    refused = (
        f"{PROG} lookup: error: cannot reach the LMCache server at http://127.0.0.1:9: connection refused\n"
    )
    for argv in (
        [*lookup, "--tokens", "4294967295:4294967296"],
        [*lookup, "--tokens", f"0:{MAX_TOKENS - 1},4294967295"],
        [*lookup, "--token-start", str(2**32 - MAX_TOKENS), "--num-tokens", str(MAX_TOKENS)],
        [*lookup, "--token-start", "99999999999", "--num-tokens", "0"],
    ):
        assert run_main(capsys, *argv) == (1, "", refused), argv


def test_remap_batch_lines_past_the_bounds_or_not_utf8_fail_alone(
    embedded_server_shm: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = embedded_server_shm
    model = unique_model("cli-batch-bounds")
    src, dst = fresh_tokens(32), fresh_tokens(32)
    store_sources(srv, model, [(random_kv(SMALL_GEOMETRY, 32, seed=1), src, "")])
    not_utf8 = b'{"source": "0:16", "target": "16:32", "id": "caf\xe9"}'
    at = not_utf8.index(b"\xe9")
    text = [
        json.dumps({"source": src, "target": dst}).encode(),  # line 1: a hit
        json.dumps({"source": "0:99999999999", "target": "0:16"}).encode(),
        json.dumps({"source": {"start": 0, "count": 10**12}, "target": "0:16"}).encode(),
        json.dumps({"source": "0:16", "target": {"start": 0, "count": 5000000}}).encode(),
        not_utf8,  # line 5
        b"# a comment in Latin-1: caf\xe9 (ignored like any comment)",
        json.dumps({"source": {"start": 4294967290, "count": 16}, "target": "16:32"}).encode(),
        b"[" * 5000,  # line 8: nested past the recursion limit (QA-4 n1)
        b'{"source": "0:16", "target": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,
    ]
    pairs, report = tmp_path / "pairs.jsonl", tmp_path / "report.jsonl"
    pairs.write_bytes(b"\n".join(text) + b"\n")
    outside = "invalid pair: source: token id 4294967296 is outside [0, 2**32)"
    errors = {
        2: outside,
        3: outside,
        4: "invalid pair: target: 5000000 tokens; at most 4194304 are accepted",
        5: f"invalid pair: 'utf-8' codec can't decode byte 0xe9 in position {at}: invalid continuation byte",
        7: outside,
        8: "invalid pair: JSON nested too deeply",
        9: "invalid pair: JSON nested too deeply",
    }
    code, out, err = run_main(capsys, "remap-batch", str(pairs), "--url", srv.url, "--http-url", srv.http_url,
                              "--timeout", "30", *GEOMETRY_FLAGS, "--model-name", model, "--report", str(report),
                              "--json")  # fmt: skip
    assert code == 1
    summary = json.loads(out)
    assert (summary["pairs"], summary["hits"], summary["misses"], summary["failures"]) == (8, 1, 0, 7)
    first = list(errors.items())[:5]  # stderr names the first five, the report has them all
    assert err == "".join(f"{PROG} remap-batch: failed: line {n}: {e}\n" for n, e in first) + (
        f"{PROG} remap-batch: ... and 2 more failures (see the report)\n"
    )
    rows = {}
    for raw in report.read_text().splitlines():
        row = json.loads(raw)
        del row["key"], row["elapsed"]
        rows[row.pop("line")] = row
    assert rows == {
        1: {"status": "hit", "retrieved_tokens": 32, "stored_tokens": 32, "stored_new": True, "error": None},
        **{
            n: {"status": "error", "retrieved_tokens": 0, "stored_tokens": 0, "stored_new": False, "error": e}
            for n, e in errors.items()
        },
    }


def test_outputs_that_cannot_be_written_are_one_line_errors(
    embedded_server_shm: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = embedded_server_shm
    model = unique_model("cli-output")
    tokens = fresh_tokens(32)
    store_sources(srv, model, [(random_kv(SMALL_GEOMETRY, 32, seed=2), tokens, "")])
    a_file = tmp_path / "file.txt"
    a_file.write_text("not a directory\n")
    missing = tmp_path / "missing" / "p.pt"
    cases = [
        (missing, f"{missing}: cannot write: no such directory {missing.parent}"),
        (a_file / "p.pt", f"{a_file / 'p.pt'}: cannot write: {a_file} is not a directory"),
        (tmp_path, f"{tmp_path}: cannot write: it is a directory"),
    ]
    make = ["make-package", "--model-name", "m", "--chunk-size", "16", "--num-chunks", "1", "--num-layers", "2",
            "--hidden-dim", "16"]  # fmt: skip
    # Refused before anything is made or fetched (nothing listens at NOWHERE).
    for path, message in cases:
        for argv in (
            [*make, "--output", str(path)],
            ["retrieve", *NOWHERE, "--model-name", "m", "--num-tokens", "16", "--output", str(path)],
        ):
            assert run_main(capsys, *argv) == (1, "", f"{PROG} {argv[0]}: error: {message}\n"), argv
    assert not missing.parent.exists() and a_file.read_text() == "not a directory\n"
    # A write that fails (a full disk), for retrieve after the KV was fetched: one line, exit 1.
    server = ["--url", srv.url, "--http-url", srv.http_url, "--timeout", "30", *GEOMETRY_FLAGS]
    for argv in (
        [*make, "--output", "/dev/full"],
        ["retrieve", *server, "--model-name", model, "--tokens", f"{tokens[0]}:{tokens[0] + 32}", "--output",
         "/dev/full"],
    ):  # fmt: skip
        error = f"{PROG} {argv[0]}: error: /dev/full: cannot write: No space left on device\n"
        assert run_main(capsys, *argv) == (1, "", error), argv
    # A file that opens but refuses the write (QA-4 n6: was torch's "basic_ios::clear: iostream
    # error"); /proc/version opens for root and fails the write, and refuses the open otherwise.
    why = "Input/output error" if os.geteuid() == 0 else "Permission denied"
    error = f"{PROG} make-package: error: /proc/version: cannot write: {why}\n"
    assert run_main(capsys, *make, "--output", "/proc/version") == (1, "", error)


def test_a_file_that_is_not_a_package_is_told_what_a_package_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmcache_async.cli.package_file import PACKAGE_FORMAT

    module = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), module)  # a pickled class: weights_only refuses it
    text = tmp_path / "notes.pt"
    text.write_text("hello, not a torch file\n")
    listed = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], listed)
    partial = tmp_path / "partial.pt"
    torch.save({"kv": torch.zeros(1), "cache_salt": ""}, partial)
    # The old torch.save format (a sequence of pickles, not a zip archive).
    legacy = tmp_path / "legacy.pt"
    torch.save(torch.nn.Linear(2, 2), legacy, _use_new_zipfile_serialization=False)
    # Not written by torch.save: torch's weights_only unpickler refuses these too.
    as_json = tmp_path / "package.json"
    as_json.write_text('{"kv": [1, 2], "model_name": "m", "tokens": [1], "cache_salt": ""}\n')
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"model_name": "m", "tokens": [1], "cache_salt": ""}, protocol=4))
    holds = "it holds objects other than tensors, strings, numbers, lists and dicts, so it was not loaded"
    not_torch = f"not a KV package: not a file written by torch.save ({PACKAGE_FORMAT})"
    cases = [
        (module, f"{module}: not a KV package: {holds} ({PACKAGE_FORMAT})"),
        (legacy, f"{legacy}: not a KV package: {holds} ({PACKAGE_FORMAT})"),
        (text, f"{text}: {not_torch}"),
        (as_json, f"{as_json}: {not_torch}"),
        (plain, f"{plain}: {not_torch}"),
        (listed, f"{listed}: not a KV package: it holds a list, not a dict ({PACKAGE_FORMAT})"),
        (partial, f"{partial}: not a KV package: no model_name, tokens ({PACKAGE_FORMAT})"),
        (tmp_path / "absent.pt", f"{tmp_path / 'absent.pt'}: no such file"),
    ]
    for path, message in cases:
        for argv in (
            ["store", *NOWHERE, "--input", str(path)],
            [
                "remap",
                *NOWHERE,
                "--model-name",
                "m",
                "--source-package",
                str(path),
                "--target-tokens",
                "0:16",
            ],
        ):
            # Every warning recorded (the test run turns them into errors): torch's about the
            # pickle protocol of a plain pickle is not shown above the one-line error.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                code, out, err = run_main(capsys, *argv)
            assert (code, out, err) == (1, "", f"{PROG} {argv[0]}: error: {message}\n")
            assert "weights_only" not in err
            assert [str(w.message) for w in caught] == []


def test_progress_line_fits_the_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from lmcache_async.bulk import BatchProgress, ItemResult
    from lmcache_async.cli.batch import render_progress, terminal_columns

    p = BatchProgress(120, 200, 100, 10, 10, 0, 0, 1_234_000_000, 0.5, ItemResult(0))
    full = "[##############..........] 120/200  60%  hits 100  misses 10  failed 10  1.23 GB  2.47 GB/s"
    assert render_progress(p) == full  # no terminal: never cut
    assert render_progress(p, columns=200) == full
    assert render_progress(p, columns=len(full) + 1) == full
    # One column short: the bar gives one character (23 wide, 13 filled).
    assert render_progress(p, columns=len(full)) == "[#############..........]" + full[26:]
    # The bar narrows first (12 wide), then the throughput goes, the bar widens again (13).
    assert render_progress(p, columns=80) == "[#######.....]" + full[26:]
    assert render_progress(p, columns=70) == "[#######......]" + full[26:-11]
    # At the narrowest bar without the optional fields, the line is cut.
    assert render_progress(p, columns=40) == "[####....] 120/200  60%  hits 100  miss"
    skipped = render_progress(p, 7, columns=90)
    assert (
        skipped == "[######.....] 120/200  60%  hits 100  misses 10  failed 10  skipped 7  1.23 GB  2.47 GB/s"
    )
    for columns in range(1, 120):
        assert len(render_progress(p, 3, columns=columns)) <= max(columns - 1, 1)

    monkeypatch.setenv("COLUMNS", "57")
    assert terminal_columns(io.StringIO()) == 57
    monkeypatch.delenv("COLUMNS")
    assert terminal_columns(io.StringIO()) is None  # pytest captures: no terminal anywhere


# --------------------------------------------------------------------------- the docs, as written

DOCS = Path(__file__).resolve().parents[2] / "docs" / "guides" / "bulk-and-cli.md"


def _doc_examples(*commands: str) -> list[tuple[list[str], str]]:
    """The ``$ lmcache-async COMMAND ...`` examples of docs/guides/bulk-and-cli.md, in page order:
    (argv after the program name, the output shown under it)."""
    examples: list[tuple[list[str], str]] = []
    for block in re.findall(r"^```\n(\$ lmcache-async .*?)^```$", DOCS.read_text(), flags=re.S | re.M):
        command_text, _, output = block.partition("\n")
        while command_text.endswith("\\"):
            more, _, output = output.partition("\n")
            command_text = command_text[:-1] + " " + more.strip()
        argv = shlex.split(command_text)[2:]
        if argv[0] in commands:
            examples.append((argv, output))
    return examples


def test_the_package_and_remap_examples_of_the_docs_run_as_written(
    real_server_shm: RealLMCacheServer, tmp_path: Path
) -> None:
    """make-package, store, lookup, remap as docs/guides/bulk-and-cli.md shows them (only the
    model name is made unique and the server's address added): the same output, and the
    remap finds the source under the package's salt."""
    srv = real_server_shm
    model = unique_model("cli-docs")
    examples = _doc_examples("make-package", "store", "lookup", "remap")
    assert [argv[0] for argv, _ in examples] == ["store", "make-package", "store", "lookup", "remap"]
    torch.save(torch.nn.Linear(2, 2), tmp_path / "model.pt")  # the refused file of the page
    runs: list[tuple[list[str], str]] = []
    for argv, shown in examples:
        argv = [model if i and argv[i - 1] == "--model-name" else a for i, a in enumerate(argv)]
        if argv[0] != "make-package":
            argv += server_args(srv)
        runs.append((argv, re.sub(r"^model( +)m$", rf"model\g<1>{model}", shown, flags=re.M)))
    # The refused store and make-package are independent: at once; the rest in page order.
    procs = cli_many(runs[0][0], runs[1][0], cwd=tmp_path)
    for (argv, expected), proc in zip(runs, [*procs, *([None] * (len(runs) - 2))], strict=True):
        proc = proc or cli(*argv, cwd=tmp_path)
        if expected.startswith(f"{PROG} {argv[0]}: error: "):
            assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected), argv
        else:
            assert (proc.returncode, proc.stdout, proc.stderr) == (0, expected, ""), argv

    async def check() -> None:
        pkg = torch.load(tmp_path / "p.pt", weights_only=True)
        async with AsyncClient(srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30) as c:
            got = await c.retrieve(list(range(5000, 5040)), "t")
            assert got is not None and torch.equal(got, pkg["kv"][:, :, :32])

    asyncio.run(check())


# --------------------------------------------------------------------------- the 0.5.7 server

KEY = "cli-key-057"


async def _store(
    srv: RealLMCacheServer, model: str, kv: torch.Tensor, tokens: list[int], api_key: str | None = None
) -> None:
    async with AsyncClient(
        srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30, api_key=api_key
    ) as c:
        assert await c.store(kv, tokens) is True


async def _retrieve(
    srv: RealLMCacheServer, model: str, tokens: list[int], salt: str, api_key: str | None = None
) -> torch.Tensor | None:
    async with AsyncClient(
        srv.url, srv.http_url, model, geometry=SMALL_GEOMETRY, timeout=30, api_key=api_key
    ) as c:
        return await c.retrieve(tokens, salt)


@pytest.mark.parametrize("generation", ["0.5.7"])
def test_remap_json_on_each_transport(real_server: RealLMCacheServer, tmp_path: Path) -> None:
    srv = real_server
    model = unique_model("cli057")
    src, dst = fresh_tokens(64), fresh_tokens(40)
    kv = random_kv(SMALL_GEOMETRY, 64, seed=5)
    asyncio.run(_store(srv, model, kv, src))
    done = ok(cli("remap", *server_args(srv), *GEOMETRY_FLAGS, "--model-name", model, "--source-tokens",
                  f"{src[0]}:{src[0] + 64}", "--target-tokens", f"{dst[0]}:{dst[0] + 40}",
                  "--target-cache-salt", "t", "--json", cwd=tmp_path))  # fmt: skip
    assert json.loads(done.stdout) == {
        "model_name": model,
        "cache_salt": "",
        "target_cache_salt": "t",
        "source_tokens": 64,
        "target_tokens": 40,
        "retrieved_tokens": 32,
        "stored_tokens": 32,
        "stored_new": True,
        "hit": True,
    }
    got = asyncio.run(_retrieve(srv, model, dst, "t"))
    assert got is not None and torch.equal(got, kv[:, :, :32])


@pytest.mark.parametrize("generation", ["0.5.7"])  # API keys: 0.5.7 servers only
def test_an_api_keyed_server_needs_the_key_from_the_environment(
    fresh_real_server: Callable[..., RealLMCacheServer],
    generation: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    srv = fresh_real_server("pickle", generation=generation, api_key=KEY)
    model = unique_model("cli057-key")
    src, dst = fresh_tokens(32), fresh_tokens(32)
    kv = random_kv(SMALL_GEOMETRY, 32, seed=6)
    asyncio.run(_store(srv, model, kv, src, api_key=KEY))
    args = [*server_args(srv), *GEOMETRY_FLAGS, "--model-name", model, "--source-tokens",
            f"{src[0]}:{src[0] + 32}", "--target-tokens", f"{dst[0]}:{dst[0] + 32}", "--json"]  # fmt: skip
    monkeypatch.delenv("LMCACHE_API_KEY", raising=False)
    refused = cli("remap", *args, cwd=tmp_path)
    assert refused.returncode != 0
    assert "requires an API key: pass api_key= or set LMCACHE_API_KEY" in refused.stderr + refused.stdout
    monkeypatch.setenv("LMCACHE_API_KEY", KEY)
    done = ok(cli("remap", *args, cwd=tmp_path))
    assert json.loads(done.stdout)["stored_tokens"] == 32
    got = asyncio.run(_retrieve(srv, model, dst, "", api_key=KEY))
    assert got is not None and torch.equal(got, kv)


def test_a_negative_looking_value_gets_the_equals_hint(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["lookup", *NOWHERE, "--model-name", "m", "--tokens", "-5:3"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"{PROG} lookup: error: argument --tokens: expected one argument (a value that starts "
        "with '-' is read as an option: write --tokens=-5:3)"
    )
    with pytest.raises(SystemExit):  # a missing value that is not a negative number: no hint
        main(["lookup", *NOWHERE, "--model-name", "m", "--tokens", "--json"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"{PROG} lookup: error: argument --tokens: expected one argument"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "99999"], "argument --port: 99999 is not a port number in 0..65535 (0: a free one)"),
        (["--http-port", "-1"], "argument --http-port: -1 is not a port number in 0..65535 (0: a free one)"),
        (["--port", "x"], "argument --port: 'x' is not a port number"),
    ],
)
def test_serve_refuses_a_bad_port_while_parsing(argv: list[str], message: str) -> None:
    """In a fresh interpreter: the error names the subcommand, and torch is not imported."""
    code = (
        "import sys\n"
        "from lmcache_async.cli import main\n"
        "try:\n"
        f"    main(['serve', *{argv!r}])\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.stdout == "exit 2 False\n"
    assert proc.stderr.splitlines()[-1] == f"{PROG} serve: error: {message}"


def test_demo_says_connection_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--url", "tcp://127.0.0.1:9", "--http-url", "http://127.0.0.1:9", "--timeout", "5"]
    assert run_main(capsys, *args) == (
        1,
        "",
        f"{PROG} demo: cannot reach the LMCache server at http://127.0.0.1:9: connection refused\n",
    )
    code, out, err = run_main(capsys, *args, "--json")
    assert (code, json.loads(out), err) == (
        1,
        {"ok": False, "error": "cannot reach the LMCache server at http://127.0.0.1:9: connection refused"},
        "",
    )
