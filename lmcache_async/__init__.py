"""lmcache_async: an async-first client for the LMCache MP server's KV-cache API.

>>> import lmcache_async as lmc
>>> client = await lmc.connect(url="tcp://localhost:5555", http_url="http://localhost:8080",
...                            model_name="my-model", geometry=lmc.KVGeometry(32, 8, 128))
>>> await client.store(kv, tokens)
>>> kv = await client.retrieve(tokens)

The public modules are ``client``, ``sync_client``, ``bulk``, ``results``, ``geometry``, ``rope``,
``errors``, ``defaults`` (``DEFAULT``, what a ``timeout=`` means), ``kvcache`` (the official SDK's
drop-in), ``hf`` (transformers), ``hf_blend`` (the selective repair of composed prompts), ``ray``
(Ray Data), ``testing`` (the embedded server), ``observe`` (the operation hook), ``otel``
(OpenTelemetry), ``events`` (KV events), ``hashing`` (the server's chunk hashes), ``management``
(capabilities, warm, delete, clear), ``fleet`` (routing by cached prefix) and ``cli``; modules
whose name starts with ``_`` are the implementation, with no promise. The names below are
re-exported here from their public homes.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any, Final

from lmcache_async import errors as _errors

if TYPE_CHECKING:
    from lmcache_async._version import (
        __version__ as __version__,
    )
    from lmcache_async.bulk import (
        BatchProgress as BatchProgress,
        BatchResult as BatchResult,
        BatchSummary as BatchSummary,
        ComposeItem as ComposeItem,
        ItemResult as ItemResult,
        RemapPair as RemapPair,
        RetrieveItem as RetrieveItem,
        StoreItem as StoreItem,
    )
    from lmcache_async.client import (
        AsyncClient as AsyncClient,
        connect as connect,
    )
    from lmcache_async.defaults import (
        DEFAULT as DEFAULT,
        DefaultType as DefaultType,
    )
    from lmcache_async.errors import (
        AuthenticationError as AuthenticationError,
        ClientClosedError as ClientClosedError,
        ClientNotOpenError as ClientNotOpenError,
        ClientStateError as ClientStateError,
        ForkedClientError as ForkedClientError,
        ForkedSyncClientError as ForkedSyncClientError,
        HTTPStatusError as HTTPStatusError,
        HybridLayoutError as HybridLayoutError,
        KVEventsDisabledError as KVEventsDisabledError,
        LayoutMismatchError as LayoutMismatchError,
        LMCacheConnectionError as LMCacheConnectionError,
        LMCacheError as LMCacheError,
        LMCacheTimeoutError as LMCacheTimeoutError,
        LoopThreadCallError as LoopThreadCallError,
        ModelNotRegisteredError as ModelNotRegisteredError,
        ProtocolError as ProtocolError,
        ServerError as ServerError,
        ServerReplacedError as ServerReplacedError,
        SyncUsageError as SyncUsageError,
        TransferError as TransferError,
        UnfilledReservationError as UnfilledReservationError,
        UnknownServerVersionWarning as UnknownServerVersionWarning,
        UnsafePayloadError as UnsafePayloadError,
        UnsupportedHashAlgorithmError as UnsupportedHashAlgorithmError,
        UnsupportedServerVersionError as UnsupportedServerVersionError,
        WrongEventLoopError as WrongEventLoopError,
    )
    from lmcache_async.events import (
        RemovedEvent as RemovedEvent,
        Resync as Resync,
        StoredEvent as StoredEvent,
    )
    from lmcache_async.fleet import (
        Fleet as Fleet,
    )
    from lmcache_async.geometry import (
        KVGeometry as KVGeometry,
    )
    from lmcache_async.hashing import (
        chunk_hashes as chunk_hashes,
    )
    from lmcache_async.management import (
        DeleteResult as DeleteResult,
        WarmResult as WarmResult,
    )
    from lmcache_async.observe import (
        Observer as Observer,
        Operation as Operation,
        add_observer as add_observer,
        remove_observer as remove_observer,
    )
    from lmcache_async.otel import (
        instrument as instrument,
        uninstrument as uninstrument,
    )
    from lmcache_async.results import (
        ComposeResult as ComposeResult,
        KVPart as KVPart,
        PartResult as PartResult,
        RemapResult as RemapResult,
    )
    from lmcache_async.rope import (
        RopeLayer as RopeLayer,
        RopeScaling as RopeScaling,
        RopeSpec as RopeSpec,
    )
    from lmcache_async.sync_client import (
        Client as Client,
    )

#: The package's names and the module each comes from: the one table behind ``__all__``
#: and the lazy re-exports. Each name is imported on first use (PEP 562), so that
#: ``import lmcache_async`` -- which every ``lmcache-async`` command pays, ``--help``
#: included -- does not import torch (~2-3 s) until a name needs it.
_EXPORTS: Final[dict[str, tuple[str, ...]]] = {
    "lmcache_async._version": ("__version__",),
    "lmcache_async.defaults": (
        "DEFAULT",
        "DefaultType",
    ),
    # The error tree is errors.__all__ (errors imports nothing else, so this costs no torch).
    "lmcache_async.errors": tuple(_errors.__all__),
    "lmcache_async.geometry": ("KVGeometry",),
    "lmcache_async.rope": ("RopeLayer", "RopeScaling", "RopeSpec"),
    "lmcache_async.results": (
        "ComposeResult",
        "KVPart",
        "PartResult",
        "RemapResult",
    ),
    "lmcache_async.client": (
        "AsyncClient",
        "connect",
    ),
    "lmcache_async.sync_client": ("Client",),
    "lmcache_async.bulk": (
        "BatchProgress",
        "BatchResult",
        "BatchSummary",
        "ComposeItem",
        "ItemResult",
        "RemapPair",
        "RetrieveItem",
        "StoreItem",
    ),
    "lmcache_async.observe": (
        "Observer",
        "Operation",
        "add_observer",
        "remove_observer",
    ),
    "lmcache_async.otel": ("instrument", "uninstrument"),
    "lmcache_async.events": ("RemovedEvent", "Resync", "StoredEvent"),
    "lmcache_async.hashing": ("chunk_hashes",),
    "lmcache_async.management": ("DeleteResult", "WarmResult"),
    "lmcache_async.fleet": ("Fleet",),
}
_HOME: Final[dict[str, str]] = {name: module for module, names in _EXPORTS.items() for name in names}


if not TYPE_CHECKING:  # type checkers see the imports above (and flag misspelt names)

    def __getattr__(name: str) -> Any:
        module = _HOME.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            # A public submodule (``lmcache_async.client``): an attribute once imported.
            value = importlib.import_module(f"{__name__}.{name}")
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


__all__ = sorted(_HOME)
