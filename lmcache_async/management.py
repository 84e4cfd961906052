"""Management calls of an LMCache MP server: warm a prefix, delete a prefix's
chunks, clear L1, list capabilities. The ``AsyncClient`` methods
(:meth:`~lmcache_async.AsyncClient.warm`, :meth:`~lmcache_async.AsyncClient.delete`,
:meth:`~lmcache_async.AsyncClient.clear`, :meth:`~lmcache_async.AsyncClient.experimental`;
the blocking ``Client``'s twins) check their arguments and the client's state, then call
the functions of the same names here with what each needs (the session's RPC, the HTTP
metadata, the model name): nothing here sees a client.

Each is a server-wide action with effects beyond the caller's own data; the danger of
each is written on its method (docs/guides/routing.md, "Management calls").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import quote

from lmcache_async._base.deadline import Deadline
from lmcache_async._protocol.wire import Op, Reply
from lmcache_async._transport.metadata import Metadata, decode_json, excerpt
from lmcache_async.errors import (
    HTTPStatusError,
    LMCacheTimeoutError,
    ProtocolError,
    ServerError,
)
from lmcache_async.hashing import DEFAULT_HASH_ALGORITHM, hash_algorithm_of

__all__ = [
    "MAX_DELETE_KEYS",
    "RPC",
    "DeleteResult",
    "Tier",
    "WarmResult",
    "check_delete",
    "check_force",
    "clear",
    "delete",
    "experimental",
    "hash_algorithm",
    "kv_rank",
    "object_keys",
    "warm",
]

#: Where ``delete`` deletes: the server's L1, its L2, or both.
Tier = Literal["l1", "l2", "all"]
#: How often ``warm`` asks whether the prefetch completed.
WARM_POLL_INTERVAL_S: Final = 0.05

#: The most keys one ``DELETE /cache/objects`` takes (the server's ``MAX_DELETE_BATCH``).
MAX_DELETE_KEYS: Final = 10_000
#: The most object groups of a model, for the bound on a prefetch's ``total_keys``.
MAX_OBJECT_GROUPS: Final = 64


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What a warm prefetch reported.

    Attributes:
        chunks: whole chunks of the prompt the server resolved (0: shorter than a chunk).
        found: object keys the server found in L2 *or already in L1* (it does not tell
            the two apart: "found" is not "loaded by this call").
        total: object keys asked for (chunks x ranks x object groups).
    """

    chunks: int
    found: int
    total: int


@dataclass(frozen=True, slots=True)
class DeleteResult:
    """What ``DELETE /cache/objects`` reported: keys deleted, and keys skipped because a
    reader or writer held them (``force`` not given). Keys that were not resident count
    in neither."""

    deleted: int
    skipped: int


def kv_rank(world_size: int, worker_id: int) -> int:
    """The server's ``kv_rank`` of one worker of a single-node world (``ObjectKey.ComputeKVRank``)."""
    return world_size << 24 | worker_id << 16 | world_size << 8 | worker_id


def object_keys(
    hashes: Sequence[bytes], model_name: str, world_size: int, cache_salt: str
) -> list[dict[str, Any]]:
    """The JSON object keys (``EncodedObjectKey``) of ``hashes`` for every rank of
    ``world_size``, object group 0 (what this client stores)."""
    return [
        {
            "chunk_hash_hex": h.hex(),
            "model_name": model_name,
            "kv_rank": kv_rank(world_size, w),
            "object_group_id": 0,
            "cache_salt": cache_salt,
        }
        for h in hashes
        for w in range(world_size)
    ]


