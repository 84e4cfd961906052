"""Every wait has the caller's deadline (issue 40, item 1): against a paused real server
(SIGSTOP) every public call raises LMCacheTimeoutError within its timeout, ``timeout=0``
included (aiohttp reads ``ClientTimeout(total=0)`` as no timeout); a deadline already
passed sends nothing; a warm whose server goes silent at the deadline ends at it; HTTP
deadlines are not rounded up (aiohttp's ``ceil_threshold``). And what HTTP answers the
client reads (items 4 and m2): bodies are capped, hostile management replies are
refused precisely."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.helpers import ceil_timeout

import lmcache_async as lmc
from lmcache_async._base import deadline as _deadline
from lmcache_async._protocol.wire import Op
from lmcache_async._transport.metadata import MAX_HTTP_BODY_BYTES, Metadata
from tests.fakes import server_wire
from tests.fakes.fake_router import FakeRouter
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, random_kv, unique_model

pytestmark = pytest.mark.anyio

#: The small timeout of the paused-server calls, and how late past a deadline a call may end.
SMALL = 0.2
SLACK = 0.5
CS = 16


@contextlib.contextmanager
def _paused(pid: int) -> Iterator[None]:
    """SIGSTOP the server process (ZMQ and HTTP stop answering); SIGCONT on the way out."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def _bounded(call: Awaitable[Any], timeout: float) -> tuple[BaseException | None, Any, float]:
    """Await ``call`` under a watchdog (a hang fails the test instead of stalling it):
    ``(error, result, elapsed)``."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout + 5):
            result = await call
    except Exception as exc:  # the outcome under test
        return exc, None, time.monotonic() - start
    return None, result, time.monotonic() - start


def _many_timed_out(result: Any) -> bool:
    return len(result) == 1 and isinstance(result[0].error, lmc.LMCacheTimeoutError)


async def _first_event(c: lmc.AsyncClient, timeout: float) -> Any:
    """``kv_events()`` has no ``timeout``: its documented bound is ``asyncio.timeout``."""
    async with asyncio.timeout(timeout):
        return await anext(aiter(c.kv_events()))


#: Each public call of AsyncClient that waits for the server, given (client, timeout).
CALLS: dict[str, Callable[[lmc.AsyncClient, float], Awaitable[Any]]] = {
    "lookup": lambda c, t: c.lookup(fresh_tokens(2 * CS), timeout=t),
    "retrieve": lambda c, t: c.retrieve(fresh_tokens(2 * CS), timeout=t),
    "store": lambda c, t: c.store(random_kv(SMALL_GEOMETRY, 2 * CS, seed=1), fresh_tokens(2 * CS), timeout=t),
    "remap": lambda c, t: c.remap(fresh_tokens(2 * CS), fresh_tokens(2 * CS), timeout=t),
    "compose": lambda c, t: c.compose(fresh_tokens(2 * CS), [lmc.KVPart(fresh_tokens(CS))], timeout=t),
    "noop": lambda c, t: c.noop(timeout=t),
    "status": lambda c, t: c.status(max_age=0, timeout=t),
    "config": lambda c, t: c.config(max_age=0, timeout=t),
    "experimental": lambda c, t: c.experimental(timeout=t),
    "clear": lambda c, t: c.clear(force=False, timeout=t),
    "warm": lambda c, t: c.warm(fresh_tokens(2 * CS), timeout=t),
    "delete": lambda c, t: c.delete(fresh_tokens(2 * CS), timeout=t),
    "store_many": lambda c, t: c.store_many(
        [(random_kv(SMALL_GEOMETRY, CS, seed=2), fresh_tokens(CS))], timeout=t
    ),
    "retrieve_many": lambda c, t: c.retrieve_many([fresh_tokens(CS)], timeout=t),
    "remap_many": lambda c, t: c.remap_many([(fresh_tokens(CS), fresh_tokens(CS))], timeout=t),
    "compose_many": lambda c, t: c.compose_many(
        [(fresh_tokens(2 * CS), [lmc.KVPart(fresh_tokens(CS))])], timeout=t
    ),
    "drain": lambda c, t: c.drain(timeout=t),
    "kv_events": _first_event,
}


def _outcome(name: str, timeout: float, error: BaseException | None, result: Any, elapsed: float) -> str:
    """``"ok"``, or what is wrong with how ``name(timeout=timeout)`` ended."""
    if elapsed >= timeout + SLACK:
        return f"took {elapsed:.3f}s"
    if name.endswith("_many"):
        ok = error is None and _many_timed_out(result)
    elif name == "drain":
        ok = (error, result) == (None, False)  # its contract: False when the timeout passed first
    elif name == "kv_events":
        ok = type(error) is TimeoutError  # asyncio.timeout's own (the documented bound)
    else:
        ok = isinstance(error, lmc.LMCacheTimeoutError)
        if ok and timeout == 0 and elapsed >= 0.3:  # refused at once (nothing sent: see the fakes below)
            return f"took {elapsed:.3f}s"
    return "ok" if ok else f"ended with {error!r} / {result!r}"


@pytest.mark.parametrize("generation", ["0.5.6", "0.5.7"])
async def test_every_call_ends_within_its_deadline_on_a_paused_server(
    fresh_real_server: Callable[..., Any], generation: str
) -> None:
    """One server a generation (xdist spreads parametrized tests over workers, each of
    which would start its own): every call, with ``timeout=0`` and a small one; on 0.5.6
    also the blocking ``Client.delete(timeout=0)``."""
    srv = fresh_real_server("pickle", generation=generation)
    assert srv.pid is not None
    outcomes: dict[str, str] = {}
    blocking: lmc.Client | None = None
    async with lmc.AsyncClient(
        srv.url, srv.http_url, unique_model(), geometry=SMALL_GEOMETRY, timeout=30, cleanup_grace=0.5
    ) as c:
        if generation == "0.5.6":
            blocking = await asyncio.to_thread(
                lmc.Client, srv.url, srv.http_url, unique_model(), geometry=SMALL_GEOMETRY, timeout=30
            )
        try:
            with _paused(srv.pid):
                for timeout in (0, SMALL):
                    for name, call in CALLS.items():
                        if name == "drain":  # something to wait for: a lookup abandoned on its deadline
                            with pytest.raises(lmc.LMCacheTimeoutError):
                                await c.lookup(fresh_tokens(CS), timeout=0.01)
                        error, result, elapsed = await _bounded(call(c, timeout), timeout)
                        outcomes[f"{name}(timeout={timeout})"] = _outcome(
                            name, timeout, error, result, elapsed
                        )
                if blocking is not None:
                    start = time.monotonic()
                    with pytest.raises(lmc.LMCacheTimeoutError) as info:
                        await asyncio.to_thread(blocking.delete, fresh_tokens(2 * CS), timeout=0)
                    elapsed = time.monotonic() - start
                    assert elapsed < 1.0  # not the facade's bound (timeout + grace)
                    assert (info.value.operation, info.value.elapsed < 0.1) == ("delete", True)
                    elapsed_text = f"{info.value.elapsed:.3f}s"
                    assert str(info.value) == f"delete: no reply from the LMCache server after {elapsed_text}"
        finally:
            if blocking is not None:
                await asyncio.to_thread(blocking.close)
    assert outcomes == dict.fromkeys(outcomes, "ok")
    assert len(outcomes) == 2 * len(CALLS)


# --------------------------------------------------------------------------- fakes


def _registering(req: server_wire.Request) -> list[tuple[Any, ...]]:
    """The ZMQ side of an inline 0.5.6 server that answers only what connecting needs."""
    answers: dict[Op, Any] = {
        Op.NOOP: "OK",
        Op.GET_CHUNK_SIZE: CS,
        Op.REGISTER_ENGINE_DRIVEN: {"shm_name": "", "pool_size": 0},
        Op.UNREGISTER_ENGINE_DRIVEN: None,
    }
    return [("reply", answers[req.op])] if req.op in answers else []


_MP = {"chunk_size": CS, "supported_transfer_mode": "auto", "instance_id": "x", "max_cpu_workers": 1}
Route = tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]


def _json(value: Any, status: int = 200) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def answer(_: web.Request) -> web.StreamResponse:
        if isinstance(value, bytes):
            return web.Response(body=value, status=status, content_type="application/json")
        return web.json_response(value, status=status)

    return answer


@contextlib.asynccontextmanager
async def _http(*routes: Route) -> AsyncIterator[tuple[str, list[str]]]:
    """A 0.5.6 server's HTTP API (``/config``, ``/status``) with ``routes`` added or replacing, on a free
    loopback port: ``(base URL, the requests it received as "METHOD path")``."""
    seen: list[str] = []

    @web.middleware
    async def note(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.append(f"{request.method} {request.path}")
        return await handler(request)

    app = web.Application(middlewares=[note])
    table = {
        ("GET", "/config"): _json({"mp": _MP}),
        ("GET", "/status"): _json({"cache_context_meta": {}, "active_sessions": 0}),
    }
    table |= {(method, path): handler for method, path, handler in routes}
    for (method, path), handler in table.items():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


def _fake_client(router: FakeRouter, http: str) -> lmc.AsyncClient:
    return lmc.AsyncClient(router.url, http, "m", geometry=SMALL_GEOMETRY, timeout=5, cleanup_grace=0.5)


async def test_no_time_left_sends_nothing() -> None:
    async with FakeRouter(_registering) as router, _http() as (http, seen), _fake_client(router, http) as c:
        zmq_before, http_before = len(router.requests), list(seen)
        for name in (
            "lookup",
            "retrieve",
            "store",
            "remap",
            "noop",
            "experimental",
            "clear",
            "warm",
            "delete",
        ):
            with pytest.raises(lmc.LMCacheTimeoutError) as info:
                await CALLS[name](c, 0)
            assert info.value.request_id is None, name  # no request id: nothing went out
        with pytest.raises(lmc.LMCacheTimeoutError, match=r"^GET /status: no reply .* after 0\.0"):
            await c.status(max_age=0, timeout=0)
        with pytest.raises(lmc.LMCacheTimeoutError, match=r"^GET /config: no reply .* after 0\.0"):
            await c.config(max_age=0, timeout=0)
        assert (len(router.requests), seen) == (zmq_before, http_before)


async def test_a_warm_whose_server_goes_silent_at_the_deadline_ends_at_it() -> None:
    """The prefetch is "pending" until just before the deadline, then the server stops
    answering: the last poll goes out with almost no time left, and times out with it."""
    timeout = 1.0
    posted = 0.0

    async def post(_: web.Request) -> web.StreamResponse:
        nonlocal posted
        posted = time.monotonic()
        return web.json_response({"request_id": "r1", "chunks": 2}, status=202)

    async def poll(_: web.Request) -> web.StreamResponse:
        if time.monotonic() - posted >= timeout - 0.001:
            await asyncio.sleep(3600)  # silent (cancelled when the client goes)
        return web.json_response({"request_id": "r1", "status": "pending"})

    routes = [("POST", "/cache/prefetches", post), ("GET", "/cache/prefetches/r1", poll)]
    async with (
        FakeRouter(_registering) as router,
        _http(*routes) as (http, seen),
        _fake_client(router, http) as c,
    ):
        error, _, elapsed = await _bounded(c.warm(fresh_tokens(2 * CS), timeout=timeout), timeout)
        assert isinstance(error, lmc.LMCacheTimeoutError), repr(error)
        assert error.operation == "warm"
        assert timeout <= elapsed < timeout + SLACK
        assert seen.count("GET /cache/prefetches/r1") >= 10  # polled every 50 ms meanwhile


async def test_http_deadlines_are_not_rounded_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """aiohttp rounds a deadline above ``ceil_threshold`` (5 s by default) up to the next
    whole loop second; the client's requests never are, and never mean "none" but for None."""
    sent: list[aiohttp.ClientTimeout] = []
    request = aiohttp.ClientSession.request

    def spy(self: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> Any:
        sent.append(kw["timeout"])
        return request(self, method, url, **kw)

    monkeypatch.setattr(aiohttp.ClientSession, "request", spy)
    async with _http() as (http, _):
        meta = Metadata(http)
        try:
            await meta.status(max_age=0, timeout=7.3)
            await meta.config(max_age=0, timeout=None)
        finally:
            await meta.close()
    assert len(sent) == 2
    assert 7.29 < sent[0].total <= 7.3 and sent[0].ceil_threshold == math.inf  # type: ignore[operator]
    assert sent[1].total is None
    when = ceil_timeout(sent[0].total, sent[0].ceil_threshold).when()  # aiohttp's own deadline
    assert when is not None and when - asyncio.get_running_loop().time() < 7.3
    for no_time in (0, 0.0, -1.0):
        with pytest.raises(ValueError, match="time left > 0"):
            _deadline.http_timeout(no_time)
    assert (_deadline.zmq_poll_ms(None), _deadline.zmq_poll_ms(0.0001), _deadline.zmq_poll_ms(0.0101)) == (
        -1,
        1,
        11,
    )


# --------------------------------------------------------------------------- HTTP bodies


def _endless(written: list[int]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A handler that answers 1 MiB chunks for ever (until the client goes), adding the
    bytes it wrote to ``written[0]``."""

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        chunk = b" " * (1 << 20)
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while True:
                await resp.write(chunk)
                written[0] += len(chunk)
        return resp

    return answer


async def _ticking(call: Awaitable[Any]) -> tuple[BaseException | None, float, float]:
    """``(error, elapsed, longest gap of a 10 ms ticker on the loop meanwhile)``."""
    gaps = [0.0]

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.ensure_future(tick())
    try:
        error, _, elapsed = await _bounded(call, 3)
    finally:
        ticker.cancel()
    return error, elapsed, max(gaps)


_TOO_LONG = (
    "the answer is longer than {n} bytes, more than the client reads ({n} bytes, MAX_HTTP_BODY_BYTES); "
    "is http_url the LMCache server's HTTP API?"
)


async def test_an_endless_body_at_open_is_a_protocol_error_at_the_cap() -> None:
    written = [0]
    async with (
        _http(("GET", "/lmc_version", _endless(written))) as (http, _),
        FakeRouter(_registering) as router,
    ):
        c = lmc.AsyncClient(router.url, http, "m", geometry=SMALL_GEOMETRY, timeout=3)
        error, elapsed, gap = await _ticking(c.open())
        assert isinstance(error, lmc.ProtocolError), repr(error)
        assert str(error) == f"GET {http}/lmc_version: " + _TOO_LONG.format(n=MAX_HTTP_BODY_BYTES)
        assert elapsed < 1.5 and gap < 0.5  # well before the deadline; the loop kept running
        assert router.requests == []  # refused before the ZMQ connection is used
    assert MAX_HTTP_BODY_BYTES < written[0] < 64 << 20  # it stopped writing: the client hung up


async def test_an_endless_management_reply_is_a_protocol_error_at_the_cap() -> None:
    written = [0]
    async with (
        FakeRouter(_registering) as router,
        _http(("DELETE", "/cache/objects", _endless(written))) as (http, _),
        _fake_client(router, http) as c,
    ):
        error, elapsed, gap = await _ticking(c.delete(fresh_tokens(2 * CS), timeout=2))
        assert isinstance(error, lmc.ProtocolError), repr(error)
        assert str(error) == f"DELETE {http}/cache/objects: " + _TOO_LONG.format(n=MAX_HTTP_BODY_BYTES)
        assert elapsed < 1.5 and gap < 0.5  # well before the deadline; the loop kept running
    assert MAX_HTTP_BODY_BYTES < written[0] < 64 << 20


async def test_a_body_announced_too_long_is_refused_before_it_is_read() -> None:
    async def announced(_: web.Request) -> web.StreamResponse:
        return web.Response(body=b"[" + b" " * MAX_HTTP_BODY_BYTES + b"]", content_type="application/json")

    async with _http(("GET", "/status", announced)) as (http, _):
        meta = Metadata(http)
        try:
            with pytest.raises(lmc.ProtocolError) as info:
                await meta.status(max_age=0, timeout=5)
        finally:
            await meta.close()
    n = MAX_HTTP_BODY_BYTES
    assert str(info.value) == (
        f"GET {http}/status: the answer announces {n + 2} bytes, more than the client reads ({n} bytes, "
        "MAX_HTTP_BODY_BYTES); is http_url the LMCache server's HTTP API?"
    )


# --------------------------------------------------------------------------- hostile management replies

_DEEP = b"[" * 200_000 + b"]" * 200_000
_HUGE = "x" * (MAX_HTTP_BODY_BYTES - 100)


@pytest.mark.parametrize(
    ("call", "route", "reply", "status", "error", "message"),
    [
        ("delete", "/cache/objects", _DEEP, 200, lmc.ProtocolError,
         "DELETE {http}/cache/objects: invalid JSON (nested too deeply)"),
        ("warm", "/cache/prefetches", _DEEP, 202, lmc.ProtocolError,
         "POST {http}/cache/prefetches: invalid JSON (nested too deeply)"),
        ("delete", "/cache/objects", _DEEP, 500, lmc.HTTPStatusError,
         "delete: DELETE {http}/cache/objects failed with HTTP 500: " + "[" * 512 + "..."),
        ("warm", "/cache/prefetches", _DEEP, 500, lmc.HTTPStatusError,
         "warm: POST {http}/cache/prefetches failed with HTTP 500: " + "[" * 512 + "..."),
        ("delete", "/cache/objects", {"detail": _HUGE}, 500, lmc.HTTPStatusError,
         "delete: DELETE {http}/cache/objects failed with HTTP 500: " + "x" * 512 + "..."),
        ("delete", "/cache/objects", {"deleted": -5, "skipped": -(2**70), "ok": True}, 200, lmc.ProtocolError,
         "delete: DELETE /cache/objects answered {'deleted': -5, 'skipped': -1180591620717411303424, 'ok': True}"),
        ("delete", "/cache/objects", {"deleted": 3, "skipped": 0, "ok": True}, 200, lmc.ProtocolError,
         "delete: DELETE /cache/objects answered {'deleted': 3, 'skipped': 0, 'ok': True}"),  # 2 keys asked
        ("warm", "/cache/prefetches", {"request_id": "r1", "chunks": -1}, 202, lmc.ProtocolError,
         "warm: POST /cache/prefetches answered {'request_id': 'r1', 'chunks': -1}"),
        ("warm", "/cache/prefetches", {"request_id": "r1", "chunks": 2, "found_keys": -1, "total_keys": 10**30},
         202, lmc.ProtocolError,
         "warm: prefetch r1 answered {'request_id': 'r1', 'status': 'completed', 'found_keys': -1, "
         "'total_keys': 1000000000000000000000000000000}"),
        ("warm", "/cache/prefetches", {"request_id": "r1", "chunks": 2, "found_keys": 3, "total_keys": 2},
         202, lmc.ProtocolError,
         "warm: prefetch r1 answered {'request_id': 'r1', 'status': 'completed', 'found_keys': 3, "
         "'total_keys': 2}"),
    ],
    ids=["deep-200-delete", "deep-202-warm", "deep-500-delete", "deep-500-warm", "huge-detail-500",
         "negative-counts", "more-deleted-than-asked", "negative-chunks", "absurd-keys", "found-over-total"],
)  # fmt: skip
async def test_a_hostile_management_reply_is_refused_precisely(
    call: str, route: str, reply: Any, status: int, error: type[Exception], message: str
) -> None:
    if call == "warm" and isinstance(reply, dict) and "found_keys" in reply:
        # the POST answers the request id, the poll the hostile counts
        completed = {"request_id": "r1", "status": "completed"}
        completed |= {k: reply[k] for k in ("found_keys", "total_keys")}
        routes: list[Route] = [
            ("POST", route, _json({"request_id": "r1", "chunks": reply["chunks"]}, 202)),
            ("GET", f"{route}/r1", _json(completed)),
        ]
    else:
        routes = [("DELETE" if call == "delete" else "POST", route, _json(reply, status))]
    async with (
        FakeRouter(_registering) as router,
        _http(*routes) as (http, _),
        _fake_client(router, http) as c,
    ):
        tokens = fresh_tokens(2 * CS)
        with pytest.raises(error) as info:
            await (c.delete(tokens, timeout=5) if call == "delete" else c.warm(tokens, timeout=5))
    assert str(info.value) == message.replace("{http}", http)
