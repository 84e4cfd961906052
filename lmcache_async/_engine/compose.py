"""Composition of cached KV: the plan, the checks and the tensor work behind
:meth:`AsyncClient.compose <lmcache_async.AsyncClient.compose>` (docs/internals/design.md,
section "Compose and rope").

Every argument is checked first (:func:`plan`, nothing sent); a part not cached makes the
call store nothing; a part moved from its source position has its keys rotated
(:meth:`lmcache_async.rope.RopeSpec.rotate_keys`), its values copied.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lmcache_async._base.host_copy import empty_host
from lmcache_async._base.timeouts import DEFAULT, DefaultType
from lmcache_async._protocol.wire import validate_cache_salt, validate_tokens
from lmcache_async.geometry import KVGeometry
from lmcache_async.results import ComposeResult, KVPart, PartResult, RemapResult
from lmcache_async.rope import RopeSpec

__all__ = [
    "ComposeClient",
    "ComposeResult",
    "Fill",
    "Gathered",
    "KVPart",
    "PartResult",
    "Plan",
    "PoolSources",
    "assemble",
    "compose_inline",
    "gather",
    "gather_assemble_store",
    "plan",
    "pool_result",
    "pool_sources",
    "remap_inline",
    "result",
    "slot_filler",
]


#: ``fill(sources, j, slot)`` of the in-pool composition (:func:`slot_filler`).
Fill = Callable[[Sequence[Sequence[torch.Tensor]], int, torch.Tensor], None]


class ComposeClient(Protocol):
    """What a composition uses of a client (an open ``AsyncClient`` is one)."""

    @property
    def chunk_size(self) -> int: ...

    @property
    def geometry(self) -> KVGeometry: ...

    async def store(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        request_configs: Mapping[str, Any] | None = None,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> bool: ...

    async def retrieve(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        out: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        request_configs: Mapping[str, Any] | None = None,
        timeout: float | DefaultType | None = DEFAULT,
    ) -> torch.Tensor | None: ...


@dataclass(frozen=True, slots=True)
class _Placement:
    part: KVPart
    salt: str
    offset: int
    shift: int
    placed: int  # tokens inside the stored whole chunks
    read: int  # source tokens to retrieve (the whole chunks reaching ``end``)


@dataclass(frozen=True, slots=True)
class Plan:
    """A checked composition: where each part goes and what is read and stored."""

    target: tuple[int, ...]
    salt: str
    placements: tuple[_Placement, ...]
    stored: int  # target tokens stored (whole chunks)
    rope: RopeSpec | None

    def reads(self) -> dict[tuple[tuple[int, ...], str], int]:
        """Each distinct (source, salt) and the tokens to read from it (the most any of
        its parts needs)."""
        out: dict[tuple[tuple[int, ...], str], int] = {}
        for p in self.placements:
            key = (tuple(p.part.source_tokens), p.salt)
            out[key] = max(out.get(key, 0), p.read)
        return out


def plan(
    target_tokens: Sequence[int],
    parts: Sequence[KVPart],
    rope: RopeSpec | None,
    cache_salt: str,
    geometry: KVGeometry,
    chunk_size: int,
) -> Plan:
    """Check a composition and lay it out; nothing is sent.

    Raises:
        TypeError: ``parts`` is not a sequence of :class:`KVPart`, ``rope`` not a
            :class:`RopeSpec`.
        ValueError: no parts; the parts longer than the target; a part shifted without
            ``rope``; a part whose range reaches past its source's whole chunks; a
            ``rope`` whose head size or layer count is not the geometry's; an MLA or
            integer geometry with a shifted part.
    """
    target = tuple(validate_tokens(target_tokens, "target_tokens"))
    validate_cache_salt(cache_salt)
    if isinstance(parts, str | bytes) or not isinstance(parts, Sequence):
        raise TypeError(f"parts must be a sequence of KVPart, got {type(parts).__name__}")
    if not parts:
        raise ValueError("parts must name at least one KVPart")
    for i, part in enumerate(parts):
        if not isinstance(part, KVPart):
            raise TypeError(f"parts[{i}] must be a KVPart, got {type(part).__name__}")
    if rope is not None and not isinstance(rope, RopeSpec):
        raise TypeError(f"rope must be a RopeSpec or None, got {type(rope).__name__}")
    total = sum(p.length for p in parts)
    if total > len(target):
        raise ValueError(f"the parts hold {total} tokens, more than the target's {len(target)}")
    stored = total // chunk_size * chunk_size
    placements = []
    offset = 0
    for i, part in enumerate(parts):
        assert part.end is not None
        shift = offset - part.start
        if shift and rope is None:
            raise ValueError(
                f"parts[{i}] moves from position {part.start} to {offset} (shift {shift:+d}): its keys "
                "must be rotated; pass rope=RopeSpec... (e.g. RopeSpec.from_hf_config(model.config))"
            )
        read = -(-part.end // chunk_size) * chunk_size
        if read > len(part.source_tokens):
            whole = len(part.source_tokens) // chunk_size * chunk_size
            raise ValueError(
                f"parts[{i}] ends at token {part.end}, past its source's whole chunks ({whole} of "
                f"{len(part.source_tokens)} tokens at chunk size {chunk_size}): LMCache caches whole "
                "chunks only"
            )
        if shift:
            _check_rope(rope, geometry, i)
        placed = max(0, min(part.length, stored - offset))
        salt = cache_salt if part.cache_salt is None else part.cache_salt
        placements.append(_Placement(part, salt, offset, shift, placed, read))
        offset += part.length
    return Plan(target, cache_salt, tuple(placements), stored, rope)


def _check_rope(rope: RopeSpec | None, geometry: KVGeometry, index: int) -> None:
    assert rope is not None
    if geometry.use_mla:
        raise ValueError(f"parts[{index}] is shifted, but MLA (single-plane) KV cannot be rotated here")
    if not geometry.dtype.is_floating_point or geometry.dtype.itemsize < 2:
        raise ValueError(f"parts[{index}] is shifted, but {geometry.dtype} KV cannot be rotated")
    if rope.head_dim != geometry.head_dim:
        raise ValueError(
            f"rope.head_dim is {rope.head_dim}, the client's geometry has head_dim {geometry.head_dim}"
        )
    if rope.layers is not None and len(rope.layers) != geometry.num_layers:
        raise ValueError(f"rope describes {len(rope.layers)} layers, the geometry has {geometry.num_layers}")


def assemble(
    the_plan: Plan,
    kvs: Mapping[tuple[tuple[int, ...], str], torch.Tensor],
    geometry: KVGeometry,
    out: torch.Tensor | None = None,
    in_place: frozenset[tuple[tuple[int, ...], str]] = frozenset(),
) -> torch.Tensor:
    """The target's KV (``[2, L, stored, D]``; ``out`` or a new host tensor) from the
    retrieved sources: each part's values copied, its keys rotated by its shift (or
    copied). The parts of the sources in ``in_place`` were retrieved straight into their
    place in ``out``: their keys are rotated there, their values left as they are."""
    if out is None:
        out = empty_host(geometry.kv_shape(the_plan.stored), geometry.dtype)
    heads = geometry.num_kv_heads
    for p in the_plan.placements:
        if p.placed == 0:
            continue
        dst = out[:, :, p.offset : p.offset + p.placed]
        if _key(p) in in_place:
            if p.shift:
                assert the_plan.rope is not None
                the_plan.rope.rotate_keys(dst[0], p.shift, out=dst[0], heads=heads)
            continue
        kv = kvs[_key(p)]
        a, b = p.part.start, p.part.start + p.placed
        dst[1].copy_(kv[1, :, a:b])
        if p.shift == 0:
            dst[0].copy_(kv[0, :, a:b])
        else:
            assert the_plan.rope is not None
            the_plan.rope.rotate_keys(kv[0, :, a:b], p.shift, out=dst[0], heads=heads)
    return out


@dataclass(frozen=True, slots=True)
class Gathered:
    """The sources a plan reads, as retrieved: the tensors of those found, per source the
    cached prefix (0 on a miss), and the sources retrieved straight into the target."""

    kvs: dict[tuple[tuple[int, ...], str], torch.Tensor]
    cached: dict[tuple[tuple[int, ...], str], int]
    in_place: frozenset[tuple[tuple[int, ...], str]] = frozenset()

    def hits(self, the_plan: Plan) -> list[bool]:
        """Per part: its range lies within its source's cached prefix."""
        return [self.cached[_key(p)] >= (p.part.end or 0) for p in the_plan.placements]


