"""lmcache_async: an async-first client for the LMCache MP server's KV-cache API.

>>> import lmcache_async as lmc
>>> client = await lmc.connect(url="tcp://localhost:5555", http_url="http://localhost:8080",
...                            model_name="my-model", geometry=lmc.KVGeometry(32, 8, 128))
>>> await client.store(kv, tokens)
>>> kv = await client.retrieve(tokens)
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from lmcache_async._defaults import DEFAULT, DefaultType
from lmcache_async._version import __version__
from lmcache_async.errors import (
    AuthenticationError,
    ClientClosedError,
    ClientNotOpenError,
    ClientStateError,
    ForkedClientError,
    ForkedSyncClientError,
    HTTPStatusError,
    LMCacheConnectionError,
    LMCacheError,
    LMCacheTimeoutError,
    LoopThreadCallError,
    ModelNotRegisteredError,
    ProtocolError,
    ServerError,
    ServerReplacedError,
    SyncUsageError,
    TransferError,
    UnsafePayloadError,
    UnsupportedServerVersionError,
    WrongEventLoopError,
)

if TYPE_CHECKING:
    from lmcache_async.bulk import (
        BatchProgress,
        BatchResult,
        BatchSummary,
        ItemResult,
        RemapPair,
        RetrieveItem,
        StoreItem,
    )
    from lmcache_async.client import AsyncClient, RemapResult, connect
    from lmcache_async.geometry import KVGeometry
    from lmcache_async.sync_client import Client

#: The names that need torch, and the module each comes from: imported on first use
#: (PEP 562), so that ``import lmcache_async`` -- which every ``lmcache-async`` command
#: pays, ``--help`` included -- does not import torch (~2-3 s) until a name needs it.
_LAZY: dict[str, str] = {
    **dict.fromkeys(
        (
            "BatchProgress",
            "BatchResult",
            "BatchSummary",
            "ItemResult",
            "RemapPair",
            "RetrieveItem",
            "StoreItem",
        ),
        "lmcache_async.bulk",
    ),
    **dict.fromkeys(("AsyncClient", "RemapResult", "connect"), "lmcache_async.client"),
    "KVGeometry": "lmcache_async.geometry",
    "Client": "lmcache_async.sync_client",
}


if not TYPE_CHECKING:  # type checkers see the imports above (and flag misspelt names)

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            # A submodule (``lmcache_async.client``): an attribute once imported, as the
            # eager imports of the names above made it before they were lazy.
            value = importlib.import_module(f"{__name__}.{name}")
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "DEFAULT",
    "AsyncClient",
    "AuthenticationError",
    "BatchProgress",
    "BatchResult",
    "BatchSummary",
    "Client",
    "ClientClosedError",
    "ClientNotOpenError",
    "ClientStateError",
    "DefaultType",
    "ForkedClientError",
    "ForkedSyncClientError",
    "HTTPStatusError",
    "ItemResult",
    "KVGeometry",
    "LMCacheConnectionError",
    "LMCacheError",
    "LMCacheTimeoutError",
    "LoopThreadCallError",
    "ModelNotRegisteredError",
    "ProtocolError",
    "RemapPair",
    "RemapResult",
    "RetrieveItem",
    "ServerError",
    "ServerReplacedError",
    "StoreItem",
    "SyncUsageError",
    "TransferError",
    "UnsafePayloadError",
    "UnsupportedServerVersionError",
    "WrongEventLoopError",
    "__version__",
    "connect",
]
