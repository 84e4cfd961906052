"""Shared pieces of both tiers, the SDK-comparison suite (``benchmarks/suite/``) and the
probes (``benchmarks/probes/``).

* :func:`server_python`: the lmcache venv of a server generation (0.5.6: ``.lmcache-venv``,
  built by ``make lmcache-venv``; 0.5.7: ``.lmcache-venv-057``);
* :func:`stamp`: what the figures were measured on (machine, versions, commit, load);
* :func:`spread`: median and range of a list of round figures;
* :func:`require_generation`: a clear error when the server is not the generation asked for;
* :func:`bare_dealer_rtt`: the floor of a round trip, a blocking pyzmq DEALER;
* :func:`raw_call` and :func:`facade_loop`: the two handles on the client's internals that
  the suite needs and the API does not give (a request that has no method of its own, and
  the blocking facade's loop thread), taken here so that a refactor changes this file only.

Nothing here times anything but :func:`bare_dealer_rtt`; every section module does its own
timing and returns a JSON-able dict.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import zmq

from harness.real_server import LMCacheServerError, RealLMCacheServer, lmcache_venv_python
from harness.workers import _JsonLinesWorker
from lmcache_async._protocol import wire as wire
from lmcache_async._protocol.wire import Op

ROOT = Path(__file__).resolve().parent.parent

GENERATIONS = ("0.5.6", "0.5.7")


def server_python(generation: str = "0.5.6") -> Path:
    """The python of the lmcache venv that runs ``generation``'s server, SDK and engine worker.

    Raises:
        SystemExit: an unknown generation, or its venv is missing (with how to build it).
    """
    if generation == "0.5.6":
        return lmcache_venv_python()
    if generation == "0.5.7":
        python = ROOT / ".lmcache-venv-057" / "bin" / "python"
        if not python.exists():
            raise SystemExit(
                f"--generation 0.5.7 needs the LMCache 0.5.7rc3 venv at {python.parent.parent} "
                "(built by the 0.5.7 test set-up; or `ln -sfn /path/to/venv057 .lmcache-venv-057`)"
            )
        return python
    raise SystemExit(f"unknown server generation {generation!r}; choose one of {', '.join(GENERATIONS)}")


async def require_generation(client: Any, generation: str, timeout: float = 10.0) -> None:
    """Fail clearly when ``client`` (an open AsyncClient) is not talking to ``generation``.

    On 0.5.6 this does nothing. On 0.5.7 the server the client found
    (``client.server_version``) must be a 0.5.7 one and a 1-chunk store + retrieve must
    round-trip within ``timeout``.

    Raises:
        SystemExit: naming what is wrong.
    """
    if generation == "0.5.6":
        return
    version = client.server_version
    if not version.startswith(generation):
        raise SystemExit(f"asked for generation {generation}, but the server says {version!r}")
    import torch

    geom = client.geometry
    kv = torch.randn(geom.kv_shape(client.chunk_size), dtype=torch.float32).to(geom.dtype)
    tokens = list(range(7_000_000, 7_000_000 + client.chunk_size))
    try:
        async with asyncio.timeout(timeout):
            await client.store(kv, tokens)
            got = await client.retrieve(tokens)
    except Exception as exc:
        raise SystemExit(
            f"lmcache_async ({git_commit()}) failed a 1-chunk store + retrieve against the {generation} "
            f"server: {type(exc).__name__}: {exc}"
        ) from exc
    if got is None or not torch.equal(got, kv):
        raise SystemExit(f"lmcache_async read back different KV from the {generation} server")


def bare_dealer_rtt(url: str, op: Op, args: Sequence[Any], n: int) -> float:
    """The median round trip (seconds) of the last 80 % of ``n`` requests ``op(*args)`` sent
    one by one from a blocking pyzmq DEALER: the server's own cost per request plus the
    least a client can add."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(url)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        sock.send_multipart(wire.encode_request(i, op, args))
        sock.recv_multipart()
        times.append(time.perf_counter() - t0)
    sock.close(0)
    ctx.term()
    return statistics.median(times[n // 5 :])


async def raw_call(client: Any, op: Op, args: Sequence[Any], timeout: float) -> Any:
    """Send ``op(*args)`` on an open AsyncClient's connection and wait for the reply: a
    request that has no method of its own (``end_session``), or one timed without the
    method around it."""
    return await client._session.conn.call(op, args, timeout=timeout)


def facade_loop(client: Any) -> Any:
    """The loop thread of a blocking :class:`~lmcache_async.sync_client.Client`, whose
    ``submit(factory).wait(name, bound, grace)`` hands a coroutine over and waits for it:
    the facade's hand-over without a server."""
    return client._lt


def start_servers(servers: Sequence[RealLMCacheServer]) -> None:
    """Start several servers at once (each takes 5-15 s to come up on a loaded machine)."""
    import threading

    errors: list[BaseException] = []

    def go(s: RealLMCacheServer) -> None:
        try:
            s.start(timeout=120)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]


def spread(values: Sequence[float], scale: float = 1.0, digits: int = 4) -> dict[str, Any]:
    """``{"median", "min", "max", "n"}`` of ``values`` x ``scale``."""
    return {
        "median": round(statistics.median(values) * scale, digits),
        "min": round(min(values) * scale, digits),
        "max": round(max(values) * scale, digits),
        "n": len(values),
    }


def git_commit() -> str:
    """``<short sha>`` of HEAD, with ``+dirty`` when the tree has uncommitted changes."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return 0.0


def venv_lmcache_version(python: Path) -> str:
    """The lmcache version installed in the venv of ``python`` (0.5.7 ships as ``lmcache-cli``)."""
    code = (
        "import importlib.metadata as m\n"
        "for d in ('lmcache', 'lmcache-cli'):\n"
        "    try:\n        print(m.version(d)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def stamp(generation: str = "0.5.6", **extra: Any) -> dict[str, Any]:
    """What a result was measured on: machine, versions, commit, load average, time."""
    import torch

    import lmcache_async

    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": _mem_gib(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "lmcache_async": lmcache_async.__version__,
        "generation": generation,
        "lmcache": venv_lmcache_version(server_python(generation)),
        **extra,
    }


def clear_l1(http_url: str, timeout: float = 60.0) -> None:
    """``POST /cache/clear`` (L1, forced): the server evicts lazily, so benchmarks that store
    many GiB clear between cases to keep stores from failing on a full L1."""
    import json
    import urllib.request

    req = urllib.request.Request(
        f"{http_url}/cache/clear",
        data=json.dumps({"tier": "l1", "force": True}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()


async def settle(timeout: float = 300.0) -> float:
    """Wait until no client background warm-up thread runs; returns the seconds waited.

    A new SHM client maps the server's pool in a background thread (its threads are named
    ``lmcache-shm-prefault ...``); the steady-state sections wait for it so that its CPU is
    not charged to the operations they time (the ``fresh`` section measures exactly that
    overlap instead). Threads are found by name, so this keeps working (waits for nothing)
    if the client stops using such a thread. Raises TimeoutError after ``timeout`` s.
    """
    import threading
    import time

    t0 = time.monotonic()
    async with asyncio.timeout(timeout):
        for t in threading.enumerate():
            if t.name.startswith("lmcache-shm-prefault"):
                await asyncio.to_thread(t.join)
    return round(time.monotonic() - t0, 3)


async def sdk_call(
    worker: _JsonLinesWorker, cmd: str, *, server: RealLMCacheServer | None = None, **params: Any
) -> dict[str, Any]:
    """``worker.request(cmd, **params)`` in a thread, so that this process's event loop (and
    the keep-alive of its clients) runs while the SDK measures in its own process.

    With ``server``, its process is watched meanwhile: if it dies (e.g. killed for memory),
    the worker is killed and :class:`LMCacheServerError` raised with the server's log tail,
    instead of waiting out the request's deadline. Cancellation SIGKILLs the worker too,
    which ends the thread's wait at once, then re-raises.
    """
    task = asyncio.ensure_future(asyncio.to_thread(worker.request, cmd, **params))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            if server is not None and not server.is_running():
                worker._kill()
                raise LMCacheServerError(
                    f"the LMCache server died during the SDK's {cmd!r}\n{server.log_tail(20)}"
                )
    except BaseException:
        worker._kill()
        raise


@contextlib.contextmanager
def workers(*ws: _JsonLinesWorker) -> Iterator[tuple[Any, ...]]:
    """Spawn every helper process at once (each takes seconds to import lmcache), wait for
    each to be ready (its own startup deadline), and close them all on exit."""
    with contextlib.ExitStack() as stack:
        for w in ws:
            stack.callback(w.close)
            w.spawn()
        for w in ws:
            w.start()
        yield ws