def _key(p: _Placement) -> tuple[tuple[int, ...], str]:
    return (tuple(p.part.source_tokens), p.salt)


def _direct(the_plan: Plan) -> list[_Placement]:
    """The parts that can be retrieved straight into their place in the target: the whole
    range of a source from its first token (``start == 0``), inside the stored chunks with
    the chunks read, the only part of its source. In offset order."""
    uses: dict[tuple[tuple[int, ...], str], int] = {}
    for p in the_plan.placements:
        uses[_key(p)] = uses.get(_key(p), 0) + 1
    return [
        p
        for p in the_plan.placements
        if p.part.start == 0
        and p.placed == p.part.length
        and p.offset + p.read <= the_plan.stored
        and uses[_key(p)] == 1
    ]


async def gather(
    client: ComposeClient, the_plan: Plan, timeout: float | None, target: torch.Tensor | None = None
) -> Gathered:
    """Retrieve each distinct source of ``the_plan`` once, as far as its parts reach,
    under one deadline of ``timeout`` seconds.

    With ``target`` (the ``[2, L, stored, D]`` tensor the target is assembled in), the
    parts :func:`_direct` names are retrieved straight into their place (``out=`` a view
    of ``target``), one after another in offset order (a retrieve reads whole chunks, so
    it may write up to a chunk past its part, into the next part's place, which the next
    retrieve or :func:`assemble` overwrites); the other sources go to tensors of their
    own (on ``target``'s device when it is a GPU), concurrently with those. Cancellation,
    or a failed retrieve, cancels the others
    (each cleans up as :meth:`AsyncClient.retrieve` does)."""
    start = time.monotonic()
    reads = the_plan.reads()
    direct = _direct(the_plan) if target is not None else []
    direct_keys = {_key(p) for p in direct}
    keys = [key for key in reads if key not in direct_keys]
    axis = client.geometry.token_axis

    def left() -> float | None:
        return None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)

    async def in_place() -> dict[tuple[tuple[int, ...], str], int]:
        hits: dict[tuple[tuple[int, ...], str], int] = {}
        for p in direct:
            assert target is not None
            src, salt = _key(p)
            view = target[:, :, p.offset : p.offset + p.read]
            kv = await client.retrieve(src[: p.read], salt, out=view, timeout=left())
            hits[(src, salt)] = 0 if kv is None else kv.shape[axis]
        return hits

    device = target.device if target is not None and target.device.type == "cuda" else None
    tasks = [
        asyncio.ensure_future(
            client.retrieve(src[: reads[(src, salt)]], salt, device=device, timeout=timeout)
        )
        for src, salt in keys
    ]
    sequence = asyncio.ensure_future(in_place())
    try:
        got = await asyncio.gather(*tasks)
        direct_hits = await sequence
    finally:
        for t in (*tasks, sequence):
            if not t.done():
                t.cancel()
        if not all(t.done() for t in (*tasks, sequence)):
            await asyncio.wait([*tasks, sequence])
    return Gathered(
        kvs={key: kv for key, kv in zip(keys, got, strict=True) if kv is not None},
        cached={
            **{key: (0 if kv is None else kv.shape[axis]) for key, kv in zip(keys, got, strict=True)},
            **direct_hits,
        },
        in_place=frozenset(direct_keys),
    )


