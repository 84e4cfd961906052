"""The SHM sequences: retrieve from the server's pool slots, store into reserved slots
(in groups, with the repair path of a failed copy), and the in-pool remap."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache_async import _copies as copies
from lmcache_async._cuda.hooks import new_target
from lmcache_async._ops.base import (
    Configs,
    OperationsBase,
    RemapResult,
    Reserved,
    RetrieveState,
    cleanup_done,
    log,
    request_id,
    shape_bytes,
)
from lmcache_async._runner import OpState
from lmcache_async._wire import Op, SlotDescriptor, parse_prepare_retrieve, parse_prepare_store
from lmcache_async.errors import LayoutMismatchError, ProtocolError, TransferError, UnfilledReservationError

if TYPE_CHECKING:
    from lmcache_async._cuda.copies import Mark

__all__ = ["ShmSequences", "store_groups"]


class ShmSequences(OperationsBase):
    """The SHM halves of :class:`~lmcache_async._ops.Operations`."""

    async def _retrieve_shm(
        self,
        op: OpState,
        rkey: dict[str, Any],
        hit: int,
        target: torch.Tensor | None,
        state: RetrieveState,
        mark: Mark | None = None,
        rid: str | None = None,
    ) -> torch.Tensor | None:
        geom = self.reg.geometry
        assert self.reg.pool is not None
        committed = False
        try:
            state.prepared = True
            resp = await self.call(op, Op.PREPARE_RETRIEVE, rkey, self.reg.instance_id)
            success, _data, slots = parse_prepare_retrieve(resp)
            if not success:
                committed = True  # nothing is pending on the server
                return None  # evicted between lookup and prepare: a miss
            n_chunks = hit // self.reg.chunk_size
            if len(slots) != n_chunks:
                raise ProtocolError(f"prepare_retrieve gave {len(slots)} slots for {n_chunks} chunks")
            views = self._stored_views(slots)
            if op.abandoned:
                return None
            if target is None:
                target, mark = new_target(geom.kv_shape(hit), geom.dtype, mark)
            start = op.clock()
            await self._copy_chunks(target, views, mark)
            op.phase("copy", start)
            committed = True
            if mark is None or rid is None or not self._commit_retrieve_later(rkey, rid, state):
                await self.call(op, Op.COMMIT_RETRIEVE, rkey, self.reg.instance_id)
            return target
        finally:
            if not committed:
                await self.cleanup_call(Op.COMMIT_RETRIEVE, rkey, self.reg.instance_id)

    def _commit_retrieve_later(self, rkey: dict[str, Any], rid: str, state: RetrieveState) -> bool:
        """CUDA retrieve: send ``commit_retrieve`` now and let the call return without
        waiting for its answer (the KV is already in the caller's tensor). The key gate
        stays held, and ``end_session`` is sent, only once the commit is answered (an
        ``end_session`` ahead of it would let it recreate the session; a retrieve of the
        same prefix must not prepare before it). Both replies are tracked by the client
        (``drain()``, ``aclose()``). False (nothing sent) where the channel cannot post.
        """
        post = self._post
        if post is None or not self.channel.usable or state.gate is None:
            return False
        fut = post(Op.COMMIT_RETRIEVE, (rkey, self.reg.instance_id), self.cleanup_grace)
        if fut is None:
            return False
        release = state.gate.defer()
        state.ended = True

        def answered(f: asyncio.Future[Any]) -> None:
            release()
            cleanup_done(Op.COMMIT_RETRIEVE, rid, f)
            end = post(Op.END_SESSION, (rid,), self.cleanup_grace) if self.channel.usable else None
            if end is not None:
                end.add_done_callback(functools.partial(cleanup_done, Op.END_SESSION, rid))
            elif self.channel.usable:
                end = asyncio.ensure_future(self.cleanup_call(Op.END_SESSION, rid))
            if end is not None and self._track is not None:
                self._track(end)

        fut.add_done_callback(answered)
        if self._track is not None:
            self._track(fut)
        return True

    def _stored_views(self, slots: Sequence[SlotDescriptor]) -> list[torch.Tensor]:
        """Views of the SHM slots of stored KV (a retrieve's) in the geometry's chunk shape.

        Raises:
            LayoutMismatchError: a slot of another shape or dtype, named as KV stored under
                this model by a client of another geometry.
            ProtocolError: a slot outside the pool.
        """
        geom = self.reg.geometry
        assert self.reg.pool is not None
        shape = geom.kv_shape(self.reg.chunk_size)
        try:
            return [self.reg.pool.view(s, shape, geom.dtype) for s in slots]
        except LayoutMismatchError as exc:
            raise exc.for_model(self.reg.model_name) from None

    async def _store_shm(
        self,
        op: OpState,
        kv: torch.Tensor,
        toks: list[int],
        end: int,
        salt: str,
        configs: Configs,
        mark: Mark | None = None,
    ) -> bool:
        geom = self.reg.geometry
        assert self.reg.pool is not None
        rid = request_id("store", op)
        key = self._key(toks, end, rid, salt, worker=True, configs=configs)
        reserved = Reserved()
        try:
            reserved.sent = True
            resp = await self.call(op, Op.PREPARE_STORE, key, self.reg.instance_id)
            slots, indices = parse_prepare_store(resp)
            if not slots:
                reserved.sent = False  # nothing reserved: no pending entry on the server
                # Nothing reservable: every chunk is cached (or being written), or the
                # server is out of memory (it reserves a batch all-or-nothing). A lookup
                # tells which; it only runs on this uncommon path.
                await self._check_stored(op, toks, end, salt, "reserve memory for")
                return False
            n_chunks = end // self.reg.chunk_size
            if max(indices) >= n_chunks:
                raise ProtocolError(f"prepare_store asked for chunk {max(indices)} of {n_chunks}")
            shape = geom.kv_shape(self.reg.chunk_size)
            views = [self.reg.pool.view(s, shape, geom.dtype) for s in slots]
            pairs = [(v, self._chunk(kv, j)) for v, j in zip(views, indices, strict=True)]
            nbytes = sum(v.numel() for v in views) * kv.element_size()
            start = op.clock()
            await self._fill_reserved(pairs, nbytes, mark)
            op.phase("copy", start)
            reserved.filled = True
            op.moved(nbytes)
            ok = await self.call(op, Op.COMMIT_STORE, key, self.reg.instance_id, b"")
            if ok is not True:
                raise TransferError("the server refused the SHM commit (registration lost?)")
            return True
        finally:
            self._settle(reserved)
            await self.cleanup_later(Op.END_SESSION, rid)

    async def _store_shm_grouped(
        self,
        op: OpState,
        kv: torch.Tensor,
        toks: list[int],
        end: int,
        salt: str,
        configs: Configs,
        mark: Mark | None,
        groups: Sequence[tuple[int, int]] | None = None,
    ) -> bool:
        """A CUDA store on SHM in groups of chunks (:func:`store_groups`), pipelined: every
        group's ``prepare_store`` goes out at once (each group a session of its own, its
        key the tokens up to the group's end with ``start`` at its first chunk, as the
        inline store keys the chunks after a cached prefix: the first, small group's
        request is small and answered soonest); each group's copy starts as soon as its slots are
        known, while the other groups' requests are in flight, and each group is
        committed as soon as its copy is done, while later groups still copy. The call
        waits for the first group's reservation, the copy, and the last group's commit.

        Each group is a store of its own for the server (its own pending reservation):
        a group whose ``prepare_store`` was sent is filled and committed, or its
        registration is retired, exactly as :meth:`_store_shm` does for the whole. A
        group with nothing reserved (cached, another writer's, no memory) is checked as
        :meth:`_store_shm` checks an empty reservation, after the others are committed.
        ``groups``: chunk ranges covering ``[0, end)`` in order (default
        :func:`store_groups`); ``mark`` None: a CPU ``kv`` (tests).
        """
        cs = self.reg.chunk_size
        if groups is None:
            groups = store_groups(end // cs)
        rids = [request_id("store", op) for _ in groups]
        reserved = [Reserved() for _ in groups]

        async def group(i: int) -> bool:
            first, last = groups[i]
            gkey = self._key(toks, last * cs, rids[i], salt, start=first * cs, worker=True, configs=configs)
            reserved[i].sent = True
            resp = await self.call(op, Op.PREPARE_STORE, gkey, self.reg.instance_id)
            slots, indices = parse_prepare_store(resp)
            if not slots:
                reserved[i].sent = False  # nothing reserved: no pending entry on the server
                return False
            if max(indices) >= last - first:
                raise ProtocolError(f"prepare_store asked for chunk {max(indices)} of {last - first}")
            assert self.reg.pool is not None
            shape = self.reg.geometry.kv_shape(cs)
            views = [self.reg.pool.view(sl, shape, self.reg.geometry.dtype) for sl in slots]
            pairs = [(v, self._chunk(kv, first + j)) for v, j in zip(views, indices, strict=True)]
            nbytes = sum(v.numel() for v in views) * kv.element_size()
            start = op.clock()
            await self._fill_reserved(pairs, nbytes, mark)
            op.phase("copy", start)
            reserved[i].filled = True
            op.moved(nbytes)
            ok = await self.call(op, Op.COMMIT_STORE, gkey, self.reg.instance_id, b"")
            if ok is not True:
                raise TransferError("the server refused the SHM commit (registration lost?)")
            return True

        try:
            results = await asyncio.gather(*(group(i) for i in range(len(groups))), return_exceptions=True)
            for res in results:
                if isinstance(res, BaseException):
                    raise res
            if not all(results):
                # A group reserved nothing: cached, being written by another writer, or no
                # memory. A lookup tells which (as for an empty reservation of a whole store).
                await self._check_stored(op, toks, end, salt, "reserve memory for")
            return any(results)
        finally:
            for one in reserved:
                self._settle(one)
            for rid in rids:
                await self.cleanup_later(Op.END_SESSION, rid)

    async def _fill_reserved(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], nbytes: int, mark: Mark | None = None
    ) -> None:
        """Fill reserved slots; when the copy fails midway, fill them all again through
        :func:`refill_slots` (the slots then hold exactly the caller's data).

        ``mark``: the sources are CUDA tensors, copied on the CUDA copy streams after the
        caller's stream mark (:func:`lmcache_async._cuda.copies.to_host`); their repair waits
        for the mark on the host first, in a worker thread.

        Raises:
            UnfilledReservationError: the repair failed too (the slots hold anything).

        Cancellation: a copy running in a thread is waited for before re-raising.
        """
        try:
            if mark is not None:
                from lmcache_async._cuda import copies as cuda

                await copies.await_to_the_end(cuda.to_host(pairs, mark, self.reg.pool))
            else:
                pool = self.reg.pool
                await copies.copy_to_the_end(nbytes, lambda: copies.fill_slots(pairs, pool))
            return
        except Exception as exc:
            log.warning("copy into reserved SHM slots failed (%r); filling them again from CPU copies", exc)
        try:
            if mark is not None:
                event = mark.event

                def repair() -> None:
                    event.synchronize()  # the caller's writes to the sources are done
                    copies.refill_slots(pairs)

                await copies.copy_to_the_end(max(nbytes, copies.THREAD_COPY_BYTES), repair)
            else:
                await copies.copy_to_the_end(nbytes, lambda: copies.refill_slots(pairs))
        except Exception as exc:
            raise UnfilledReservationError(
                f"could not write {len(pairs)} reserved chunks ({exc!r}); nothing was committed "
                "and the slots stay invisible to readers (this client's registration that holds "
                "them is retired and never unregistered)"
            ) from exc

    def _settle(self, reserved: Reserved) -> None:
        """After a store half: report a reservation that may hold anything but the data."""
        if reserved.sent and not reserved.filled and self._on_unfilled is not None:
            self._on_unfilled(self.reg.instance_id)

    async def _remap_shm(
        self, op: OpState, src: list[int], dst: list[int], n: int, salt: str, tsalt: str
    ) -> RemapResult:
        """Remap inside the SHM pool: the source's slots are copied straight into the
        target's reserved slots (one copy, no client-side buffer).

        Cancellation/timeout: once the target's slots are reserved the copy and commit are
        completed (as for :meth:`store`); every lock, pending read and session is released.
        """
        if n == 0:
            return RemapResult(0, 0, False)
        assert self.reg.pool is not None
        rid = request_id("remap", op)
        key = self._key(src, n, rid, salt, worker=False)
        hit = 0
        state = RetrieveState()
        try:
            hit = await self._lookup_locked(op, key, rid, release=False)
            if hit == 0:
                return RemapResult(0, 0, False)
            rkey = self._key(src, hit, rid, salt, worker=True)
            # Gates always in this order (retrieve, then store): no cycle between remaps.
            async with (
                self._gate(("retrieve", salt, tuple(src[:hit]))),
                self._gate(("store", tsalt, tuple(dst[:hit]))),
            ):
                return await self._remap_slots(op, rkey, dst, hit, tsalt, state)
        finally:
            if hit and not state.prepared:
                await self._free_locks(key, hit // self.reg.chunk_size)
            await self.cleanup_later(Op.END_SESSION, rid)

    async def _remap_slots(
        self, op: OpState, rkey: dict[str, Any], dst: list[int], hit: int, tsalt: str, state: RetrieveState
    ) -> RemapResult:
        geom = self.reg.geometry
        assert self.reg.pool is not None
        shape = geom.kv_shape(self.reg.chunk_size)
        n_chunks = hit // self.reg.chunk_size
        committed = False
        try:
            state.prepared = True
            resp = await self.call(op, Op.PREPARE_RETRIEVE, rkey, self.reg.instance_id)
            success, _data, rslots = parse_prepare_retrieve(resp)
            if not success:
                committed = True
                return RemapResult(0, 0, False)  # evicted between lookup and prepare
            if len(rslots) != n_chunks:
                raise ProtocolError(f"prepare_retrieve gave {len(rslots)} slots for {n_chunks} chunks")
            sources = self._stored_views(rslots)
            if op.abandoned:  # the caller left before the store half began: skip it
                return RemapResult(hit, 0, False)
            srid = request_id("remap-store", op)
            skey = self._key(dst, hit, srid, tsalt, worker=True)
            reserved = Reserved()
            try:
                reserved.sent = True
                sresp = await self.call(op, Op.PREPARE_STORE, skey, self.reg.instance_id)
                wslots, indices = parse_prepare_store(sresp)
                if not wslots:
                    reserved.sent = False
                    await self._check_stored(op, dst, hit, tsalt, "reserve memory for")
                    return RemapResult(hit, hit, False)
                if max(indices) >= n_chunks:
                    raise ProtocolError(f"prepare_store asked for chunk {max(indices)} of {n_chunks}")
                pairs = [
                    (self.reg.pool.view(w, shape, geom.dtype), sources[j])
                    for w, j in zip(wslots, indices, strict=True)
                ]
                nbytes = len(pairs) * shape_bytes(shape, geom.dtype)
                start = op.clock()
                await self._fill_reserved(pairs, nbytes)
                op.phase("copy", start)
                reserved.filled = True
                op.moved(nbytes)
                # The target is written: the source's pending read can go with its commit.
                committed = True
                ok, _ = await self.pipeline(
                    op,
                    (Op.COMMIT_STORE, skey, self.reg.instance_id, b""),
                    (Op.COMMIT_RETRIEVE, rkey, self.reg.instance_id),
                )
                if ok is not True:
                    raise TransferError("the server refused the SHM commit (registration lost?)")
                return RemapResult(hit, hit, True)
            finally:
                self._settle(reserved)
                await self.cleanup_later(Op.END_SESSION, srid)
        finally:
            if not committed:
                await self.cleanup_call(Op.COMMIT_RETRIEVE, rkey, self.reg.instance_id)


def store_groups(n_chunks: int) -> list[tuple[int, int]]:
    """How a CUDA store of ``n_chunks`` chunks on SHM is split (chunk ranges
    ``[first, last)``, in order): one group below 4 chunks; else a small first group (its
    reservation comes back soonest, so the copy starts early), a small last group (its
    commit is the one the call waits for) and the rest in two halves between them."""
    if n_chunks < 4:
        return [(0, n_chunks)]
    edge = max(1, n_chunks // 8)
    middle = n_chunks - 2 * edge
    half = middle // 2
    bounds = [0, edge, edge + half, n_chunks - edge, n_chunks]
    return [(bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1) if bounds[k + 1] > bounds[k]]
