"""A client that cannot open releases everything it made: a mistyped URL is refused at
construction, and a failure inside ``Connection.open()`` closes the socket and its monitor
(the ZMQ context is the process's, never terminated: nothing can block collecting them)."""

from __future__ import annotations

import asyncio
import gc
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

import lmcache_async as lmc
from harness.real_server import REPO_ROOT
from lmcache_async import kvcache
from lmcache_async._protocol.urls import check_zmq_url
from lmcache_async._transport.connection import Connection
from lmcache_async.testing import EmbeddedServer

SCRIPT = Path(__file__).with_name("failed_open_script.py")
GEOMETRY = lmc.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=16)

BAD_URLS = [
    (
        "tcp://localhost",
        "url 'tcp://localhost' has no port (tcp://host:port; the server's --port, often 5555)",
    ),
    ("tcp://127.0.0.1:70000", "url 'tcp://127.0.0.1:70000': port '70000' is not a port number in 1..65535"),
    ("tcp://127.0.0.1:port", "url 'tcp://127.0.0.1:port': port 'port' is not a port number in 1..65535"),
    ("tcp://127.0.0.1:0", "url 'tcp://127.0.0.1:0': port 0 is not a port to connect to (1..65535)"),
    ("tcp://127.0.0.1:5555/kv", "url 'tcp://127.0.0.1:5555/kv' must be tcp://host:port and nothing else"),
    ("tcp://:5555", "url 'tcp://:5555' names no host to connect to (tcp://host:port)"),
    ("tcp://*:5555", "url 'tcp://*:5555' names no host to connect to (tcp://host:port)"),
    ("ipc://", "url 'ipc://' names no socket path (ipc://path)"),
    ("inproc://kv", "url must be tcp://host:port or ipc://path, got 'inproc://kv'"),
    (
        "http://127.0.0.1:8080",
        "url 'http://127.0.0.1:8080' is an HTTP address: url is the server's ZMQ endpoint, "
        "tcp://host:port (the HTTP endpoint is http_url)",
    ),
    ("localhost:5555", "url must look like tcp://host:port, got 'localhost:5555'"),
    # QA-4 n4: a second port read as "port '1' is not a port number".
    (
        "tcp://127.0.0.1:5555:1",
        "url 'tcp://127.0.0.1:5555:1' has more than one ':' after the host (tcp://host:port; "
        "an IPv6 address goes in brackets, tcp://[::1]:5555)",
    ),
    (
        "tcp://::1:5555",
        "url 'tcp://::1:5555' has more than one ':' after the host (tcp://host:port; "
        "an IPv6 address goes in brackets, tcp://[::1]:5555)",
    ),
    # QA-4 n4: a 300-character host was a raw UnicodeError (idna: label too long) at open.
    (
        f"tcp://{'a' * 300}:5555",
        f"url 'tcp://{'a' * 300}:5555': {'a' * 40!r}... is not a host name "
        "(at most 253 characters, in dot-separated labels of 1 to 63)",
    ),
    (
        f"tcp://{'b' * 64}.example:5555",
        f"url 'tcp://{'b' * 64}.example:5555': {'b' * 40!r}... is not a host name "
        "(at most 253 characters, in dot-separated labels of 1 to 63)",
    ),
    (
        "tcp://a..b:5555",
        "url 'tcp://a..b:5555': 'a..b' is not a host name (at most 253 characters, in dot-separated labels of 1 to 63)",
    ),
]


@pytest.mark.parametrize(("url", "message"), BAD_URLS)
def test_a_url_that_cannot_work_is_a_value_error_at_construction(url: str, message: str) -> None:
    pattern = f"^{re.escape(message)}$"
    with pytest.raises(ValueError, match=pattern):
        check_zmq_url(url)
    with pytest.raises(ValueError, match=pattern):
        lmc.AsyncClient(url, "http://127.0.0.1:9", "m")
    with pytest.raises(ValueError, match=pattern):
        lmc.Client(url, "http://127.0.0.1:9", "m", geometry=GEOMETRY)
    with pytest.raises(ValueError, match=pattern):
        kvcache.connect(url, "http://127.0.0.1:9", "m", geometry=GEOMETRY)
    with pytest.raises(ValueError, match=pattern):
        Connection(url)


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("tcp://localhost:5555", "localhost"),
        ("tcp://[::1]:5555", "::1"),
        ("tcp://10.0.0.7:1", "10.0.0.7"),
        ("ipc:///tmp/kv", ""),
    ],
)
def test_urls_that_can_work_are_accepted(url: str, host: str) -> None:
    assert check_zmq_url(url) == host


