"""A scripted ZMQ ROUTER for faults the real server will not produce on demand.

``FakeRouter(handler)`` binds a ROUTER on a free loopback port and, for every request,
calls ``handler(request)`` (a :class:`tests.fakes.server_wire.Request`), which returns a list
of actions: ``("reply", value)``, ``("raw", [frames])`` (frames after the identity),
``("sleep", seconds)``, ``("drop",)`` (close the socket: the client sees a disconnect).
Returning ``[]`` means never reply, like the real server on a bad request. The control
frames of a stream (``ack``, ``cancel``) are recorded in ``controls``.

``json_http_server(routes)`` is the HTTP side of such a fake server: each ``GET path``
answers the JSON value given for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from lmcache_async._protocol import wire as wire
from tests.fakes import server_wire

Action = tuple[Any, ...]
Handler = Callable[[server_wire.Request], list[Action]]


def ok_handler(request: server_wire.Request) -> list[Action]:
    """Answer the basic probes like the real server."""
    if request.op is wire.Op.NOOP:
        return [("reply", "OK")]
    if request.op is wire.Op.GET_CHUNK_SIZE:
        return [("reply", 16)]
    return []


class FakeRouter:
    def __init__(self, handler: Handler = ok_handler, port: int = 0) -> None:
        self.handler = handler
        self.requests: list[server_wire.Request] = []
        self.controls: list[tuple[bytes, bytes]] = []  # a stream's (uid frame, b"ack" | b"cancel")
        self._port = port
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._acting: set[asyncio.Task[None]] = set()  # the running scripts, cancelled on stop

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self._port}"

    async def __aenter__(self) -> FakeRouter:
        self._bind()
        return self

    def _bind(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if self._port:
                sock.bind(self.url)
            else:
                self._port = sock.bind_to_random_port("tcp://127.0.0.1")
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._sock = sock
        self._task = asyncio.create_task(self._serve(sock))

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            ident, rest = frames[0], frames[1:]
            if len(rest) == 3 and rest[1] == b"":  # a stream's control frame
                self.controls.append((rest[0], rest[2]))
                continue
            try:
                request = server_wire.decode_request(rest)
            except Exception:
                continue
            self.requests.append(request)
            task = asyncio.create_task(self._act(sock, ident, request, self.handler(request)))
            self._acting.add(task)
            task.add_done_callback(self._acting.discard)

    async def _act(
        self, sock: zmq.asyncio.Socket, ident: bytes, request: server_wire.Request, actions: list[Action]
    ) -> None:
        for action in actions:
            kind = action[0]
            if kind == "reply":
                await sock.send_multipart([ident, *server_wire.encode_reply(request, action[1])])
            elif kind == "raw":
                await sock.send_multipart([ident, *action[1]])
            elif kind == "sleep":
                await asyncio.sleep(action[1])
            elif kind == "drop":
                current = asyncio.current_task()
                if current is not None:
                    self._acting.discard(current)
                await self.stop()
                return

    async def stop(self) -> None:
        # A script still sending (a flood) must end before its socket closes: a send on a
        # closed socket raises in its task, which the test's runner reports as the test's error.
        acting, self._acting = list(self._acting), set()
        for task in acting:
            task.cancel()
        for task in acting:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def restart(self) -> None:
        """Stop and bind again on the same port (a server restart)."""
        await self.stop()
        for _ in range(100):
            try:
                self._bind()
                return
            except zmq.ZMQError:  # the port is not free again yet
                await asyncio.sleep(0.05)
        self._bind()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        self._ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def json_http_server(routes: dict[str, Any]) -> AsyncIterator[str]:
    """An HTTP server on a free loopback port answering ``GET path`` with ``routes[path]``
    as JSON; yields its base URL."""
    app = web.Application()
    for path, value in routes.items():

        async def answer(_: web.Request, value: Any = value) -> web.Response:
            if isinstance(value, bytes):  # a raw body (e.g. JSON no encoder would write)
                return web.Response(body=value, content_type="application/json")
            return web.json_response(value)

        app.router.add_get(path, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
