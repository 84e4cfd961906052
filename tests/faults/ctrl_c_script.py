"""A script that uses the blocking facade in a ``with`` block and runs operations until
it is interrupted (tests/faults/test_ctrl_c_exit.py sends it SIGINT while the server hangs).

    python tests/faults/ctrl_c_script.py ZMQ_URL HTTP_URL [with|open]

``with`` (the default) uses ``with Client(...)``; ``open`` leaves the client open (the exit
hook closes it). Prints ``READY`` once an operation succeeded, then ``OP`` before each
further operation.
"""

from __future__ import annotations

import sys

import torch

import lmcache_async as lmc


def main() -> None:
    url, http_url = sys.argv[1], sys.argv[2]
    geometry = lmc.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)
    kv = torch.zeros(geometry.kv_shape(32), dtype=geometry.dtype)
    style = sys.argv[3] if len(sys.argv) > 3 else "with"
    client = lmc.Client(url, http_url, "ctrl-c-script", geometry=geometry, timeout=30)
    if style == "with":
        with client:
            run(client, kv)
    else:
        run(client, kv)  # never closed: the exit hook closes it


def run(client: lmc.Client, kv: torch.Tensor) -> None:
    client.store(kv, list(range(32)))
    print("READY", flush=True)
    i = 0
    while True:
        i += 1
        print("OP", flush=True)
        client.store(kv, list(range(1000 * i, 1000 * i + 32)))
        client.retrieve(list(range(32)))


if __name__ == "__main__":
    main()
