"""Run a REAL ``redis-server`` (Debian's package) on loopback for tests and benchmarks.

Stdlib only. LMCache servers use it as their shared L2 through
``--l2-adapter '{"type":"resp","host":"127.0.0.1","port":PORT}'``.

    from harness.redis_server import RedisServer

    with RedisServer() as redis:
        redis.port               # a free loopback port
        redis.l2_adapter_arg()   # the JSON for --l2-adapter
        redis.command("DBSIZE")  # a tiny RESP client, no redis-py needed

Each server binds 127.0.0.1 only, on a port picked free, with its own working
directory (its log, and its dump/AOF files when ``persistent=True``). No
persistence by default (``--save "" --appendonly no``): a restart then starts
empty, exactly like a cache node that lost its memory. ``stop()`` signals
exactly the pid it started (never by name).

Install redis-server with ``harness/ensure_redis.sh`` (idempotent).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["ENSURE_SCRIPT", "RedisError", "RedisServer", "redis_server_exe"]

ENSURE_SCRIPT = Path(__file__).resolve().with_name("ensure_redis.sh")


class RedisError(RuntimeError):
    """redis-server could not be found, started or talked to."""


def redis_server_exe() -> str:
    """Path of ``redis-server``; runs ``ensure_redis.sh`` first if it is missing.

    Raises:
        RedisError: with the script's output if it cannot be installed.
    """
    exe = shutil.which("redis-server")
    if exe:
        return exe
    proc = subprocess.run(
        ["bash", str(ENSURE_SCRIPT)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    exe = shutil.which("redis-server")
    if proc.returncode != 0 or not exe:
        raise RedisError(
            f"{ENSURE_SCRIPT} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return exe


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _encode(args: tuple[Any, ...]) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()  # appends are amortized O(1): large values stay linear

    def _fill(self) -> None:
        data = self._sock.recv(1 << 20)
        if not data:
            raise RedisError("redis closed the connection")
        self._buf += data

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def _exact(self, n: int) -> bytes:
        while len(self._buf) < n + 2:
            self._fill()
        data = bytes(self._buf[:n])
        del self._buf[: n + 2]
        return data

    def reply(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RedisError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise RedisError(f"unexpected RESP reply {line[:80]!r}")


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1.

    Args:
        persistent: keep data across :meth:`restart` (append-only file, fsync on
            every write); default False (``--save "" --appendonly no``).
        workdir: its directory (log, data files); default a fresh temp dir,
            removed by :meth:`stop` unless given by the caller.

    The port is chosen once, so :meth:`restart` comes back on the SAME port
    (LMCache's RESP adapter is configured with it at server start).
    """

    def __init__(self, *, persistent: bool = False, workdir: Path | str | None = None) -> None:
        self.persistent = persistent
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="redis_"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.log_path = self.workdir / "redis.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.started_pids: list[int] = []

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def l2_adapter_arg(self, **extra: Any) -> str:
        """The JSON for LMCache's ``--l2-adapter`` pointing at this server."""
        return json.dumps({"type": "resp", "host": self.host, "port": self.port, **extra})

    def command_line(self) -> list[str]:
        cmd = [
            redis_server_exe(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.workdir),
            "--logfile", str(self.log_path),
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--save", "",
        ]  # fmt: skip
        if self.persistent:
            cmd += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            cmd += ["--appendonly", "no"]
        return cmd

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start it and wait until ``PING`` answers ``PONG``.

        Raises:
            RedisError: it exited or did not answer within ``timeout`` s (it is
                then stopped); the message has the log tail.
        """
        if self.is_running():
            raise RedisError(f"redis already running (pid {self.pid})")
        self._proc = subprocess.Popen(
            self.command_line(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=str(self.workdir),
            start_new_session=True,
        )
        self.started_pids.append(self._proc.pid)
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                rc = self._proc.returncode
                self._proc = None
                raise RedisError(f"redis-server exited with {rc} at start:\n{self.log_tail()}")
            with contextlib.suppress(OSError, RedisError):
                if self.command("PING", timeout=1.0) == "PONG":
                    return self
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise RedisError(f"redis-server not answering within {timeout:.0f} s:\n{tail}")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM exactly the started pid, wait, SIGKILL if needed. Idempotent."""
        proc = self._proc
        rc: int | None = None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=10)
            rc = proc.returncode
            self._proc = None
        return rc

    def kill(self) -> None:
        """SIGKILL exactly the started pid (a crash: no shutdown save)."""
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=10)
            self._proc = None

    def restart(self, timeout: float = 20.0) -> RedisServer:
        """Stop, then start again on the same port and directory."""
        self.stop()
        return self.start(timeout=timeout)

    def cleanup(self) -> None:
        """Stop, and remove the working directory if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        if not self.is_running():
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"RedisServer(port={self.port}, pid={self.pid}, persistent={self.persistent})"

    # ------------------------------------------------------------ client side
    def command(self, *args: Any, timeout: float = 10.0) -> Any:
        """Send one command on a fresh connection and return the decoded reply
        (``str`` for simple strings, ``bytes`` for bulk strings, ``int``, ``list``).

        Raises:
            RedisError: an error reply; OSError: cannot connect / timeout.
        """
        with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
            sock.sendall(_encode(args))
            return _Reader(sock).reply()

    def keys(self, pattern: str = "*") -> list[str]:
        """``KEYS pattern`` (test data sets are small), decoded, sorted."""
        return sorted(k.decode() for k in self.command("KEYS", pattern))

    def wait_for_keys(self, pattern: str, count: int, timeout: float = 20.0) -> list[str]:
        """Poll until exactly ``count`` keys match ``pattern``; returns them.

        Raises:
            RedisError: a different number of keys after ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self.keys(pattern)
            if len(found) == count:
                return found
            if time.monotonic() > deadline:
                raise RedisError(
                    f"{len(found)} keys match {pattern!r} after {timeout:.0f} s, expected {count}"
                )
            time.sleep(0.02)

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "<no log>"
        return "\n".join(lines[-n:])
