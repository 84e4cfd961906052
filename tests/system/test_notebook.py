"""Execute ``docs/examples/kv_remap.ipynb`` in a real Jupyter kernel (nbclient + ipykernel)
against the real SHM server; any failing cell fails the test.

The kernel runs this venv's interpreter (``sys.executable``) through a kernelspec written
to a temporary directory, so nothing has to be installed with ``ipykernel install`` and a
``python3`` kernelspec elsewhere on the machine cannot be picked up by mistake. The
server endpoints reach the notebook through the kernelspec's environment.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager, KernelManager
from nbclient import NotebookClient

from harness.real_server import REPO_ROOT, RealLMCacheServer

NOTEBOOK = REPO_ROOT / "docs" / "examples" / "kv_remap.ipynb"
KERNEL_NAME = "lmcache-async-test"

# Warnings: none of the Jupyter stack installed here warns under filterwarnings=error
# (the kernel's channels are closed explicitly, see cleanup_kc below); should a new
# version start to, add a targeted pytest.mark.filterwarnings here, never a global one.


def _load() -> Any:
    nb = nbformat.read(NOTEBOOK, as_version=4)  # type: ignore[no-untyped-call]
    nbformat.validate(nb)
    return nb


def test_the_committed_notebook_is_valid_and_has_no_outputs() -> None:
    nb = _load()
    assert nb.nbformat == 4
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the notebook has no code cells"
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    sources = [c.source for c in code]
    assert any("lmc.Client(" in s for s in sources)  # the blocking client
    assert any("await aclient." in s for s in sources)  # top-level await


def _env(srv: RealLMCacheServer, tmp_path: Path, model: str) -> dict[str, str]:
    """The kernel's environment: the server, the model, and no user IPython profile."""
    return {
        "LMCACHE_URL": srv.url,
        "LMCACHE_HTTP_URL": srv.http_url,
        "LMCACHE_MODEL": model,
        "LMCACHE_BLOCK_SIZE": str(srv.chunk_size),
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "JUPYTER_PLATFORM_DIRS": "1",
    }


def _kernel_specs(tmp_path: Path, env: dict[str, str]) -> KernelSpecManager:
    spec_dir = tmp_path / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lmcache_async tests",
        "language": "python",
        "env": env,
        "metadata": {"debugger": False},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])


def test_the_notebook_runs_in_a_real_kernel(real_server_shm: RealLMCacheServer, tmp_path: Path) -> None:
    srv = real_server_shm
    env = _env(srv, tmp_path, f"test-notebook-{os.getpid()}")
    nb = _load()
    client = NotebookClient(
        nb,
        km=AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=_kernel_specs(tmp_path, env)),
        timeout=120,  # per cell
        startup_timeout=120,
        allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    # Raises CellExecutionError naming the failing cell. cleanup_kc: we passed our own
    # kernel manager, so nbclient would otherwise leave the kernel and its channels open.
    client.execute(cleanup_kc=True)

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert [o for o in outputs if o.output_type == "error"] == []
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.name == "stdout")
    assert "transfer=shm" in text  # the blocking client used the SHM transport
    assert "async remap: RemapResult(" in text
    # both clients were closed by the notebook: no registration of its model is left
    meta = srv.status().get("non_cuda_context_meta", {})
    assert [m for m in meta.values() if m.get("model_name") == env["LMCACHE_MODEL"]] == []


_SETUP = """
import os, torch
from lmcache_async import KVGeometry
from lmcache_async.sync_client import Client
geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)
client = Client(os.environ["LMCACHE_URL"], os.environ["LMCACHE_HTTP_URL"], os.environ["LMCACHE_MODEL"],
                geometry=geometry)
toks = list(range(7, 7 + 64))
assert client.store(torch.ones(geometry.kv_shape(64), dtype=torch.bfloat16), toks) is True
assert client.drain(timeout=10) is True  # the store's end_session, sent in the background
"""

_SLOW_CALL = """
print("calling", flush=True)
client.lookup(toks, timeout=60)
"""

# The kernel's working directory is a temporary one: tests.helpers (peek) is found through
# the repository root put first on its path.
_AFTER = f"""
import sys, time
sys.path.insert(0, {str(REPO_ROOT)!r})
from tests.helpers import peek
deadline = time.monotonic() + 30
while peek(client).in_flight_ops and time.monotonic() < deadline:
    time.sleep(0.02)
assert not peek(client).in_flight_ops, "the interrupted call did not finish its cleanup"
assert client.lookup(toks) == 64
client.close()
print("closed", flush=True)
"""


def _run_cell(kc: Any, code: str, timeout: float = 60.0) -> tuple[dict[str, Any], str]:
    """Execute ``code``; return the execute_reply content and the cell's stdout."""
    msg_id = kc.execute(code)
    out: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.1))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = _shell_reply(kc, msg_id, deadline)
    return reply["content"], "".join(out)


def _shell_reply(kc: Any, msg_id: str, deadline: float) -> dict[str, Any]:
    """The shell channel's reply to ``msg_id``, skipping replies to other requests.

    ``wait_for_ready`` sends ``kernel_info_request`` again every second until one is
    answered, so a kernel slow to start leaves extra ``kernel_info_reply`` messages
    queued on the shell channel; a reply to an execute request is found by its parent.
    """
    while True:
        reply: dict[str, Any] = kc.get_shell_msg(timeout=max(deadline - time.monotonic(), 0.1))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply
        assert reply["msg_type"] == "kernel_info_reply", reply["msg_type"]


def test_a_kernel_interrupt_cancels_a_blocking_call_and_the_kernel_lives_on(
    fresh_real_server: Callable[..., RealLMCacheServer], tmp_path: Path
) -> None:
    srv = fresh_real_server("shm")
    km = KernelManager(
        kernel_name=KERNEL_NAME,
        kernel_spec_manager=_kernel_specs(tmp_path, _env(srv, tmp_path, f"test-nb-interrupt-{os.getpid()}")),
    )
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        # What wait_for_ready leaves behind when the kernel answers its first request
        # late (CI under load): one more kernel_info_reply queued on the shell channel.
        kc.kernel_info()
        reply, _ = _run_cell(kc, _SETUP)
        assert reply["status"] == "ok", reply
        baseline = srv.status()["active_sessions"]
        pid = srv.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the lookup cannot be answered now
        try:
            # stop_on_error=False: after an error the kernel otherwise aborts the requests
            # that reach it before its abort flag is cleared on a later loop turn, and
            # under load that can be the next cell (its reply then reads 'aborted').
            msg_id = kc.execute(_SLOW_CALL, stop_on_error=False)
            deadline = time.monotonic() + 60
            while True:  # wait until the cell is about to block in client.lookup
                msg = kc.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.1))
                if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                    break
            time.sleep(0.2)  # let it enter the wait (an earlier interrupt is fine too)
            km.interrupt_kernel()  # SIGINT, as the notebook's stop button
            reply = _shell_reply(kc, msg_id, time.monotonic() + 60)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        reply, out = _run_cell(kc, _AFTER)  # the kernel and the client live on
        assert reply["status"] == "ok", reply
        assert "closed" in out
        deadline = time.monotonic() + 30
        while srv.status()["active_sessions"] != baseline:
            assert time.monotonic() < deadline, "a server session was left behind"
            time.sleep(0.05)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
