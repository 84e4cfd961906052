"""Plain helpers and constants the tests share (no fixtures: those are in tests/plugins/).

* :data:`SESSION_CHUNK_SIZE`: the chunk size of every shared server of the session (the
  real ones and the embedded ones), 16 tokens, so tests can use small tensors.
* :data:`SMALL_GEOMETRY`, :func:`random_kv`: the small explicit KV geometry of the client
  fixtures and KV of it.
* :func:`unique_model`, :func:`fresh_tokens`: a model name and token ids no other test
  uses (the session servers are shared).
"""

from __future__ import annotations

import os
import uuid

import torch

from lmcache_async import KVGeometry

#: Chunk size of the shared session servers (tokens). Small on purpose.
SESSION_CHUNK_SIZE = 16

SMALL_GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)


def unique_model(prefix: str = "test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def fresh_tokens(n: int) -> list[int]:
    """``n`` token ids no other test uses (random base, so shared servers don't collide)."""
    base = int.from_bytes(os.urandom(4), "little") % (2**31)
    return list(range(base, base + n))


def random_kv(geometry: KVGeometry, num_tokens: int, seed: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    return torch.randn(geometry.kv_shape(num_tokens), generator=gen, dtype=torch.float32).to(geometry.dtype)
