"""The fleet index on Redis (:class:`RedisIndex`), shared by every router process that
names the same namespace: what one learns (events, stores, lookups), the others route by.

Layout under the namespace ``ns`` (bytes keys; see docs/guides/routing.md):

* ``ns:c:<first 16 bytes of the chunk hash>``: a sorted set per chunk; each member
  ``<epoch>@<server URL>``, its score the time (Redis's clock, in ms) it expires. The
  key's own expiry is pushed to its longest-lived member's on each write, so an
  abandoned key vanishes; expired members are ignored on read and pruned on write.
* ``ns:epochs``: a hash, server URL -> epoch (0 when absent). Forgetting a server (a
  resync) increments its epoch: every member written under an older epoch is dead at once.

Writes run as Lua scripts (the epoch read and the members written atomically), a batch
in one pipeline; a lookup is one round trip: a Lua script returns the clock, the epochs
and each chunk's unexpired members up to the first chunk with none (one reply, where a
pipeline of one ``ZRANGE`` per chunk costs redis-py a parsed reply each), and the entries
are parsed and the prefix counted here.
Redis is a cache: every call has a deadline; a failure is logged once (and once when it
works again), then Redis is left alone for ``retry_after`` seconds: writes are dropped
and :meth:`RedisIndex.prefix` answers ``None`` (the fleet asks the servers instead).
Entries read back are parsed strictly; a malformed one is ignored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lmcache_async._base.timeouts import check_duration
from lmcache_async.fleet.index import FleetIndex, IndexOp

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["RedisIndex"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Connections to Redis an index made from a URL keeps at most; more concurrent calls
#: wait for one, within the deadline.
CONNECTIONS = 64

# KEYS[1] the epochs hash, KEYS[2..] chunk sets; ARGV[1] the server, ARGV[2] the life in ms.
_ADD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local m = (redis.call('HGET', KEYS[1], ARGV[1]) or '0') .. '@' .. ARGV[1]
local life = tonumber(ARGV[2])
for i = 2, #KEYS do
  local k = KEYS[i]
  redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
  redis.call('ZADD', k, 'GT', now + life, m)
  if redis.call('PTTL', k) < life then redis.call('PEXPIRE', k, life) end
end
return #KEYS - 1
"""

_REMOVE = """
local m = (redis.call('HGET', KEYS[1], ARGV[1]) or '0') .. '@' .. ARGV[1]
for i = 2, #KEYS do redis.call('ZREM', KEYS[i], m) end
return #KEYS - 1
"""

