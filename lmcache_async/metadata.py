"""Server metadata over HTTP: ``/config`` and ``/status``, cached, single-flight.

One ``aiohttp.ClientSession`` per client, created on the client's loop. ``/config`` is
tried first and ``/conf`` (older servers) second. Cached documents are refreshed when
older than their TTL; concurrent callers share one fetch, and a cancelled caller does
not cancel the shared fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from lmcache_async.errors import LMCacheConnectionError, LMCacheTimeoutError, ProtocolError

__all__ = ["Metadata"]


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
    """

    def __init__(self, http_url: str, *, ttl: float = 5.0) -> None:
        self.http_url = http_url.rstrip("/")
        self.ttl = ttl
        self._session: aiohttp.ClientSession | None = None
        self._cache: dict[str, _Cached] = {"config": _Cached(), "status": _Cached()}
        self._config_path: str | None = None

    async def close(self) -> None:
        """Cancel shared fetches and close the HTTP session. Idempotent."""
        for entry in self._cache.values():
            if entry.inflight is not None:
                entry.inflight.cancel()
                with contextlib.suppress(BaseException):
                    await entry.inflight
                entry.inflight = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _get_json(self, path: str, timeout: float | None) -> tuple[int, Any]:
        url = self.http_url + path
        start = time.monotonic()
        try:
            async with self._get_session().get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                body = await resp.read()
                status = resp.status
        except TimeoutError:
            raise LMCacheTimeoutError(f"GET {path}", time.monotonic() - start) from None
        except aiohttp.ClientError as exc:
            raise LMCacheConnectionError(f"GET {url} failed: {exc}") from exc
        if status != 200:
            return status, None
        try:
            return status, json.loads(body)
        except ValueError as exc:
            raise ProtocolError(f"GET {url}: invalid JSON") from exc

    async def healthcheck(self, timeout: float | None = 5.0) -> bool:
        """True when ``/healthcheck`` answers 200."""
        status, _ = await self._get_json("/healthcheck", timeout)
        return status == 200

    async def _fetch_config(self, timeout: float | None) -> dict[str, Any]:
        paths = [self._config_path] if self._config_path else ["/config", "/conf"]
        last = 0
        for path in paths:
            status, doc = await self._get_json(path, timeout)
            if status == 200:
                if not isinstance(doc, dict) or not isinstance(doc.get("mp"), dict):
                    raise ProtocolError(f"GET {path}: no 'mp' section")
                self._config_path = path
                return doc
            last = status
            if status != 404:
                break
        raise LMCacheConnectionError(f"GET {self.http_url}/config failed with HTTP {last}")

    async def _fetch_status(self, timeout: float | None) -> dict[str, Any]:
        status, doc = await self._get_json("/status", timeout)
        if status != 200:
            raise LMCacheConnectionError(f"GET {self.http_url}/status failed with HTTP {status}")
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
        # shield: a cancelled caller leaves the shared fetch running for the others
        return await asyncio.shield(entry.inflight)

    async def config(self, *, max_age: float | None = None, timeout: float | None = 10.0) -> dict[str, Any]:
        """The ``/config`` document (``/conf`` on older servers)."""
        return await self._get("config", max_age, timeout)

    async def status(self, *, max_age: float | None = None, timeout: float | None = 10.0) -> dict[str, Any]:
        """The ``/status`` document."""
        return await self._get("status", max_age, timeout)

    @staticmethod
    def mp_section(config: Mapping[str, Any]) -> dict[str, Any]:
        mp = config.get("mp")
        if not isinstance(mp, dict):
            raise ProtocolError("/config has no 'mp' section")
        return mp
