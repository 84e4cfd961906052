"""The fleet's router: :class:`Fleet`, one client per server, routed by cached prefix
(the index's entries, a lookup fan-out, load, then a rendezvous hash of the prompt).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import time
from collections import Counter
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
from lmcache_async.fleet.index import FleetIndex, IndexOp
from lmcache_async.fleet.memory import MemoryIndex
from lmcache_async.hashing import check_hash_algorithm, chunk_hashes

__all__ = ["Fleet", "Route", "Routed"]

log = logging.getLogger(__name__)

T = TypeVar("T")


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


def _seed(url: str) -> int:
    """A server's 64-bit rendezvous seed: a hash of its URL (every router agrees)."""
    return int.from_bytes(blake3.blake3(url.encode()).digest()[:8], "big")


def _rank(key: int, seed: int) -> int:
    """Rendezvous rank of the server of ``seed`` for a prompt ``key`` (the lowest wins a
    tie): a splitmix64 of both, so each server wins about an equal share of the prompts
    and a server that goes down moves only its own share."""
    z = (key ^ (seed * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True, slots=True)
class Route:
    """Where :meth:`Fleet.best` sends a prompt.

    Attributes:
        server: the server's id, its ZMQ URL.
        client: its client.
        cached_tokens: tokens of the prompt's prefix the index (or a lookup) says it holds.
        load: its load when chosen.
        source: ``"index"`` or ``"lookup"`` (a fan-out answered).
    """

    server: str
    client: AsyncClient
    cached_tokens: int
    load: int
    source: str


@dataclass(frozen=True, slots=True)
class Routed(Generic[T]):
    """A routed call's result: the route taken and the call's own result."""

    route: Route
    value: T


#: Events the fleet queues for its index before a server's stream waits (back-pressure).
_QUEUE = 65_536
#: Events applied to the index in one batch (one pipeline on a shared index).
_BATCH = 4096

_Item = tuple[str, IndexOp, bool]


class Fleet:
    """One :class:`~lmcache_async.AsyncClient` per server, routed by cached prefix.

    Args:
        servers: ``(url, http_url)`` pairs, one per server (any number, each URL once;
            the URL is the server's id, in this process and in a shared index).
        model_name: the model (as for ``AsyncClient``).
        index: where the fleet keeps which server holds which chunk: a
            :class:`~lmcache_async.fleet.RedisIndex` to share it with other routers
            (the caller closes it), default a :class:`~lmcache_async.fleet.MemoryIndex`
            of ``max_chunks`` entries.
        max_chunks: the default index's bound in chunk entries.
        events: follow each server's KV events (default True).
        fanout: :meth:`best`'s default: ``"auto"`` (lookup fan-out on an index miss of
            the first chunk, when a salt is given, or when the index cannot answer),
            ``"always"`` or ``"never"``.
        **options: passed to every ``AsyncClient``.

    Raises:
        ValueError: no server, a URL given twice, or a bad ``fanout``.

    Use ``async with Fleet(...) as fleet``; :meth:`aclose` closes streams and clients.
    """

    def __init__(
        self,
        servers: Sequence[tuple[str, str]],
        model_name: str,
        *,
        index: FleetIndex | None = None,
        max_chunks: int = 1_000_000,
        events: bool = True,
        fanout: str = "auto",
        **options: Unpack[ClientOptions],
    ) -> None:
        servers = list(servers)
        if not servers:
            raise ValueError("a fleet needs at least one server")
        dup = [u for u, n in Counter(u for u, _ in servers).items() if n > 1]
        if dup:
            raise ValueError(f"a fleet names each server once: {dup[0]!r} is given twice")
        if fanout not in ("auto", "always", "never"):
            raise ValueError(f"fanout must be 'auto', 'always' or 'never', got {fanout!r}")
        if index is not None and not isinstance(index, FleetIndex):
            raise TypeError(f"index must be a FleetIndex or None, got {type(index).__name__}")
        self.index: FleetIndex = index if index is not None else MemoryIndex(max_chunks)
        self._own_index = index is None
        self._options = options
        self._clients = {url: AsyncClient(url, http, model_name, **options) for url, http in servers}
        self._seeds = {url: _seed(url) for url in self._clients}
        self.model_name = model_name
        self._events = events
        self._fanout = fanout
        self._routed = dict.fromkeys(self._clients, 0)
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._applier: asyncio.Task[None] | None = None
        self._queue: asyncio.Queue[_Item] | None = None
        #: Resyncs applied to the index per server URL (events lost, the server
        #: restarted, or its stream failed).
        self.resyncs = dict.fromkeys(self._clients, 0)
        #: Events applied per server URL.
        self.events_applied = dict.fromkeys(self._clients, 0)
        self._cs = 0

    @property
    def clients(self) -> list[AsyncClient]:
        """The servers' clients, in the order the servers were given (then added)."""
        return list(self._clients.values())

    @property
    def servers(self) -> list[str]:
        """The servers' URLs (their ids), in the same order."""
        return list(self._clients)

    def client(self, server: str) -> AsyncClient:
        """The client of ``server`` (its URL). Raises ValueError: not in this fleet."""
        try:
            return self._clients[server]
        except KeyError:
            raise ValueError(f"server {server!r} is not in this fleet") from None

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
        clients = self.clients
        opens = [asyncio.create_task(c.open(), name=f"lmcache-fleet-open {i}") for i, c in enumerate(clients)]
        try:
            await asyncio.wait(opens, return_when=asyncio.FIRST_EXCEPTION)
            for i, task in enumerate(opens):
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise self._open_error(f"fleet server {i}", clients[i], task.exception())
            sizes = {c.chunk_size for c in clients}
            if len(sizes) != 1:
                raise ValueError(f"the servers of a fleet need one chunk size, got {sorted(sizes)}")
            self._cs = sizes.pop()
            for c in clients:
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
            self._queue = asyncio.Queue(_QUEUE)
            self._applier = asyncio.create_task(self._apply_events(), name="lmcache-fleet-index")
            for url in self._clients:
                self._start_following(url)

    def _open_error(self, where: str, c: AsyncClient, exc: BaseException | None) -> BaseException:
        """The error raised for a failed open of ``c``, naming it."""
        assert exc is not None
        where = f"{where} ({c.url}, {c.http_url})"
        if isinstance(exc, LMCacheConnectionError | LMCacheTimeoutError):
            err = LMCacheConnectionError(
                f"{where} cannot be opened, and a Fleet opens only with every server up: {exc}"
            )
            err.__cause__ = exc
            return err
        exc.add_note(f"while opening {where}")
        return exc

    async def add_server(self, url: str, http_url: str) -> None:
        """Add a server while the fleet runs: open its client, check it, follow its events.

        Raises:
            ValueError: ``url`` is already in the fleet, or its chunk size differs from
                the fleet's.
            RuntimeError: the fleet is not open.
            LMCacheConnectionError / LMCacheError: as :meth:`open`, naming the server.

        On failure or cancellation the new client is closed and the fleet is unchanged.
        """
        if url in self._clients:
            raise ValueError(f"server {url!r} is already in this fleet")
        if not self._cs:
            raise RuntimeError("add_server needs an open fleet (open() first)")
        c = AsyncClient(url, http_url, self.model_name, **self._options)
        try:
            try:
                await c.open()
            except LMCacheError as exc:
                raise self._open_error("fleet server", c, exc) from None
            if c.chunk_size != self._cs:
                raise ValueError(
                    f"the servers of a fleet need one chunk size, got {sorted({self._cs, c.chunk_size})}"
                )
            check_hash_algorithm(c.hash_algorithm, c.http_url)
        except BaseException:
            await c.aclose()
            raise
        self._clients[url] = c
        self._seeds[url] = _seed(url)
        self._routed[url] = 0
        self.resyncs[url] = 0
        self.events_applied[url] = 0
        if self._queue is not None:
            self._start_following(url)

    async def remove_server(self, url: str) -> None:
        """Remove a server while the fleet runs: stop following it, close its client
        (its calls in flight fail with ``ClientClosedError``) and release it in the index.

        Raises:
            ValueError: ``url`` is not in the fleet, or it is the last server.
        """
        self.client(url)
        if len(self._clients) == 1:
            raise ValueError("a fleet keeps at least one server")
        c = self._clients.pop(url)
        for d in (self._seeds, self._routed, self.resyncs, self.events_applied):
            d.pop(url, None)
        follower = self._followers.pop(url, None)
        if follower is not None:
            await cancel_and_wait([follower], "fleet event follower")
        await c.aclose()
        await self.index.release(url)

    async def aclose(self) -> None:
        """Stop following events, close every client, and close the index it made."""
        await cancel_and_wait(list(self._followers.values()), "fleet event follower")
        self._followers = {}
        if self._applier is not None:
            await cancel_and_wait([self._applier], "fleet index writer")
            self._applier = None
        await asyncio.gather(*(c.aclose() for c in self._clients.values()), return_exceptions=True)
        if self._own_index:
            await self.index.aclose()

    # ------------------------------------------------------------------ events

    def _start_following(self, url: str) -> None:
        self._followers[url] = asyncio.create_task(self._follow(url), name=f"lmcache-fleet-events {url}")

    async def _follow(self, url: str) -> None:
        """Queue one server's KV events for the index, for as long as it is in the fleet;
        a stream that fails (the server away too long) is started again, fresh (the
        server's entries are forgotten first: what happened meanwhile is unknown)."""
        client = self._clients[url]
        queue = self._queue
        assert queue is not None
        while True:
            try:
                async with contextlib.aclosing(client.kv_events(reconnect_timeout=None)) as stream:
                    async for ev in stream:
                        if isinstance(ev, StoredEvent):
                            await queue.put((url, ("add", url, (ev.block_hash,)), True))
                        elif isinstance(ev, RemovedEvent):
                            await queue.put((url, ("remove", url, ev.block_hashes), True))
                        elif isinstance(ev, Resync):
                            await queue.put((url, ("forget", url, ()), True))
                        else:
                            await queue.put((url, ("remove", url, ()), True))
            except ClientClosedError:
                return
            except LMCacheError as exc:
                log.warning("fleet: events of %s stopped (%s); following again", url, exc)
                await queue.put((url, ("forget", url, ()), False))
                await asyncio.sleep(1.0)

    async def _apply_events(self) -> None:
        """Write the queued events into the index, as many as are queued in one batch
        (consecutive adds or removes of one server merged)."""
        queue = self._queue
        assert queue is not None
        while True:
            batch = [await queue.get()]
            while len(batch) < _BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            ops: list[tuple[Any, str, list[bytes]]] = []
            counted: Counter[str] = Counter()
            forgot: Counter[str] = Counter()
            for url, (kind, server, hashes), counts in batch:
                if url not in self._clients:  # removed meanwhile
                    continue
                if counts:
                    counted[url] += 1
                if kind == "forget":
                    forgot[url] += 1
                if ops and kind in ("add", "remove") and ops[-1][0] == kind and ops[-1][1] == server:
                    ops[-1][2].extend(hashes)
                elif hashes or kind == "forget":
                    ops.append((kind, server, list(hashes)))
            try:
                await self.index.apply(ops)
            except Exception:
                log.exception("fleet: the index failed to apply %d changes", len(ops))
            for url, n in forgot.items():
                if url in self.resyncs:
                    self.resyncs[url] += n
            for url, n in counted.items():
                if url in self.events_applied:
                    self.events_applied[url] += n

    # ------------------------------------------------------------------ routing

    def load(self, server: str) -> int:
        """Requests the fleet routed to ``server`` (its URL) still in flight, plus the
        client's own operations in flight (not counting background cleanup replies)."""
        return self._routed[server] + self._clients[server].in_flight

    def _up(self) -> list[str]:
        return [u for u, c in self._clients.items() if c.usable]

    async def score(
        self, tokens: Sequence[int], cache_salt: str = "", *, fanout: str | None = None
    ) -> tuple[dict[str, int], str]:
        """Each server's cached prefix of ``tokens``, in tokens (servers holding none left
        out), and where it came from: ``"index"`` or ``"lookup"`` (the shape a routing
        service answers; :meth:`best` picks from it). ``fanout`` as in :meth:`best`.

        Raises:
            LMCacheConnectionError: no server is up.
            ValueError/TypeError: bad tokens, salt or ``fanout`` (nothing sent).
        """
        *_, depth, source, _up = await self._depths(tokens, cache_salt, fanout)
        return {u: n * self._cs for u, n in depth.items()}, source

    async def _depths(
        self, tokens: Sequence[int], cache_salt: str, fanout: str | None
    ) -> tuple[list[int], list[bytes], dict[str, int], str, list[str]]:
        toks = validate_tokens(tokens)
        validate_cache_salt(cache_salt)
        mode = self._fanout if fanout is None else fanout
        if mode not in ("auto", "always", "never"):
            raise ValueError(f"fanout must be 'auto', 'always' or 'never', got {mode!r}")
        up = self._up()
        if not up:
            raise LMCacheConnectionError("fleet: no server is up")
        hashes = chunk_hashes(toks, self._cs)
        known = await self.index.prefix(hashes, up) if hashes else {}
        depth = known or {}
        source = "index"
        if mode == "always" or (mode == "auto" and (cache_salt or known is None or (hashes and not depth))):
            source = "lookup"
            depth = await self._fan_out(toks, hashes, cache_salt, up)
        return toks, hashes, depth, source, up

    async def best(self, tokens: Sequence[int], cache_salt: str = "", *, fanout: str | None = None) -> Route:
        """The server holding the longest cached prefix of ``tokens`` (ties: the least
        loaded, then a rank computed from the prompt); with nothing cached anywhere, the
        least loaded, then that rank. The rank (a rendezvous hash of the prompt's first
        chunk hash, or of a shorter prompt's tokens, and the server's URL) spreads
        prompts nobody holds evenly over the servers, the same prompt always to the
        same server while the servers up are the same, in every router process.

        ``fanout`` (default: the fleet's): ``"always"`` asks every server that is up
        (``lookup``, concurrently) and records the answers (speculative entries);
        ``"auto"`` does so only when the index has none of the first chunk, a
        ``cache_salt`` is given, or the index cannot answer (a shared index down);
        ``"never"`` answers from the index alone (nothing cached if it cannot answer).

        Raises:
            LMCacheConnectionError: no server is up.
            ValueError/TypeError: bad tokens or salt (nothing sent).

        Cancellation: the fan-out lookups are cancelled (each cleans up on its server).
        """
        toks, hashes, depth, source, up = await self._depths(tokens, cache_salt, fanout)
        return self._choose(toks, hashes, depth, source, up)

    async def score_and_best(
        self, tokens: Sequence[int], cache_salt: str = "", *, fanout: str | None = None
    ) -> tuple[dict[str, int], Route]:
        """:meth:`score` and :meth:`best` from one read of the index (or one fan-out):
        each server that is up with its cached prefix of ``tokens`` in tokens (0 for one
        holding none), and the route :meth:`best` takes from them (its ``source`` says
        where the prefixes came from). Raises and cancellation: as :meth:`best`."""
        toks, hashes, depth, source, up = await self._depths(tokens, cache_salt, fanout)
        return {u: depth.get(u, 0) * self._cs for u in up}, self._choose(toks, hashes, depth, source, up)

    def _choose(
        self, toks: list[int], hashes: list[bytes], depth: dict[str, int], source: str, up: list[str]
    ) -> Route:
        spread = _prompt_key(hashes, toks)
        seeds = self._seeds
        top = max(depth.values(), default=0)
        tied = [u for u in up if depth.get(u, 0) == top] if top else up
        chosen = min(tied, key=lambda u: (self.load(u), _rank(spread, seeds[u])))
        return Route(
            chosen, self._clients[chosen], depth.get(chosen, 0) * self._cs, self.load(chosen), source
        )

    async def _fan_out(
        self, toks: list[int], hashes: list[bytes], cache_salt: str, up: list[str]
    ) -> dict[str, int]:
        answers = await asyncio.gather(
            *(self._clients[u].lookup(toks, cache_salt) for u in up), return_exceptions=True
        )
        depth: dict[str, int] = {}
        ops: list[IndexOp] = []
        for u, got in zip(up, answers, strict=True):
            if isinstance(got, BaseException):
                if isinstance(got, asyncio.CancelledError):
                    raise got
                log.debug("fleet: lookup on %s failed: %s", u, got)
                continue
            n = got // self._cs
            if n:
                depth[u] = n
                if not cache_salt:  # the index is salt-blind: record unsalted answers only
                    ops.append(("speculate", u, hashes[:n]))
        if ops:
            await self.index.apply(ops)
        return depth

    @contextlib.asynccontextmanager
    async def _routed_to(self, server: str) -> Any:
        self._routed[server] += 1
        try:
            yield
        finally:
            if server in self._routed:
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
        server: str | None = None,
        **kw: Any,
    ) -> Routed[bool]:
        """Store on ``server`` (its URL; default: the best server for ``tokens``: the one
        already holding most of the prefix, else the least loaded, ties spread by the
        prompt as in :meth:`best`) and record the stored chunks in the index as
        speculative entries (the server publishes no event for it).

        Raises:
            TypeError: ``server`` is not a str.
            ValueError: ``server`` is not in this fleet. Both before anything is sent.
        """
        if server is None:
            route = await self.best(tokens, cache_salt, fanout="never")
        else:
            if not isinstance(server, str):
                raise TypeError(f"server must be a server's URL (str) or None, got {type(server).__name__}")
            route = Route(server, self.client(server), 0, self.load(server), "given")
        async with self._routed_to(route.server):
            stored = await route.client.store(kv, tokens, cache_salt, **kw)
        if not cache_salt:
            await self.index.add(
                route.server, chunk_hashes(validate_tokens(tokens), self._cs), confirmed=False
            )
        return Routed(route, stored)

    async def remap_many(self, pairs: Iterable[Any], **kw: Any) -> list[Routed[Any]]:
        """``remap_many`` with each pair sent to the best server for its source tokens:
        one ``remap_many`` per server chosen, concurrently; ``kw`` go to each.

        Returns:
            One ``Routed`` per server used, its value that server's ``BatchResult``
            (items in the order they were given, among those sent there), in the
            fleet's server order.
        """
        groups: dict[str, tuple[Route, list[Any]]] = {}
        for pair in pairs:
            source = pair.source_tokens if hasattr(pair, "source_tokens") else pair[0]
            salt = pair.cache_salt if hasattr(pair, "cache_salt") else (pair[2] if len(pair) > 2 else "")
            route = await self.best(source, salt)
            groups.setdefault(route.server, (route, []))[1].append(pair)

        async def run(route: Route, items: list[Any]) -> Routed[Any]:
            async with self._routed_to(route.server):
                return Routed(route, await route.client.remap_many(items, **kw))

        order = {u: i for i, u in enumerate(self._clients)}
        used = sorted(groups.values(), key=lambda g: order.get(g[0].server, len(order)))
        return list(await asyncio.gather(*(run(r, items) for r, items in used)))

    async def wait_applied(self, server: str, count: int, timeout: float) -> None:
        """Wait until ``count`` events of ``server`` (its URL) were applied to the index
        (for tests and demos).

        Raises:
            TimeoutError: not within ``timeout`` seconds.
        """
        end = time.monotonic() + timeout
        while self.events_applied.get(server, 0) < count:
            if time.monotonic() > end:
                raise TimeoutError(
                    f"fleet: {self.events_applied.get(server, 0)} events of {server} applied, not {count}"
                )
            await asyncio.sleep(0.01)
