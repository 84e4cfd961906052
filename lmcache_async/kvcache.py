"""The official SDK's KV-cache API, on :class:`~lmcache_async.Client`.

What this replaces, exactly:

* lmcache 0.5.6's ``lmcache.sdk.kvcache`` has one function, ``connect(url, http_url,
  model_name, timeout=60.0)``, returning an ``LMCacheSDKContext`` whose methods do the
  work: ``ctx.retrieve(tokens, cache_salt="", request_configs=None)``, ``ctx.store(kv,
  tokens, cache_salt="", request_configs=None)``, ``ctx.close()``, ``ctx.chunk_size``,
  ``ctx.instance_id``. Here :func:`connect` has the same arguments (plus ``geometry=``
  and ``api_key=``, default ``$LMCACHE_API_KEY``) and returns a :class:`KVCacheContext`
  (also named :data:`LMCacheSDKContext`, as the official class), a
  :class:`~lmcache_async.Client` whose ``retrieve``/``store`` take the official
  context's positional arguments; ``request_configs`` travel in the cache key, on 0.5.6
  and 0.5.7 servers alike, as the official SDK sends them.
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

The context is a :class:`KVCacheContext`, a :class:`lmcache_async.sync_client.Client`
whose ``retrieve`` and ``store`` take the official context's positional arguments, so the
SDK context's own methods (``ctx.retrieve(tokens, cache_salt, request_configs)``,
``ctx.store(kv, tokens, cache_salt, request_configs)``, ``ctx.close()``,
``ctx.chunk_size``, ``ctx.instance_id``) work on it as well. Every function is a one-line
call of that client; there is no second implementation. ``request_configs`` travel in the
cache key, on 0.5.6 and 0.5.7 servers alike, as the official SDK sends them.

Differences from the official SDK (all deliberate; the full table is in
docs/internals/compatibility.md):

* ``store`` returns False exactly when every whole chunk was already cached (or there is
  no whole chunk), on SHM and on pickle alike; the official SDK answers True for an
  already cached store over pickle. It raises instead of returning False on failure
  (:class:`~lmcache_async.LMCacheTimeoutError` on timeout, ``ValueError``/``TypeError``
  on a bad shape or dtype, where the SDK raises its ``LMCacheSDKError``).
* Failures raise subclasses of :class:`~lmcache_async.LMCacheError`; only the misuse
  errors (:class:`~lmcache_async.ClientStateError`: a closed or forked context) are also
  ``RuntimeError``, as the SDK's ``LMCacheSDKError`` is. ``except RuntimeError`` does not
  catch a timeout, a lost connection or a transfer error; docs/internals/compatibility.md maps
  each failure and gives one ``except`` clause for both libraries.
* ``connect`` also takes ``geometry=`` (a :class:`~lmcache_async.KVGeometry`), so no
  inference engine has to have registered the model; without it the geometry comes from
  ``/status`` as in the official SDK.
* ``store`` accepts ``tokens`` longer than the KV (it stores under ``tokens[:T]``), so
  ``store(retrieve(source), target)`` works when the prompt is not a whole number of
  chunks; the official SDK raises on the shape mismatch.
* ``lookup`` is an addition: the cached prefix length without transferring anything.
* ``close`` also unregisters the client from the server.
* a ``kv`` of another dtype than the registered one is refused (``TypeError``); the
  official SDK casts it silently.
* ``connect`` also takes ``api_key=`` (default ``$LMCACHE_API_KEY``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lmcache_async._base.timeouts import DEFAULT, DefaultType
from lmcache_async.geometry import KVGeometry
from lmcache_async.sync_client import Client

__all__ = ["KVCacheContext", "LMCacheSDKContext", "close", "connect", "lookup", "retrieve", "store"]


class KVCacheContext(Client):
    """The drop-in's context: a :class:`~lmcache_async.sync_client.Client` whose
    ``retrieve``/``store`` take the official SDK context's positional arguments
    (``request_configs`` third and fourth; ``out`` is keyword-only here)."""

    def retrieve(  # type: ignore[override]  # the official SDK's signature wins here
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        request_configs: Mapping[str, Any] | None = None,
        *,
        out: torch.Tensor | None = None,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> torch.Tensor | None:
        """As the official ``LMCacheSDKContext.retrieve``: the KV of the longest cached
        chunk-aligned prefix, or ``None``; see :meth:`Client.retrieve`."""
        return super().retrieve(tokens, cache_salt, out, request_configs=request_configs, timeout=timeout)

    def store(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int],
        cache_salt: str = "",
        request_configs: Mapping[str, Any] | None = None,
        *,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> bool:
        """As the official ``LMCacheSDKContext.store``; see :meth:`Client.store`.

        A non-CPU or grad-tracking ``kv`` is detached and moved to the CPU first, as
        the SDK does.
        """
        if isinstance(kv, torch.Tensor):  # anything else: the client raises TypeError
            kv = kv.detach() if kv.device.type == "cpu" else kv.detach().cpu()
        return super().store(kv, tokens, cache_salt, request_configs=request_configs, timeout=timeout)


# The official name of the context class (``lmcache.sdk.kvcache.LMCacheSDKContext``, the
# class of what its ``connect`` returns), so annotations and isinstance checks written
# against it keep working.
LMCacheSDKContext = KVCacheContext


def connect(
    url: str,
    http_url: str,
    model_name: str,
    timeout: float | None = 60.0,
    *,
    geometry: KVGeometry | None = None,
    api_key: str | None = None,
) -> KVCacheContext:
    """Connect to the server and register for ``model_name``; returns the context.

    Args:
        url: ZMQ endpoint of the server, e.g. ``tcp://localhost:5555``.
        http_url: HTTP endpoint of the server, e.g. ``http://localhost:8080``.
        model_name: the model whose KV is stored.
        timeout: deadline in seconds of every call made with this context (``None``:
            none; checked as every ``timeout`` of the library, see
            :func:`lmcache_async._base.timeouts.check_timeout`).
        geometry: the KV layout; when omitted it is read from ``/status``, which
            requires an inference engine to have registered ``model_name``.
        api_key: HTTP API key (servers started with one answer 401 without it);
            default ``$LMCACHE_API_KEY``.

    Raises:
        LMCacheConnectionError, LMCacheTimeoutError, ModelNotRegisteredError: as
        :class:`~lmcache_async.sync_client.Client`.
    """
    return KVCacheContext(url, http_url, model_name, geometry=geometry, timeout=timeout, api_key=api_key)


def retrieve(
    ctx: Client,
    tokens: Sequence[int],
    cache_salt: str = "",
    request_configs: Mapping[str, Any] | None = None,
) -> torch.Tensor | None:
    """The KV (``[2, L, T, D]``, CPU) of the longest cached chunk-aligned prefix of
    ``tokens``, or ``None`` when nothing is cached (or there is no whole chunk)."""
    return Client.retrieve(ctx, tokens, cache_salt, request_configs=request_configs)


def store(
    ctx: Client,
    kv: torch.Tensor,
    tokens: Sequence[int],
    cache_salt: str = "",
    request_configs: Mapping[str, Any] | None = None,
) -> bool:
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
    return Client.store(ctx, kv, tokens, cache_salt, request_configs=request_configs)


def lookup(
    ctx: Client,
    tokens: Sequence[int],
    cache_salt: str = "",
    request_configs: Mapping[str, Any] | None = None,
) -> int:
    """Length in tokens of the longest cached chunk-aligned prefix of ``tokens``."""
    return ctx.lookup(tokens, cache_salt, request_configs=request_configs)


def close(ctx: Client) -> None:
    """Close the context: unregister, close the socket and the HTTP session."""
    ctx.close()
