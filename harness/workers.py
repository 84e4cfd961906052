"""Client-venv side of the lmcache-venv helper processes (stdlib + torch only).

* :class:`EngineWorker` drives ``engine_worker.py``: a fake vLLM worker that
  registers a paged KV cache through lmcache's lmcache-driven path and
  stores / retrieves through it.
* :class:`SDKWorker` drives ``sdk_worker.py``: the OFFICIAL SDK
  (``lmcache.sdk.kvcache``).

Both scripts run with an lmcache venv's python (:func:`lmcache_venv_python`):
``generation="0.5.6"`` (default) or ``"0.5.7"`` picks the venv, and so lmcache's
own wire of that generation; ``EngineWorker(server)`` takes the generation of
the server object it is given (``RealLMCacheServer.generation``,
``EmbeddedServer.generation``). They speak JSON lines (see ``_worker_loop.py``); tensors travel as
``torch.save`` files in a private temp dir. Every request has a deadline:
on timeout the child is killed and :class:`WorkerTimeout` raised, so a
silent server can never hang a test. Both classes are context managers and
always terminate their child.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from harness.real_server import (
    Generation,
    check_generation,
    child_env,
    lmcache_venv_python,
    venv_generation,
)

__all__ = ["EngineWorker", "SDKWorker", "WorkerDied", "WorkerError", "WorkerTimeout"]

HARNESS_DIR = Path(__file__).resolve().parent


class WorkerError(RuntimeError):
    """The worker answered ``{"ok": false, ...}``."""

    def __init__(self, message: str, reply: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.reply = reply or {}


class WorkerTimeout(TimeoutError):
    """No reply before the deadline; the worker process has been killed."""


class WorkerDied(RuntimeError):
    """The worker process exited (or closed stdout) unexpectedly."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _JsonLinesWorker:
    #: The worker script, a name in this directory (it imports ``_worker_loop`` by its bare name).
    SCRIPT: str = ""
    KIND: str = ""

    def __init__(
        self,
        *,
        python: Path | str | None = None,
        generation: Generation | None = None,
        request_timeout: float = 60.0,
        startup_timeout: float = 120.0,
    ) -> None:
        self._python = Path(python) if python is not None else None
        if self._python is not None:
            found = venv_generation(self._python)
            if generation is not None and check_generation(generation) != found:
                raise ValueError(f"python {python} is an lmcache {found} venv, not {generation}")
            generation = found
        #: The lmcache generation the worker runs (its venv): "0.5.6" or "0.5.7".
        self.generation: Generation = check_generation(generation or "0.5.6")
        #: The lmcache version the worker reported at startup ("" before).
        self.lmcache_version = ""
        self.request_timeout = request_timeout
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None
        self._stderr_path: Path | None = None
        self._buf = b""
        self._ids = itertools.count(1)
        self._files = itertools.count()
        self._ready = False
        self.pid: int | None = None

    # ------------------------------------------------------------ process
    def start(self) -> _JsonLinesWorker:
        """Spawn the worker (if needed) and wait for its ready line."""
        self.spawn()
        if not self._ready:
            try:
                hello = self._read_reply(self.startup_timeout, "startup")
            except BaseException:
                self.close()
                raise
            if not hello.get("ok") or not hello.get("ready"):
                msg = hello.get("error", hello)
                self.close()
                raise WorkerError(f"{self.KIND} worker failed to start: {msg}", hello)
            if hello.get("generation") != self.generation:
                self.close()
                raise WorkerError(
                    f"{self.KIND} worker runs lmcache {hello.get('lmcache_version')!r} "
                    f"(generation {hello.get('generation')!r}), not generation {self.generation}",
                    hello,
                )
            self.lmcache_version = str(hello["lmcache_version"])
            self._ready = True
        return self

    def spawn(self) -> _JsonLinesWorker:
        """Start the child without waiting for it (imports take ~2.5 s): spawn
        several workers, then ``start()`` each to overlap their startup."""
        if self._proc is not None:
            return self
        python = self._python or lmcache_venv_python(generation=self.generation)
        self._tmp = Path(tempfile.mkdtemp(prefix=f"lmcache_{self.KIND}_worker_"))
        self._stderr_path = self._tmp / "stderr.log"
        with open(self._stderr_path, "wb") as err:
            self._proc = subprocess.Popen(
                [str(python), "-u", str(HARNESS_DIR / self.SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=str(self._tmp),  # never inside an lmcache source tree
                env=child_env(),
                start_new_session=True,
            )
        self.pid = self._proc.pid
        self._ready = False
        return self

    def stderr_tail(self, n: int = 40) -> str:
        if self._stderr_path is None:
            return ""
        try:
            lines = self._stderr_path.read_bytes().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def _kill(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def _read_reply(self, timeout: float, what: str) -> dict[str, Any]:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                tail = self.stderr_tail()
                self._kill()
                raise WorkerTimeout(
                    f"{self.KIND} worker: no reply to {what} within {timeout:.1f} s "
                    f"(worker killed).\n--- worker stderr ---\n{tail}"
                )
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.5))
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
                raise WorkerDied(
                    f"{self.KIND} worker exited (rc={proc.returncode}) before replying "
                    f"to {what}.\n--- worker stderr ---\n{self.stderr_tail()}"
                )
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            obj = json.loads(line)
        except ValueError as exc:
            self._kill()
            raise WorkerDied(f"{self.KIND} worker sent a non-JSON line: {line[:300]!r}") from exc
        if not isinstance(obj, dict):
            self._kill()
            raise WorkerDied(f"{self.KIND} worker sent a non-object: {line[:300]!r}")
        return obj

    def request(self, cmd: str, *, deadline: float | None = None, **params: Any) -> dict[str, Any]:
        """Send one request and return its reply; raises WorkerError on ok=false.

        ``deadline`` (s, default ``request_timeout``) bounds the wait for the
        reply; on expiry the worker is killed and WorkerTimeout raised. Unless
        ``timeout`` is among ``params``, the worker gets ``timeout =
        deadline - 5`` for its own lmcache calls, so it normally answers first.
        """
        if self._proc is None or not self._ready:
            self.start()
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        if proc.poll() is not None:
            raise WorkerDied(
                f"{self.KIND} worker is not running (rc={proc.returncode}).\n"
                f"--- worker stderr ---\n{self.stderr_tail()}"
            )
        budget = self.request_timeout if deadline is None else deadline
        req_id = next(self._ids)
        msg = {"cmd": cmd, "id": req_id, **params}
        if "timeout" not in params:
            # The worker's own lmcache calls time out a little earlier than we do.
            msg["timeout"] = max(1.0, budget - 5.0)
        try:
            proc.stdin.write(json.dumps(msg).encode() + b"\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerDied(
                f"{self.KIND} worker: cannot send {cmd}: {exc}\n--- worker stderr ---\n{self.stderr_tail()}"
            ) from exc
        reply = self._read_reply(budget, cmd)
        if reply.get("id") != req_id:
            self._kill()
            raise WorkerDied(f"{self.KIND} worker reply id {reply.get('id')!r} != {req_id}")
        if not reply.get("ok"):
            raise WorkerError(
                f"{self.KIND} worker {cmd} failed: {reply.get('error')}\n{reply.get('traceback', '')}",
                reply,
            )
        return reply

    def _tmp_file(self, stem: str) -> Path:
        assert self._tmp is not None
        return self._tmp / f"{stem}_{next(self._files)}.pt"

    def _save(self, tensor: torch.Tensor, stem: str) -> Path:
        if self._proc is None or not self._ready:
            self.start()
        path = self._tmp_file(stem)
        torch.save(tensor.detach().cpu().contiguous(), path)
        return path

    def _request_with_kv_file(
        self, cmd: str, tokens: Sequence[int], kv: torch.Tensor, *, deadline: float | None, **params: Any
    ) -> dict[str, Any]:
        """:meth:`request` ``cmd`` with ``tokens`` and ``kv`` saved to a ``kv_file`` (removed
        after the reply, or after the error it raises)."""
        path = self._save(kv, cmd)
        try:
            return self.request(
                cmd, deadline=deadline, tokens=[int(t) for t in tokens], kv_file=str(path), **params
            )
        finally:
            path.unlink(missing_ok=True)

    def _load(self, path: Path) -> torch.Tensor:
        t = torch.load(path, weights_only=True)
        path.unlink(missing_ok=True)
        assert isinstance(t, torch.Tensor)
        return t

    def close(self, timeout: float = 15.0) -> None:
        """Ask the worker to quit, then make sure it is gone (SIGKILL if needed)."""
        proc = self._proc
        if proc is not None:
            if proc.poll() is None and self._ready:
                with contextlib.suppress(WorkerError, WorkerTimeout, WorkerDied):
                    self.request("quit", deadline=timeout)
            elif proc.poll() is None:
                self._kill()  # never became ready: nothing to shut down cleanly
            if proc.poll() is None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._kill()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            self._cleanup_shm(proc.pid)
            self._proc = None
            self._ready = False
            self._buf = b""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    @staticmethod
    def _cleanup_shm(pid: int) -> None:
        # lmcache's CPU KV wrapper names its segments /lmcache_kv_<pid>_<n>; a
        # killed worker cannot unlink them itself.
        prefix = f"lmcache_kv_{pid}_"
        with contextlib.suppress(OSError):
            for name in os.listdir("/dev/shm"):
                if name.startswith(prefix):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join("/dev/shm", name))

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:  # last resort; never rely on it (use close())
        proc = getattr(self, "_proc", None)
        if proc is not None:
            with contextlib.suppress(Exception):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=5)
                for stream in (proc.stdin, proc.stdout):
                    if stream is not None:
                        stream.close()
                self._cleanup_shm(proc.pid)


