"""Each operation's RPC sequence, written once, over a small interface: an
:class:`Operations` object runs ``lookup``, ``retrieve``, ``store``, ``remap`` and the
in-pool ``compose`` for one :class:`Registration`, talking to the server only through a
:class:`Channel` (the client's ZMQ connection, or a test's in-process server); no sequence
branches on the server generation (docs/internals/design.md, section "Operations over a
channel").

Cancellation: a sequence runs in a task of its own (:func:`run_detached`); a caller that
times out or is cancelled marks the :class:`OpState` abandoned and the sequence finishes
the server side on its own (prefetch result, read locks, reservations, session), bounded
by ``cleanup_grace``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmcache_async._engine.ops.base import (
    Channel,
    Configs,
    LateEnds,
    PostingChannel,
    Registration,
    RemapResult,
    RetrieveState,
    request_id,
)
from lmcache_async._engine.ops.inline import InlineSequences
from lmcache_async._engine.ops.shm import ShmSequences
from lmcache_async._engine.runner import OpState
from lmcache_async._protocol.wire import Op
from lmcache_async.errors import TransferError

if TYPE_CHECKING:
    from lmcache_async._engine.cuda.copies import Mark

__all__ = ["Channel", "LateEnds", "Operations", "PostingChannel", "Registration", "RemapResult", "request_id"]


class Operations(ShmSequences, InlineSequences):
    """The RPC sequences of every operation, for one :class:`Registration`, over one
    :class:`Channel` (the shared part in :class:`~lmcache_async._engine.ops.base.OperationsBase`,
    the SHM and inline halves in :mod:`.shm` and :mod:`.inline`)."""

    async def lookup(self, op: OpState, toks: list[int], end: int, salt: str, configs: Configs = None) -> int:
        """Tokens of the longest cached prefix of ``toks[:end]`` (``end`` chunk-aligned);
        locks released and session ended before returning."""
        if end == 0:
            return 0
        rid = request_id("lookup", op)
        key = self._key(toks, end, rid, salt, worker=False, configs=configs)
        return await self._lookup_locked(op, key, rid, release=True)

    async def retrieve(
        self,
        op: OpState,
        toks: list[int],
        end: int,
        salt: str,
        configs: Configs = None,
        out: torch.Tensor | None = None,
        *,
        mark: Mark | None = None,
    ) -> torch.Tensor | None:
        """The KV of the longest cached prefix of ``toks[:end]``, or ``None``; copied into
        ``out`` when given (a view of it is returned). ``mark``: the KV goes to a GPU
        (``out``'s, or a new tensor on the mark's device), ordered after the mark."""
        if end == 0:
            return None
        geom = self.reg.geometry
        rid = request_id("retrieve", op)
        key = self._key(toks, end, rid, salt, worker=False, configs=configs)
        hit = 0
        state = RetrieveState()
        try:
            hit = await self._lookup_locked(op, key, rid, release=False)
            if hit == 0:
                return None
            rkey = self._key(toks, hit, rid, salt, worker=True, configs=configs)
            target = out.narrow(geom.token_axis, 0, hit) if out is not None else None
            if self.reg.pool is None:
                return await self._retrieve_pickle(op, rkey, hit, target, state, mark)
            # The server keys pending SHM reads by (instance, key) without the request
            # id: concurrent retrieves of one prefix must not overlap their pairs.
            state.gate = self._gate(("retrieve", salt, tuple(toks[:hit])))
            async with state.gate:
                return await self._retrieve_shm(op, rkey, hit, target, state, mark, rid)
        finally:
            if hit and not state.prepared:
                await self._free_locks(key, hit // self.reg.chunk_size)
            if not state.ended:
                await self.cleanup_later(Op.END_SESSION, rid)

    async def store(
        self,
        op: OpState,
        kv: torch.Tensor,
        toks: list[int],
        end: int,
        salt: str,
        configs: Configs = None,
        *,
        mark: Mark | None = None,
    ) -> bool:
        """Store ``kv`` (already validated) under ``toks[:end]``; False when all was cached.
        ``mark``: ``kv`` is on a GPU and is read as seen after the mark.

        One ``prepare_store`` and one ``commit_store`` whatever the size
        (docs/internals/design.md, section "CUDA tensors").
        """
        if end == 0:
            return False
        # One store per key at a time from this client: a concurrent twin would see
        # the chunks "being written" and could not tell that from out-of-memory.
        async with self._gate(("store", salt, tuple(toks[:end]))):
            if self.reg.pool is not None:
                return await self._store_shm(op, kv, toks, end, salt, configs, mark)
            return await self._store_pickle(op, kv, toks, end, salt, configs, mark)

    async def remap(
        self, op: OpState, src: list[int], dst: list[int], n: int, salt: str, tsalt: str
    ) -> RemapResult:
        """SHM only: copy the source's slots straight into the target's (see
        :meth:`_remap_shm`)."""
        if self.reg.pool is None:
            raise TransferError("an in-pool remap needs the SHM transport")
        return await self._remap_shm(op, src, dst, n, salt, tsalt)

    # ------------------------------------------------------------------ sequences
