"""The identity of one remap pair: the key that ``remap-batch`` reports, shards and resumes
by, and that :mod:`lmcache_async.ray` writes in each output row (so both agree).

Pure and stdlib only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

__all__ = ["pair_key", "text_key"]


def text_key(text: str) -> str:
    """The first 20 hex digits of the SHA-256 of ``text`` (UTF-8; lone surrogates kept as
    ``surrogateescape`` bytes, for lines that are not UTF-8)."""
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:20]


def pair_key(
    source: Sequence[int] | object,
    target: Sequence[int] | object,
    cache_salt: object = "",
    target_cache_salt: object = None,
) -> str:
    """The key of the pair: :func:`text_key` of ``[source, target, cache_salt,
    target_cache_salt]`` as compact JSON (token lists as JSON arrays; anything JSON cannot
    write, as its ``str``)."""
    canon = json.dumps([source, target, cache_salt, target_cache_salt], separators=(",", ":"), default=str)
    return text_key(canon)
