"""The client-side fixtures (a pytest plugin, registered by tests/conftest.py): the embedded
servers, the server-configuration matrix of the contract suite and an open client on it.

* ``embedded_server_shm`` / ``embedded_server_pickle`` / ``embedded_server_057_shm`` /
  ``embedded_server_057_pickle`` (session): an embedded server (``lmcache_async.testing``)
  on a thread of this process, chunk size 16, speaking 0.5.6 or 0.5.7, over SHM or inline.
* ``server`` (function, parametrized with :data:`SERVER_CONFIGS`): each server
  configuration in turn: the real 0.5.6 and 0.5.7 session servers (marked
  ``real_server``) and the embedded ones, each over SHM and pickle.
* ``own_server`` (function): a factory for a server of ``server``'s configuration owned
  by the test (for tests that clear the cache or restart it).
* ``client`` (function): an open :class:`AsyncClient` on ``server`` with
  :data:`~tests.helpers.SMALL_GEOMETRY` and a model of its own.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from harness.real_server import RealLMCacheServer
from lmcache_async import AsyncClient
from tests.helpers import SESSION_CHUNK_SIZE, SMALL_GEOMETRY, unique_model

#: Parameters of the contract suite: every server configuration a client test runs on.
SERVER_CONFIGS = [
    pytest.param("real-shm", marks=pytest.mark.real_server),
    pytest.param("real-pickle", marks=pytest.mark.real_server),
    pytest.param("real057-shm", marks=pytest.mark.real_server),
    pytest.param("real057-pickle", marks=pytest.mark.real_server),
    "embedded-shm",
    "embedded-pickle",
    "embedded057-shm",
    "embedded057-pickle",
]


def _embedded(mode: str, **kw: Any) -> Any:
    from lmcache_async.testing import EmbeddedServer

    assert mode in ("shm", "pickle"), mode
    return EmbeddedServer.start_in_thread(
        chunk_size=SESSION_CHUNK_SIZE, mode="shm" if mode == "shm" else "pickle", **kw
    )


@pytest.fixture(scope="session")
def embedded_server_shm() -> Iterator[Any]:
    """A shared embedded server (SHM, chunk size 16) on a thread of this process."""
    handle = _embedded("shm")
    yield handle
    handle.stop()
    assert handle.shm_segment is None or not os.path.exists(handle.shm_segment)


@pytest.fixture(scope="session")
def embedded_server_pickle() -> Iterator[Any]:
    """A shared embedded server (pickle, chunk size 16) on a thread of this process."""
    handle = _embedded("pickle")
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def embedded_server_057_shm() -> Iterator[Any]:
    """A shared embedded server speaking 0.5.7 (SHM, chunk size 16)."""
    handle = _embedded("shm", generation="0.5.7")
    yield handle
    handle.stop()
    assert handle.shm_segment is None or not os.path.exists(handle.shm_segment)


@pytest.fixture(scope="session")
def embedded_server_057_pickle() -> Iterator[Any]:
    """A shared embedded server speaking 0.5.7 (inline tensor envelopes, chunk size 16)."""
    handle = _embedded("pickle", generation="0.5.7")
    yield handle
    handle.stop()


@pytest.fixture(params=SERVER_CONFIGS)
def server(request: pytest.FixtureRequest) -> Any:
    """Each server configuration of the contract suite in turn (url, http_url, mode,
    chunk_size 16)."""
    kind, mode = request.param.split("-")
    if kind == "real":
        return request.getfixturevalue(f"real_server_{mode}")
    if kind == "real057":
        return request.getfixturevalue(f"real_server_057_{mode}")
    if kind == "embedded057":
        return request.getfixturevalue(f"embedded_server_057_{mode}")
    return request.getfixturevalue(f"embedded_server_{mode}")


@pytest.fixture
def own_server(server: Any, request: pytest.FixtureRequest) -> Iterator[Callable[[], Any]]:
    """A factory for a server of the same configuration as ``server`` but owned by the test
    (for tests that clear the cache or restart it)."""
    made: list[Any] = []

    def make() -> Any:
        if isinstance(server, RealLMCacheServer):
            srv = request.getfixturevalue("fresh_real_server")(server.mode, generation=server.generation)
        else:
            srv = _embedded(server.mode, generation=server.generation)
            made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop()


@pytest.fixture
async def client(server: Any) -> AsyncIterator[AsyncClient]:
    """An open AsyncClient with the small explicit geometry and a model of its own."""
    async with AsyncClient(
        server.url, server.http_url, unique_model(), geometry=SMALL_GEOMETRY, timeout=30
    ) as c:
        yield c
