"""A fleet of LMCache servers routed by cached prefix.

:class:`Fleet` (``fleet/router.py``) holds one :class:`~lmcache_async.AsyncClient` per
server, identified by its ZMQ URL, and a :class:`FleetIndex` of which server holds which
chunk, fed by

* each server's KV events (:meth:`~lmcache_async.AsyncClient.kv_events`): ``stored``
  from the engine (vLLM) path, ``removed`` from every eviction, delete and clear; a
  resync (events lost, the server restarted) forgets the server's entries;
* the fleet's own stores (:meth:`Fleet.store`; the server publishes no ``stored`` event
  for a client's store, so the fleet records it itself, as a speculative entry);
* ``lookup`` fan-out (:meth:`Fleet.best` with ``fanout``): each server is asked, and what
  it answers is recorded (speculative). By default the fleet fans out only when its
  index knows none of the prompt's first chunk, when a cache salt is given (events
  carry no salt), or when the index cannot answer.

The index's backends (``fleet/index.py`` the interface):

* :class:`MemoryIndex` (``fleet/memory.py``, the default): one process's
  :class:`PrefixIndex`, bounded by ``max_chunks``, no ceiling on servers;
* :class:`RedisIndex` (``fleet/redis.py``, the ``fleet`` extra): shared by every router
  process naming the same Redis namespace; entries expire; Redis down means fan-out.

:meth:`Fleet.best` returns the server with the longest cached prefix, ties broken by
load (requests the fleet routed there and still in flight, plus the client's own
operations in flight), then by a rendezvous hash of the prompt and the server's URL;
a server that is down is never chosen. Servers join and leave a running fleet with
:meth:`Fleet.add_server` and :meth:`Fleet.remove_server`.

:mod:`lmcache_async.fleet.service` (``fleet/service.py``) is the routing service over a
fleet: aiohttp's web server answering each server's cached prefix of a prompt and the
server to use (``lmcache-async route`` runs it).
"""

from __future__ import annotations

from lmcache_async.fleet.index import FleetIndex as FleetIndex, IndexOp as IndexOp
from lmcache_async.fleet.memory import MemoryIndex as MemoryIndex, PrefixIndex as PrefixIndex
from lmcache_async.fleet.redis import RedisIndex as RedisIndex
from lmcache_async.fleet.router import Fleet as Fleet, Route as Route, Routed as Routed

__all__ = ["Fleet", "FleetIndex", "IndexOp", "MemoryIndex", "PrefixIndex", "RedisIndex", "Route", "Routed"]