async def _http_json(
    meta: Metadata, method: str, path: str, body: Any, deadline: Deadline
) -> tuple[int, Any, str]:
    """``method path`` with a JSON body, within ``deadline``: ``(status, document,
    detail)``. A 2xx answer must be JSON (its document); another status's document is
    ``None`` when its body is not JSON. ``detail`` is the ``detail`` of a JSON object, or
    the start of the body, cut to an excerpt for an error message.

    Raises:
        AuthenticationError: 401. LMCacheConnectionError (:meth:`Metadata.request`).
        LMCacheTimeoutError: named ``deadline.what``, the deadline passed (before the
            request: nothing sent).
        ProtocolError: a 2xx answer that is not JSON, or nested too deeply; a body longer
        than :data:`~lmcache_async._transport.metadata.MAX_HTTP_BODY_BYTES`.
    """
    try:
        status, raw = await meta.request(method, path, deadline.left(), json_body=body)
    except LMCacheTimeoutError as exc:
        if exc.operation == deadline.what:
            raise
        raise LMCacheTimeoutError(deadline.what, deadline.elapsed()) from None  # named by the call
    what = f"{method} {meta.http_url}{path}"
    if 200 <= status < 300:
        doc = decode_json(raw, what) if raw else None
    else:
        try:
            doc = decode_json(raw, what) if raw else None
        except ProtocolError:
            doc = None
    if isinstance(doc, dict) and "detail" in doc:
        detail = excerpt(str(doc["detail"]))
    else:
        detail = excerpt(raw) if doc is None else excerpt(repr(doc))
    return status, doc, detail


def _count(doc: dict[str, Any], name: str, most: int) -> int:
    """``doc[name]`` when it is an int from 0 to ``most``, else -1."""
    value = doc.get(name)
    if type(value) is not int or not 0 <= value <= most:
        return -1
    return value


async def _warm_prefetch(
    meta: Metadata,
    model_name: str,
    world_size: int,
    tokens: list[int],
    cache_salt: str,
    timeout: float | None,
    poll_interval: float,
) -> WarmResult:
    """``POST /cache/prefetches`` then poll ``GET /cache/prefetches/{id}`` until it
    completes, all within ``timeout`` seconds (a poll is never sent past the deadline:
    :class:`LMCacheTimeoutError` instead)."""
    deadline = Deadline(timeout, "warm")
    body = {
        "model_name": model_name,
        "world_size": world_size,
        "token_ids": tokens,
        "cache_salt": cache_salt,
        "source_tier": "l2",
        "target_tier": "l1",
    }
    status, doc, detail = await _http_json(meta, "POST", "/cache/prefetches", body, deadline)
    url = f"{meta.http_url}/cache/prefetches"
    if status == 404:
        raise ServerError(f"{meta.http_url} has no warm prefetch route (POST /cache/prefetches: 404)")
    if status == 503:
        raise ServerError(f"warm: {meta.http_url} cannot warm {model_name!r}: {detail}")
    if status not in (200, 202):
        raise HTTPStatusError(status, url, detail, f"warm: POST {url} failed with HTTP {status}: {detail}")
    if not isinstance(doc, dict) or _count(doc, "chunks", len(tokens)) < 0:
        raise ProtocolError(f"warm: POST /cache/prefetches answered {excerpt(repr(doc))}")
    chunks = doc["chunks"]
    if doc.get("status") == "noop":
        return WarmResult(0, 0, 0)
    request_id = doc.get("request_id")
    if not isinstance(request_id, str) or not 0 < len(request_id) <= 256:
        raise ProtocolError(f"warm: POST /cache/prefetches answered {excerpt(repr(doc))}")
    poll = f"/cache/prefetches/{quote(request_id, safe='')}"
    # Keys asked for: chunks x ranks x object groups.
    most_keys = chunks * world_size * MAX_OBJECT_GROUPS
    while True:
        status, doc, detail = await _http_json(meta, "GET", poll, None, deadline)
        if status != 200:
            raise HTTPStatusError(
                status,
                f"{url}/{request_id}",
                detail,
                f"warm: polling prefetch {request_id} got HTTP {status}",
            )
        if not isinstance(doc, dict):
            raise ProtocolError(f"warm: prefetch {request_id} answered {excerpt(repr(doc))}")
        if doc.get("status") == "completed":
            total = _count(doc, "total_keys", most_keys)
            found = _count(doc, "found_keys", max(total, 0))
            if total < 0 or found < 0:
                raise ProtocolError(f"warm: prefetch {request_id} answered {excerpt(repr(doc))}")
            return WarmResult(chunks, found, total)
        left = deadline.left()  # past the deadline: LMCacheTimeoutError, no poll sent
        await asyncio.sleep(poll_interval if left is None else min(poll_interval, left))


