"""Plain helpers and constants the tests share (no fixtures: those are in tests/plugins/).

* :data:`SESSION_CHUNK_SIZE`: the chunk size of every shared server of the session (the
  real ones and the embedded ones), 16 tokens, so tests can use small tensors.
* :data:`SMALL_GEOMETRY`, :func:`random_kv`: the small explicit KV geometry of the client
  fixtures and KV of it.
* :func:`unique_model`, :func:`fresh_tokens`: a model name and token ids no other test
  uses (the session servers are shared).
* :func:`peek` (and :func:`shared_loop_thread`): the one way tests look at a client's
  internals, so that a refactor of the package changes this file, not the tests.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import torch

from lmcache_async import AsyncClient, Client, KVGeometry
from lmcache_async._blocking.loop_thread import LoopThread
from lmcache_async._engine.event_stream import KVEventStream, subscribe
from lmcache_async._engine.session import Session
from lmcache_async._transport.connection import Connection
from lmcache_async._transport.replacement import ServerWatch
from lmcache_async._transport.shm import ShmPool

#: Chunk size of the shared session servers (tokens). Small on purpose.
SESSION_CHUNK_SIZE = 16

SMALL_GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)


def unique_model(prefix: str = "test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def fresh_tokens(n: int) -> list[int]:
    """``n`` token ids no other test uses (random base, so shared servers don't collide)."""
    base = int.from_bytes(os.urandom(4), "little") % (2**31)
    return list(range(base, base + n))


def random_kv(geometry: KVGeometry, num_tokens: int, seed: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    return torch.randn(geometry.kv_shape(num_tokens), generator=gen, dtype=torch.float32).to(geometry.dtype)


# --------------------------------------------------------------------------- internals
# The one place the tests reach into the package's private state: a refactor of the
# package changes this section, not the tests.


class ClientView:
    """What tests observe inside a client (from :func:`peek`): read-only properties, plus
    the few named interventions a fault test makes (``track``, ``replace_keepalive``,
    ``intercept_retire``, ``report_replaced``, ``next_request_uid``)."""

    def __init__(self, client: AsyncClient, sync: Client | None = None) -> None:
        self._client = client
        self._sync = sync

    @property
    def _session(self) -> Session:
        return self._client._session

    @property
    def conn(self) -> Connection:
        """The client's ZMQ connection (``in_flight``, ``dropped``, ``generation``, ``call``)."""
        return self._session.conn

    @property
    def in_flight_ops(self) -> set[asyncio.Future[Any]]:
        """The operations and background cleanup replies the client still tracks."""
        return self._client._runner.ops

    @property
    def pool(self) -> ShmPool | None:
        """The mapped SHM pool, or None (inline transfer)."""
        return self._session.pool

    @property
    def pool_buffer(self) -> torch.Tensor | None:
        """The pool's mapping as a byte tensor, or None once unmapped."""
        assert self._session.pool is not None
        return self._session.pool._base

    @property
    def keepalive_task(self) -> asyncio.Task[None] | None:
        return self._session.keepalive

    @property
    def http_session(self) -> aiohttp.ClientSession | None:
        """The HTTP session of the client's metadata fetches (None once closed)."""
        return self._session.meta._session

    @property
    def zmq_socket(self) -> Any:
        return self.conn._sock

    @property
    def zmq_context(self) -> Any:
        return self.conn._ctx

    @property
    def reader_task(self) -> asyncio.Task[None]:
        """The connection's reply reader."""
        return self.conn._tasks[0]

    @property
    def late_ends(self) -> Any:
        """The counts of ``end_session`` requests held back for late replies
        (``deferred``, ``unordered``, ``unsent``: :class:`lmcache_async._engine.ops.base.LateEnds`)."""
        return self._session.late_ends

    @property
    def registered_id(self) -> int | None:
        """The instance id the server knows the client by."""
        return self._session.registered_id

    @property
    def registration_lock(self) -> asyncio.Lock | None:
        return self._session._reg_lock

    @property
    def watch(self) -> ServerWatch:
        """The client's watch of the server's identity (``checks``, ``replacements``, ``quiet``)."""
        return self._session.watch

    @property
    def loop_thread(self) -> LoopThread:
        """The loop thread a blocking :class:`Client` runs on."""
        assert self._sync is not None, "peek(...).loop_thread is for a blocking Client"
        return self._sync._lt

    def next_request_uid(self) -> int:
        """Takes the uid the next request would have had: two calls that return consecutive
        numbers show that nothing was sent between them."""
        return next(self.conn._table._uids)

    def track(self, future: asyncio.Future[Any]) -> None:
        """Tracks ``future`` as the client tracks an operation or a cleanup reply."""
        self._client._runner.track(future)

    def event_stream(self, **kw: Any) -> KVEventStream:
        """The stream ``kv_events(**kw)`` iterates, of the client's model (its cursor and
        counters readable; the client open)."""
        s = self._session
        return subscribe(s.conn, self._client.model_name, s.chunk_size, **kw)

    def replace_keepalive(self, task: asyncio.Task[None]) -> None:
        """Makes ``task`` the client's keep-alive task (what its close cancels and awaits)."""
        self._session.keepalive = task

    def intercept_retire(self, retire: Callable[..., None]) -> None:
        """Calls ``retire(instance_id, reason)`` instead of retiring a registration."""
        self._session.retire_registration = retire  # type: ignore[method-assign]

    def report_replaced(self, identity: object) -> None:
        """Reports a new server identity, as the client's watch does when it sees one."""
        self._session.replaced(identity)


def peek(client: AsyncClient | Client) -> ClientView:
    """The internals of an :class:`AsyncClient` or a blocking :class:`Client` (its async
    client's, plus its ``loop_thread``), for tests that must look inside."""
    if isinstance(client, Client):
        return ClientView(client._async, client)
    return ClientView(client)


def shared_loop_thread() -> LoopThread | None:
    """The loop thread blocking clients share now (None before the first or after it exited)."""
    return LoopThread.current()
