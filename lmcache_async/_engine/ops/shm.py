"""The SHM sequences: retrieve from the server's pool slots, store into reserved slots
(with the repair path of a failed copy), and the in-pool remap and composition (the
sources' slots copied, keys rotated where a part moves, straight into the target's
reserved slots; the tensor work of one target chunk comes from
:mod:`lmcache_async._engine.compose` as a ``fill`` function)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache_async._engine import copies as copies
from lmcache_async._engine.cuda import hooks as cuda_hooks
from lmcache_async._engine.cuda.hooks import new_target
from lmcache_async._engine.ops.base import (
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
from lmcache_async._engine.runner import OpState
from lmcache_async._protocol.wire import Op, SlotDescriptor, parse_prepare_retrieve, parse_prepare_store
from lmcache_async.errors import LayoutMismatchError, ProtocolError, TransferError, UnfilledReservationError

if TYPE_CHECKING:
    from lmcache_async._engine.cuda.copies import Mark

__all__ = ["Fill", "ShmSequences", "Source"]

#: One source of a composition: its tokens, the tokens to read (whole chunks), its salt.
Source = tuple[list[int], int, str]
#: ``fill(sources, j, slot)``: write target chunk ``j`` into ``slot`` from the sources'
#: chunk views (``sources[i][c]``: chunk ``c`` of source ``i``). Runs in a worker thread.
Fill = Callable[[Sequence[Sequence[torch.Tensor]], int, torch.Tensor], None]


class ShmSequences(OperationsBase):
    """The SHM halves of :class:`~lmcache_async._engine.ops.Operations`."""

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
        fut = self._post_request(Op.COMMIT_RETRIEVE, (rkey, self.reg.instance_id), self.cleanup_grace)
        if fut is None:
            return False
        release = state.gate.defer()
        state.ended = True

        def answered(f: asyncio.Future[Any]) -> None:
            release()
            cleanup_done(Op.COMMIT_RETRIEVE, rid, f)
            if self._end_after_late(rid):  # the commit timed out: after its late reply
                return
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

    async def _fill_reserved(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], nbytes: int, mark: Mark | None = None
    ) -> None:
        """Fill reserved slots; when the copy fails midway, fill them all again through
        :func:`refill_slots` (the slots then hold exactly the caller's data).

        ``mark``: the sources are CUDA tensors, copied on the CUDA copy streams after the
        caller's stream mark (:func:`lmcache_async._engine.cuda.copies.to_host`); their repair waits
        for the mark on the host first, in a worker thread.

        Raises:
            UnfilledReservationError: the repair failed too (the slots hold anything).

        Cancellation: a copy running in a thread is waited for before re-raising.
        """
        try:
            if mark is not None:
                await copies.await_to_the_end(cuda_hooks.to_host(pairs, mark, self.reg.pool))
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

    async def compose_in_pool(
        self,
        op: OpState,
        sources: Sequence[Source],
        target: list[int],
        stored: int,
        tsalt: str,
        fill: Fill,
    ) -> tuple[list[int], bool]:
        """Compose ``target[:stored]`` (whole chunks) in the SHM pool from ``sources``.

        Every source is looked up (its read locks held); when each holds the tokens it
        must give, each is prepared for reading, the target's chunks are reserved, each
        reserved chunk is written by ``fill`` in a worker thread, and the store and the
        reads are committed together. A source short of its tokens stores nothing.

        Returns:
            The tokens of each source that are cached (up to what it must give), and
            whether a chunk of the target was added.

        Cancellation/timeout: as :meth:`_remap_shm`: once the target's slots are reserved
        they are written and committed; every lock, pending read and session is released.
        """
        assert self.reg.pool is not None
        cs = self.reg.chunk_size
        rids = [request_id("compose", op) for _ in sources]
        keys = [
            self._key(toks, read, rid, salt, worker=False)
            for (toks, read, salt), rid in zip(sources, rids, strict=True)
        ]
        hits = [0] * len(sources)
        states = [RetrieveState() for _ in sources]
        rkeys: list[dict[str, Any] | None] = [None] * len(sources)
        pending = [False] * len(sources)  # prepared for reading, no commit_retrieve sent yet
        try:

            async def look(i: int) -> None:
                hits[i] = await self._lookup_locked(op, keys[i], rids[i], release=False)

            await asyncio.gather(*(look(i) for i in range(len(sources))))
            if stored == 0 or any(h < read for h, (_, read, _) in zip(hits, sources, strict=True)):
                return hits, False
            # Gates in one order everywhere (every read, sorted, then the store): no cycle.
            reads = sorted({("retrieve", salt, tuple(toks[:read])) for toks, read, salt in sources})
            async with contextlib.AsyncExitStack() as gates:
                for identity in reads:
                    await gates.enter_async_context(self._gate(identity))
                await gates.enter_async_context(self._gate(("store", tsalt, tuple(target[:stored]))))
                views: list[list[torch.Tensor]] = []
                for i, (toks, read, salt) in enumerate(sources):
                    states[i].prepared = True
                    rkey = rkeys[i] = self._key(toks, read, rids[i], salt, worker=True)
                    resp = await self.call(op, Op.PREPARE_RETRIEVE, rkey, self.reg.instance_id)
                    success, _data, slots = parse_prepare_retrieve(resp)
                    if not success:  # evicted between lookup and prepare: a miss
                        hits[i] = 0
                        return hits, False
                    pending[i] = True
                    if len(slots) != read // cs:
                        raise ProtocolError(
                            f"prepare_retrieve gave {len(slots)} slots for {read // cs} chunks"
                        )
                    views.append(self._stored_views(slots))
                if op.abandoned:  # the caller left before the store half began: skip it
                    return hits, False
                return hits, await self._compose_store(op, views, target, stored, tsalt, fill, rkeys, pending)
        finally:
            for i in range(len(sources)):
                if hits[i] and not states[i].prepared:
                    await self._free_locks(keys[i], hits[i] // cs)
                if pending[i]:
                    await self.cleanup_call(Op.COMMIT_RETRIEVE, rkeys[i], self.reg.instance_id)
                await self.cleanup_later(Op.END_SESSION, rids[i])

    async def _compose_store(
        self,
        op: OpState,
        views: Sequence[Sequence[torch.Tensor]],
        target: list[int],
        stored: int,
        tsalt: str,
        fill: Fill,
        rkeys: Sequence[dict[str, Any] | None],
        pending: list[bool],
    ) -> bool:
        """Reserve the target's chunks, fill them, commit them with the reads."""
        assert self.reg.pool is not None
        geom = self.reg.geometry
        shape = geom.kv_shape(self.reg.chunk_size)
        srid = request_id("compose-store", op)
        skey = self._key(target, stored, srid, tsalt, worker=True)
        reserved = Reserved()
        commits = [(Op.COMMIT_RETRIEVE, rkey, self.reg.instance_id) for rkey in rkeys]
        try:
            reserved.sent = True
            sresp = await self.call(op, Op.PREPARE_STORE, skey, self.reg.instance_id)
            wslots, indices = parse_prepare_store(sresp)
            if not wslots:
                reserved.sent = False  # nothing reserved: every chunk cached (or no memory)
                await self._check_stored(op, target, stored, tsalt, "reserve memory for")
                pending[:] = [False] * len(pending)
                await self.pipeline(op, *commits)
                return False
            if max(indices) >= stored // self.reg.chunk_size:
                raise ProtocolError(
                    f"prepare_store asked for chunk {max(indices)} of {stored // self.reg.chunk_size}"
                )
            slots = [
                (self.reg.pool.view(w, shape, geom.dtype), j) for w, j in zip(wslots, indices, strict=True)
            ]
            nbytes = len(slots) * slots[0][0].numel() * slots[0][0].element_size()

            def write() -> None:
                for slot, j in slots:
                    fill(views, j, slot)

            start = op.clock()
            try:
                await copies.copy_to_the_end(max(nbytes, copies.THREAD_COPY_BYTES), write)
            except Exception as exc:
                raise TransferError(
                    f"could not write the composed chunks ({exc!r}); nothing was committed"
                ) from exc
            op.phase("copy", start)
            reserved.filled = True
            op.moved(nbytes)
            pending[:] = [False] * len(pending)  # the reads go with the store's commit
            ok, *_ = await self.pipeline(op, (Op.COMMIT_STORE, skey, self.reg.instance_id, b""), *commits)
            if ok is not True:
                raise TransferError("the server refused the SHM commit (registration lost?)")
            return True
        finally:
            self._settle(reserved)
            await self.cleanup_later(Op.END_SESSION, srid)