async def _delete_keys(
    meta: Metadata,
    keys: list[dict[str, Any]],
    tier: Tier,
    force: bool,
    timeout: float | None,
) -> DeleteResult:
    """``DELETE /cache/objects`` in batches of at most :data:`MAX_DELETE_KEYS` keys, all
    within ``timeout`` seconds (a batch is never sent past the deadline:
    :class:`LMCacheTimeoutError` instead)."""
    deleted = skipped = 0
    deadline = Deadline(timeout, "delete")
    url = f"{meta.http_url}/cache/objects"
    for i in range(0, len(keys), MAX_DELETE_KEYS):
        batch = keys[i : i + MAX_DELETE_KEYS]
        body = {"keys": batch, "tier": tier, "force": force, "adapter": None}
        status, doc, detail = await _http_json(meta, "DELETE", "/cache/objects", body, deadline)
        if status == 404 and not isinstance(doc, dict):
            raise ServerError(f"{meta.http_url} has no targeted delete (DELETE /cache/objects: 404)")
        if status != 200:
            raise HTTPStatusError(
                status, url, detail, f"delete: DELETE {url} failed with HTTP {status}: {detail}"
            )
        if not isinstance(doc, dict):
            raise ProtocolError(f"delete: DELETE /cache/objects answered {excerpt(repr(doc))}")
        if doc.get("ok") is False:
            raise ServerError(
                f"delete: the server failed part of the delete: {excerpt(str(doc.get('error')))}"
            )
        # Each key is deleted or skipped at most once per tier it is deleted from.
        most = len(batch) * (2 if tier == "all" else 1)
        d = _count(doc, "deleted", most)
        s = _count(doc, "skipped", most)
        if d < 0 or s < 0 or d + s > most:
            raise ProtocolError(f"delete: DELETE /cache/objects answered {excerpt(repr(doc))}")
        deleted += d
        skipped += s
    return DeleteResult(deleted, skipped)


# --------------------------------------------------------------------------- the client's calls
# Each is given what it needs by the ``AsyncClient`` method of the same name, which checks
# the arguments, the timeout and the client's state first (nothing is sent before).

#: A one-shot RPC through the client's session (:meth:`Session.call
#: <lmcache_async._engine.session.Session.call>`): ``(op, args, timeout) -> reply``.
RPC = Callable[[Op, tuple[Any, ...], float | None], Awaitable[Reply]]


def hash_algorithm(meta: Metadata) -> str:
    """The server's hash algorithm from its ``/status`` or ``/config`` read at connect
    (``"blake3"``, the default, when neither says: an older build)."""
    return hash_algorithm_of(meta.cached("config"), meta.cached("status")) or DEFAULT_HASH_ALGORITHM


async def experimental(call: RPC, timeout: float | None) -> frozenset[str]:
    """The experimental features the server advertises (``get_experimental``): 0.5.6 says
    ``"kv_event_stream"`` when its event channel is on; 0.5.7 lists only features its
    modules add (``"transfer_query"``), and an empty set is usual.

    Raises:
        LMCacheTimeoutError: no answer within ``timeout``. ProtocolError: not a list of str.

    Cancellation: the reply is dropped when it comes.
    """
    value = (await call(Op.GET_EXPERIMENTAL, (), timeout)).value()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProtocolError(f"get_experimental answered {value!r}")
    return frozenset(value)


@dataclass(frozen=True, slots=True)
class BlockAllocation:
    """One request's new GPU blocks and tokens, as a serving engine reports them."""

    req_id: str
    new_block_ids: Sequence[int]
    new_token_ids: Sequence[int]


def check_allocations(records: object) -> list[dict[str, Any]]:
    """``records`` (a sequence of :class:`BlockAllocation`) as the wire's maps.

    Raises:
        TypeError: not a sequence of BlockAllocation, or an id that is not an int.
    """
    if not isinstance(records, Sequence) or isinstance(records, str | bytes):
        raise TypeError(f"records must be a sequence of BlockAllocation, got {type(records).__name__}")
    out = []
    for r in records:
        if not isinstance(r, BlockAllocation):
            raise TypeError(f"records must hold BlockAllocation, got {type(r).__name__}")
        blocks, toks = list(r.new_block_ids), list(r.new_token_ids)
        if not isinstance(r.req_id, str) or not all(type(i) is int for i in (*blocks, *toks)):
            raise TypeError("a BlockAllocation holds a str req_id and int ids")
        out.append({"req_id": r.req_id, "new_block_ids": blocks, "new_token_ids": toks})
    return out


