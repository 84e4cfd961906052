"""Management calls of an LMCache MP server (issue 33): warm a prefix, delete a prefix's
chunks, clear L1, list capabilities. The thin ``AsyncClient`` methods
(:meth:`~lmcache_async.AsyncClient.warm`, :meth:`~lmcache_async.AsyncClient.delete`,
:meth:`~lmcache_async.AsyncClient.clear`, :meth:`~lmcache_async.AsyncClient.experimental`)
call these.

Each is a server-wide action with effects beyond the caller's own data; the danger of
each is written on its method (docs/guides/routing.md, "Management calls").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import aiohttp

from lmcache_async._metadata import Metadata
from lmcache_async.errors import (
    AuthenticationError,
    HTTPStatusError,
    LMCacheConnectionError,
    LMCacheTimeoutError,
    ProtocolError,
    ServerError,
)

__all__ = ["MAX_DELETE_KEYS", "DeleteResult", "WarmResult", "kv_rank", "object_keys"]

#: The most keys one ``DELETE /cache/objects`` takes (the server's ``MAX_DELETE_BATCH``).
MAX_DELETE_KEYS: Final = 10_000


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


async def http_json(
    meta: Metadata, method: str, path: str, body: Any, timeout: float | None
) -> tuple[int, Any]:
    """``method path`` with a JSON body: ``(status, decoded JSON or None)``.

    Raises:
        AuthenticationError: 401. LMCacheTimeoutError, LMCacheConnectionError.
    """
    url = meta.http_url + path
    start = time.monotonic()
    try:
        async with meta._get_session().request(
            method,
            url,
            json=body,
            headers=meta._headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            raw = await resp.read()
            status = resp.status
    except TimeoutError:
        raise LMCacheTimeoutError(f"{method} {path}", time.monotonic() - start) from None
    except aiohttp.ClientError as exc:
        raise LMCacheConnectionError(f"{method} {url} failed: {exc}") from exc
    text = raw[:500].decode("utf-8", "replace")
    if status == 401:
        raise AuthenticationError(status, url, text, key_sent=meta._api_key is not None)
    try:
        doc = json.loads(raw) if raw else None
    except ValueError:
        doc = None
    return status, doc


def _detail(doc: Any) -> str:
    if isinstance(doc, dict) and "detail" in doc:
        return str(doc["detail"])
    return repr(doc)


async def warm(
    meta: Metadata,
    model_name: str,
    world_size: int,
    tokens: list[int],
    cache_salt: str,
    timeout: float | None,
    poll_interval: float,
) -> WarmResult:
    """``POST /cache/prefetches`` then poll ``GET /cache/prefetches/{id}`` until it
    completes, all within ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(deadline - time.monotonic(), 0.0)

    body = {
        "model_name": model_name,
        "world_size": world_size,
        "token_ids": tokens,
        "cache_salt": cache_salt,
        "source_tier": "l2",
        "target_tier": "l1",
    }
    status, doc = await http_json(meta, "POST", "/cache/prefetches", body, left())
    url = f"{meta.http_url}/cache/prefetches"
    if status == 404:
        raise ServerError(f"{meta.http_url} has no warm prefetch route (POST /cache/prefetches: 404)")
    if status == 503:
        raise ServerError(f"warm: {meta.http_url} cannot warm {model_name!r}: {_detail(doc)}")
    if status not in (200, 202):
        raise HTTPStatusError(
            status, url, _detail(doc), f"warm: POST {url} failed with HTTP {status}: {_detail(doc)}"
        )
    if not isinstance(doc, dict) or type(doc.get("chunks")) is not int:
        raise ProtocolError(f"warm: POST /cache/prefetches answered {doc!r}")
    chunks = doc["chunks"]
    if doc.get("status") == "noop":
        return WarmResult(0, 0, 0)
    request_id = doc.get("request_id")
    if not isinstance(request_id, str):
        raise ProtocolError(f"warm: POST /cache/prefetches answered {doc!r}")
    while True:
        status, doc = await http_json(meta, "GET", f"/cache/prefetches/{request_id}", None, left())
        if status != 200 or not isinstance(doc, dict):
            raise HTTPStatusError(
                status,
                f"{url}/{request_id}",
                _detail(doc),
                f"warm: polling prefetch {request_id} got HTTP {status}",
            )
        if doc.get("status") == "completed":
            found, total = doc.get("found_keys"), doc.get("total_keys")
            if type(found) is not int or type(total) is not int:
                raise ProtocolError(f"warm: prefetch {request_id} answered {doc!r}")
            return WarmResult(chunks, found, total)
        remaining = left()
        if remaining is not None and remaining <= 0:
            raise LMCacheTimeoutError("warm", timeout or 0.0)
        await asyncio.sleep(poll_interval if remaining is None else min(poll_interval, remaining))


async def delete(
    meta: Metadata,
    keys: list[dict[str, Any]],
    tier: Literal["l1", "l2", "all"],
    force: bool,
    timeout: float | None,
) -> DeleteResult:
    """``DELETE /cache/objects`` in batches of at most :data:`MAX_DELETE_KEYS` keys."""
    deleted = skipped = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    for i in range(0, len(keys), MAX_DELETE_KEYS):
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        body = {"keys": keys[i : i + MAX_DELETE_KEYS], "tier": tier, "force": force, "adapter": None}
        status, doc = await http_json(meta, "DELETE", "/cache/objects", body, left)
        url = f"{meta.http_url}/cache/objects"
        if status == 404 and not isinstance(doc, dict):
            raise ServerError(f"{meta.http_url} has no targeted delete (DELETE /cache/objects: 404)")
        if status != 200 or not isinstance(doc, dict):
            raise HTTPStatusError(
                status, url, _detail(doc), f"delete: DELETE {url} failed with HTTP {status}: {_detail(doc)}"
            )
        if doc.get("ok") is False:
            raise ServerError(f"delete: the server failed part of the delete: {doc.get('error')}")
        d, s = doc.get("deleted"), doc.get("skipped")
        if type(d) is not int or type(s) is not int:
            raise ProtocolError(f"delete: DELETE /cache/objects answered {doc!r}")
        deleted += d
        skipped += s
    return DeleteResult(deleted, skipped)
