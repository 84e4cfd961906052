"""A drop-in for the official SDK's module-level KV-cache functions.

Code written against the official SDK keeps working with only the import changed::

    import lmcache_async.kvcache as lmc_sdk

    ctx = lmc_sdk.connect(url="tcp://localhost:6555", http_url="http://localhost:8080",
                          model_name="my-model")
    kv = lmc_sdk.retrieve(ctx, tokens=source_tokens)
    if kv is not None:
        lmc_sdk.store(ctx, kv=kv, tokens=target_tokens)
    lmc_sdk.close(ctx)

The context is a :class:`lmcache_async.sync_client.Client`, so the SDK context's own
methods (``ctx.retrieve(tokens, cache_salt)``, ``ctx.store(kv, tokens, cache_salt)``,
``ctx.close()``, ``ctx.chunk_size``, ``ctx.instance_id``) work on it as well. Every
function is a one-line call of that client; there is no second implementation.

Differences from the official SDK (all deliberate):

* ``store`` returns False exactly when every whole chunk was already cached (or there is
  no whole chunk), on SHM and on pickle alike; the official SDK answers True for an
  already cached store over pickle. It raises instead of returning False on failure
  (:class:`~lmcache_async.LMCacheTimeoutError` on timeout, ``ValueError``/``TypeError``
  on a bad shape or dtype, where the SDK raises its ``LMCacheSDKError``).
* ``connect`` also takes ``geometry=`` (a :class:`~lmcache_async.KVGeometry`), so no
  inference engine has to have registered the model; without it the geometry comes from
  ``/status`` as in the official SDK.
* ``store`` accepts ``tokens`` longer than the KV (it stores under ``tokens[:T]``), so
  ``store(retrieve(source), target)`` works when the prompt is not a whole number of
  chunks; the official SDK raises on the shape mismatch.
* ``lookup`` is an addition: the cached prefix length without transferring anything.
* ``close`` also unregisters the client from the server.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_async.geometry import KVGeometry
from lmcache_async.sync_client import Client

__all__ = ["close", "connect", "lookup", "retrieve", "store"]


def connect(
    url: str,
    http_url: str,
    model_name: str,
    timeout: float = 60.0,
    *,
    geometry: KVGeometry | None = None,
) -> Client:
    """Connect to the server and register for ``model_name``; returns the context.

    Args:
        url: ZMQ endpoint of the server, e.g. ``tcp://localhost:5555``.
        http_url: HTTP endpoint of the server, e.g. ``http://localhost:8080``.
        model_name: the model whose KV is stored.
        timeout: deadline in seconds of every call made with this context.
        geometry: the KV layout; when omitted it is read from ``/status``, which
            requires an inference engine to have registered ``model_name``.

    Raises:
        LMCacheConnectionError, LMCacheTimeoutError, ModelNotRegisteredError: as
        :class:`~lmcache_async.sync_client.Client`.
    """
    return Client(url, http_url, model_name, geometry=geometry, timeout=timeout)


def retrieve(ctx: Client, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None:
    """The KV (``[2, L, T, D]``, CPU) of the longest cached chunk-aligned prefix of
    ``tokens``, or ``None`` when nothing is cached (or there is no whole chunk)."""
    return ctx.retrieve(tokens, cache_salt)


def store(ctx: Client, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "") -> bool:
    """Store ``kv`` (``[2, L, T, D]``) under ``tokens``.

    ``tokens`` may be longer than ``T``: the KV is stored under ``tokens[:T]``, so the
    official snippet ``store(ctx, kv=retrieve(ctx, tokens=source), tokens=target)`` works
    for prompts of any length (a retrieve returns whole chunks only; the official SDK
    raises there). Fewer tokens than ``T`` raise ``ValueError``. Tokens beyond the last
    whole chunk are ignored. Returns True if at least one chunk was added, False exactly
    when all were cached already.
    """
    if isinstance(kv, torch.Tensor):  # anything else: the client raises TypeError
        kv = kv.detach() if kv.device.type == "cpu" else kv.detach().cpu()  # as the SDK does
    return ctx.store(kv, tokens, cache_salt)


def lookup(ctx: Client, tokens: Sequence[int], cache_salt: str = "") -> int:
    """Length in tokens of the longest cached chunk-aligned prefix of ``tokens``."""
    return ctx.lookup(tokens, cache_salt)


def close(ctx: Client) -> None:
    """Close the context: unregister, close the socket and the HTTP session."""
    ctx.close()
