"""Server metadata over HTTP: ``/lmc_version``, ``/config`` and ``/status``, cached,
single-flight.

One ``aiohttp.ClientSession`` per client, created on the client's loop. ``/config`` is
tried first and ``/conf`` (older servers) second. Cached documents are refreshed when
older than their TTL; concurrent callers share one fetch, and a cancelled caller does
not cancel the shared fetch.

With an API key (``api_key=``, else the ``LMCACHE_API_KEY`` environment variable) every
request carries ``Authorization: Bearer KEY`` (lmcache 0.5.7 servers started with
``--api-key-file`` or ``LMCACHE_API_KEY`` require it on every route but ``/`` and
``/healthcheck``). A 401 raises :class:`~lmcache_async.errors.AuthenticationError`;
any other status than 200 where a document is needed raises
:class:`~lmcache_async.errors.HTTPStatusError` (``status`` and ``url`` attached).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any, Final, Literal

import aiohttp

from lmcache_async._base.deadline import Deadline, async_timeout, http_timeout
from lmcache_async._base.tasks import cancel_and_wait
from lmcache_async.errors import (
    AuthenticationError,
    HTTPStatusError,
    LMCacheConnectionError,
    LMCacheTimeoutError,
    ProtocolError,
)

__all__ = ["API_KEY_ENV", "MAX_HTTP_BODY_BYTES", "Metadata", "decode_json", "excerpt", "resolve_api_key"]

#: The environment variable an API key is read from when none is passed.
API_KEY_ENV = "LMCACHE_API_KEY"

#: The longest HTTP body the client reads (``/lmc_version``, ``/config``, ``/status`` and
#: the management calls' answers; a real server's are a few KiB): a longer one is a
#: :class:`~lmcache_async.errors.ProtocolError` (an ``http_url`` naming something else
#: than the server's HTTP API, e.g. a port that streams).
MAX_HTTP_BODY_BYTES: Final = 4 << 20

#: The most characters of a body an error message quotes.
EXCERPT_CHARS: Final = 512


def resolve_api_key(api_key: str | None) -> str | None:
    """``api_key`` if given, else ``$LMCACHE_API_KEY`` (unset or empty: no key).

    Raises:
        TypeError: ``api_key`` is not a str.
        ValueError: the key is empty or contains whitespace or control characters (it
            could not travel in an HTTP header).
    """
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
        if api_key is None:
            return None
        api_key = api_key.strip()
    if not isinstance(api_key, str):
        raise TypeError(f"api_key must be a str, got {type(api_key).__name__}")
    if not api_key or any(c.isspace() or not c.isprintable() for c in api_key):
        raise ValueError("api_key must be a non-empty string without whitespace or control characters")
    return api_key


def _consume_exception(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved by the waiters; marks it seen if none are left


class _Cached:
    def __init__(self) -> None:
        self.value: dict[str, Any] | None = None
        self.fetched_at = 0.0
        self.inflight: asyncio.Task[dict[str, Any]] | None = None


class Metadata:
    """HTTP metadata of one server.

    Args:
        http_url: base URL, e.g. ``http://localhost:8080``.
        ttl: seconds a cached document stays fresh.
        api_key: sent as ``Authorization: Bearer KEY`` on every request; default
            ``$LMCACHE_API_KEY`` (see :func:`resolve_api_key`).
    """

    def __init__(self, http_url: str, *, ttl: float = 5.0, api_key: str | None = None) -> None:
        self.http_url = http_url.rstrip("/")
        self.ttl = ttl
        self._api_key = resolve_api_key(api_key)
        self._headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._cache: dict[str, _Cached] = {"config": _Cached(), "status": _Cached()}
        self._config_path: str | None = None

    def cached(self, name: Literal["config", "status"]) -> dict[str, Any] | None:
        """The ``/config`` or ``/status`` document last fetched (``None`` before the first
        fetch); no I/O, whatever its age."""
        return self._cache[name].value

    async def close(self) -> None:
        """Cancel shared fetches and close the HTTP session. Idempotent."""
        fetches = [e.inflight for e in self._cache.values() if e.inflight is not None]
        for entry in self._cache.values():
            entry.inflight = None
        try:
            await cancel_and_wait(fetches, "a shared HTTP fetch")
        finally:  # also when the closer is cancelled: the session is closed all the same
            session, self._session = self._session, None
            if session is not None:
                await session.close()

    def abandon(self) -> None:
        """Close the HTTP session without awaiting anything (its event loop is closed or
        not running): its pooled connections are closed. Idempotent."""

        def close(connector: aiohttp.BaseConnector) -> None:
            pooled = [proto.transport for conns in connector._conns.values() for proto, _ in conns]
            connector._close()  # the synchronous part of close(): nothing to await
            if connector._loop.is_closed():
                # The loop that would finish closing them is gone: finish it here (an
                # asyncio transport's own last step: the socket is closed and dropped).
                for transport in pooled:
                    with contextlib.suppress(Exception):
                        transport._call_connection_lost(None)  # type: ignore[union-attr]

        self._let_go(close)

    def drop_inherited(self) -> None:
        """In a forked child: forget the parent's HTTP session without closing it
        (closing would unregister the parent's sockets from the selector both processes
        share), and without aiohttp's "Unclosed client session" warnings later."""

        def forget(connector: aiohttp.BaseConnector) -> None:
            # aiohttp has no public way to mark a connector closed without closing it:
            # close() would unregister the sockets the parent still uses.
            connector._closed = True  # its __del__ then neither warns nor closes

        self._let_go(forget)

    def _let_go(self, finish: Callable[[aiohttp.BaseConnector], None]) -> None:
        """Drop the session and the shared fetches, ``finish`` its connector, and mark the
        session closed (no "Unclosed client session" warning at its collection)."""
        session, self._session = self._session, None
        for entry in self._cache.values():
            entry.inflight = None
        if session is None:
            return
        connector = session.connector
        with contextlib.suppress(AttributeError):
            if connector is not None:
                finish(connector)
        session.detach()  # closed, without closing the connector again

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def request(
        self, method: str, path: str, timeout: float | None, *, json_body: Any = None
    ) -> tuple[int, bytes]:
        """``method path`` on the HTTP API (``json_body``, if given, sent as JSON), with the
        client's headers: ``(status, body)``. The one place an HTTP request is made, for
        this object's GETs and for :mod:`lmcache_async.management`'s calls.

        Reads at most :data:`MAX_HTTP_BODY_BYTES` of the answer's body.

        Raises:
            AuthenticationError: HTTP 401 (an API key is needed, or was wrong).
            LMCacheTimeoutError: no whole answer within ``timeout`` seconds; with
                ``timeout=0`` at once, and nothing is sent.
            LMCacheConnectionError: the request could not be made or read.
            ProtocolError: the body is longer than :data:`MAX_HTTP_BODY_BYTES`.

        Cancellation: the request is abandoned (aiohttp closes its connection).
        """
        url = self.http_url + path
        deadline = Deadline(timeout, f"{method} {path}")
        # A deadline already passed raises here, before anything is sent.
        wait = http_timeout(deadline.left())
        try:
            async with self._get_session().request(
                method, url, json=json_body, headers=self._headers, timeout=wait
            ) as resp:
                status = resp.status
                body = await _read_capped(resp, method, url)
        except TimeoutError:
            raise LMCacheTimeoutError(deadline.what, deadline.elapsed()) from None
        except aiohttp.ClientError as exc:
            raise LMCacheConnectionError(_failure_message(method, url, exc)) from exc
        if status == 401:
            raise AuthenticationError(status, url, excerpt(body), key_sent=self._api_key is not None)
        return status, body

    async def _get_json(self, path: str, timeout: float | None) -> tuple[int, Any, str]:
        """GET ``path``: ``(200, document, "")``, or ``(status, None, excerpt)`` for another
        status (the start of the body, for the error that reports it).

        Raises:
            AuthenticationError: HTTP 401 (an API key is needed, or was wrong).
            LMCacheTimeoutError, LMCacheConnectionError, ProtocolError (not JSON).
        """
        status, body = await self.request("GET", path, timeout)
        if status != 200:
            return status, None, excerpt(body)
        return status, decode_json(body, f"GET {self.http_url}{path}"), ""

    async def healthcheck(self, timeout: float | None = 5.0) -> bool:
        """True when ``/healthcheck`` answers 200."""
        status, _, _ = await self._get_json("/healthcheck", timeout)
        return status == 200

    async def _fetch_config(self, timeout: float | None) -> dict[str, Any]:
        paths = [self._config_path] if self._config_path else ["/config", "/conf"]
        last, body = 0, ""
        for path in paths:
            status, doc, body = await self._get_json(path, timeout)
            if status == 200:
                if not isinstance(doc, dict) or not isinstance(doc.get("mp"), dict):
                    raise ProtocolError(f"GET {path}: no 'mp' section")
                self._config_path = path
                return doc
            last = status
            if status != 404:
                break
        raise HTTPStatusError(
            last,
            f"{self.http_url}/config",
            body,
            f"GET {self.http_url}/config failed with HTTP {last}",
        )

    async def _fetch_status(self, timeout: float | None) -> dict[str, Any]:
        status, doc, body = await self._get_json("/status", timeout)
        if status != 200:
            raise HTTPStatusError(
                status,
                f"{self.http_url}/status",
                body,
                f"GET {self.http_url}/status failed with HTTP {status}",
            )
        if not isinstance(doc, dict):
            raise ProtocolError("GET /status: not a JSON object")
        return doc

    async def _get(self, name: str, max_age: float | None, timeout: float | None) -> dict[str, Any]:
        entry = self._cache[name]
        age_limit = self.ttl if max_age is None else max_age
        if entry.value is not None and time.monotonic() - entry.fetched_at <= age_limit:
            return entry.value
        if entry.inflight is None:
            fetch = self._fetch_config if name == "config" else self._fetch_status

            async def run() -> dict[str, Any]:
                try:
                    value = await fetch(timeout)
                    entry.value, entry.fetched_at = value, time.monotonic()
                    return value
                finally:
                    entry.inflight = None

            entry.inflight = asyncio.ensure_future(run())
            entry.inflight.add_done_callback(_consume_exception)
        # shield: a cancelled caller, or one whose own deadline passes first, leaves the
        # shared fetch running for the others
        start = time.monotonic()
        try:
            async with async_timeout(timeout):
                return await asyncio.shield(entry.inflight)
        except TimeoutError as exc:
            if isinstance(exc, LMCacheTimeoutError):  # the fetch's own
                raise
            raise LMCacheTimeoutError(f"GET /{name}", time.monotonic() - start) from None

    async def version(self, timeout: float | None = 10.0) -> str | None:
        """The server's LMCache version from ``GET /lmc_version`` (not cached), or
        ``None`` when the route does not exist (404).

        Raises:
            AuthenticationError: 401. HTTPStatusError: another status than 200 or 404.
            ProtocolError: the answer is not a JSON string.
        """
        status, doc, body = await self._get_json("/lmc_version", timeout)
        if status == 404:
            return None
        if status != 200:
            url = f"{self.http_url}/lmc_version"
            raise HTTPStatusError(status, url, body, f"GET {url} failed with HTTP {status}")
        if not isinstance(doc, str) or not doc or len(doc) > 128:
            raise ProtocolError(f"GET /lmc_version answered {doc!r}, not a version string")
        return doc

    async def config(self, *, max_age: float | None = None, timeout: float | None = 10.0) -> dict[str, Any]:
        """The ``/config`` document (``/conf`` on older servers). ``timeout`` bounds this
        caller's wait, also when it shares a fetch another caller started."""
        return await self._get("config", max_age, timeout)

    async def status(self, *, max_age: float | None = None, timeout: float | None = 10.0) -> dict[str, Any]:
        """The ``/status`` document. ``timeout`` bounds this caller's wait, also when it
        shares a fetch another caller started."""
        return await self._get("status", max_age, timeout)


