"""The trained model's float32 weight cache (``lmcache_async.testing.trained.write_once``):
concurrent first loads in several processes write it once, under an ``fcntl`` lock, through a
temporary folder renamed into place; a writer that fails leaves nothing behind; a lock held
too long is a ``TimeoutError`` and nothing is written. No model is loaded here: the writer is
a stand-in that sleeps as dequantizing does."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.real_server import REPO_ROOT
from lmcache_async.testing import trained

_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from lmcache_async.testing.trained import write_once

    where, log = Path(sys.argv[1]), Path(sys.argv[2])

    def write(tmp):
        with log.open("a") as f:
            f.write(f"{os.getpid()}\\n")
        (tmp / "config.json").write_text("{}")
        time.sleep(0.5)  # a slow dequantize: the others wait on the lock meanwhile
        (tmp / "model.safetensors").write_bytes(b"w" * 1000)

    print("wrote" if write_once(where, write, timeout=60) else "found", flush=True)
    """
)


def _files(where: Path) -> list[str]:
    return sorted(p.name for p in where.parent.iterdir())


def test_concurrent_first_loads_in_four_processes_write_the_cache_once(tmp_path: Path) -> None:
    where, log = tmp_path / "cache" / "model-abc", tmp_path / "writers.log"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(where), str(log)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0]
    assert sorted(outs) == ["found", "found", "found", "wrote"]
    assert len(log.read_text().split()) == 1  # one process dequantized
    assert sorted(p.name for p in where.iterdir()) == ["config.json", "model.safetensors"]
    assert (where / "model.safetensors").read_bytes() == b"w" * 1000
    assert _files(where) == ["model-abc", "model-abc.lock"]  # no temporary folder left


def test_a_complete_cache_is_not_written_again(tmp_path: Path) -> None:
    where = tmp_path / "m"
    where.mkdir()
    (where / "config.json").write_text("{}")
    (where / "model.safetensors").write_bytes(b"old")

    def write(tmp: Path) -> None:
        raise AssertionError("the writer must not run")

    assert trained.write_once(where, write) is False
    assert (where / "model.safetensors").read_bytes() == b"old"


def test_a_partial_cache_is_completed_and_the_weights_renamed_last(tmp_path: Path) -> None:
    where = tmp_path / "m"
    where.mkdir()
    (where / "config.json").write_text("stale")  # an interrupted first load of an old version
    seen: list[list[str]] = []

    def write(tmp: Path) -> None:
        seen.append(sorted(p.name for p in where.iterdir()))
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"new")

    assert trained.write_once(where, write) is True
    assert seen == [["config.json"]]
    assert (where / "config.json").read_text() == "{}"
    assert (where / "model.safetensors").read_bytes() == b"new"


def test_a_failing_writer_leaves_nothing_and_releases_the_lock(tmp_path: Path) -> None:
    where = tmp_path / "m"

    def fail(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match=r"^disk full$"):
        trained.write_once(where, fail)
    assert _files(where) == ["m.lock"]  # neither the folder nor a temporary one

    def incomplete(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")

    with pytest.raises(RuntimeError, match=r"^the cache writer did not write model\.safetensors$"):
        trained.write_once(where, incomplete)
    assert _files(where) == ["m.lock"]

    def good(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"ok")

    assert trained.write_once(where, good, timeout=1) is True  # the lock was released
    assert (where / "model.safetensors").read_bytes() == b"ok"


def test_a_lock_held_past_the_deadline_is_a_timeout_and_nothing_is_written(tmp_path: Path) -> None:
    where = tmp_path / "m"
    called: list[Path] = []
    with open(tmp_path / "m.lock", "a+b") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another process's first load, still running
        # flock locks belong to the open file description: a second open in this process
        # contends as another process would
        t0 = time.monotonic()
        with pytest.raises(
            TimeoutError,
            match=r"^another process held m\.lock for 0\.3 s \(the trained model's first load\): nothing was written$",
        ):
            trained.write_once(where, called.append, timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 5
    assert called == [] and not where.exists()
