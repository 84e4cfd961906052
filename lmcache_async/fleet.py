"""A fleet of LMCache servers routed by cached prefix (issue 33).

:class:`Fleet` holds one :class:`~lmcache_async.AsyncClient` per server and a
:class:`PrefixIndex` of which server holds which chunk, fed by

* each server's KV events (:meth:`~lmcache_async.AsyncClient.kv_events`): ``stored``
  from the engine (vLLM) path, ``removed`` from every eviction, delete and clear;
* the fleet's own stores (:meth:`Fleet.store`; the server publishes no ``stored`` event
  for a client's store, so the fleet records it itself);
* ``lookup`` fan-out (:meth:`Fleet.best` with ``fanout``): each server is asked, and what
  it answers is recorded. By default the fleet fans out only when its index knows none
  of the prompt's first chunk (so stores made by other clients are found once), or when
  a cache salt is given (events carry no salt: the index cannot tell salts apart).

:meth:`Fleet.best` returns the server with the longest cached prefix, ties broken by
load (requests the fleet routed there and still in flight, plus the client's own
operations in flight), then by a rendezvous hash of the prompt (so that prompts nobody
holds spread evenly over the servers); a server that is down is never chosen. :meth:`Fleet.retrieve`,
:meth:`Fleet.lookup` and :meth:`Fleet.remap_many` go to the chosen server.

Memory is bounded: the index keeps at most ``max_chunks`` chunk entries (default one
million), the oldest-learned dropped first; each entry is a 64-bit key (the first 8
bytes of the chunk hash; two different chunks share one with a probability of about
n²/2⁶⁵, 3·10⁻⁸ at a million) and a small-int bitmask of servers:
``benchmarks/suite/bench_fleet.py`` measures the bytes per chunk (figures in
docs/benchmarks.md). A server whose stream says events were lost, or that restarted,
has its bit cleared from every entry (one pass over the index), then is learned again.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar, Unpack

import blake3
import torch

from lmcache_async._base.tasks import cancel_and_wait
from lmcache_async._protocol.wire import validate_cache_salt, validate_tokens
from lmcache_async.client import AsyncClient, ClientOptions
from lmcache_async.errors import ClientClosedError, LMCacheConnectionError, LMCacheError, LMCacheTimeoutError
from lmcache_async.events import RemovedEvent, Resync, StoredEvent
from lmcache_async.hashing import check_hash_algorithm, chunk_hashes

__all__ = ["MAX_SERVERS", "Fleet", "PrefixIndex", "Route", "Routed"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Servers one fleet may hold (the index's bitmask stays a small int up to 62).
MAX_SERVERS = 62


def _key(h: bytes) -> int:
    return int.from_bytes(h[:8], "big")


_MASK64: Final = (1 << 64) - 1


def _prompt_key(hashes: Sequence[bytes], toks: Sequence[int]) -> int:
    """A 64-bit key of the prompt for breaking ties: its first chunk's hash (prompts
    sharing a first chunk tie-break alike), or for a prompt shorter than a chunk a hash
    of its tokens."""
    if hashes:
        return _key(hashes[0])
    return int.from_bytes(blake3.blake3(array.array("I", toks).tobytes()).digest()[:8], "big")


def _rank(key: int, server: int) -> int:
    """Rendezvous rank of ``server`` for a prompt ``key`` (the lowest wins a tie): a
    splitmix64 of both, so each server wins about an equal share of the prompts and a
    server that goes down moves only its own share."""
    z = (key ^ ((server + 1) * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class PrefixIndex:
    """Which server holds which chunk (sans-IO; no clocks, no sockets).

    Keys are chunk hashes (:func:`lmcache_async.hashing.chunk_hashes`), kept as their
    first 8 bytes; values a bitmask of server numbers. At most ``max_chunks`` entries:
    inserting into a full index first drops the oldest-inserted entries, a 64th of
    ``max_chunks`` (at least one) at a time (``evicted`` counts them; dropping them one
    by one from the front of a dict costs a scan over every earlier deletion each time,
    which made a full index of a million entries take seconds per 40,000 inserts).
    """

    def __init__(self, max_chunks: int = 1_000_000) -> None:
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
            raise ValueError(f"max_chunks must be an int >= 1, got {max_chunks!r}")
        self.max_chunks = max_chunks
        self._map: dict[int, int] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._map)

    def add(self, server: int, hashes: Iterable[bytes]) -> None:
        """Record that ``server`` holds the chunks ``hashes``."""
        bit = 1 << server
        m = self._map
        for h in hashes:
            k = _key(h)
            old = m.get(k)
            if old is None:
                if len(m) >= self.max_chunks:
                    self._make_room()
                m[k] = bit
            else:
                m[k] = old | bit

    def _make_room(self) -> None:
        m = self._map
        oldest = list(itertools.islice(m, max(1, self.max_chunks // 64)))
        for k in oldest:
            del m[k]
        self.evicted += len(oldest)

    def remove(self, server: int, hashes: Iterable[bytes]) -> None:
        """Record that ``server`` no longer holds the chunks ``hashes``."""
        keep = ~(1 << server)
        m = self._map
        for h in hashes:
            k = _key(h)
            old = m.get(k)
            if old is not None:
                new = old & keep
                if new:
                    m[k] = new
                else:
                    del m[k]

    def forget_server(self, server: int) -> int:
        """Clear ``server`` from every entry (a resync); returns the entries it was in."""
        bit = 1 << server
        keep = ~bit
        m = self._map
        hit = [k for k, v in m.items() if v & bit]
        for k in hit:
            new = m[k] & keep
            if new:
                m[k] = new
            else:
                del m[k]
        return len(hit)

    def prefix_chunks(self, hashes: Sequence[bytes], servers: int) -> dict[int, int]:
        """For each server in the bitmask ``servers``, how many leading chunks of
        ``hashes`` it holds (servers holding none are left out)."""
        out: dict[int, int] = {}
        live = servers
        m = self._map
        for i, h in enumerate(hashes):
            now = live & m.get(_key(h), 0)
            gone = live & ~now
            while gone:
                low = gone & -gone
                if i:
                    out[low.bit_length() - 1] = i
                gone ^= low
            live = now
            if not live:
                return out
        while live:
            low = live & -live
            out[low.bit_length() - 1] = len(hashes)
            live ^= low
        return out


@dataclass(frozen=True, slots=True)
class Route:
    """Where :meth:`Fleet.best` sends a prompt.

    Attributes:
        server: the server's number (its position in ``Fleet.clients``).
        client: its client.
        cached_tokens: tokens of the prompt's prefix the index (or a lookup) says it holds.
        load: its load when chosen.
        source: ``"index"`` or ``"lookup"`` (a fan-out answered).
    """

    server: int
    client: AsyncClient
    cached_tokens: int
    load: int
    source: str


@dataclass(frozen=True, slots=True)
class Routed(Generic[T]):
    """A routed call's result: the route taken and the call's own result."""

    route: Route
    value: T


class Fleet:
    """One :class:`~lmcache_async.AsyncClient` per server, routed by cached prefix.

    Args:
        servers: ``(url, http_url)`` pairs, one per server (at most 62).
        model_name: the model (as for ``AsyncClient``).
        max_chunks: the index's bound in chunk entries.
        events: follow each server's KV events (default True).
        fanout: :meth:`best`'s default: ``"auto"`` (lookup fan-out on an index miss of
            the first chunk, or when a salt is given), ``"always"`` or ``"never"``.
        **options: passed to every ``AsyncClient``.

    Use ``async with Fleet(...) as fleet``; :meth:`aclose` closes streams and clients.
    """

    def __init__(
        self,
        servers: Sequence[tuple[str, str]],
        model_name: str,
        *,
        max_chunks: int = 1_000_000,
        events: bool = True,
        fanout: str = "auto",
        **options: Unpack[ClientOptions],
    ) -> None:
        servers = list(servers)
        if not 1 <= len(servers) <= MAX_SERVERS:
            raise ValueError(f"a fleet holds 1..{MAX_SERVERS} servers, got {len(servers)}")
        if fanout not in ("auto", "always", "never"):
            raise ValueError(f"fanout must be 'auto', 'always' or 'never', got {fanout!r}")
        self.index = PrefixIndex(max_chunks)
        self.clients = [AsyncClient(url, http, model_name, **options) for url, http in servers]
        self.model_name = model_name
        self._events = events
        self._fanout = fanout
        self._routed = [0] * len(self.clients)
        self._followers: list[asyncio.Task[None]] = []
        #: Resyncs applied per server (events lost, or the server restarted).
        self.resyncs = [0] * len(self.clients)
        #: Events applied per server.
        self.events_applied = [0] * len(self.clients)
        self._cs = 0

    async def __aenter__(self) -> Fleet:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Open every client (concurrently) and start following their events.

        Every server must be up: a fleet does not start with one of them down (route
        around a server that goes down later, which :meth:`best` does).

        Raises:
            LMCacheConnectionError: a server cannot be reached (or did not answer in
                time); the message names it (``fleet server 1 (tcp://..., http://...)``)
                and the client's error is its ``__cause__``.
            ValueError: the servers' chunk sizes differ.
            LMCacheError: what else ``AsyncClient.open`` raises, with a note naming the
                server.

        On any failure or cancellation, the opens still running are stopped and every
        client is closed (and unregistered) before this returns.
        """
        opens = [
            asyncio.create_task(c.open(), name=f"lmcache-fleet-open {i}") for i, c in enumerate(self.clients)
        ]
        try:
            await asyncio.wait(opens, return_when=asyncio.FIRST_EXCEPTION)
            for i, task in enumerate(opens):
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise self._open_error(i, task.exception())
            sizes = {c.chunk_size for c in self.clients}
            if len(sizes) != 1:
                raise ValueError(f"the servers of a fleet need one chunk size, got {sorted(sizes)}")
            self._cs = sizes.pop()
            for c in self.clients:
                check_hash_algorithm(c.hash_algorithm, c.http_url)
        except BaseException:
            # aclose() of a client still opening stops its open and waits for it.
            await self.aclose()
            await asyncio.wait(opens)
            for task in opens:  # retrieved: none is left "never retrieved"
                if not task.cancelled():
                    task.exception()
            raise
        if self._events:
            self._followers = [
                asyncio.create_task(self._follow(i), name=f"lmcache-fleet-events {i}")
                for i in range(len(self.clients))
            ]

    def _open_error(self, server: int, exc: BaseException | None) -> BaseException:
        """The error :meth:`open` raises for ``server``'s failed open, naming it."""
        assert exc is not None
        c = self.clients[server]
        where = f"fleet server {server} ({c.url}, {c.http_url})"
        if isinstance(exc, LMCacheConnectionError | LMCacheTimeoutError):
            err = LMCacheConnectionError(
                f"{where} cannot be opened, and a Fleet opens only with every server up: {exc}"
            )
            err.__cause__ = exc
            return err
        exc.add_note(f"while opening {where}")
        return exc

    async def aclose(self) -> None:
        """Stop following events and close every client."""
        await cancel_and_wait(self._followers, "fleet event follower")
        self._followers = []
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)

    # ------------------------------------------------------------------ events

    async def _follow(self, server: int) -> None:
        """Apply one server's KV events to the index, for as long as the fleet is open;
        a stream that fails (the server away too long) is started again, fresh (the
        server's entries are forgotten first: what happened meanwhile is unknown)."""
        client = self.clients[server]
        index = self.index
        while True:
            try:
                async with contextlib.aclosing(client.kv_events(reconnect_timeout=None)) as stream:
                    async for ev in stream:
                        if isinstance(ev, StoredEvent):
                            index.add(server, (ev.block_hash,))
                        elif isinstance(ev, RemovedEvent):
                            index.remove(server, ev.block_hashes)
                        elif isinstance(ev, Resync):
                            self.resyncs[server] += 1
                            index.forget_server(server)
                        self.events_applied[server] += 1
            except ClientClosedError:
                return
            except LMCacheError as exc:
                log.warning("fleet: events of %s stopped (%s); following again", client.url, exc)
                self.resyncs[server] += 1
                index.forget_server(server)
                await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ routing

    def load(self, server: int) -> int:
        """Requests the fleet routed to ``server`` still in flight, plus the client's
        own operations in flight (not counting background cleanup replies)."""
        return self._routed[server] + self.clients[server].in_flight

    def _up(self) -> int:
        mask = 0
        for i, c in enumerate(self.clients):
            if c.usable:
                mask |= 1 << i
        return mask

    async def best(self, tokens: Sequence[int], cache_salt: str = "", *, fanout: str | None = None) -> Route:
        """The server holding the longest cached prefix of ``tokens`` (ties: the least
        loaded, then a rank computed from the prompt); with nothing cached anywhere, the
        least loaded, then that rank. The rank (a rendezvous hash of the prompt's first
        chunk hash, or of a shorter prompt's tokens, and the server number) spreads
        prompts nobody holds evenly over the servers, the same prompt always to the
        same server while the servers up are the same.

        ``fanout`` (default: the fleet's): ``"always"`` asks every server that is up
        (``lookup``, concurrently) and records the answers; ``"auto"`` does so only when
        the index has none of the first chunk or a ``cache_salt`` is given; ``"never"``
        answers from the index alone (no I/O).

        Raises:
            LMCacheConnectionError: no server is up.
            ValueError/TypeError: bad tokens or salt (nothing sent).

        Cancellation: the fan-out lookups are cancelled (each cleans up on its server).
        """
        toks = validate_tokens(tokens)
        validate_cache_salt(cache_salt)
        mode = self._fanout if fanout is None else fanout
        if mode not in ("auto", "always", "never"):
            raise ValueError(f"fanout must be 'auto', 'always' or 'never', got {mode!r}")
        up = self._up()
        if not up:
            raise LMCacheConnectionError("fleet: no server is up")
        hashes = chunk_hashes(toks, self._cs)
        depth = self.index.prefix_chunks(hashes, up)
        source = "index"
        if mode == "always" or (mode == "auto" and (cache_salt or (hashes and not depth))):
            source = "lookup"
            depth = await self._fan_out(toks, hashes, cache_salt, up)
        servers = [i for i in range(len(self.clients)) if up >> i & 1]
        spread = _prompt_key(hashes, toks)
        chosen = min(servers, key=lambda i: (-depth.get(i, 0), self.load(i), _rank(spread, i)))
        return Route(chosen, self.clients[chosen], depth.get(chosen, 0) * self._cs, self.load(chosen), source)

    async def _fan_out(
        self, toks: list[int], hashes: list[bytes], cache_salt: str, up: int
    ) -> dict[int, int]:
        servers = [i for i in range(len(self.clients)) if up >> i & 1]
        answers = await asyncio.gather(
            *(self.clients[i].lookup(toks, cache_salt) for i in servers), return_exceptions=True
        )
        depth: dict[int, int] = {}
        for i, got in zip(servers, answers, strict=True):
            if isinstance(got, BaseException):
                if isinstance(got, asyncio.CancelledError):
                    raise got
                log.debug("fleet: lookup on %s failed: %s", self.clients[i].url, got)
                continue
            n = got // self._cs
            if n:
                depth[i] = n
                if not cache_salt:  # the index is salt-blind: record unsalted answers only
                    self.index.add(i, hashes[:n])
        return depth

    @contextlib.asynccontextmanager
    async def _routed_to(self, server: int) -> Any:
        self._routed[server] += 1
        try:
            yield
        finally:
            self._routed[server] -= 1

    async def lookup(self, tokens: Sequence[int], cache_salt: str = "", **kw: Any) -> Routed[int]:
        """``lookup`` on the best server (:meth:`best`); ``kw`` go to ``AsyncClient.lookup``."""
        route = await self.best(tokens, cache_salt)
        async with self._routed_to(route.server):
            return Routed(route, await route.client.lookup(tokens, cache_salt, **kw))

    async def retrieve(
        self, tokens: Sequence[int], cache_salt: str = "", **kw: Any
    ) -> Routed[torch.Tensor | None]:
        """``retrieve`` from the best server (:meth:`best`); ``kw`` go to
        ``AsyncClient.retrieve``. Cancellation/timeout: as there."""
        route = await self.best(tokens, cache_salt)
        async with self._routed_to(route.server):
            return Routed(route, await route.client.retrieve(tokens, cache_salt, **kw))

    async def store(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        server: int | None = None,
        **kw: Any,
    ) -> Routed[bool]:
        """Store on ``server`` (default: the best server for ``tokens``: the one
        already holding most of the prefix, else the least loaded, ties spread by the
        prompt as in :meth:`best`) and record the stored chunks in the index (the
        server publishes no event for it).

        Raises:
            TypeError: ``server`` is not an int (a bool is refused too).
            ValueError: ``server`` is not a server's number. Both before anything is sent.
        """
        if server is None:
            route = await self.best(tokens, cache_salt, fanout="never")
        else:
            if isinstance(server, bool) or not isinstance(server, int):
                raise TypeError(f"server must be an int or None, got {type(server).__name__}")
            if not 0 <= server < len(self.clients):
                raise ValueError(f"server must be in 0..{len(self.clients) - 1}, got {server!r}")
            route = Route(server, self.clients[server], 0, self.load(server), "given")
        async with self._routed_to(route.server):
            stored = await route.client.store(kv, tokens, cache_salt, **kw)
        if not cache_salt:
            self.index.add(route.server, chunk_hashes(validate_tokens(tokens), self._cs))
        return Routed(route, stored)

    async def remap_many(self, pairs: Iterable[Any], **kw: Any) -> list[Routed[Any]]:
        """``remap_many`` with each pair sent to the best server for its source tokens:
        one ``remap_many`` per server chosen, concurrently; ``kw`` go to each.

        Returns:
            One ``Routed`` per server used, its value that server's ``BatchResult``
            (items in the order they were given, among those sent there), in server order.
        """
        groups: dict[int, tuple[Route, list[Any]]] = {}
        for pair in pairs:
            source = pair.source_tokens if hasattr(pair, "source_tokens") else pair[0]
            salt = pair.cache_salt if hasattr(pair, "cache_salt") else (pair[2] if len(pair) > 2 else "")
            route = await self.best(source, salt)
            groups.setdefault(route.server, (route, []))[1].append(pair)

        async def run(route: Route, items: list[Any]) -> Routed[Any]:
            async with self._routed_to(route.server):
                return Routed(route, await route.client.remap_many(items, **kw))

        return list(await asyncio.gather(*(run(r, items) for _, (r, items) in sorted(groups.items()))))

    async def wait_applied(self, server: int, count: int, timeout: float) -> None:
        """Wait until ``count`` events of ``server`` were applied (for tests and demos).

        Raises:
            TimeoutError: not within ``timeout`` seconds.
        """
        end = time.monotonic() + timeout
        while self.events_applied[server] < count:
            if time.monotonic() > end:
                raise TimeoutError(
                    f"fleet: {self.events_applied[server]} events of server {server} applied, not {count}"
                )
            await asyncio.sleep(0.01)
