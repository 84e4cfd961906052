"""The official SDK's KV-cache API, on :class:`~lmcache_async.Client`.

What this replaces, exactly:

* lmcache 0.5.6's ``lmcache.sdk.kvcache`` has one function, ``connect(url, http_url,
  model_name, timeout=60.0)``, returning an ``LMCacheSDKContext`` whose methods do the
  work: ``ctx.retrieve(tokens, cache_salt="")``, ``ctx.store(kv, tokens,
  cache_salt="")``, ``ctx.close()``, ``ctx.chunk_size``, ``ctx.instance_id``. Here
  :func:`connect` has the same arguments and returns a
  :class:`~lmcache_async.Client`, which has those methods and properties.
* The module-level functions :func:`retrieve`, :func:`store`, :func:`lookup` and
  :func:`close` take that context first; each is a one-line call of its method. They are
  not in lmcache's ``lmcache.sdk.kvcache`` (0.5.6 and 0.5.7rc3 have only ``connect``).
  The newer SDK example script of the LMCache repository
  (``examples/kvcache_sdk/store_retrieve.py``) calls URL-based functions of
  ``lmcache.sdk`` instead (``lmc_sdk.retrieve(path, url, model_name=..., tokens=...)``),
  which this module does not provide.

Code written against the 0.5.6 SDK (``ctx = kvcache.connect(...)``, then
``ctx.retrieve(...)``, ``ctx.store(...)``, ``ctx.close()``) keeps working with only the
import changed. The function form::

    import lmcache_async.kvcache as lmc_sdk

    ctx = lmc_sdk.connect(url="tcp://localhost:6555", http_url="http://localhost:8080",
                          model_name="my-model")
    kv = lmc_sdk.retrieve(ctx, tokens=source_tokens)
    if kv is not None:
        lmc_sdk.store(ctx, kv=kv, tokens=target_tokens)
    lmc_sdk.close(ctx)

There is no second implementation: every function calls the :class:`Client`.

Differences from the official SDK (all deliberate):

* ``store`` returns False exactly when every whole chunk was already cached (or there is
  no whole chunk), on SHM and on pickle alike; the official SDK answers True for an
  already cached store over pickle. It raises instead of returning False on failure
  (:class:`~lmcache_async.LMCacheTimeoutError` on timeout, ``ValueError``/``TypeError``
  on a bad shape or dtype, where the SDK raises its ``LMCacheSDKError``).
* ``connect`` also takes ``geometry=`` (a :class:`~lmcache_async.KVGeometry`), so no
  inference engine has to have registered the model; without it the geometry comes from
  ``/status`` as in the official SDK.
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
    timeout: float | None = 60.0,
    *,
    geometry: KVGeometry | None = None,
) -> Client:
    """Connect to the server and register for ``model_name``; returns the context.

    Args:
        url: ZMQ endpoint of the server, e.g. ``tcp://localhost:5555``.
        http_url: HTTP endpoint of the server, e.g. ``http://localhost:8080``.
        model_name: the model whose KV is stored.
        timeout: deadline in seconds of every call made with this context (``None``:
            none; checked as every ``timeout`` of the library, see
            :func:`lmcache_async._defaults.check_timeout`).
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
    """Store ``kv`` (``[2, L, T, D]``, ``T == len(tokens)``) under ``tokens``.

    Tokens beyond the last whole chunk are ignored. Returns True if at least one chunk
    was added, False exactly when all were cached already.
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
