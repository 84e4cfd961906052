"""What every ``timeout=`` of the library means, and :data:`DEFAULT`, "use the client's
timeout", the default value of every per-call ``timeout``.

A ``timeout`` is one of:

* :data:`DEFAULT` (the default value of every per-call ``timeout``): the client's own
  ``timeout``;
* ``None``: no deadline, wait as long as it takes;
* a finite number of seconds ``>= 0`` (``int`` or ``float``; ``0``: the deadline has
  passed, so the call raises :class:`~lmcache_async.errors.LMCacheTimeoutError` at once,
  before anything is sent; a bulk call fails each item so, and ``drain`` returns
  ``False`` unless nothing is left); a deadline is kept to the millisecond, never
  rounded up;
* ``math.inf``: the same as ``None``;
* a negative number or ``nan`` raises ``ValueError``, and what is not a number (a
  ``bool``, a string, ...) ``TypeError``, naming the argument, before anything is sent.

:data:`DEFAULT` is the only member of the enum :class:`DefaultType`, so a signature can
say ``timeout: float | DefaultType | None = DEFAULT`` and type checkers narrow it with
``if timeout is DEFAULT``. Both also import from the package (``lmcache_async.DEFAULT``).
"""

from __future__ import annotations

import enum
from typing import Final, Literal

__all__ = ["DEFAULT", "DefaultType"]


class DefaultType(enum.Enum):
    """Type of :data:`DEFAULT` (a single-member enum: a typed, picklable singleton)."""

    DEFAULT = "DEFAULT"

    def __repr__(self) -> str:  # shown in signatures and help(): "timeout=DEFAULT"
        return "DEFAULT"


DEFAULT: Final[Literal[DefaultType.DEFAULT]] = DefaultType.DEFAULT
""""Use the client's default": the default value of every per-call ``timeout`` (the
client's own ``timeout``); ``repr`` ``DEFAULT``, pickles to itself."""