def slot_filler(
    the_plan: Plan, geometry: KVGeometry, chunk_size: int, index: Mapping[tuple[tuple[int, ...], str], int]
) -> Fill:
    """For the in-pool composition on SHM: a function that writes target chunk ``j`` into
    the slot ``dst`` from the sources' chunk views (``sources[i][c]``: chunk ``c`` of
    source ``i``; ``index`` gives each (source tokens, salt) of the plan its ``i``), each
    part's values copied and its keys rotated by its shift (or copied), a part split where
    it crosses a source chunk."""
    axis, heads, cs = geometry.token_axis, geometry.num_kv_heads, chunk_size

    def fill(sources: Sequence[Sequence[torch.Tensor]], j: int, dst: torch.Tensor) -> None:
        lo, hi = j * cs, (j + 1) * cs
        for p in the_plan.placements:
            a, b = max(lo, p.offset), min(hi, p.offset + p.placed)
            chunks = sources[index[_key(p)]] if a < b else ()
            s = p.part.start + (a - p.offset)  # the source's token at target position a
            while a < b:
                c, o = divmod(s, cs)
                n = min(b - a, cs - o)
                src = chunks[c].narrow(axis, o, n)
                out = dst.narrow(axis, a - lo, n)
                if p.shift == 0:
                    out.copy_(src)
                else:
                    assert the_plan.rope is not None
                    out[1].copy_(src[1])
                    the_plan.rope.rotate_keys(src[0], p.shift, out=out[0], heads=heads)
                a, s = a + n, s + n

    return fill


