"""The "use the client's default" sentinel and the one validator of timeouts.

Every ``timeout=`` of the library means the same thing and is checked by
:func:`check_timeout`:

* ``DEFAULT`` (the default value of every per-call ``timeout``): the client's own
  ``timeout``;
* ``None``: no deadline, wait as long as it takes;
* a finite number of seconds ``>= 0`` (``int`` or ``float``; ``0`` fails at the first
  wait);
* ``math.inf``: the same as ``None`` (it is returned as ``None``, so a caller never has
  to add to or sleep for an infinite number);
* a negative number or ``nan`` raises ``ValueError``, and what is not a number (a
  ``bool``, a string, ...) ``TypeError``, naming the argument, before anything is sent.

``DEFAULT`` is the only member of the enum :class:`DefaultType`, so a signature can say
``timeout: float | DefaultType | None = DEFAULT`` and type checkers narrow it with
``if timeout is DEFAULT``.
"""

from __future__ import annotations

import enum
import math
from typing import Final, Literal

__all__ = ["DEFAULT", "DefaultType", "check_timeout", "resolve_timeout"]


class DefaultType(enum.Enum):
    """Type of :data:`DEFAULT` (a single-member enum: a typed, picklable singleton)."""

    DEFAULT = "DEFAULT"

    def __repr__(self) -> str:  # shown in signatures and help(): "timeout=DEFAULT"
        return "DEFAULT"


#: "Use the client's default": the default value of every per-call ``timeout``.
DEFAULT: Final[Literal[DefaultType.DEFAULT]] = DefaultType.DEFAULT


def check_timeout(value: object, name: str = "timeout", *, allow_none: bool = True) -> float | None:
    """``value`` as a deadline in seconds: a float ``>= 0``, or ``None`` for no deadline.

    ``math.inf`` is returned as ``None``. With ``allow_none=False`` (a duration that must
    be finite, such as ``cleanup_grace``) ``None`` and ``inf`` are refused too.

    Raises:
        TypeError: ``value`` is neither ``None`` nor an ``int`` or ``float`` (a ``bool``,
            a string, ...); the message names ``name``.
        ValueError: a negative number or ``nan`` (or, with ``allow_none=False``, ``None``
            or ``inf``); the message names ``name``.
    """
    if value is None or (isinstance(value, float) and value == math.inf):
        if allow_none:
            return None
        raise ValueError(f"{name} must be a finite non-negative number of seconds, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        what = "a number of seconds (int or float)" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    if not value >= 0:
        what = (
            "a non-negative number of seconds or None"
            if allow_none
            else "a finite non-negative number of seconds"
        )
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def resolve_timeout(value: float | DefaultType | None, default: float | None) -> float | None:
    """``default`` when ``value`` is :data:`DEFAULT`, else ``check_timeout(value)``.

    Raises:
        TypeError, ValueError: as :func:`check_timeout`.
    """
    if value is DEFAULT:
        return default
    return check_timeout(value)
