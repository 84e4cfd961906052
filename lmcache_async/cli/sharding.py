"""Split one bulk job into N deterministic shards, one per host.

``lmcache-async remap-batch pairs.jsonl --shard I/N`` runs only the pairs of shard
``I`` (1-based, ``1 <= I <= N``). The shard of a pair is a function of the pair's
identity alone -- the key ``remap-batch`` already gives every line (a hash of its
source, target and salts; for an unreadable line, of its text) -- never of its line
number, so:

* the N shards are disjoint and together hold every line exactly once, whatever the
  hosts, the order they run in, or their Python versions;
* a pair keeps its shard when lines are inserted, removed or reordered, so
  ``--resume`` with the shard's own ``--report`` file stays valid after editing the
  input;
* identical lines fall into the same shard.

Pure functions only; nothing here touches the network.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Shard", "parse_shard", "select_shard", "shard_arg", "shard_of"]

T = TypeVar("T")

_SHARD_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True, slots=True)
class Shard:
    """Shard ``index`` of ``count`` (1-based: ``1 <= index <= count``)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        for name in ("index", "count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"shard {name} must be an int, got {type(value).__name__}")
        if self.count < 1:
            raise ValueError(f"shard count must be >= 1, got {self.count}")
        if not 1 <= self.index <= self.count:
            raise ValueError(f"shard index must be in 1..{self.count}, got {self.index}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def holds(self, key: str) -> bool:
        """Whether the item with identity ``key`` belongs to this shard."""
        return shard_of(key, self.count) == self.index


def parse_shard(text: str) -> Shard:
    """Parse ``"I/N"`` (e.g. ``"2/4"``) into a :class:`Shard`.

    Raises:
        ValueError: not of the form ``I/N`` with ``1 <= I <= N``.
    """
    if not isinstance(text, str):
        raise TypeError(f"a shard is a string 'I/N', got {type(text).__name__}")
    m = _SHARD_RE.match(text)
    if m is None:
        raise ValueError(f"a shard is written I/N with 1 <= I <= N (e.g. 1/4), got {text!r}")
    return Shard(int(m.group(1)), int(m.group(2)))


def shard_arg(text: str) -> Shard:
    """:func:`parse_shard` for ``argparse`` (``type=shard_arg``): its message on error."""
    try:
        return parse_shard(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shard_of(key: str, count: int) -> int:
    """The 1-based shard (of ``count``) that the item with identity ``key`` belongs to.

    ``key`` is any string (remap-batch passes its per-line key); the result is the
    first 8 bytes of its SHA-256, big-endian, modulo ``count``, plus one -- the same
    on every machine.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"shard count must be an int >= 1, got {count!r}")
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count + 1


def select_shard(items: Iterable[T], shard: Shard | None, key: Callable[[T], str]) -> list[T]:
    """The items of ``shard`` (all of them when ``shard`` is None), in input order."""
    if shard is None:
        return list(items)
    return [item for item in items if shard.holds(key(item))]
