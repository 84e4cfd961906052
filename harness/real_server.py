"""Run the REAL LMCache MP server (``lmcache server``) for tests and benchmarks.

Two server generations: ``"0.5.6"`` (the default) and ``"0.5.7"`` (the
0.5.7rc3 build). Stdlib only; never imports ``lmcache_async`` nor ``lmcache``
(each generation's server runs in its own virtual environment, built by
``harness/build_lmcache_venv.sh [--generation 0.5.7]``: ``.lmcache-venv``
and ``.lmcache-venv-057``).

    from harness.real_server import RealLMCacheServer

    with RealLMCacheServer("shm", chunk_size=16) as srv:
        srv.url        # "tcp://127.0.0.1:<port>"  (ZMQ request endpoint)
        srv.http_url   # "http://127.0.0.1:<port>" (FastAPI: /healthcheck, /config, /status)
        srv.get_json("/config")["mp"]["chunk_size"]

    with RealLMCacheServer("pickle", generation="0.5.7") as srv:
        srv.generation                      # "0.5.7"
        srv.get_json("/lmc_version")        # "0.5.7rc3.dev0" (LMC_VERSIONS["0.5.7"])

Every server binds loopback only, on two fresh ports, and (mode ``"shm"``) a
unique shm name ``lmca_<pid>_<hex>``, so several can run side by side. ``stop()``
signals exactly the pid it started (never by name) and removes the L1 pool
segment ``/dev/shm/lmcache_l1_pool_<name>`` if the server left it behind.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

__all__ = [
    "BUILD_SCRIPT",
    "GENERATIONS",
    "LMC_VERSIONS",
    "REPO_ROOT",
    "Generation",
    "LMCacheServerError",
    "RealLMCacheServer",
    "lmcache_venv_python",
    "venv_generation",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = Path(__file__).resolve().with_name("build_lmcache_venv.sh")

SHM_DIR = Path("/dev/shm")
L1_POOL_PREFIX = "lmcache_l1_pool_"

#: Environment every lmcache process gets: no telemetry (without these the
#: server tries to reach an outside host), no banner.
LMCACHE_QUIET_ENV = {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}
#: Variables a 0.5.7 server reads its HTTP API keys from: never inherited by an lmcache
#: process (a key in the developer's shell would silently turn authentication on); use
#: ``RealLMCacheServer(api_key=...)``.
LMCACHE_API_KEY_ENV = (
    "LMCACHE_API_KEY",
    "LMCACHE_API_KEY_FILE",
    "LMCACHE_HTTP_API_KEY",
    "LMCACHE_HTTP_API_KEY_FILE",
)

Mode = Literal["shm", "pickle"]

#: A server generation: the lmcache release line whose wire the server speaks.
Generation = Literal["0.5.6", "0.5.7"]
GENERATIONS: tuple[Generation, ...] = ("0.5.6", "0.5.7")
#: What ``GET /lmc_version`` answers on each generation's server.
LMC_VERSIONS: dict[Generation, str] = {"0.5.6": "0.5.6", "0.5.7": "0.5.7rc3.dev0"}
#: The installed distribution (its ``*.dist-info`` directory) that marks a venv's generation.
_DIST_INFO_GLOBS: dict[Generation, str] = {
    "0.5.6": "lmcache-0.5.6.dist-info",
    "0.5.7": "lmcache_cli-0.5.7*.dist-info",
}
#: The environment variable that overrides a generation's venv location (build script).
VENV_ENV_VARS: dict[Generation, str] = {"0.5.6": "LMCACHE_VENV", "0.5.7": "LMCACHE_VENV_057"}


def check_generation(generation: str) -> Generation:
    """``generation`` itself if it is one of :data:`GENERATIONS`, else ValueError."""
    for g in GENERATIONS:
        if generation == g:
            return g
    raise ValueError(f"unknown LMCache server generation {generation!r}; known: {', '.join(GENERATIONS)}")


def venv_generation(python: Path | str) -> Generation:
    """The generation of the lmcache venv that ``python`` (``<venv>/bin/python``) belongs to,
    read from its installed distributions (no interpreter started).

    Raises:
        LMCacheServerError: no lmcache distribution of a known generation in that venv.
    """
    venv = Path(python).parent.parent  # never resolve(): bin/python links to the base python
    found = sorted(
        g
        for g, pattern in _DIST_INFO_GLOBS.items()
        for _ in venv.glob(f"lib/python*/site-packages/{pattern}")
    )
    if len(set(found)) != 1:
        raise LMCacheServerError(
            f"cannot tell the lmcache generation of {python}: "
            f"found {sorted(set(found)) or 'no lmcache distribution'}"
        )
    return check_generation(found[0])


class LMCacheServerError(RuntimeError):
    """The real server (or its venv) could not be built, started or stopped."""


# --------------------------------------------------------------------------- venv

_venv_lock = threading.Lock()
_venv_pythons: dict[Generation, Path] = {}


def lmcache_venv_python(*, generation: Generation = "0.5.6", timeout: float = 1800.0) -> Path:
    """Build (idempotently) the lmcache venv of ``generation`` and return its python.

    Runs ``harness/build_lmcache_venv.sh --generation G``. Location:
    ``<repo>/.lmcache-venv`` (0.5.6) or ``<repo>/.lmcache-venv-057`` (0.5.7),
    overridden by ``LMCACHE_VENV`` / ``LMCACHE_VENV_057``. A built venv costs
    ~0.1 s; a cold build ~70-80 s (0.5.6) or ~45-60 s (0.5.7). The result is
    cached per process and generation.

    Raises:
        ValueError: unknown generation.
        LMCacheServerError: with the script's output if the build fails.
    """
    generation = check_generation(generation)
    with _venv_lock:
        cached = _venv_pythons.get(generation)
        if cached is not None and cached.exists():
            return cached
        try:
            proc = subprocess.run(
                ["bash", str(BUILD_SCRIPT), "--generation", generation],
                cwd=str(REPO_ROOT),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise LMCacheServerError(f"{BUILD_SCRIPT} did not finish within {timeout:.0f} s") from exc
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        if proc.returncode != 0 or not lines:
            raise LMCacheServerError(
                f"{BUILD_SCRIPT} failed (exit {proc.returncode}).\n"
                f"--- stdout ---\n{proc.stdout[-4000:]}\n"
                f"--- stderr ---\n{proc.stderr[-8000:]}"
            )
        python = Path(lines[-1].strip())
        if not python.exists():
            raise LMCacheServerError(
                f"{BUILD_SCRIPT} reported {python}, which does not exist.\n"
                f"--- stderr ---\n{proc.stderr[-8000:]}"
            )
        _venv_pythons[generation] = python
        return python


#: ``LMCACHE_ASYNC_TEST_LAUNCHER=0`` starts every server as its own interpreter (Popen)
#: instead of forking it from a launcher that has imported lmcache already.
LAUNCHER_ENV = "LMCACHE_ASYNC_TEST_LAUNCHER"
LAUNCHER_SCRIPT = Path(__file__).resolve().with_name("lmcache_launcher.py")


class _Forked:
    """What :class:`RealLMCacheServer` uses of a ``Popen``, for a server forked by a
    :class:`_Launcher`: the launcher reaps it and writes its exit code to a file."""

    def __init__(self, pid: int, rc_path: Path, args: list[str], launcher: _Launcher) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._rc_path = rc_path
        self._launcher = launcher

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._rc_path.read_text())
            except (FileNotFoundError, ValueError):
                if not self._launcher.alive() and not pid_alive(self.pid):
                    self.returncode = -1  # exited after its launcher: the code is lost
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Launcher:
    """One ``harness/lmcache_launcher.py`` per lmcache venv and test process, started on
    the first server of that venv: it forks servers from an interpreter that has
    imported lmcache (most of a server's start), see the script's docstring."""

    _all: dict[Path, _Launcher] = {}
    _lock = threading.Lock()

    def __init__(self, python: Path) -> None:
        self.rc_dir = Path(tempfile.mkdtemp(prefix="lmcache_launcher_"))
        self.env = child_env(source=_IMPORT_ENVIRON)
        self._stderr = open(self.rc_dir / "launcher.log", "ab")  # noqa: SIM115 - for its life
        self.proc = subprocess.Popen(
            [str(python), str(LAUNCHER_SCRIPT), str(self.rc_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=str(self.rc_dir),
            env=self.env,
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if not ready:
            raise LMCacheServerError(f"the lmcache launcher of {python} did not start: {self.log_tail()}")
        self._request_lock = threading.Lock()
        atexit.register(self.close)

    def close(self) -> None:
        """End the launcher (its stdin closed; killed after 5 s) and remove its files;
        servers it forked are not touched."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._stderr.close()
        shutil.rmtree(self.rc_dir, ignore_errors=True)

    @classmethod
    def get(cls, python: Path) -> _Launcher:
        with cls._lock:
            launcher = cls._all.get(python)
            if launcher is None or not launcher.alive() or launcher.pid_owner != os.getpid():
                launcher = cls._all[python] = cls(python)
                launcher.pid_owner = os.getpid()
            return launcher

    pid_owner = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a server with ``env`` can be forked from this launcher: lmcache reads
        some variables when it is imported (``LMCACHE_LOG_LEVEL``), so a difference from
        the launcher's own environment in a variable lmcache, Python or torch may read
        (:data:`_IMPORT_READ`) takes a new interpreter instead. (Others change under the
        suite: importing ray sets ``RAY_CLIENT_MODE``, pytest ``PYTEST_CURRENT_TEST``.)"""

        def relevant(e: dict[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items() if k.startswith(_IMPORT_READ)}

        return relevant(env) == relevant(self.env)

    def log_tail(self) -> str:
        try:
            return (self.rc_dir / "launcher.log").read_text()[-3000:]
        except OSError:
            return ""

    def spawn(self, args: list[str], log: Path, cwd: Path, env: dict[str, str]) -> _Forked:
        request = json.dumps({"args": args, "log": str(log), "cwd": str(cwd), "env": env}) + "\n"
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self._request_lock:
            self.proc.stdin.write(request.encode())
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        if not answer:
            raise LMCacheServerError(f"the lmcache launcher exited: {self.log_tail()}")
        pid = int(json.loads(answer)["pid"])
        return _Forked(pid, self.rc_dir / f"{pid}.rc", args, self)


def _use_launcher() -> bool:
    return os.environ.get(LAUNCHER_ENV, "1") != "0"


#: The prefixes of the variables a server may read when lmcache is imported.
_IMPORT_READ = ("LMCACHE", "PYTHON", "VLLM", "OTEL", "PROMETHEUS", "TORCH", "CUDA", "OMP_", "MKL_", "LD_")
#: The environment when this module was imported (before any test changed it): what a
#: launcher runs with (:class:`_Launcher`).
_IMPORT_ENVIRON = dict(os.environ)


def child_env(extra: dict[str, str] | None = None, source: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a process of the lmcache venv.

    Drops variables that would leak the caller's interpreter setup into the
    other venv (``PYTHONPATH``, ``PYTHONHOME``, ``VIRTUAL_ENV``) and the API-key
    variables (:data:`LMCACHE_API_KEY_ENV`), and adds the telemetry/banner switches.
    """
    dropped = (
        "PYTHONPATH",
        "PYTHONHOME",
        "VIRTUAL_ENV",
        "PYTHONSTARTUP",
        "PYTHONSAFEPATH",
        *LMCACHE_API_KEY_ENV,
    )
    env = {k: v for k, v in (os.environ if source is None else source).items() if k not in dropped}
    env.update(LMCACHE_QUIET_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pick_ports(n: int) -> list[int]:
    # Hold all sockets open until every port is chosen so they are distinct.
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the comm field (index 0 = state)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live descendant of ``pid``."""
    out: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                kids = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for k in kids:
                child = int(k)
                st = _proc_stat(child)
                if st is not None:
                    out.append((child, st[19]))  # field 22 of stat: starttime
                    todo.append(child)
    return out


def _same_process_alive(pid: int, starttime: str) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[19] == starttime and st[0] not in ("Z", "X")


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (Linux ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    # state is the field after the parenthesised comm
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X")


# --------------------------------------------------------------------------- server


class RealLMCacheServer:
    """One ``lmcache server`` process (ZMQ + HTTP) on loopback.

    Args:
        mode: ``"shm"`` (``--shm-name lmca_<pid>_<hex> --no-l1-use-lazy``: the
            whole L1 is the POSIX segment ``/dev/shm/lmcache_l1_pool_<name>``)
            or ``"pickle"`` (``--shm-name ""``).
        chunk_size: ``--chunk-size`` in tokens (default 256).
        l1_size_gb: ``--l1-size-gb`` (default 1); eviction policy is LRU.
        extra_args: appended to the command line verbatim.
        venv_python: the lmcache venv's python; default: built on first
            ``start()`` via :func:`lmcache_venv_python`.
        log_dir: directory for the log file (default: a fresh temp dir). The
            log is appended across ``restart()`` and kept after ``stop()``.
        name: label used in the log file name.
        generation: ``"0.5.6"`` or ``"0.5.7"``: which server to run. Default:
            the generation of ``venv_python`` when given (read from its
            installed distributions), else ``"0.5.6"``. A ``venv_python`` of
            another generation is a ValueError.
        api_key: (0.5.7 only) turn on the HTTP API keys: the key is written to
            a file of mode 0600 in ``log_dir`` and passed as
            ``--api-key-file``; every route but ``/`` and ``/healthcheck``
            then answers 401 without it. :meth:`http_get` and friends send it.

    The ports and shm name are chosen once, in the constructor, so
    :meth:`restart` brings the server back on the SAME endpoints.
    """

    def __init__(
        self,
        mode: Mode = "shm",
        *,
        chunk_size: int = 256,
        l1_size_gb: float = 1,
        extra_args: Sequence[str] = (),
        venv_python: Path | str | None = None,
        log_dir: Path | str | None = None,
        name: str | None = None,
        generation: Generation | None = None,
        api_key: str | None = None,
    ) -> None:
        if mode not in ("shm", "pickle"):
            raise ValueError(f"mode must be 'shm' or 'pickle', got {mode!r}")
        if venv_python is not None:
            found = venv_generation(venv_python)
            if generation is not None and check_generation(generation) != found:
                raise ValueError(f"venv_python {venv_python} is an lmcache {found} venv, not {generation}")
            generation = found
        self._generation: Generation = check_generation(generation or "0.5.6")
        if api_key is not None and (self._generation == "0.5.6" or not api_key or "\n" in api_key):
            raise ValueError("api_key needs generation 0.5.7 and a non-empty one-line key")
        self._api_key = api_key
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        self._mode: Mode = mode
        self._chunk_size = int(chunk_size)
        self._l1_size_gb = l1_size_gb
        self._extra_args = [str(a) for a in extra_args]
        self._venv_python = Path(venv_python) if venv_python is not None else None
        self._port, self._http_port = _pick_ports(2)
        self._shm_name = f"lmca_{os.getpid()}_{secrets.token_hex(4)}" if mode == "shm" else ""
        label = name or f"lmcache{self._generation.replace('.', '')}_{mode}_{self._port}"
        self._log_dir = (
            Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="lmcache_server_"))
        )
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = self._log_dir / f"{label}.log"
        self._api_key_file: Path | None = None
        if api_key is not None:
            self._api_key_file = self._log_dir / f"{label}.api_key"
            fd = os.open(self._api_key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(api_key + "\n")
        self._proc: subprocess.Popen[bytes] | _Forked | None = None
        self._started_pids: list[int] = []
        self._start_times: dict[int, str] = {}  # pid: its /proc start time, read at start
        self._children: list[tuple[int, str]] = []
        self._sigterm_sent = False

    # ------------------------------------------------------------ properties
    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def generation(self) -> Generation:
        """``"0.5.6"`` or ``"0.5.7"``: the server generation this object runs."""
        return self._generation

    @property
    def api_key(self) -> str | None:
        """The HTTP API key the server requires (None: no authentication)."""
        return self._api_key

    @property
    def lmc_version(self) -> str:
        """What this generation's ``GET /lmc_version`` answers (``LMC_VERSIONS``)."""
        return LMC_VERSIONS[self._generation]

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def port(self) -> int:
        return self._port

    @property
    def http_port(self) -> int:
        return self._http_port

    @property
    def url(self) -> str:
        """ZMQ request endpoint, ``tcp://127.0.0.1:<port>``."""
        return f"tcp://127.0.0.1:{self._port}"

    @property
    def http_url(self) -> str:
        """HTTP endpoint, ``http://127.0.0.1:<http_port>`` (no trailing slash)."""
        return f"http://127.0.0.1:{self._http_port}"

    @property
    def shm_name(self) -> str:
        """The bare ``--shm-name`` value (``""`` in pickle mode)."""
        return self._shm_name

    @property
    def shm_segment(self) -> str | None:
        """``/dev/shm/lmcache_l1_pool_<name>`` in shm mode, else None."""
        if not self._shm_name:
            return None
        return str(SHM_DIR / f"{L1_POOL_PREFIX}{self._shm_name}")

    @property
    def pid(self) -> int | None:
        """Pid of the running server (None before start / after stop)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def started_pids(self) -> list[int]:
        """Every pid this object has started (restart adds one)."""
        return list(self._started_pids)

    @property
    def log_path(self) -> Path:
        return self._log_path

    @property
    def command(self) -> list[str]:
        """The command line (with the venv resolved lazily to ``<venv>/bin/lmcache``)."""
        return self._build_command(self._lmcache_exe())

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------ lifecycle
    def _lmcache_exe(self) -> Path:
        if self._venv_python is None:
            self._venv_python = lmcache_venv_python(generation=self._generation)
        return self._venv_python.parent / "lmcache"

    def _build_command(self, exe: Path) -> list[str]:
        cmd = [
            str(exe), "server",
            "--host", "127.0.0.1",
            "--port", str(self._port),
            "--http-host", "127.0.0.1",
            "--http-port", str(self._http_port),
            "--chunk-size", str(self._chunk_size),
            "--l1-size-gb", str(self._l1_size_gb),
            "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto",
        ]  # fmt: skip
        if self._mode == "shm":
            cmd += ["--shm-name", self._shm_name, "--no-l1-use-lazy"]
        else:
            cmd += ["--shm-name", ""]
        if self._api_key_file is not None:
            cmd += ["--api-key-file", str(self._api_key_file)]
        return cmd + self._extra_args

    def start(self, timeout: float = 60.0) -> RealLMCacheServer:
        """Start the server and wait until ``GET /healthcheck`` answers 200.

        Raises:
            LMCacheServerError: the process exited, or was not healthy before
                ``timeout`` (it is then stopped); the message has the log tail.
        """
        if self.is_running():
            raise LMCacheServerError(f"server already running (pid {self.pid})")
        self._reap()
        exe = self._lmcache_exe()
        if not exe.exists():
            raise LMCacheServerError(f"{exe} does not exist")
        cmd = self._build_command(exe)
        with open(self._log_path, "ab") as log:
            log.write(f"\n===== {time.strftime('%H:%M:%S')} start: {cmd!r}\n".encode())
            log.flush()
            env = child_env()
            launcher = _Launcher.get(exe.parent / "python") if _use_launcher() else None
            if launcher is not None and launcher.serves(
                env
            ):  # a fork of an interpreter that imported lmcache
                self._proc = launcher.spawn(cmd[1:], self._log_path, self._log_dir, env)
            else:
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=str(self._log_dir),  # never inside an lmcache source tree
                    env=env,
                    start_new_session=True,  # no terminal signals; we signal the pid
                )
        self._sigterm_sent = False
        self._started_pids.append(self._proc.pid)
        stat = _proc_stat(self._proc.pid)
        if stat is not None:
            self._start_times[self._proc.pid] = stat[19]
        deadline = time.monotonic() + timeout
        url = f"{self.http_url}/healthcheck"
        while True:
            rc = self._proc.poll()
            if rc is not None:
                self._reap()
                raise LMCacheServerError(
                    f"lmcache server exited with code {rc} during startup "
                    f"(generation={self._generation}, mode={self._mode}, port={self._port}).\n"
                    f"--- log tail ({self._log_path}) ---\n{self.log_tail(60)}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail(60)
                self.stop()
                raise LMCacheServerError(
                    f"lmcache server not healthy within {timeout:.0f} s "
                    f"(generation={self._generation}, mode={self._mode}, {url}).\n"
                    f"--- log tail ({self._log_path}) ---\n{tail}"
                )
            time.sleep(0.1)

    def terminate(self) -> None:
        """Send SIGTERM to the started pid without waiting (``stop()`` then
        waits); lets several servers shut down in parallel."""
        proc = self._proc
        if proc is not None and proc.poll() is None and not self._sigterm_sent:
            # The server's own children (multiprocessing's resource_tracker)
            # exit by themselves once the server is gone; remember exactly
            # which they are so a straggler can be killed by pid in stop().
            self._children.extend(_descendants(proc.pid))
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)  # Popen: only while unreaped
            self._sigterm_sent = True

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM exactly the started pid, wait up to ``timeout`` s, then SIGKILL.

        Afterwards removes ``/dev/shm/lmcache_l1_pool_<name>`` if it is left.
        Idempotent. Returns the exit code (None if nothing was running).
        """
        proc = self._proc
        rc: int | None = None
        if proc is not None:
            self.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=30)
            self._reap_children(self._children)
            rc = proc.returncode
            with open(self._log_path, "ab") as log:
                log.write(f"\n===== {time.strftime('%H:%M:%S')} stopped pid {proc.pid} rc={rc}\n".encode())
            self._proc = None
            self._sigterm_sent = False
        self.remove_shm_segment()
        return rc

    def remove_shm_segment(self) -> bool:
        """Unlink the L1 pool segment if present (True if something was removed)."""
        seg = self.shm_segment
        if seg is None or self.is_running():
            return False
        try:
            os.unlink(seg)
        except FileNotFoundError:
            return False
        return True

    def restart(self, timeout: float = 60.0) -> RealLMCacheServer:
        """Stop, then start again on the SAME ports and shm name (new pid,
        new ``mp.instance_id``; all server state is gone)."""
        self.stop()
        return self.start(timeout=timeout)

    @staticmethod
    def _reap_children(kids: list[tuple[int, str]], grace: float = 5.0) -> None:
        deadline = time.monotonic() + grace
        while any(_same_process_alive(p, st) for p, st in kids):
            if time.monotonic() > deadline:
                for p, st in kids:
                    if _same_process_alive(p, st):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(p, signal.SIGKILL)
                break
            time.sleep(0.05)

    def _reap(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None

    def __enter__(self) -> RealLMCacheServer:
        if not self.is_running():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"RealLMCacheServer(mode={self._mode!r}, generation={self._generation!r}, url={self.url!r}, "
            f"http_url={self.http_url!r}, chunk_size={self._chunk_size}, "
            f"shm_name={self._shm_name!r}, pid={self.pid})"
        )

    # ------------------------------------------------------------ helpers
    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server log."""
        try:
            data = self._log_path.read_bytes()
        except FileNotFoundError:
            return "<no log>"
        lines = data.decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])

    def http_get(
        self, path: str, timeout: float = 10.0, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """``GET http_url + path`` -> (status, body); HTTP errors are returned, not raised.

        Sends ``Authorization: Bearer <api_key>`` when the server has a key, unless
        ``headers`` is given (then exactly those headers).
        """
        if headers is None:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        request = urllib.request.Request(f"{self.http_url}{path}", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as err:
            body = err.read()
            err.close()
            return int(err.code), body

    def get_json(self, path: str, timeout: float = 10.0) -> Any:
        """``GET`` a JSON endpoint (``/config``, ``/status``...); raises on non-200."""
        status, body = self.http_get(path, timeout=timeout)
        if status != 200:
            raise LMCacheServerError(f"GET {path} -> {status}: {body[:500]!r}")
        return json.loads(body)

    def config(self) -> dict[str, Any]:
        """``GET /config``."""
        return dict(self.get_json("/config"))

    def status(self) -> dict[str, Any]:
        """``GET /status``."""
        return dict(self.get_json("/status"))

    def _is_our_server(self, pid: int) -> bool:
        # A reaped pid may be reused by an unrelated process: match its start time (a
        # forked server's command line is its launcher's), else the port.
        if pid in self._start_times:
            return _same_process_alive(pid, self._start_times[pid])
        if not pid_alive(pid):
            return False
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return str(self._port).encode() in cmdline

    def leftovers(self) -> list[str]:
        """Problems after stop(): live pids this object started, or a left segment."""
        problems = [f"server pid {p} still alive" for p in self._started_pids if self._is_our_server(p)]
        problems += [
            f"server child pid {p} still alive" for p, st in self._children if _same_process_alive(p, st)
        ]
        seg = self.shm_segment
        if seg is not None and os.path.exists(seg):
            problems.append(f"shm segment {seg} still exists")
        return problems
