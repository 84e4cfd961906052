"""The one place where the time left of a deadline becomes a wait's timeout.

Every library the client waits through spells "no time left" and "no deadline"
differently: aiohttp reads ``ClientTimeout(total=0)`` as *no timeout at all* (and rounds
a deadline above 5 s up to the next whole loop second), ``asyncio.timeout(None)`` never
expires, a ZMQ poll of ``-1`` waits for ever. The rules here, for every wait of the
library:

* ``None`` only ever means "no deadline".
* A deadline already passed raises :class:`~lmcache_async.errors.LMCacheTimeoutError`
  before anything is sent (:meth:`Deadline.left`, :func:`check_left`).
* A converter (:func:`http_timeout`, :func:`async_timeout`, :func:`zmq_poll_ms`) is given
  ``None`` or the time left, and its result always expires at that time, never later.
"""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp

from lmcache_async.errors import LMCacheTimeoutError

__all__ = ["Deadline", "async_timeout", "check_left", "http_timeout", "zmq_poll_ms"]


class Deadline:
    """The deadline of one call: ``timeout`` seconds from now (``None``: none).

    Args:
        timeout: a checked timeout (``>= 0`` or ``None``).
        what: the operation, as :class:`~lmcache_async.errors.LMCacheTimeoutError` names it.
    """

    __slots__ = ("end", "start", "what")

    def __init__(self, timeout: float | None, what: str) -> None:
        self.start = time.monotonic()
        self.end = None if timeout is None else self.start + timeout
        self.what = what

    def elapsed(self) -> float:
        """Seconds since the deadline was set."""
        return time.monotonic() - self.start

    def left(self) -> float | None:
        """Seconds left, always ``> 0`` (``None``: no deadline).

        Raises:
            LMCacheTimeoutError: the deadline has passed (``timeout=0`` included).
        """
        if self.end is None:
            return None
        left = self.end - time.monotonic()
        if not left > 0:
            raise LMCacheTimeoutError(self.what, self.elapsed())
        return left

    def expired(self) -> bool:
        """Whether the deadline has passed (never, without one)."""
        return self.end is not None and time.monotonic() >= self.end


def check_left(left: float | None, what: str, elapsed: float = 0.0) -> float | None:
    """``left`` (seconds left of a deadline; ``None``: none), if time is left.

    Raises:
        LMCacheTimeoutError: ``left <= 0`` (named ``what``, after ``elapsed`` seconds).
    """
    if left is not None and not left > 0:
        raise LMCacheTimeoutError(what, elapsed)
    return left


def http_timeout(left: float | None) -> aiohttp.ClientTimeout:
    """The aiohttp timeout of a request (its body read included) with ``left`` seconds
    (``None``: no deadline): exactly ``left`` (``ceil_threshold`` is infinite, so aiohttp
    does not round the deadline up to a whole second).

    Raises:
        ValueError: ``left <= 0``, which aiohttp would read as *no timeout*: the caller
            must check its deadline first (:meth:`Deadline.left`).
    """
    if left is None:
        return aiohttp.ClientTimeout(total=None)
    if not left > 0:
        raise ValueError(f"an HTTP request needs time left > 0 or None, got {left!r}")
    return aiohttp.ClientTimeout(total=left, ceil_threshold=math.inf)


def async_timeout(left: float | None) -> asyncio.Timeout:
    """``asyncio.timeout`` for ``left`` seconds (``None``: no deadline; ``<= 0``: expires
    at the first await)."""
    return asyncio.timeout(None if left is None else max(left, 0.0))


def zmq_poll_ms(left: float | None) -> int:
    """A ZMQ poll's timeout in milliseconds for ``left`` seconds: ``-1`` (for ever) only
    for ``None``; otherwise at least 1 ms, rounded up, so a poll with time left never
    returns before it (``0`` would not wait at all, a rounding down would spin)."""
    if left is None:
        return -1
    return max(1, math.ceil(left * 1000))