def test_a_url_that_is_not_a_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"^url must be a str like tcp://host:port, got bytes$"):
        lmc.AsyncClient(b"tcp://localhost:5555", "http://127.0.0.1:9", "m")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_an_unresolvable_host_is_reported_as_such() -> None:
    async with EmbeddedServer() as srv:
        port = srv.url.rpartition(":")[2]
        client = lmc.AsyncClient(
            f"tcp://no-such-host.invalid:{port}", srv.http_url, "m", geometry=GEOMETRY, timeout=10
        )
        with pytest.raises(lmc.LMCacheConnectionError) as info:
            await client.open()
        assert str(info.value).startswith(
            f"cannot connect to tcp://no-such-host.invalid:{port}: the host 'no-such-host.invalid' cannot be resolved ("
        )
        assert client.closed


@pytest.mark.anyio
async def test_bad_urls_leave_nothing_behind_and_the_next_client_works_at_once() -> None:
    def open_sockets() -> int:
        gc.collect()
        return sum(issubclass(type(o), zmq.Socket) and not o.closed for o in gc.get_objects())

    before = open_sockets()
    for url, message in BAD_URLS:
        with pytest.raises(ValueError, match=re.escape(message)):
            lmc.AsyncClient(url, "http://127.0.0.1:9", "m")
    assert open_sockets() == before  # refused before any socket existed
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    try:
        async with EmbeddedServer() as srv:
            async with asyncio.timeout(10):
                async with lmc.AsyncClient(
                    srv.url, srv.http_url, "m", geometry=GEOMETRY, timeout=10
                ) as client:
                    assert await client.lookup(list(range(16))) == 0
        assert ticks > 0
    finally:
        ticker.cancel()


def test_a_failed_open_releases_its_zmq_sockets_so_collecting_them_hangs_nothing() -> None:
    # In a subprocess under a deadline: the defect froze the collecting thread for good.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "OK"
    values = dict(line.split("=", 1) for line in lines[:-1])
    errors = [line for line in lines if line.startswith(("sync_error=", "async_error="))]
    assert len(errors) == 6
    assert all(
        re.fullmatch(r"\w+_error=cannot open a ZMQ connection to tcp://127\.0\.0\.1:\d+: Invalid argument", e)
        for e in errors
    )
    assert values["sockets_left"] == "0"
    assert values["sync_lookup"] == "0"
    assert int(values["ticks"]) > 0


async def _open_error(url: str, http_url: str) -> str:
    client = lmc.AsyncClient(url, http_url, "m", geometry=GEOMETRY, timeout=10)
    with pytest.raises(lmc.LMCacheConnectionError) as info:
        await client.open()
    assert client.closed
    return str(info.value)


def _zmq_port_as_http(url: str) -> str:
    return "http://127.0.0.1:" + url.rpartition(":")[2]


ZMQ_PORT_AS_HTTP = (
    "GET {}/lmc_version failed: the peer answered with a ZMQ greeting, not HTTP: http_url names "
    "the server's ZMQ port; give its HTTP port (lmcache server --http-port, often 8080)"
)


@pytest.mark.anyio
async def test_an_http_url_at_the_zmq_port_says_so() -> None:
    async with EmbeddedServer() as srv:
        http_url = _zmq_port_as_http(srv.url)
        assert await _open_error(srv.url, http_url) == ZMQ_PORT_AS_HTTP.format(http_url)


@pytest.mark.anyio
async def test_an_http_url_at_the_real_servers_zmq_port_says_so(real_server_shm: Any) -> None:
    http_url = _zmq_port_as_http(real_server_shm.url)
    assert await _open_error(real_server_shm.url, http_url) == ZMQ_PORT_AS_HTTP.format(http_url)


@pytest.mark.anyio
async def test_an_http_url_at_another_protocols_port_says_it_is_not_http() -> None:
    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        message = await _open_error("tcp://127.0.0.1:9", f"http://127.0.0.1:{port}")
    assert message == (
        f"GET http://127.0.0.1:{port}/lmc_version failed: the peer does not speak HTTP; "
        "is http_url the server's HTTP port?"
    )
