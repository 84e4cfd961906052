"""A launcher of real LMCache servers for the tests: one process of an lmcache venv that
has imported lmcache (about 3.5 s of CPU, most of a server's start) and forks a server
per request, so each start costs a fork instead of an interpreter and its imports.

Run by ``harness/real_server.py`` (``_Launcher``) with that venv's Python; stdlib and
lmcache only. The protocol, one JSON line each way per server on stdin/stdout:

    -> {"args": [...], "log": path, "cwd": path, "env": {...}}    (args after "lmcache")
    <- {"pid": n}

The forked child becomes what ``subprocess.Popen([lmcache, *args], start_new_session=True,
stdin=DEVNULL, stdout=log, stderr=STDOUT, cwd=cwd, env=env)`` would have been: its own
session, stdin from /dev/null, stdout and stderr appended to the log, the environment
given, the default signal dispositions, then lmcache's command line, and the normal
interpreter exit (atexit handlers, non-daemon threads). The launcher reaps its children
and writes each exit code to ``<rc_dir>/<pid>.rc`` (``os.waitstatus_to_exitcode``: a
signal is ``-signum``, as ``Popen.returncode``). It exits when its stdin closes (the test
process is gone); servers still running are the test process's to stop, by pid.

Forking after these imports is safe: they start no Python thread, and torch (whose
import starts one native thread) is not initialised for a device.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from lmcache.cli.main import main as lmcache_main

for _module in ("lmcache.v1.multiprocess.server", "lmcache.v1.multiprocess.http_server"):
    # the heavy part of a server's start; a layout without them still works, slower
    with contextlib.suppress(ImportError):
        __import__(_module)


def _reap(rc_dir: str) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # no child yet
            time.sleep(0.02)
            continue
        path = os.path.join(rc_dir, f"{pid}.rc")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(path + ".tmp", path)


def _become(request: dict[str, Any]) -> int:
    """In the forked child: set up as Popen would, run lmcache's command line."""
    os.setsid()
    # What a new interpreter has (SIGPIPE and SIGXFSZ stay ignored, as Python sets them).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["lmcache", *request["args"]]
    result = lmcache_main()
    return result if isinstance(result, int) else 0


def serve(rc_dir: str) -> int:
    threading.Thread(target=_reap, args=(rc_dir,), name="reaper", daemon=True).start()
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sys.exit(_become(request))  # a normal exit, out through this frame
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