class EngineWorker(_JsonLinesWorker):
    """A fake vLLM worker (``engine_worker.py``) bound to one server URL.

    >>> with EngineWorker(server.url) as eng:
    ...     eng.register("m", num_layers=2, num_kv_heads=2, head_dim=8,
    ...                  block_size=4, num_blocks=64, dtype=torch.bfloat16)
    ...     eng.store(tokens, kv)          # kv: [2, L, T, NH*HS]
    ...     got = eng.retrieve(tokens)     # [2, L, hit, NH*HS] or None
    """

    SCRIPT = "engine_worker.py"
    KIND = "engine"

    def __init__(self, url: Any, **kw: Any) -> None:
        if "generation" not in kw and "python" not in kw:
            kw["generation"] = getattr(url, "generation", None)
        super().__init__(**kw)
        self.url: str = str(getattr(url, "url", url))
        self.registration: dict[str, Any] = {}
        self.last_store: dict[str, Any] = {}

    @property
    def chunk_size(self) -> int:
        return int(self.registration["chunk_size"])

    @property
    def instance_id(self) -> int:
        return int(self.registration["instance_id"])

    def register(
        self,
        model_name: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        seed: int = 0,
        transfer_mode: str = "lmcache_driven",
        engine_groups: Sequence[Sequence[int]] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Register ``num_layers`` x ``[2, num_blocks, block_size, NH, HS]``.

        ``transfer_mode``: ``"lmcache_driven"`` (vLLM's GPU path; real servers only)
        or ``"engine_driven"`` (lmcache's worker path for non-CUDA devices: it moves
        the chunks itself with prepare/commit, which the embedded server serves too).

        ``engine_groups``: the layer indices of each of vLLM's KV cache groups, as a hybrid
        model registers them (e.g. ``[[0, 1], [2, 3]]``); default: one group of every
        layer. Only registration is meant with several groups (store and retrieve speak
        one group's block ids).

        Returns the worker's reply (instance_id, chunk_size, blocks_in_chunk,
        kv_shape, layer_names, kv_segments, transfer).
        """
        reply = self.request(
            "register",
            deadline=timeout,
            url=self.url,
            model_name=model_name,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            num_blocks=num_blocks,
            dtype=_dtype_name(dtype),
            seed=seed,
            transfer_mode=transfer_mode,
            engine_groups=None if engine_groups is None else [list(g) for g in engine_groups],
        )
        self.registration = reply
        return reply

    def store(
        self,
        tokens: Sequence[int],
        kv: torch.Tensor,
        *,
        cache_salt: str = "",
        wait_visible: bool = True,
        timeout: float | None = None,
    ) -> bool:
        """Write ``kv`` ([2, L, T, NH*HS], T == len(tokens)) into paged blocks and
        store the whole chunks through the lmcache-driven path. Returns the
        server's result (True = stored without a fatal error).

        The server commits such a store a few ms after replying; with
        ``wait_visible`` (default) this returns only once a lookup sees all
        stored tokens, and raises WorkerError if they do not become visible.
        """
        reply = self._request_with_kv_file(
            "store", tokens, kv, deadline=timeout, cache_salt=cache_salt, wait_visible=wait_visible
        )
        self.last_store = reply
        stored = bool(reply["stored"])
        if stored and wait_visible and reply["visible_tokens"] < reply["stored_tokens"]:
            raise WorkerError(
                f"engine store: only {reply['visible_tokens']} of {reply['stored_tokens']} "
                "stored tokens became visible to lookups",
                reply,
            )
        return stored

    def retrieve(
        self,
        tokens: Sequence[int],
        *,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> torch.Tensor | None:
        """Lookup + retrieve into fresh paged blocks; the gathered
        ``[2, L, hit, NH*HS]`` tensor, or None on a miss."""
        if self._proc is None or not self._ready:
            self.start()
        out = self._tmp_file("retrieve")
        reply = self.request(
            "retrieve",
            deadline=timeout,
            tokens=[int(t) for t in tokens],
            out_file=str(out),
            cache_salt=cache_salt,
        )
        if int(reply["hit_tokens"]) == 0:
            return None
        return self._load(out)

    def ping(self, *, timeout: float | None = None) -> bool:
        return bool(self.request("ping", deadline=timeout)["result"])

    def state(self) -> dict[str, Any]:
        return self.request("state")

    def unregister(self, *, timeout: float | None = None) -> dict[str, Any]:
        reply = self.request("unregister", deadline=timeout)
        self.registration = {}
        return reply


class SDKWorker(_JsonLinesWorker):
    """The official SDK (``lmcache.sdk.kvcache``) in the lmcache venv.

    >>> with SDKWorker(generation=server.generation) as sdk:
    ...     sdk.connect(server.url, server.http_url, "m")
    ...     sdk.store(tokens, kv)            # -> bool
    ...     sdk.retrieve(tokens)             # -> tensor or None

    The benchmarks' commands (``bench``, ``concurrent``, ``fresh``, ``untouched``,
    ``remap``; see ``sdk_worker.py``) go through :meth:`request`.
    """

    SCRIPT = "sdk_worker.py"
    KIND = "sdk"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.connection: dict[str, Any] = {}

    def connect(
        self,
        url: str,
        http_url: str,
        model_name: str,
        timeout: float = 30.0,
        *,
        geometry: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """``lmcache.sdk.kvcache.connect(url, http_url, model_name, timeout)``.

        ``timeout`` is the SDK's own MQ timeout; our deadline is 10 s longer.
        ``geometry`` ``[layers, hidden]``: the shape of the random KVs that the benchmark
        commands store. Returns {instance_id, chunk_size, shm_name, transfer}.
        """
        reply = self.request(
            "connect",
            deadline=timeout + 10.0,
            url=url,
            http_url=http_url,
            model_name=model_name,
            timeout=timeout,
            geometry=None if geometry is None else [int(g) for g in geometry],
        )
        self.connection = reply
        return reply

    def store(
        self,
        tokens: Sequence[int],
        kv: torch.Tensor,
        cache_salt: str = "",
        *,
        request_configs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> bool:
        """``ctx.store(kv, tokens, cache_salt, request_configs)`` -> the SDK's bool."""
        reply = self._request_with_kv_file(
            "store", tokens, kv, deadline=timeout, cache_salt=cache_salt, request_configs=request_configs
        )
        return bool(reply["result"])

    def retrieve(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        request_configs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor | None:
        """``ctx.retrieve(tokens, cache_salt, request_configs)`` -> tensor or None."""
        if self._proc is None or not self._ready:
            self.start()
        out = self._tmp_file("retrieve")
        reply = self.request(
            "retrieve",
            deadline=timeout,
            tokens=[int(t) for t in tokens],
            out_file=str(out),
            cache_salt=cache_salt,
            request_configs=request_configs,
        )
        if int(reply["hit_tokens"]) == 0:
            return None
        return self._load(out)

    def disconnect(self) -> None:
        """``ctx.close()`` (the SDK neither unregisters nor pings)."""
        self.request("close")
        self.connection = {}
