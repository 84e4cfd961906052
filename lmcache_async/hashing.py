"""The LMCache server's chunk hashes, computed from the tokens (sans-IO).

An LMCache MP server names each stored chunk by a rolling hash of the tokens up to the
end of that chunk. With the server's default ``--hash-algorithm blake3`` (the only
setting a client can reproduce: the others seed vLLM's hash with the server's
``PYTHONHASHSEED`` or random bytes), the chain is::

    NONE = blake3(int64_be(0) || uint32_be(0))
    h_0  = blake3(NONE    || uint32_be(t_0) || ... || uint32_be(t_{CS-1}))
    h_i  = blake3(h_{i-1} || the big-endian uint32 tokens of chunk i)

over whole chunks only (a partial last chunk has no hash). The hashes do not depend on
the model, the cache salt or the rank: the same tokens have the same hashes under every
model and salt. These are the ``block_hashes`` of the server's KV events
(:mod:`lmcache_async.events`), so chunk ``i`` of a prompt ends at token ``(i + 1) * CS``.

Uses the ``blake3`` package (the reference binding of the BLAKE3 reference
implementation; the standard library has no BLAKE3).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol

import blake3

from lmcache_async.errors import UnsupportedHashAlgorithmError

__all__ = [
    "DEFAULT_HASH_ALGORITHM",
    "NONE_HASH",
    "HashingServer",
    "check_hash_algorithm",
    "chunk_hashes",
    "hash_algorithm_of",
]

#: The only ``--hash-algorithm`` whose hashes a client can compute.
DEFAULT_HASH_ALGORITHM: Final = "blake3"
#: What lmcache_async's embedded server (:mod:`lmcache_async.testing`) says it hashes with
#: (no LMCache server has this setting).
EMBEDDED_HASH_ALGORITHM: Final = "blake2b"
#: The parent hash of a sequence's first chunk.
NONE_HASH: Final[bytes] = blake3.blake3(b"\0" * 12).digest()


class HashingServer(Protocol):
    """What :func:`chunk_hashes` reads of a client (``AsyncClient`` and ``Client`` have it)."""

    @property
    def chunk_size(self) -> int: ...
    @property
    def hash_algorithm(self) -> str: ...
    @property
    def http_url(self) -> str: ...


def _uint32_be(tokens: Sequence[int]) -> bytes:
    words = array.array("I", tokens)  # refuses anything outside [0, 2**32)
    if sys.byteorder == "little":
        words.byteswap()
    return words.tobytes()


def chunk_hashes(
    tokens: Sequence[int], chunk_size: int | HashingServer, *, start: int = 0, end: int | None = None
) -> list[bytes]:
    """The server's chunk hashes (32 bytes each) of ``tokens``, in chunk order.

    ``chunk_hashes(tokens, client)`` (an open ``AsyncClient`` or ``Client``) computes them
    at that server's chunk size, after checking that the server hashes with blake3 (its
    :attr:`~lmcache_async.AsyncClient.hash_algorithm`, read at connect);
    ``chunk_hashes(tokens, 256)`` at any chunk size, with no server to check.

    Args:
        tokens: token ids (ints in ``[0, 2**32)``; a list, tuple, or anything
            :func:`~lmcache_async._protocol.wire.validate_tokens` accepts).
        chunk_size: the server's chunk size (``AsyncClient.chunk_size``), or an open client.
        start: a token position (a multiple of ``chunk_size``): only the hashes of the
            chunks from there on are returned (the chain is still computed from the
            first token).
        end: a token position (a multiple of ``chunk_size``): only the hashes of the
            chunks before it; default: the last whole chunk.

    Returns:
        One hash per whole chunk in the range (a partial last chunk has none).

    Raises:
        UnsupportedHashAlgorithmError: the client's server hashes with another algorithm.
        ClientStateError: the client is not open.
        TypeError/ValueError: bad tokens. ValueError: a chunk size that is not an int
            >= 1 (a bool, float, str or ``None`` included) nor a client, or unaligned
            bounds.
    """
    from lmcache_async._protocol.wire import validate_tokens

    if not isinstance(chunk_size, int) and hasattr(chunk_size, "hash_algorithm"):
        # a client: its server's chunk size, if blake3
        check_hash_algorithm(chunk_size.hash_algorithm, chunk_size.http_url)
        chunk_size = chunk_size.chunk_size
    toks = validate_tokens(tokens)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    whole = len(toks) // chunk_size * chunk_size
    stop = whole if end is None else end
    for name, value in (("start", start), ("end", stop)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % chunk_size:
            raise ValueError(
                f"{name} must be a non-negative multiple of the chunk size {chunk_size}, got {value!r}"
            )
    if stop > whole:
        raise ValueError(f"end ({stop}) is past the last whole chunk ({whole} tokens)")
    if start > stop:
        raise ValueError(f"start ({start}) exceeds end ({stop})")
    packed = _uint32_be(toks[:stop])
    step = 4 * chunk_size
    out: list[bytes] = []
    prev = NONE_HASH
    for i in range(0, 4 * stop, step):
        prev = blake3.blake3(prev + packed[i : i + step]).digest()
        if i >= 4 * start:
            out.append(prev)
    return out


def hash_algorithm_of(config: Mapping[str, Any] | None, status: Mapping[str, Any] | None) -> str | None:
    """The server's hash algorithm from ``/status`` ``hash_algorithm`` or ``/config``
    ``mp.hash_algorithm``, or ``None`` when neither says."""
    for doc, path in ((status, ("hash_algorithm",)), (config, ("mp", "hash_algorithm"))):
        value: Any = doc
        for part in path:
            value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(value, str) and value:
            return value
    return None


def check_hash_algorithm(algorithm: str | None, where: str) -> None:
    """Refuse a server whose chunk hashes cannot be computed here.

    ``None`` (the server does not say: an older build) is taken as the default.

    Raises:
        UnsupportedHashAlgorithmError: another algorithm than blake3.
    """
    if algorithm == EMBEDDED_HASH_ALGORITHM:
        raise UnsupportedHashAlgorithmError(
            f"{where} hashes chunks with {algorithm!r}: it is lmcache_async's embedded server "
            "(lmcache_async.testing, `lmcache-async serve`, `make demo`), which has no LMCache "
            "chunk hashes; use a real LMCache server (`lmcache server`, its default "
            "--hash-algorithm blake3) for chunk hashes, KV-event routing or targeted deletes"
        )
    if algorithm is not None and algorithm != DEFAULT_HASH_ALGORITHM:
        raise UnsupportedHashAlgorithmError(
            f"{where} hashes chunks with {algorithm!r}: only the default 'blake3' can be "
            "computed by a client (the vLLM hashes the other settings use are seeded with "
            "the server's PYTHONHASHSEED or random bytes); start the server with "
            "--hash-algorithm blake3 to use chunk hashes, KV-event routing or targeted deletes"
        )