#: How every ZMTP (ZMQ) peer starts its greeting: what an HTTP client reads, as its
#: status line, from the server's ZMQ port.
_ZMTP_SIGNATURE = "\\xff\\x00\\x00\\x00\\x00\\x00\\x00\\x00"


def _failure_message(method: str, url: str, exc: aiohttp.ClientError) -> str:
    """What a failed request says: aiohttp's own words, except for a peer that does not
    speak HTTP, where they ("Bad status line", the bytes read) would mislead."""
    if isinstance(exc, aiohttp.ClientResponseError) and exc.message.startswith("Bad status line"):
        if _ZMTP_SIGNATURE in exc.message:
            return (
                f"{method} {url} failed: the peer answered with a ZMQ greeting, not HTTP: http_url names "
                "the server's ZMQ port; give its HTTP port (lmcache server --http-port, often 8080)"
            )
        return f"{method} {url} failed: the peer does not speak HTTP; is http_url the server's HTTP port?"
    return f"{method} {url} failed: {exc}"


def excerpt(body: bytes | str) -> str:
    """The start of ``body`` (at most :data:`EXCERPT_CHARS` characters), for an error message."""
    if isinstance(body, bytes):
        body = body[: EXCERPT_CHARS * 4].decode("utf-8", "replace")
    return body if len(body) <= EXCERPT_CHARS else body[:EXCERPT_CHARS] + "..."


