"""Smoke run: start the real LMCache 0.5.6 server (from .lmcache-venv), connect with
lmcache_async, print the server's chunk size and the median ``noop`` round trip, stop.

    .venv/bin/python -m benchmarks.smoke_real_server   (or: make smoke)
"""

from __future__ import annotations

import asyncio
import statistics
import sys

import torch

import lmcache_async as lmc
from harness.real_server import RealLMCacheServer, lmcache_venv_python


async def smoke(srv: RealLMCacheServer) -> None:
    geometry = lmc.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    async with lmc.AsyncClient(srv.url, srv.http_url, "smoke", geometry=geometry, timeout=30) as client:
        rtts = [await client.noop() for _ in range(200)]
        print(f"server      {srv.url} (http {srv.http_url}), pid {srv.pid}")
        print(f"chunk size  {client.chunk_size} tokens")
        print(f"transfer    {client.transfer}")
        print(f"noop RTT    median {statistics.median(rtts[20:]) * 1e6:.0f} us over {len(rtts) - 20} calls")


def main() -> int:
    with RealLMCacheServer("shm", venv_python=lmcache_venv_python(), chunk_size=256) as srv:
        asyncio.run(smoke(srv))
    print("server stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
