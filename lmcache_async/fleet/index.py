"""The fleet's index interface: which server holds which chunk, shared or not.

A :class:`FleetIndex` maps chunk hashes (:func:`lmcache_async.hashing.chunk_hashes`) to
the servers holding them. Servers are named by a stable string id that every router
process agrees on: the server's ZMQ URL. Every method is a coroutine (a shared index
does I/O); none raises because the index is unavailable: a write is then dropped, and
:meth:`FleetIndex.prefix` answers ``None`` so that the caller asks the servers instead.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from typing import Literal

__all__ = ["FleetIndex", "IndexOp"]

#: One change to the index: ``("add", server, hashes)`` (confirmed by an event),
#: ``("speculate", server, hashes)`` (the fleet's own store or a lookup's answer: a short
#: life until an event confirms it), ``("remove", server, hashes)`` or
#: ``("forget", server, ())`` (the server's entries are no longer known: a resync).
IndexOp = tuple[Literal["add", "speculate", "remove", "forget"], str, Sequence[bytes]]


class FleetIndex(abc.ABC):
    """Which server holds which chunk; the backends are :class:`~lmcache_async.fleet.MemoryIndex`
    (one process) and :class:`~lmcache_async.fleet.RedisIndex` (shared by routers)."""

    @abc.abstractmethod
    async def apply(self, ops: Sequence[IndexOp]) -> None:
        """Apply ``ops`` in order (a shared index writes them in one round trip).

        Never raises for an unavailable index (the ops are then dropped).
        """

    async def add(self, server: str, hashes: Sequence[bytes], *, confirmed: bool = True) -> None:
        """Record that ``server`` holds ``hashes``: confirmed (an event said so, the long
        life) or not (the short, speculative life)."""
        await self.apply([("add" if confirmed else "speculate", server, hashes)])

    async def remove(self, server: str, hashes: Sequence[bytes]) -> None:
        """Record that ``server`` no longer holds ``hashes``."""
        await self.apply([("remove", server, hashes)])

    async def forget(self, server: str) -> None:
        """Forget every entry of ``server`` (its events were lost, or it restarted)."""
        await self.apply([("forget", server, ())])

    @abc.abstractmethod
    async def prefix(self, hashes: Sequence[bytes], servers: Collection[str]) -> dict[str, int] | None:
        """For each of ``servers`` holding at least the first chunk, how many leading
        chunks of ``hashes`` it holds (servers holding none are left out); ``None`` when
        the index cannot answer now (the caller then asks the servers)."""

    async def release(self, server: str) -> None:  # noqa: B027 (optional: a no-op by default)
        """``server`` left this fleet: free what the index keeps for it in this process
        (a shared index keeps its entries: other routers may still use them)."""

    async def aclose(self) -> None:  # noqa: B027 (optional: a no-op by default)
        """Release the index's resources (connections)."""
