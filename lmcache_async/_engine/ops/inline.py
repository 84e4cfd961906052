"""The inline sequences (no shared memory): retrieve and store with the tensors in the
request and reply frames (lmcache 0.5.6's pickle, 0.5.7's envelope:
:mod:`lmcache_async._protocol.payload`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import torch

from lmcache_async._engine import copies as copies
from lmcache_async._engine.cuda import hooks as cuda_hooks
from lmcache_async._engine.cuda.hooks import new_target
from lmcache_async._engine.ops.base import (
    Configs,
    OperationsBase,
    RetrieveState,
    request_id,
)
from lmcache_async._engine.runner import OpState
from lmcache_async._protocol.payload.inline import decode_inline, encode_inline
from lmcache_async._protocol.wire import Op, PreEncoded, parse_prepare_retrieve
from lmcache_async.errors import LayoutMismatchError, TransferError

if TYPE_CHECKING:
    from lmcache_async._engine.cuda.copies import Mark

__all__ = ["InlineSequences"]


class InlineSequences(OperationsBase):
    """The inline halves of :class:`~lmcache_async._engine.ops.Operations`."""

    async def _retrieve_pickle(
        self,
        op: OpState,
        rkey: dict[str, Any],
        hit: int,
        target: torch.Tensor | None,
        state: RetrieveState,
        mark: Mark | None = None,
    ) -> torch.Tensor | None:
        geom = self.reg.geometry
        if self.reg.server_has_shm:
            raise TransferError("the server keeps its KV in SHM, which this client cannot map")
        state.prepared = True  # the server releases the locks when it answers
        resp = await self.call(op, Op.PREPARE_RETRIEVE, rkey, self.reg.instance_id)
        success, data, _slots = parse_prepare_retrieve(resp)
        if not success:
            return None
        n_chunks = hit // self.reg.chunk_size
        shape = geom.kv_shape(self.reg.chunk_size)
        try:
            tensors = decode_inline(self.reg.wire, data, count=n_chunks, shape=shape, dtype=geom.dtype)
        except LayoutMismatchError as exc:
            raise exc.for_model(self.reg.model_name) from None
        if op.abandoned:
            return None
        if target is None:
            target, mark = new_target(geom.kv_shape(hit), geom.dtype, mark)
        start = op.clock()
        await self._copy_chunks(target, tensors, mark)
        op.phase("copy", start)
        return target

    async def _store_pickle(
        self,
        op: OpState,
        kv: torch.Tensor,
        toks: list[int],
        end: int,
        salt: str,
        configs: Configs,
        mark: Mark | None = None,
    ) -> bool:
        rid = request_id("store", op)
        lookup_key = self._key(toks, end, rid, salt, worker=False)
        try:
            # The lookup tells which chunks are cached already; its locks are not needed
            # (released in the background: they cover other chunks than the commit's).
            hit = await self._lookup_locked(op, lookup_key, rid, release=False)
            await self._free_locks(lookup_key, hit // self.reg.chunk_size, later=True)
            if hit >= end:
                return False
            first = hit // self.reg.chunk_size
            chunks = [self._chunk(kv, j) for j in range(first, end // self.reg.chunk_size)]
            nbytes = sum(c.numel() for c in chunks) * kv.element_size()
            if mark is not None:  # CUDA kv: staged through pinned memory
                frame = await cuda_hooks.encode_inline(self.reg.wire, chunks, mark)
            elif nbytes >= copies.THREAD_COPY_BYTES:
                frame = await asyncio.to_thread(encode_inline, self.reg.wire, chunks)
            else:
                frame = encode_inline(self.reg.wire, chunks)
            key = self._key(toks, end, rid, salt, start=hit, worker=True, configs=configs)
            ok = await self.call(op, Op.COMMIT_STORE, key, self.reg.instance_id, PreEncoded(frame))
            if ok is not True:
                raise TransferError("the server could not store every chunk (out of memory?)")
            op.moved(nbytes)
        finally:
            await self.cleanup_later(Op.END_SESSION, rid)
        # A pickle commit the server found no memory for still answers True: verify.
        await self._check_stored(op, toks, end, salt, "store")
        return True
