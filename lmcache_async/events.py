"""KV events of an LMCache MP server: the typed items of ``AsyncClient.kv_events()``
(:class:`StoredEvent`, :class:`RemovedEvent`, :class:`Resync`) and the stream that yields
them (:class:`KVEventStream`, made by :meth:`AsyncClient.kv_events
<lmcache_async.client.AsyncClient.kv_events>`).

The server (0.5.6 and 0.5.7) streams a *batch* per credit over the string-only
streaming RPC ``subscribe_kv_events(instance_id, model_name, cursor, max_events)``; a
batch is ``{enabled, incarnation, next_cursor, lost, events}`` and each event a record
``{seq, kind, medium, model_name, block_hashes, parent_block_hash, token_ids}``.

What the events can see (docs/guides/routing.md has the whole list):

* ``stored`` only for chunks written by the lmcache-driven (vLLM GPU) path: stores made
  by clients (``AsyncClient.store``, the SDK) publish nothing;
* ``removed`` for every L1 removal: eviction, a freed temporary prefetch copy,
  ``DELETE /cache/objects``, ``clear``;
* L1 only (no L2), one model per subscription, no cache salt, no rank.
"""

from __future__ import annotations

from lmcache_async._engine.event_stream import KVEventStream as KVEventStream
from lmcache_async._protocol.event_types import (
    MAX_BATCH_HASHES as MAX_BATCH_HASHES,
    MAX_EVENTS_LIMIT as MAX_EVENTS_LIMIT,
    KVEvent as KVEvent,
    KVEventBatch as KVEventBatch,
    RemovedEvent as RemovedEvent,
    Resync as Resync,
    StoredEvent as StoredEvent,
    batch_size_limit as batch_size_limit,
    decode_batch as decode_batch,
    validate_cursor as validate_cursor,
    validate_max_events as validate_max_events,
)

__all__ = [
    "MAX_BATCH_HASHES",
    "MAX_EVENTS_LIMIT",
    "KVEvent",
    "KVEventBatch",
    "KVEventStream",
    "RemovedEvent",
    "Resync",
    "StoredEvent",
    "batch_size_limit",
    "decode_batch",
    "validate_cursor",
    "validate_max_events",
]
