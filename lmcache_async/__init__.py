"""lmcache_async: an async-first client for the LMCache MP server's KV-cache API.

>>> import lmcache_async as lmc
>>> client = await lmc.connect(url="tcp://localhost:5555", http_url="http://localhost:8080",
...                            model_name="my-model", geometry=lmc.KVGeometry(32, 8, 128))
>>> await client.store(kv, tokens)
>>> kv = await client.retrieve(tokens)
"""

from lmcache_async._defaults import DEFAULT, DefaultType
from lmcache_async._version import __version__
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
from lmcache_async.geometry import KVGeometry
from lmcache_async.sync_client import Client

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
