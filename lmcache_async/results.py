"""The public result and parameter types of the client's operations.

:class:`RemapResult` (what :meth:`AsyncClient.remap <lmcache_async.AsyncClient.remap>`
did), :class:`KVPart` (a cached range placed by :meth:`AsyncClient.compose
<lmcache_async.AsyncClient.compose>`), :class:`ComposeResult` and its
:class:`PartResult`, and :data:`TransferMode` (the client's ``transfer=``). They live
here, in a public module of their own, so that their ``repr``, pickles and API pages name
a path that stays: the modules that make them are private.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lmcache_async._protocol.wire import validate_cache_salt, validate_tokens

__all__ = ["ComposeResult", "KVPart", "PartResult", "RemapResult", "TransferMode"]

#: The client's ``transfer=``: ``"auto"`` (SHM when the server offers it and the segment
#: maps), ``"shm"`` to insist on SHM, ``"inline"`` (or its older name ``"pickle"``) to
#: insist on the tensors travelling inside the messages.
TransferMode = Literal["auto", "shm", "inline", "pickle"]


@dataclass(frozen=True, slots=True)
class RemapResult:
    """What :meth:`AsyncClient.remap <lmcache_async.AsyncClient.remap>` did.

    Attributes:
        retrieved_tokens: tokens of the source prefix read from the cache (only as far as
            the target's whole chunks reach).
        stored_tokens: tokens of the target prefix written with the source KV (equal to
            ``retrieved_tokens``).
        stored_new: whether the store added any chunk (False when all were cached).
    """

    retrieved_tokens: int
    stored_tokens: int
    stored_new: bool

    @property
    def hit(self) -> bool:
        return self.retrieved_tokens > 0


@dataclass(frozen=True, slots=True)
class KVPart:
    """One cached token range placed into a composed prompt.

    The part's KV is that of ``source_tokens[start:end]`` as the cache holds it for the
    prompt ``source_tokens`` (computed at positions ``start .. end - 1``).

    Attributes:
        source_tokens: the cached prompt (stored as a tuple); it must reach at least to
            the end of the chunk that holds ``end - 1`` (LMCache caches whole chunks).
        start: first token of the range (>= 0).
        end: one past the last token (``None``: ``len(source_tokens)``; resolved on
            construction).
        cache_salt: the source's namespace (``None``: the composition's ``cache_salt``).

    Raises:
        TypeError/ValueError: bad token ids or salt, or not ``0 <= start < end <=
            len(source_tokens)``.
    """

    source_tokens: Sequence[int]
    start: int = 0
    end: int | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        toks = tuple(validate_tokens(self.source_tokens, "source_tokens"))
        object.__setattr__(self, "source_tokens", toks)
        end = len(toks) if self.end is None else self.end
        for name, value in (("start", self.start), ("end", end)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"KVPart.{name} must be an int, got {type(value).__name__}")
        if not 0 <= self.start < end <= len(toks):
            raise ValueError(
                f"KVPart needs 0 <= start < end <= len(source_tokens) = {len(toks)}, got start={self.start}, "
                f"end={end}"
            )
        object.__setattr__(self, "end", end)
        if self.cache_salt is not None:
            validate_cache_salt(self.cache_salt)

    @property
    def length(self) -> int:
        """Tokens in the range."""
        assert self.end is not None
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class PartResult:
    """What a composition did with one part.

    Attributes:
        offset: the part's first position in the target.
        tokens: the part's length.
        shift: positions its keys moved (``offset - start``; 0: not rotated).
        hit: the part's range was cached.
        cached_tokens: the source's cached prefix that was read (whole chunks; 0 on a
            miss of the first chunk).
        placed: the part's tokens in the stored target (0 when nothing was stored, or
            when the part lies past the target's last whole chunk).
    """

    offset: int
    tokens: int
    shift: int
    hit: bool
    cached_tokens: int
    placed: int


@dataclass(frozen=True, slots=True)
class ComposeResult:
    """What :meth:`AsyncClient.compose <lmcache_async.AsyncClient.compose>` did.

    Attributes:
        parts: one :class:`PartResult` per part, in order.
        stored_tokens: the target's tokens handed to the store (its whole chunks the
            parts cover); 0 when a part missed (nothing is stored then).
        stored_new: the store added at least one chunk (False when every chunk was
            cached already, or nothing was stored).
    """

    parts: tuple[PartResult, ...]
    stored_tokens: int
    stored_new: bool

    @property
    def hit(self) -> bool:
        """Every part's range was cached."""
        return all(p.hit for p in self.parts)

    @property
    def missed(self) -> tuple[int, ...]:
        """Indices of the parts whose range was not cached."""
        return tuple(i for i, p in enumerate(self.parts) if not p.hit)
