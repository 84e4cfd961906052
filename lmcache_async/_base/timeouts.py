"""The one validator of timeouts (:func:`check_timeout`, :func:`resolve_timeout`): what
every ``timeout=`` means is in :mod:`lmcache_async.defaults`, the public home of
:data:`~lmcache_async.defaults.DEFAULT` and :class:`~lmcache_async.defaults.DefaultType`
(imported here too, for the library's modules).

``math.inf`` is returned as ``None``, so a caller never has to add to or sleep for an
infinite number.
"""

from __future__ import annotations

import math

from lmcache_async.defaults import DEFAULT, DefaultType

__all__ = ["DEFAULT", "DefaultType", "check_duration", "check_timeout", "resolve_timeout"]


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


def check_duration(value: object, name: str) -> float:
    """``value`` as a duration that must pass: a finite number of seconds ``> 0``.

    Raises:
        ValueError: anything else (a ``bool``, a string, 0, a negative number, ``nan``,
            ``inf``); the message names ``name``.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def resolve_timeout(value: float | DefaultType | None, default: float | None) -> float | None:
    """``default`` when ``value`` is :data:`DEFAULT`, else ``check_timeout(value)``.

    Raises:
        TypeError, ValueError: as :func:`check_timeout`.
    """
    if value is DEFAULT:
        return default
    return check_timeout(value)
