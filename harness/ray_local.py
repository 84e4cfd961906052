"""A local Ray instance on loopback, sized for a small shared machine (tests, benchmarks).

    from harness.ray_local import local_ray

    with local_ray() as node_ip:      # "127.0.0.1"
        ...                           # ray.data jobs; actors' servers keyed by node_ip

Ray picks the machine's outward address for its node by default; here every Ray process
uses 127.0.0.1 (Ray's single-machine mode, its default on macOS: the
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` switch, in this process and in those it starts).
2 CPUs, a 300 MB object store, no dashboard, logs under a fresh short temporary directory
(Ray's socket paths live there), this checkout on every worker's ``PYTHONPATH``, Ray
Data's progress bars off. Stopped (``ray.shutdown``: every process it started) and its
directory removed on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from harness.real_server import REPO_ROOT

__all__ = ["local_ray"]

_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def local_ray(num_cpus: int = 2, object_store_bytes: int = 300 << 20) -> Iterator[str]:
    """Start Ray, yield its node's IP (127.0.0.1), stop it."""
    import ray
    import ray._private.ray_constants as constants
    import ray.data

    before = os.environ.get(_SWITCH), constants.ENABLE_RAY_CLUSTER
    os.environ[_SWITCH] = "0"
    constants.ENABLE_RAY_CLUSTER = False
    tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        ray.init(
            _node_ip_address="127.0.0.1",
            num_cpus=num_cpus,
            object_store_memory=object_store_bytes,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=tmp,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
        )
        try:
            ray.data.DataContext.get_current().enable_progress_bars = False
            node = ray.util.get_node_ip_address()
            if node != "127.0.0.1":
                raise RuntimeError(f"Ray's node is at {node}, not on loopback")
            yield node
        finally:
            ray.shutdown()
    finally:
        if before[0] is None:
            os.environ.pop(_SWITCH, None)
        else:
            os.environ[_SWITCH] = before[0]
        constants.ENABLE_RAY_CLUSTER = before[1]
        shutil.rmtree(tmp, ignore_errors=True)