# KEYS[1] the epochs hash, KEYS[2..] the prompt's chunk sets, in order. Returns the clock
# (seconds, microseconds), the epochs (flat), then each chunk's unexpired members with
# their scores (flat), up to the first chunk with none (a key of another type: none).
_LOOKUP = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {t[1], t[2], redis.call('HGETALL', KEYS[1])}
for i = 2, #KEYS do
  local ok, m = pcall(redis.call, 'ZRANGE', KEYS[i], '(' .. now, '+inf', 'BYSCORE', 'WITHSCORES')
  if not ok or type(m) ~= 'table' or #m == 0 then break end
  out[#out + 1] = m
end
return out
"""

#: Bytes of the chunk hash in a chunk's key.
KEY_HASH_BYTES = 16


def _epoch(raw: object) -> int | None:
    """An epoch as stored (ASCII digits, at most 18), else None."""
    if isinstance(raw, bytes) and 0 < len(raw) <= 18 and raw.isdigit():
        return int(raw)
    return None


class RedisIndex(FleetIndex):
    """The :class:`~lmcache_async.fleet.FleetIndex` on Redis (redis-py's asyncio API;
    the ``fleet`` extra).

    Args:
        url: the Redis URL (``redis://host:port/db``), or ``client``: a
            ``redis.asyncio.Redis`` of the caller's (responses not decoded).
        namespace: the key prefix: one per fleet and model (routers that share it share
            the index; several fleets may share one Redis under different namespaces).
        ttl: the life of a confirmed entry (an event said so), seconds.
        speculative_ttl: the life of an entry the fleet wrote itself (its own store, a
            lookup's answer) until an event confirms it, seconds.
        deadline: the limit of each Redis call (one pipeline), seconds.
        retry_after: after a failure, Redis is not called for this long, seconds.

    Raises:
        ValueError: a bad argument (nothing is connected).

    The connections are made on first use, at most :data:`CONNECTIONS` from a URL (more
    concurrent calls wait for one, within ``deadline``); :meth:`aclose` closes a client
    it made.
    """

    def __init__(
        self,
        url: str | None = None,
        namespace: str = "",
        *,
        client: redis.asyncio.Redis | None = None,
        ttl: float = 3600.0,
        speculative_ttl: float = 60.0,
        deadline: float = 0.5,
        retry_after: float = 1.0,
    ) -> None:
        if (url is None) == (client is None):
            raise ValueError("give one of url or client")
        if not isinstance(namespace, str) or not namespace or any(c.isspace() for c in namespace):
            raise ValueError(f"namespace must be a non-empty str without whitespace, got {namespace!r}")
        self.ttl = check_duration(ttl, "ttl")
        self.speculative_ttl = check_duration(speculative_ttl, "speculative_ttl")
        if self.speculative_ttl > self.ttl:
            raise ValueError(f"speculative_ttl ({speculative_ttl}) must not exceed ttl ({ttl})")
        self.deadline = check_duration(deadline, "deadline")
        self.retry_after = check_duration(retry_after, "retry_after")
        self.namespace = namespace
        self._ns = namespace.encode()
        self._epochs = self._ns + b":epochs"
        self._chunk = self._ns + b":c:"
        if client is None:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            assert url is not None
            # A blocking pool: a call beyond the pool's connections waits for one (within
            # the deadline) where redis-py's default pool refuses it (MaxConnectionsError).
            pool = aioredis.BlockingConnectionPool.from_url(
                url,
                max_connections=CONNECTIONS,
                timeout=self.deadline,
                socket_timeout=self.deadline,
                socket_connect_timeout=self.deadline,
                retry=Retry(NoBackoff(), 0),
            )
            client = aioredis.Redis.from_pool(pool)
            self._owned = True
        else:
            self._owned = False
        self.client: redis.asyncio.Redis = client
        self._quiet_until = 0.0
        self._failing = False
        #: Redis calls that failed (or ran past the deadline).
        self.failures = 0
        #: Calls not made because Redis failed less than ``retry_after`` ago.
        self.skipped = 0

    def key(self, chunk_hash: bytes) -> bytes:
        """The Redis key of a chunk."""
        return self._chunk + chunk_hash[:KEY_HASH_BYTES]

    @property
    def available(self) -> bool:
        """False while Redis is left alone after a failure."""
        return time.monotonic() >= self._quiet_until

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T | None:
        """``fn()`` under the deadline; None if Redis failed (logged once) or is left alone."""
        if not self.available:
            self.skipped += 1
            return None
        from redis.exceptions import RedisError

        try:
            async with asyncio.timeout(self.deadline):
                got = await fn()
        except (RedisError, OSError, TimeoutError) as exc:
            self.failures += 1
            self._quiet_until = time.monotonic() + self.retry_after
            if not self._failing:
                self._failing = True
                log.warning(
                    "fleet index: Redis %s failed (%s: %s); routing asks the servers until it answers",
                    what,
                    type(exc).__name__,
                    exc,
                )
            return None
        if self._failing:
            self._failing = False
            log.warning("fleet index: Redis answers again")
        return got

    async def apply(self, ops: Sequence[IndexOp]) -> None:
        """Write ``ops`` in one pipeline (in order); dropped if Redis fails."""
        if not ops:
            return
        spec_ms = str(int(self.speculative_ttl * 1000))
        ttl_ms = str(int(self.ttl * 1000))

        async def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            for kind, server, hashes in ops:
                if kind == "forget":
                    pipe.hincrby(self._epochs, server, 1)
                    continue
                if not hashes:
                    continue
                keys = [self._epochs, *(self.key(h) for h in hashes)]
                if kind == "remove":
                    pipe.eval(_REMOVE, len(keys), *keys, server)
                else:
                    pipe.eval(_ADD, len(keys), *keys, server, ttl_ms if kind == "add" else spec_ms)
            await pipe.execute()

        await self._call("write", run)

    async def prefix(self, hashes: Sequence[bytes], servers: Collection[str]) -> dict[str, int] | None:
        """As :meth:`FleetIndex.prefix`: one round trip (a Lua script reads the clock,
        the epochs and each chunk's unexpired members, in order, up to the first chunk
        with none); the entries are parsed and the prefix counted here."""
        if not hashes or not servers:
            return {}
        keys = [self._epochs, *(self.key(h) for h in hashes)]

        async def run() -> Any:
            return await self.client.eval(_LOOKUP, len(keys), *keys)

        got = await self._call("lookup", run)
        if got is None:
            return None
        return self._count(got, servers)

    @staticmethod
    def _pairs(raw: object) -> list[tuple[bytes, bytes]]:
        """A flat reply ``[a, b, a, b, ...]`` as pairs of bytes (anything else: none)."""
        if not isinstance(raw, list) or len(raw) % 2:
            return []
        return [
            (k, v)
            for k, v in zip(raw[::2], raw[1::2], strict=True)
            if isinstance(k, bytes) and isinstance(v, bytes)
        ]

    def _count(self, got: object, servers: Collection[str]) -> dict[str, int] | None:
        if not isinstance(got, list) or len(got) < 3:
            return None
        try:
            now_ms = int(got[0]) * 1000 + int(got[1]) // 1000
        except (TypeError, ValueError):
            return None
        epochs: dict[bytes, int] = {}
        for k, v in self._pairs(got[2]):
            e = _epoch(v)
            if e is not None:
                epochs[k] = e
        wanted = {s.encode(): s for s in servers}
        live: set[bytes] | None = None
        out: dict[str, int] = {}
        sets = got[3:]
        for i, entries in enumerate(sets):
            holders: set[bytes] = set()
            for member, raw_score in self._pairs(entries):
                try:
                    score = float(raw_score)
                except ValueError:
                    continue
                written, sep, sid = member.partition(b"@")
                if score > now_ms and sep and sid in wanted and _epoch(written) == epochs.get(sid, 0):
                    holders.add(sid)
            now = holders if live is None else live & holders
            if live is not None:
                for sid in live - now:
                    out[wanted[sid]] = i
            live = now
            if not live:
                return out
        for sid in live or ():
            out[wanted[sid]] = len(sets)
        return out

    async def epochs(self) -> dict[str, int] | None:
        """Every server's epoch as Redis holds it (for operators and tests); None if Redis failed."""
        got = await self._call("read", lambda: self.client.hgetall(self._epochs))
        if got is None:
            return None
        out: dict[str, int] = {}
        for k, v in dict(got).items():
            e = _epoch(v)
            if isinstance(k, bytes) and e is not None:
                out[k.decode("utf-8", "replace")] = e
        return out

    async def aclose(self) -> None:
        """Close the client if this index made it."""
        if self._owned:
            await self.client.aclose()
