"""Each operation as a value: a frozen call holding its checked arguments, what its record
says (``name``, ``asked``, ``salt``), how it runs over the :class:`Operations` of the
registration it runs under (``run``, which aligns to that registration's chunk size), and
what its result says of it (``finish``, for observers).

``AsyncClient`` checks the arguments, makes the call and hands it to its runner, which
runs it through :meth:`Session.run <lmcache_async._engine.session.Session.run>`. Every call
class is in :data:`CALLS`: the cancellation matrix (``tests/unit/test_operations_cancellation.py``)
and the documented record names (:attr:`lmcache_async.observe.Operation.name`) are held
to it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import torch

from lmcache_async._engine.ops import Operations
from lmcache_async._engine.ops.base import Configs, RemapResult
from lmcache_async._engine.runner import OpState

if TYPE_CHECKING:
    from lmcache_async._engine.cuda.copies import Mark
    from lmcache_async._engine.ops.shm import Fill, Source
    from lmcache_async.observe import Operation

__all__ = [
    "CALLS",
    "Call",
    "ComposeCall",
    "LookupCall",
    "RemapCall",
    "RetrieveCall",
    "StoreCall",
    "align",
    "compose_record",
]

T = TypeVar("T")


def align(n: int, chunk_size: int) -> int:
    """``n`` rounded down to whole chunks."""
    return n // chunk_size * chunk_size


class Call(Protocol[T]):
    """What the runner and the session need of a call."""

    name: ClassVar[str]

    @property
    def asked(self) -> int:
        """Tokens the caller gave (the record's ``tokens_asked``)."""
        ...

    @property
    def salt(self) -> str:
        """The cache salt the record hashes."""
        ...

    def run(self, ops: Operations, op: OpState) -> Awaitable[T]:
        """The operation's sequence over ``ops`` (the current registration's)."""
        ...

    def finish(self, record: Operation, result: T) -> None:
        """Fill in what ``result`` says of the operation (for observers)."""
        ...


def _hit(record: Operation, hit: int) -> None:
    record.tokens_hit = hit
    record.chunks = hit // record.chunk_size if record.chunk_size else 0
    if hit == 0:
        record.outcome = "miss"


@dataclass(frozen=True, slots=True)
class LookupCall:
    """``lookup``: the longest cached chunk-aligned prefix of ``toks``."""

    name: ClassVar[str] = "lookup"
    toks: list[int]
    salt: str = ""
    configs: Configs = None

    @property
    def asked(self) -> int:
        return len(self.toks)

    def run(self, ops: Operations, op: OpState) -> Awaitable[int]:
        return ops.lookup(op, self.toks, align(len(self.toks), ops.reg.chunk_size), self.salt, self.configs)

    @staticmethod
    def finish(record: Operation, hit: int) -> None:
        _hit(record, hit)


@dataclass(frozen=True, slots=True)
class RetrieveCall:
    """``retrieve``: the KV of the longest cached prefix of ``toks`` (into ``out`` when
    given, its token axis ``axis``; ``mark``: the KV goes to a GPU)."""

    name: ClassVar[str] = "retrieve"
    toks: list[int]
    salt: str = ""
    configs: Configs = None
    out: torch.Tensor | None = None
    axis: int = 2
    mark: Mark | None = None

    @property
    def asked(self) -> int:
        return len(self.toks)

    def run(self, ops: Operations, op: OpState) -> Awaitable[torch.Tensor | None]:
        cs = ops.reg.chunk_size
        n = align(len(self.toks), cs)
        if self.out is not None:  # a new chunk size may align further than ``out`` reaches
            n = min(n, align(self.out.shape[self.axis], cs))
        return ops.retrieve(op, self.toks, n, self.salt, self.configs, self.out, mark=self.mark)

    @staticmethod
    def finish(record: Operation, kv: torch.Tensor | None) -> None:
        if kv is None:
            record.outcome = "miss"
            return
        _hit(record, kv.shape[kv.dim() - 2])  # the token axis: [2, L, T, D] or [L, T, D]
        record.bytes_moved += kv.numel() * kv.element_size()


@dataclass(frozen=True, slots=True)
class StoreCall:
    """``store``: ``kv`` (checked: it covers ``toks``) under ``toks``' whole chunks."""

    name: ClassVar[str] = "store"
    kv: torch.Tensor
    toks: list[int]
    salt: str = ""
    configs: Configs = None
    mark: Mark | None = None

    @property
    def asked(self) -> int:
        return len(self.toks)

    def run(self, ops: Operations, op: OpState) -> Awaitable[bool]:
        end = align(len(self.toks), ops.reg.chunk_size)
        return ops.store(op, self.kv, self.toks, end, self.salt, self.configs, mark=self.mark)

    @staticmethod
    def finish(record: Operation, new: bool) -> None:
        cs = record.chunk_size or 1
        record.tokens_stored = record.tokens_asked // cs * cs
        record.chunks = record.tokens_asked // cs
        record.stored_new = new


@dataclass(frozen=True, slots=True)
class RemapCall:
    """``remap`` in the pool (SHM): ``src``'s KV stored under ``dst`` (``salt``, ``tsalt``),
    as far as the target's whole chunks take."""

    name: ClassVar[str] = "remap"
    src: list[int]
    dst: list[int]
    salt: str = ""
    tsalt: str = ""

    @property
    def asked(self) -> int:
        return len(self.src)

    def run(self, ops: Operations, op: OpState) -> Awaitable[RemapResult]:
        n = align(min(len(self.src), len(self.dst)), ops.reg.chunk_size)
        return ops.remap(op, self.src, self.dst, n, self.salt, self.tsalt)

    @staticmethod
    def finish(record: Operation, result: RemapResult) -> None:
        _hit(record, result.retrieved_tokens)
        record.tokens_stored = result.stored_tokens
        record.stored_new = result.stored_new


@dataclass(frozen=True, slots=True)
class ComposeCall:
    """``compose`` in the pool (SHM): ``sources`` (each ``(tokens, read, salt)``) read
    into the reserved slots of ``target`` (``stored`` tokens, whole chunks of the plan's
    chunk size) by ``fill``; its result is the tokens each source had cached and whether
    a chunk was added."""

    name: ClassVar[str] = "compose"
    sources: Sequence[Source]
    target: list[int]
    stored: int
    salt: str
    fill: Fill

    @property
    def asked(self) -> int:
        return len(self.target)

    def run(self, ops: Operations, op: OpState) -> Awaitable[tuple[list[int], bool]]:
        return ops.compose_in_pool(op, self.sources, self.target, self.stored, self.salt, self.fill)

    def finish(self, record: Operation, result: tuple[Sequence[int], bool]) -> None:
        compose_record(record, [read for _, read, _ in self.sources], result[0], self.stored, result[1])


def compose_record(
    record: Operation, needed: Sequence[int], cached: Sequence[int], stored: int, new: bool
) -> None:
    """A composition's record: ``needed`` the tokens each source must give, ``cached``
    those found, ``stored`` the target's tokens (whole chunks) stored when every source hit."""
    hit = all(c >= n for c, n in zip(cached, needed, strict=True))
    record.tokens_hit = sum(cached)
    record.tokens_stored = stored if hit else 0
    record.chunks = record.tokens_stored // record.chunk_size if record.chunk_size else 0
    record.stored_new = new
    if not hit:
        record.outcome = "miss"


#: Every call class: one per operation sequence (:class:`Operations`).
CALLS: tuple[type[Any], ...] = (LookupCall, RetrieveCall, StoreCall, RemapCall, ComposeCall)