async def report_block_allocation(
    call: RPC, instance_id: int, model_name: str, records: list[dict[str, Any]], timeout: float | None
) -> None:
    """Report block allocations to the server's event bus (``report_block_allocation``,
    observability only: nothing is stored).

    Raises:
        LMCacheTimeoutError: no answer within ``timeout``.

    Cancellation: the report may still reach the server.
    """
    await call(Op.REPORT_BLOCK_ALLOCATION, (instance_id, model_name, records), timeout)


def check_force(force: object) -> None:
    """``TypeError`` unless ``force`` is a bool."""
    if not isinstance(force, bool):
        raise TypeError(f"force must be a bool, got {type(force).__name__}")


async def clear(call: RPC, force: bool, timeout: float | None) -> None:
    """DANGER: empty the server's L1 cache for EVERY model and EVERY cache salt, not only
    the client's (the ``clear`` RPC; L2 is untouched).

    ``force`` must be given: ``False`` frees what no reader or writer holds (locked
    objects and live reservations stay); ``True`` frees everything, including objects
    other clients are reading and reservations they are filling (their operations may
    then fail or read freed memory: only on a server nobody else uses). The removals are
    published as ``removed`` KV events.

    Raises:
        TypeError: ``force`` is not a bool (nothing sent).
        LMCacheTimeoutError: no answer within ``timeout`` (the clear may still run).

    Cancellation: the clear may still run on the server.
    """
    await call(Op.CLEAR, (force,), timeout)


async def warm(
    meta: Metadata,
    model_name: str,
    world_size: int,
    tokens: list[int],
    cache_salt: str,
    timeout: float | None,
) -> WarmResult:
    """Load the chunks of ``tokens`` (the client's model, ``cache_salt``, every rank) from
    the server's L2 into its L1 and leave them there (``POST /cache/prefetches``, polled
    every 50 ms until it completes, all within ``timeout``).

    Best effort: the chunks are resident but unlocked, so the next eviction may take them;
    chunks missing from L2 are skipped (gaps allowed); ``found`` counts chunks already in
    L1 too. Needs a server with an L2 adapter (without one, only the chunks already in L1
    are found) and a layout registered for the model.

    Raises:
        ServerError: the server cannot warm (no layout for the model, no such route).
        LMCacheTimeoutError: not completed within ``timeout`` (the prefetch may go on).
        ValueError/TypeError: bad tokens or salt (nothing sent).

    Cancellation: the polling stops; the server's prefetch goes on.
    """
    return await _warm_prefetch(
        meta, model_name, world_size, tokens, cache_salt, timeout, WARM_POLL_INTERVAL_S
    )


def check_delete(tier: object, force: object) -> None:
    """``ValueError``/``TypeError`` for a ``tier`` or ``force`` :func:`delete` does not take."""
    if tier not in ("l1", "l2", "all"):
        raise ValueError(f"tier must be 'l1', 'l2' or 'all', got {tier!r}")
    check_force(force)


async def delete(
    meta: Metadata, keys: list[dict[str, Any]], tier: Tier, force: bool, timeout: float | None
) -> DeleteResult:
    """Delete the chunks of ``tokens`` from ``start`` (a multiple of the chunk size) to
    the last whole chunk, for the client's model and ``cache_salt``, on every rank
    (``DELETE /cache/objects`` with ``keys``, :func:`object_keys` of the chunks' hashes
    computed by the client, at most :data:`MAX_DELETE_KEYS` a request).

    DANGER: the chunks go for every client of this model and salt, and a prompt sharing
    the prefix loses it too (chunks are named by the whole prefix up to them). With
    ``force`` locked chunks are deleted as well (a reader holding them may read freed
    memory). ``tier="l2"`` or ``"all"`` also deletes from L2. Published as ``removed`` KV
    events (L1).

    Returns:
        Keys deleted, and keys skipped because a reader or writer held them (keys that
        were not resident count in neither).

    Raises:
        UnsupportedHashAlgorithmError: the server does not hash with blake3.
        ServerError/HTTPStatusError: the server refused the delete.
        LMCacheTimeoutError: no answer within ``timeout``.
        ValueError/TypeError: bad tokens, salt, ``start``, ``tier`` or ``force`` (nothing sent).

    Cancellation: a request already sent may still delete its keys.
    """
    if not keys:
        return DeleteResult(0, 0)
    return await _delete_keys(meta, keys, tier, force, timeout)
