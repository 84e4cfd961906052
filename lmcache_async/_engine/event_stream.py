"""The KV-event subscription engine behind ``AsyncClient.kv_events()``: one
:class:`KVEventStream` is one ``subscribe_kv_events`` subscription on the client's
connection, under its own subscriber id, kept alive by ``ping``, credited by ``ack``,
cancelled on close, resumed from its cursor after a reconnect (docs/internals/design.md,
section "KV events: a stream on the connection").
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from types import TracebackType

from lmcache_async._base.tasks import cancel_and_wait
from lmcache_async._protocol.event_types import (
    KVEvent,
    Resync,
    decode_batch,
    validate_cursor,
    validate_max_events,
)
from lmcache_async._protocol.wire import Op, validate_model_name
from lmcache_async._transport.connection import Connection
from lmcache_async._transport.metadata import Metadata
from lmcache_async._transport.reply_stream import ReplyStream, open_stream
from lmcache_async.errors import (
    ClientClosedError,
    KVEventsDisabledError,
    LMCacheConnectionError,
    LMCacheTimeoutError,
)

__all__ = ["KVEventStream", "refuse_embedded", "subscribe"]

log = logging.getLogger(__name__)

#: The first wait before subscribing again after the server ended a stream (doubles, to 1 s).
RESUBSCRIBE_BACKOFF_S = 0.05


class KVEventStream:
    """An async iterator of the KV events of one model on one server.

    Made by :meth:`lmcache_async.AsyncClient.kv_events` (no I/O until the first
    ``__anext__``). Yields :class:`~lmcache_async.events.StoredEvent`,
    :class:`~lmcache_async.events.RemovedEvent` and
    :class:`~lmcache_async.events.Resync` items in the server's order.

    Attributes:
        subscriber_id: the random 63-bit id the subscription is made (and pinged) under.
        cursor: the server's ``next_cursor`` of the last batch received: the value to
            resume from (with :attr:`incarnation`) in a later stream.
        incarnation: the server incarnation of the last batch (``None`` before the first).
        batches: batches received; subscriptions: subscribe requests sent (1 + resumes).
    """

    def __init__(
        self,
        conn: Connection,
        model_name: str,
        *,
        cursor: int = 0,
        incarnation: int | None = None,
        max_events: int = 256,
        chunk_size: int,
        ping_interval: float = 10.0,
        reconnect_timeout: float | None = 60.0,
        send_timeout: float | None = 10.0,
        on_close: Callable[[KVEventStream], None] | None = None,
    ) -> None:
        self._conn = conn
        self.model_name = model_name
        self.cursor = validate_cursor(cursor)
        if incarnation is not None and (isinstance(incarnation, bool) or not isinstance(incarnation, int)):
            raise TypeError(f"incarnation must be an int or None, got {type(incarnation).__name__}")
        self.incarnation = incarnation
        self.max_events = validate_max_events(max_events)
        self.chunk_size = chunk_size
        if isinstance(ping_interval, bool) or not isinstance(ping_interval, int | float):
            raise TypeError(f"ping_interval must be a number of seconds, got {type(ping_interval).__name__}")
        if not 0 < ping_interval <= 30:  # nan and inf too
            raise ValueError(f"ping_interval must be in (0, 30] seconds, got {ping_interval!r}")
        self.ping_interval = float(ping_interval)
        if reconnect_timeout is not None:
            if isinstance(reconnect_timeout, bool) or not isinstance(reconnect_timeout, int | float):
                kind = type(reconnect_timeout).__name__
                raise TypeError(f"reconnect_timeout must be a number of seconds or None, got {kind}")
            if not 0 <= reconnect_timeout < math.inf:  # nan too
                raise ValueError(
                    f"reconnect_timeout must be a finite number >= 0 seconds or None (for ever), "
                    f"got {reconnect_timeout!r}"
                )
        self.reconnect_timeout = reconnect_timeout
        self._send_timeout = send_timeout
        self._on_close = on_close
        self.subscriber_id = secrets.randbits(63)
        self.batches = 0
        self.subscriptions = 0
        self._fresh = cursor == 0 and incarnation is None  # nothing derived yet: ignore 'lost'
        self._items: collections.deque[KVEvent] = collections.deque()
        self._stream: ReplyStream | None = None
        self._ack_due = False
        self._ping_task: asyncio.Task[None] | None = None
        self._closed = False
        self._backoff = RESUBSCRIBE_BACKOFF_S
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return (
            f"<KVEventStream {self.model_name!r} subscriber={self.subscriber_id} cursor={self.cursor} "
            f"incarnation={self.incarnation} closed={self._closed}>"
        )

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ iteration

    def __aiter__(self) -> KVEventStream:
        return self

    async def __aenter__(self) -> KVEventStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def __anext__(self) -> KVEvent:
        """The next event.

        Waits without a deadline: an idle server sends nothing (bound the wait with
        ``asyncio.timeout``; that cancels, and so closes, the stream).

        Raises:
            StopAsyncIteration: the stream was closed.
            KVEventsDisabledError: the server's event channel is off.
            LMCacheConnectionError: the server stayed unreachable for
                ``reconnect_timeout`` seconds.
            ClientClosedError: the client was closed.
            ProtocolError: a malformed batch.

        Cancellation, and any error: the subscription is cancelled on the server and
        the stream is closed.
        """
        if self._closed:
            raise StopAsyncIteration
        self._loop = asyncio.get_running_loop()
        try:
            while not self._items:
                await self._fill()
                if self._closed:
                    raise StopAsyncIteration
            return self._items.popleft()
        except StopAsyncIteration:
            raise
        except BaseException:
            self.close_now()
            raise

    async def aclose(self) -> None:
        """Cancel the subscription on the server (if connected) and stop pinging.
        Idempotent; never raises for a lost connection.

        Cancellation: the subscription is cancelled anyway (the frame goes out at once);
        only the wait for the ping task's end is cut short.
        """
        task = self._ping_task
        self.close_now()
        if task is not None:
            await cancel_and_wait(task, "kv-event ping")

    def close_now(self) -> None:
        """:meth:`aclose` without waiting (from a callback or a finalizer, on the loop)."""
        if self._closed:
            return
        self._closed = True
        self._items.clear()
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        if self._ping_task is not None:
            self._ping_task.cancel()
            self._ping_task = None
        if self._on_close is not None:
            self._on_close(self)

    def __del__(self) -> None:
        # A bare ``break`` out of ``async for`` drops the stream: cancel it on the server.
        if getattr(self, "_closed", True):
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            if threading.get_ident() == getattr(loop, "_thread_id", None):
                self.close_now()
            else:
                loop.call_soon_threadsafe(self.close_now)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # ------------------------------------------------------------------ engine

    async def _fill(self) -> None:
        """Receive one batch (subscribing or resuming first if needed) into the items."""
        if self._stream is not None and self._ack_due:
            self._ack_due = False
            self._stream.ack()  # the previous batch is consumed: credit for the next
        if self._stream is None:
            await self._subscribe()
        stream = self._stream
        assert stream is not None
        try:
            reply = await stream.next()
        except ClientClosedError:
            raise
        except LMCacheConnectionError as exc:
            log.info("kv events of %s: %s; resuming from cursor %d", self._conn.url, exc, self.cursor)
            self._stream = None
            self._ack_due = False
            return
        if reply is None:  # the server ended the stream (reaped, id taken, stopping)
            log.info(
                "kv events of %s: the server ended the stream; resuming from cursor %d",
                self._conn.url,
                self.cursor,
            )
            self._stream = None
            self._ack_due = False
            await asyncio.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, 1.0)
            return
        assert reply.payload is not None  # a frameless reply is the end (None above)
        batch = decode_batch(
            reply.payload,
            model_name=self.model_name,
            cursor=self.cursor,
            max_events=self.max_events,
            chunk_size=self.chunk_size,
        )
        self.batches += 1
        self._ack_due = True
        self._backoff = RESUBSCRIBE_BACKOFF_S
        if not batch.enabled:
            raise KVEventsDisabledError(
                f"{self._conn.url} does not publish KV events (its event channel is off: "
                "--kv-event-log-size 0 or --disable-observability)"
            )
        if self.incarnation is not None and batch.incarnation != self.incarnation:
            # A new server: this batch was read from the old server's cursor; read the
            # new server's log from its start instead.
            previous = self.incarnation
            self.incarnation = batch.incarnation
            self.cursor = 0
            self._fresh = False
            stream.cancel()
            self._stream = None
            self._ack_due = False
            self._items.append(Resync("restarted", batch.incarnation, previous, 0))
            return
        self.incarnation = batch.incarnation
        if batch.lost and not self._fresh:
            # Resuming from the Resync's cursor must give the records that follow it here.
            resume = batch.events[0].seq - 1 if batch.events else batch.next_cursor
            self._items.append(Resync("lost", batch.incarnation, None, resume))
        self._fresh = False
        self.cursor = batch.next_cursor
        self._items.extend(batch.events)

    async def _subscribe(self) -> None:
        """Send ``subscribe_kv_events`` from :attr:`cursor`, waiting for the connection
        (at most ``reconnect_timeout`` seconds) when it is down."""
        start = time.monotonic()
        while True:
            try:
                self._stream = await open_stream(
                    self._conn,
                    Op.SUBSCRIBE_KV_EVENTS,
                    (self.subscriber_id, self.model_name, self.cursor, self.max_events),
                    timeout=self._send_timeout,
                )
                break
            except ClientClosedError:
                raise
            except LMCacheConnectionError:
                waited = time.monotonic() - start
                if self.reconnect_timeout is not None and waited >= self.reconnect_timeout:
                    raise LMCacheConnectionError(
                        f"kv events: {self._conn.url} unreachable for {waited:.1f}s "
                        f"(reconnect_timeout {self.reconnect_timeout}s); resume later from cursor "
                        f"{self.cursor}, incarnation {self.incarnation}"
                    ) from None
                await asyncio.sleep(0.05)
        self.subscriptions += 1
        if self._ping_task is None:
            self._ping_task = asyncio.create_task(self._pinger(), name="lmcache-kv-events-ping")

    async def _pinger(self) -> None:
        """Refresh the subscription every ``ping_interval`` seconds (errors are logged:
        a ping missed while the server is away is harmless; the resume re-subscribes)."""
        while True:
            await asyncio.sleep(self.ping_interval)
            try:
                await self._conn.call(Op.PING, (self.subscriber_id,), timeout=self.ping_interval)
            except ClientClosedError:
                return
            except (LMCacheConnectionError, LMCacheTimeoutError) as exc:
                log.debug("kv events: ping of subscriber %d failed: %s", self.subscriber_id, exc)


def subscribe(
    conn: Connection,
    model_name: str,
    chunk_size: int,
    cursor: int = 0,
    incarnation: int | None = None,
    max_events: int = 256,
    ping_interval: float = 10.0,
    reconnect_timeout: float | None = 60.0,
) -> KVEventStream:
    """A stream of the KV events of ``model_name`` on the server of ``conn`` (an open
    client's; no I/O until the first ``__anext__``): what
    :meth:`lmcache_async.AsyncClient.kv_events` iterates, once it has checked its state
    and :func:`refuse_embedded`.

    Args:
        model_name: the model whose events to follow (the server filters by exact name; a
            record of another model is a ProtocolError).
        chunk_size: the server's chunk size (a stored event's tokens are whole chunks).
        cursor: resume after the records already seen (the ``seq`` of the last event
            applied, or a ``Resync`` item's ``cursor``: nothing after it is skipped); 0:
            everything the server still holds.
        incarnation: the server incarnation ``cursor`` belongs to (the last event's);
            another one on the server means it restarted: a ``Resync("restarted")``
            first. With ``cursor`` 0 and no incarnation, records the server no longer
            holds are not reported as lost.
        max_events: records a batch, 1..1024 (the server answers nothing else).
        ping_interval: seconds between the pings that keep the subscription (0 < s <= 30).
        reconnect_timeout: seconds a lost connection may take to come back before the
            iteration raises (finite, >= 0; ``None``: for ever).

    Raises (here, nothing sent): ValueError/TypeError for bad arguments. Iteration raises what
    :meth:`KVEventStream.__anext__` says; waiting for an event has no deadline (an idle
    server sends nothing: bound it with ``asyncio.timeout``, which closes the stream).

    Cancellation, ``aclose()``, leaving ``async with``, or dropping the stream: the
    subscription is cancelled on the server.
    """
    name = validate_model_name(model_name)
    if "\0" in name:  # no engine registers such a name: the stream would wait for ever
        raise ValueError(f"model_name must not contain '\\x00': {name!r}")
    return KVEventStream(
        conn,
        name,
        cursor=cursor,
        incarnation=incarnation,
        max_events=max_events,
        chunk_size=chunk_size,
        ping_interval=ping_interval,
        reconnect_timeout=reconnect_timeout,
    )


def refuse_embedded(meta: Metadata, url: str) -> None:
    """:class:`KVEventsDisabledError` when the server of ``meta`` (an open client's) is
    lmcache_async's embedded server, which publishes no KV events."""
    if is_embedded(meta):
        raise KVEventsDisabledError(
            f"{url} is lmcache_async's embedded server (lmcache_async.testing, "
            "`lmcache-async serve`, `make demo`), which publishes no KV events: follow the events "
            "of a real LMCache server (`lmcache server`, docs/guides/routing.md)"
        )


def is_embedded(meta: Metadata) -> bool:
    """Whether the server's ``/status`` or ``/config`` read at connect (``meta``, the
    client's :class:`~lmcache_async._transport.metadata.Metadata`) is the embedded server's
    (:mod:`lmcache_async.testing`: an ``lmcache_async_embedded`` section)."""
    docs = (meta.cached("status"), meta.cached("config"))
    return any(isinstance(doc, dict) and "lmcache_async_embedded" in doc for doc in docs)
