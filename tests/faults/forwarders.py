"""Small forwarders that sit between a client and a server and keep the client's
connections up while the server behind them is killed and restarted (a restart with no
visible disconnect, as through a proxy or a service mesh).

    with ZmqForwarder(srv.url) as zf, HttpForwarder(srv.http_url) as hf:
        AsyncClient(zf.url, hf.url, ...)

* :class:`ZmqForwarder`: a ROUTER bound on a fresh loopback port; each client peer (by
  its ROUTER identity) gets a DEALER of its own connected to the server, so the server
  sees the client's frames unchanged and the replies go back to the right peer. The
  DEALERs reconnect to a restarted server by themselves; the client's TCP connection to
  the forwarder never drops. Requests sent while the server is down are queued by the
  DEALER and delivered to the server that comes back (as a proxy would). While
  :attr:`ZmqForwarder.hold` is set, the client's messages are held (a server that does
  not answer, while its HTTP side still does) and sent on, in order, once it is cleared.
* :class:`HttpForwarder`: a threaded HTTP server on a fresh loopback port that forwards
  ``GET`` requests to the server's HTTP endpoint; 502 while the server is down.

Both run in a thread of the test process, stopped by their handle (``close()``, or the
``with`` block), each within a bounded wait.
"""

from __future__ import annotations

import http.server
import threading
import urllib.error
import urllib.request
from types import TracebackType
from typing import Any

import zmq

from harness.real_server import free_loopback_port

__all__ = ["HttpForwarder", "ZmqForwarder"]

#: How long a forwarder's thread may take to stop before close() reports it.
STOP_WAIT_S = 5.0


class ZmqForwarder:
    """Forward a DEALER client's messages to ``backend`` (a ``tcp://`` endpoint)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.port = free_loopback_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.forwarded = 0  # client messages sent on to the server
        #: While set, client messages are held back (sent on in order once cleared).
        self.hold = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"zmq-forwarder {self.url}", daemon=True)

    def start(self) -> ZmqForwarder:
        self._thread.start()
        if not self._ready.wait(STOP_WAIT_S):
            raise RuntimeError("the ZMQ forwarder did not start")
        if self._error is not None:
            raise RuntimeError(f"the ZMQ forwarder failed: {self._error!r}")
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(STOP_WAIT_S)
        if self._thread.is_alive():
            raise RuntimeError("the ZMQ forwarder thread did not stop")

    def __enter__(self) -> ZmqForwarder:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        front = ctx.socket(zmq.ROUTER)
        backs: dict[bytes, zmq.Socket[Any]] = {}
        try:
            front.setsockopt(zmq.LINGER, 0)
            front.bind(self.url)
            poller = zmq.Poller()
            poller.register(front, zmq.POLLIN)
            self._ready.set()
            held: list[list[bytes]] = []
            while not self._stop.is_set():
                if held and not self.hold.is_set():
                    for msg in held:
                        self._forward(ctx, poller, backs, msg)
                    held.clear()
                for sock, _ in poller.poll(20):
                    if sock is front:
                        msg = front.recv_multipart(copy=True)
                        if self.hold.is_set() or held:
                            held.append(msg)
                        else:
                            self._forward(ctx, poller, backs, msg)
                    else:
                        ident = next(i for i, b in backs.items() if b is sock)
                        frames = sock.recv_multipart(copy=True)
                        front.send_multipart([ident, *frames])
        except BaseException as exc:  # reported by start() / seen in the test
            self._error = exc
            self._ready.set()
        finally:
            for back in backs.values():
                back.close(linger=0)
            front.close(linger=0)
            ctx.term()

    def _forward(
        self, ctx: zmq.Context[Any], poller: zmq.Poller, backs: dict[bytes, zmq.Socket[Any]], msg: list[bytes]
    ) -> None:
        ident, *frames = msg
        back = backs.get(ident)
        if back is None:
            back = ctx.socket(zmq.DEALER)
            back.setsockopt(zmq.LINGER, 0)
            back.setsockopt(zmq.RECONNECT_IVL, 100)
            back.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
            back.connect(self.backend)
            backs[ident] = back
            poller.register(back, zmq.POLLIN)
        back.send_multipart(frames)
        self.forwarded += 1


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        server = self.server
        assert isinstance(server, _Server)
        req = urllib.request.Request(server.backend + self.path, headers=dict(self.headers))
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                status, body, ctype = resp.status, resp.read(), resp.headers.get("Content-Type")
        except urllib.error.HTTPError as exc:
            status, body, ctype = exc.code, exc.read(), exc.headers.get("Content-Type")
        except (OSError, urllib.error.URLError) as exc:
            status, body, ctype = 502, f'{{"error": "bad gateway: {exc!r}"}}'.encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype or "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    backend = ""


class HttpForwarder:
    """Forward ``GET`` requests to ``backend`` (``http://host:port``)."""

    def __init__(self, backend: str) -> None:
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = _Server(("127.0.0.1", self.port), _Handler)
        self._server.backend = backend.rstrip("/")
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def start(self) -> HttpForwarder:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever: only if it runs
            self._server.shutdown()
        self._server.server_close()
        self._thread.join(STOP_WAIT_S)
        if self._thread.is_alive():
            raise RuntimeError("the HTTP forwarder thread did not stop")

    def __enter__(self) -> HttpForwarder:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
