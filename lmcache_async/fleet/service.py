"""A routing service over a :class:`~lmcache_async.fleet.Fleet`: aiohttp's web server
answering, for a prompt's tokens, each server's cached prefix and the server to send it
to (the shape of llm-d's ``ScoreTokens``). Several replicas route alike when their
fleets share a :class:`~lmcache_async.fleet.RedisIndex`.

Routes (JSON in and out):

* ``POST /score`` with ``{"tokens": [int, ...], "cache_salt": ""}`` (``cache_salt``
  optional) answers ``{"scores": {url: tokens, ...}, "server": url, "source": s}``:
  every server that is up with its cached prefix of the prompt in tokens (0 for none),
  the server :meth:`Fleet.best <lmcache_async.fleet.Fleet.best>` chooses, and where the
  prefixes came from, ``"index"`` or ``"fanout"`` (a ``lookup`` on every server).
* ``GET /healthz``: the fleet's servers and whether each is up, and whether the index
  answers; 200 while a server is up, else 503.
* ``GET /metrics``: the service's counters (requests by outcome, answers by source).

Errors are ``{"error": message}``: 400 for a bad request (the content type is not
``application/json``, the body is larger than ``max_body``, not JSON, not an object, has
unknown or missing keys, bad token ids or salt; all found before any server or the
index is asked), 503 when no server is up, 504 when the request ran past its deadline,
502 for another failure of the servers.

Every request runs under a deadline (``deadline`` seconds, reading the body included):
past it the work in flight is cancelled (a fan-out's lookups clean up on their servers)
and the answer is 504; a slow server or Redis never holds a request longer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any, Final

from aiohttp import web

from lmcache_async._base.timeouts import check_duration
from lmcache_async._protocol.wire import validate_cache_salt, validate_tokens
from lmcache_async.errors import LMCacheConnectionError, LMCacheError
from lmcache_async.fleet.router import Fleet

__all__ = ["DEFAULT_DEADLINE", "DEFAULT_MAX_BODY", "create_app"]

log = logging.getLogger(__name__)

#: Seconds a request may take, by default.
DEFAULT_DEADLINE: Final = 2.0
#: The largest request body accepted, in bytes, by default (a 4k-token prompt is ~45 KB).
DEFAULT_MAX_BODY: Final = 1 << 20

_FLEET: Final = web.AppKey("fleet", Fleet)
_DEADLINE: Final = web.AppKey("deadline", float)
_MAX_BODY: Final = web.AppKey("max_body", int)
_COUNTS: Final = web.AppKey("counts", Counter)
_KEYS: Final = frozenset({"tokens", "cache_salt"})


class _BadRequest(Exception):
    """A request refused with 400 before anything is asked of a server."""


def create_app(
    fleet: Fleet, *, deadline: float = DEFAULT_DEADLINE, max_body: int = DEFAULT_MAX_BODY
) -> web.Application:
    """The routing service's application over ``fleet`` (open it first; the caller closes it).

    Args:
        fleet: an open fleet; its index (memory or Redis) and servers answer.
        deadline: seconds each request may take (finite, > 0).
        max_body: the largest request body accepted, in bytes (>= 1).

    Returns:
        An ``aiohttp.web.Application``: run it with ``web.AppRunner`` or ``web.run_app``.

    Raises:
        TypeError: ``fleet`` is not a Fleet.
        ValueError: a bad ``deadline`` or ``max_body``.
    """
    if not isinstance(fleet, Fleet):
        raise TypeError(f"fleet must be a Fleet, got {type(fleet).__name__}")
    deadline = check_duration(deadline, "deadline")
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1:
        raise ValueError(f"max_body must be an int >= 1, got {max_body!r}")
    app = web.Application(client_max_size=max_body)
    app[_FLEET] = fleet
    app[_DEADLINE] = float(deadline)
    app[_MAX_BODY] = max_body
    app[_COUNTS] = Counter()
    app.router.add_post("/score", _score)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    return app


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _body(request: web.Request) -> tuple[list[int], str]:
    """The request's tokens and salt, checked. Raises _BadRequest."""
    max_body = request.app[_MAX_BODY]
    if request.content_type != "application/json":
        raise _BadRequest(f"Content-Type must be application/json, got {request.content_type!r}")
    if request.content_length is not None and request.content_length > max_body:
        raise _BadRequest(f"the body is larger than {max_body} bytes")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _BadRequest(f"the body is larger than {max_body} bytes") from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise _BadRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _KEYS)
    if unknown:
        raise _BadRequest(f"unknown keys {unknown} (known: 'tokens', 'cache_salt')")
    if "tokens" not in body:
        raise _BadRequest("'tokens' is required")
    try:
        tokens = validate_tokens(body["tokens"])
        salt = validate_cache_salt(body.get("cache_salt", ""))
    except (TypeError, ValueError) as exc:
        raise _BadRequest(str(exc)) from None
    return tokens, salt


async def _score(request: web.Request) -> web.Response:
    fleet, deadline, counts = request.app[_FLEET], request.app[_DEADLINE], request.app[_COUNTS]
    counts["requests"] += 1
    try:
        async with asyncio.timeout(deadline):
            tokens, salt = await _body(request)
            scores, route = await fleet.score_and_best(tokens, salt)
    except _BadRequest as exc:
        counts["bad_request"] += 1
        return _error(400, str(exc))
    except TimeoutError:
        counts["deadline"] += 1
        return _error(504, f"the request ran past its deadline of {deadline:g} s")
    except LMCacheConnectionError as exc:
        counts["unavailable"] += 1
        return _error(503, str(exc))
    except LMCacheError as exc:
        counts["failed"] += 1
        log.warning("routing service: %s", exc)
        return _error(502, str(exc))
    source = "index" if route.source == "index" else "fanout"
    counts["ok"] += 1
    counts[source] += 1
    return web.json_response({"scores": scores, "server": route.server, "source": source})


async def _healthz(request: web.Request) -> web.Response:
    fleet = request.app[_FLEET]
    servers = [{"url": c.url, "http_url": c.http_url, "up": c.usable} for c in fleet.clients]
    available: Any = getattr(fleet.index, "available", True)
    index = {"kind": type(fleet.index).__name__, "available": bool(available)}
    up = sum(s["up"] is True for s in servers)
    return web.json_response({"servers": servers, "up": up, "index": index}, status=200 if up else 503)


async def _metrics(request: web.Request) -> web.Response:
    names = ("requests", "ok", "index", "fanout", "bad_request", "deadline", "unavailable", "failed")
    counts = request.app[_COUNTS]
    return web.json_response({name: counts[name] for name in names})
