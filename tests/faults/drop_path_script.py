"""One way of leaving a client unclosed, in a process of its own (tests/faults/test_drop_paths.py
runs each under a deadline and compares its run with a properly closed client's).

    python tests/faults/drop_path_script.py PATH URL HTTP_URL

``PATH`` is one of :data:`PATHS`. The script prints, one per line:

* ``imported=T``: ``time.monotonic()`` once the imports are done;
* ``instance_id=N``: the registration of each client opened;
* ``opened=T``: ``time.monotonic()`` once that client has served its lookup: the parent
  times the run from there to the process's end (the same clock on Linux), so that what
  it compares is the drop, the collection and the exit, not the start-up and the connect,
  whose times vary with the machine's load;
* ``warning=Category: message``: each warning issued, whenever it is (also at exit);
* ``sockets_open=N`` / ``fds_leaked=N``: after the drop and a collection, the ZMQ sockets
  still open and the file descriptors this process holds beyond what it held before the
  client existed (paths where the process goes on after the drop);
* ``body_done``: the path is done; then the interpreter exits.

A hang prints every thread's traceback (``faulthandler``) after :data:`HANG_S` seconds and
exits with status 1.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import sys
import threading
import time
import warnings
from typing import Any

import torch
import zmq

import lmcache_async as lmc

imported = time.monotonic()
print(f"imported={imported}", flush=True)

#: Seconds after which the script reports a hang (the parent's deadline is longer).
HANG_S = 40.0
GEOMETRY = lmc.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=16)
TOKENS = list(range(256))
MODEL = "drop"

PATHS = (
    "closed-async",  # the baseline of the AsyncClient paths
    "closed-sync",  # the baseline of the blocking Client paths
    "dropped-in-run",
    "dropped-in-thread",
    "cycle-collected-after-run",
    "kept-past-run",
    "store-in-flight",
    "sync-dropped",
    "exit-open-async-thread",
    "exit-open-sync",
    "embedded-server-dropped",
)


def _show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    print(f"warning={category.__name__}: {message}", flush=True)


def _sockets_open() -> int:
    return sum(issubclass(type(o), zmq.Socket) and not o.closed for o in gc.get_objects())


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _opened(url: str, http_url: str, **kw: Any) -> lmc.AsyncClient:
    client = await lmc.connect(url, http_url, MODEL, geometry=GEOMETRY, timeout=10, **kw)
    print(f"instance_id={client.instance_id}", flush=True)
    assert await client.lookup(TOKENS) == 0
    print(f"opened={time.monotonic()}", flush=True)
    return client


def _warm_up(url: str, http_url: str) -> None:
    """A client opened and closed first: what a process keeps once it used one (the
    ZMQ context's own descriptors) is there before the descriptors are counted."""

    async def main() -> None:
        async with lmc.AsyncClient(url, http_url, MODEL, geometry=GEOMETRY, timeout=10) as client:
            await client.lookup(TOKENS)

    asyncio.run(main())
    gc.collect()


def _report_leaks(fds_before: int, wait_s: float = 0.0) -> None:
    """After a collection: sockets still open and descriptors beyond ``fds_before``
    (polled for ``wait_s`` seconds: a close handed to another thread finishes there)."""
    end = time.monotonic() + wait_s
    while True:
        gc.collect()
        sockets, leaked = _sockets_open(), _fds() - fds_before
        if (sockets == 0 and leaked <= 0) or time.monotonic() >= end:
            break
        time.sleep(0.01)
    print(f"sockets_open={sockets}", flush=True)
    print(f"fds_leaked={leaked}", flush=True)


_kept: list[Any] = []


SYNC_PATHS = ("closed-sync", "sync-dropped", "exit-open-sync")


def _prelude(path: str, url: str, http_url: str) -> int:
    """What every path does first, its baseline too (so that their runs compare): a client
    opened and closed (and for the blocking paths, a blocking one: the loop thread then
    runs, and lingers); returns the descriptors held then."""
    _warm_up(url, http_url)
    if path in SYNC_PATHS:
        lmc.Client(url, http_url, MODEL, geometry=GEOMETRY, timeout=10).close()
    return _fds()


def _sync_client(url: str, http_url: str) -> lmc.Client:
    client = lmc.Client(url, http_url, MODEL, geometry=GEOMETRY, timeout=10)
    print(f"instance_id={client.instance_id}", flush=True)
    assert client.lookup(TOKENS) == 0
    print(f"opened={time.monotonic()}", flush=True)
    return client


def run(path: str, url: str, http_url: str) -> None:  # noqa: C901 - one branch per path
    if path == "embedded-server-dropped":
        from lmcache_async.testing import EmbeddedServer

        async def serve() -> None:
            srv = EmbeddedServer()
            await srv.start()  # never stopped
            client = await _opened(srv.url, srv.http_url)
            await client.aclose()

        asyncio.run(serve())
        gc.collect()
        return
    fds = _prelude(path, url, http_url)
    if path == "closed-async":

        async def closed() -> None:
            client = await _opened(url, http_url)
            await client.aclose()

        asyncio.run(closed())
        _report_leaks(fds)
    elif path == "closed-sync":
        _sync_client(url, http_url).close()
        _report_leaks(fds)
    elif path in ("dropped-in-run", "dropped-in-thread"):

        async def drop() -> None:
            client = await _opened(url, http_url)
            del client  # the last reference: collected here, on the running loop

        if path == "dropped-in-run":
            asyncio.run(drop())
        else:
            worker = threading.Thread(target=asyncio.run, args=(drop(),), name="worker")
            worker.start()
            worker.join()
        _report_leaks(fds)
    elif path == "cycle-collected-after-run":

        async def cycle() -> None:
            client = await _opened(url, http_url)
            client.itself = client  # type: ignore[attr-defined]  # only the collector frees it

        gc.disable()  # the collection comes after asyncio.run(), on a closed loop
        asyncio.run(cycle())
        gc.enable()
        _report_leaks(fds)
    elif path == "kept-past-run":

        async def keep() -> None:
            _kept.append(await _opened(url, http_url))

        asyncio.run(keep())
    elif path == "store-in-flight":

        async def store() -> None:
            client = await _opened(url, http_url)
            kv = torch.ones(GEOMETRY.kv_shape(len(TOKENS)), dtype=GEOMETRY.dtype)
            asyncio.ensure_future(client.store(kv, TOKENS))
            await asyncio.sleep(0)  # the store has begun; asyncio.run() ends it

        asyncio.run(store())
        _report_leaks(fds)
    elif path == "sync-dropped":
        client = _sync_client(url, http_url)
        del client
        _report_leaks(fds, wait_s=10.0)  # the close runs on the loop thread
    elif path == "exit-open-async-thread":
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="app-loop", daemon=True).start()
        _kept.append(asyncio.run_coroutine_threadsafe(_opened(url, http_url), loop).result(30))
    elif path == "exit-open-sync":
        _kept.append(_sync_client(url, http_url))
    else:
        raise SystemExit(f"unknown path {path!r}; one of {', '.join(PATHS)}")


def main() -> None:
    path, url, http_url = sys.argv[1:4]
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    warnings.simplefilter("always")
    warnings.showwarning = _show
    run(path, url, http_url)
    print("body_done", flush=True)


if __name__ == "__main__":
    main()