def decode_json(body: bytes, what: str) -> Any:
    """``body`` decoded as JSON.

    Raises:
        ProtocolError: not JSON, or nested too deeply to decode (``what`` names the request).
    """
    try:
        return json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"{what}: invalid JSON") from exc
    except RecursionError:  # a hostile document nested thousands deep
        raise ProtocolError(f"{what}: invalid JSON (nested too deeply)") from None


async def _read_capped(resp: aiohttp.ClientResponse, method: str, url: str) -> bytes:
    """The body of ``resp``, read as it comes (each read yields to the loop), at most
    :data:`MAX_HTTP_BODY_BYTES`.

    Raises:
        ProtocolError: the body (or its announced ``Content-Length``) is longer.
    """
    limit = MAX_HTTP_BODY_BYTES
    announced = resp.content_length
    if announced is not None and announced > limit:
        raise ProtocolError(_too_long(method, url, f"announces {announced} bytes"))
    body = bytearray()
    while chunk := await resp.content.read(limit + 1 - len(body)):
        body += chunk
        if len(body) > limit:
            raise ProtocolError(_too_long(method, url, f"is longer than {limit} bytes"))
    return bytes(body)


def _too_long(method: str, url: str, how: str) -> str:
    return (
        f"{method} {url}: the answer {how}, more than the client reads ({MAX_HTTP_BODY_BYTES} bytes, "
        "MAX_HTTP_BODY_BYTES); is http_url the LMCache server's HTTP API?"
    )