def result(the_plan: Plan, gathered: Gathered, stored_new: bool) -> ComposeResult:
    """The :class:`ComposeResult` of a plan whose sources were gathered (and, if every
    part hit, stored)."""
    hits = gathered.hits(the_plan)
    ok = all(hits)
    return ComposeResult(
        parts=tuple(
            PartResult(
                offset=p.offset,
                tokens=p.part.length,
                shift=p.shift,
                hit=hit,
                cached_tokens=gathered.cached[_key(p)],
                placed=p.placed if ok else 0,
            )
            for p, hit in zip(the_plan.placements, hits, strict=True)
        ),
        stored_tokens=the_plan.stored if ok else 0,
        stored_new=stored_new,
    )


@dataclass(frozen=True, slots=True)
class PoolSources:
    """The reads of an in-pool composition on SHM: ``sources`` (``(tokens, read,
    salt)``, one per distinct key: sources that differ only past the chunks read give one
    source, since the server keeps one pending read per client and key) and ``index``,
    each (source tokens, salt) of the plan to its source's place in ``sources``."""

    sources: list[tuple[list[int], int, str]]
    index: dict[tuple[tuple[int, ...], str], int]


def pool_sources(the_plan: Plan) -> PoolSources:
    """The distinct reads of ``the_plan`` for the in-pool composition (:class:`PoolSources`)."""
    index: dict[tuple[tuple[int, ...], str], int] = {}
    first: dict[tuple[tuple[int, ...], str], int] = {}
    sources: list[tuple[list[int], int, str]] = []
    for (src, salt), read in the_plan.reads().items():
        key = (src[:read], salt)
        if key not in first:
            first[key] = len(sources)
            sources.append((list(key[0]), read, salt))
        index[(src, salt)] = first[key]
    return PoolSources(sources, index)


def pool_result(the_plan: Plan, reads: PoolSources, cached: Sequence[int], stored_new: bool) -> ComposeResult:
    """The :class:`ComposeResult` of an in-pool composition whose sources had ``cached``
    tokens (one count per source of ``reads``)."""
    return result(the_plan, Gathered({}, {key: cached[i] for key, i in reads.index.items()}), stored_new)


async def gather_assemble_store(
    client: ComposeClient, the_plan: Plan, timeout: float | None
) -> ComposeResult:
    """Run a composition through the public client (the inline transport): retrieve each
    distinct source once, concurrently (:func:`gather`); if every part hit, assemble the
    target in one host tensor and store it with one ``store``. ``timeout`` is already
    resolved and covers the retrieves and the store together.

    Cancellation/timeout: the retrieves and the store clean up as theirs do; nothing is
    stored unless every part hit."""
    start = time.monotonic()
    target_kv = empty_host(client.geometry.kv_shape(the_plan.stored), client.geometry.dtype)
    gathered = await gather(client, the_plan, timeout, target_kv)
    new = False
    if all(gathered.hits(the_plan)) and the_plan.stored:
        assemble(the_plan, gathered.kvs, client.geometry, target_kv, gathered.in_place)
        gathered.kvs.clear()  # the sources' tensors are not needed any more
        left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
        new = await client.store(target_kv, the_plan.target[: the_plan.stored], the_plan.salt, timeout=left)
    return result(the_plan, gathered, new)


async def compose_inline(
    client: ComposeClient,
    target_tokens: Sequence[int],
    parts: Sequence[KVPart],
    rope: RopeSpec | None,
    cache_salt: str,
    timeout: float | None,
) -> ComposeResult:
    """:meth:`AsyncClient.compose <lmcache_async.AsyncClient.compose>` on the inline
    transport: the :func:`plan` (every check, nothing sent), then
    :func:`gather_assemble_store`."""
    the_plan = plan(target_tokens, parts, rope, cache_salt, client.geometry, client.chunk_size)
    return await gather_assemble_store(client, the_plan, timeout)


async def remap_inline(
    client: ComposeClient, src: list[int], dst: list[int], cache_salt: str, tsalt: str, timeout: float | None
) -> RemapResult:
    """:meth:`AsyncClient.remap <lmcache_async.AsyncClient.remap>` on the inline transport
    (the composition of one unshifted part): a retrieve of the source's prefix the
    target's whole chunks take, then a store of what it found; ``timeout`` (resolved)
    covers both."""
    cs = client.chunk_size
    n = min(len(src), len(dst)) // cs * cs
    start = time.monotonic()
    kv = await client.retrieve(src[:n], cache_salt, timeout=timeout)
    if kv is None:
        return RemapResult(0, 0, False)
    hit = kv.shape[client.geometry.token_axis]
    left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
    new = await client.store(kv, dst[:hit], tsalt, timeout=left)
    return RemapResult(hit, hit, new)
