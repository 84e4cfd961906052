"""The in-process fleet index: :class:`PrefixIndex` (sans-IO, servers as bit numbers)
and :class:`MemoryIndex`, the :class:`~lmcache_async.fleet.FleetIndex` over it (servers
by URL, each given a bit that is reused once the server leaves).

Each entry is a 64-bit key (the first 8 bytes of the chunk hash; two different chunks
share one with a probability of about n²/2⁶⁵) and an int bitmask of servers (a Python
int: no ceiling on the number of servers).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Sequence

from lmcache_async.fleet.index import FleetIndex, IndexOp

__all__ = ["MemoryIndex", "PrefixIndex"]


def _key(h: bytes) -> int:
    return int.from_bytes(h[:8], "big")


class PrefixIndex:
    """Which server holds which chunk (sans-IO; no clocks, no sockets).

    Keys are chunk hashes (:func:`lmcache_async.hashing.chunk_hashes`), kept as their
    first 8 bytes; values a bitmask of server numbers (any int >= 0). At most
    ``max_chunks`` entries: inserting into a full index first drops the oldest-inserted
    entries, a 64th of ``max_chunks`` (at least one) at a time (``evicted`` counts them).
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


class MemoryIndex(FleetIndex):
    """A :class:`PrefixIndex` behind the :class:`~lmcache_async.fleet.FleetIndex`
    interface, for one router process (nothing shared, nothing expires: ``"speculate"``
    is kept as ``"add"``).

    Each server URL gets the lowest free bit on its first write; :meth:`release` clears
    the server from every entry, then frees its bit for the next server.

    Args:
        max_chunks: the bound in chunk entries (see :class:`PrefixIndex`).
    """

    def __init__(self, max_chunks: int = 1_000_000) -> None:
        self.index = PrefixIndex(max_chunks)
        self._bits: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.index)

    def bit(self, server: str) -> int:
        """The bit of ``server`` (given on first use: the lowest freed one, else a new one)."""
        b = self._bits.get(server)
        if b is None:
            if self._free:
                self._free.sort()
                b = self._free.pop(0)
            else:
                b = len(self._bits)
            self._bits[server] = b
            self._names[b] = server
        return b

    async def apply(self, ops: Sequence[IndexOp]) -> None:
        """Apply ``ops`` in order (no I/O)."""
        idx = self.index
        for kind, server, hashes in ops:
            if kind in ("add", "speculate"):
                idx.add(self.bit(server), hashes)
            elif kind == "remove":
                if server in self._bits:
                    idx.remove(self._bits[server], hashes)
            elif server in self._bits:  # forget
                idx.forget_server(self._bits[server])

    def mask(self, servers: Collection[str]) -> int:
        """The bitmask of ``servers`` (those never written are left out)."""
        bits = self._bits
        mask = 0
        for s in servers:
            b = bits.get(s)
            if b is not None:
                mask |= 1 << b
        return mask

    async def prefix(self, hashes: Sequence[bytes], servers: Collection[str]) -> dict[str, int]:
        """As :meth:`FleetIndex.prefix`; never ``None``."""
        mask = self.mask(servers)
        if not mask or not hashes:
            return {}
        names = self._names
        return {names[b]: n for b, n in self.index.prefix_chunks(hashes, mask).items()}

    async def release(self, server: str) -> None:
        """Clear ``server`` from every entry and free its bit."""
        b = self._bits.pop(server, None)
        if b is not None:
            del self._names[b]
            self.index.forget_server(b)
            self._free.append(b)
