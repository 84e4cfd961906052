"""Exceptions raised by lmcache_async.

Every error the library raises on purpose derives from :class:`LMCacheError`.
Where callers already catch a builtin, the error also derives from it::

    LMCacheError
     +-- LMCacheTimeoutError         (also TimeoutError)     no reply before the deadline
     +-- LMCacheConnectionError      (also ConnectionError)  socket/HTTP unreachable, lost
     |    +-- ClientClosedError      (also ClientStateError) the client was closed
     |    +-- ServerReplacedError                            the server was replaced mid-operation
     +-- ClientStateError            (also RuntimeError)     the client cannot take calls here, now
     |    +-- ClientNotOpenError                             not opened yet (or still opening)
     |    +-- WrongEventLoopError                            used from another event loop than its own
     |    +-- ForkedClientError                              inherited across os.fork()
     |    +-- SyncUsageError                                 a blocking Client call that cannot work
     |    |    +-- LoopThreadCallError                       made from the Client's own loop thread
     |    |    +-- ForkedSyncClientError (also ForkedClientError)
     |    +-- ClientClosedError                              (see above)
     +-- ServerError                                         the server answered, but not as promised
     |    +-- ModelNotRegisteredError (also LookupError)     /status has no such model
     |    +-- HybridLayoutError                              the model's registration has several KV groups
     |    +-- ProtocolError                                  a malformed or hostile reply
     |    |    +-- UnsafePayloadError                        a pickle reply that is not plain tensors
     |    |    +-- LayoutMismatchError                       KV of another geometry under the model
     |    +-- UnsupportedServerVersionError                  /lmc_version: a generation not spoken
     |    +-- KVEventsDisabledError                          the server's KV-event channel is off
     |    +-- UnsupportedHashAlgorithmError                  chunk hashes a client cannot compute
     |    +-- HTTPStatusError                                an HTTP route answered other than 200
     |         +-- AuthenticationError (also PermissionError) 401: an API key is needed or wrong
     +-- TransferError                                       a store/retrieve could not move the data
          +-- UnfilledReservationError                       reserved slots could not be filled

:class:`UnknownServerVersionWarning` (a ``UserWarning``) is the one warning: the server
reports a version this client was not built against and is spoken to as the newest known.

``except ClientStateError`` catches every misuse of a client (used before ``open()``,
after ``close()``, from the wrong event loop or thread, or after a fork); nothing was
sent to the server in any of these cases.

Argument errors are plain :class:`ValueError` / :class:`TypeError` raised before anything
is sent (a bad ``timeout``: :func:`lmcache_async._base.timeouts.check_timeout`). No raw zmq,
aiohttp or msgpack exception escapes the public API: they are chained as ``__cause__``.
All exceptions pickle (their ``__reduce__`` keeps the attributes).
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = [
    "AuthenticationError",
    "ClientClosedError",
    "ClientNotOpenError",
    "ClientStateError",
    "ForkedClientError",
    "ForkedSyncClientError",
    "HTTPStatusError",
    "HybridLayoutError",
    "KVEventsDisabledError",
    "LMCacheConnectionError",
    "LMCacheError",
    "LMCacheTimeoutError",
    "LayoutMismatchError",
    "LoopThreadCallError",
    "ModelNotRegisteredError",
    "ProtocolError",
    "ServerError",
    "ServerReplacedError",
    "SyncUsageError",
    "TransferError",
    "UnfilledReservationError",
    "UnknownServerVersionWarning",
    "UnsafePayloadError",
    "UnsupportedHashAlgorithmError",
    "UnsupportedServerVersionError",
    "WrongEventLoopError",
]


class LMCacheError(Exception):
    """Base class of every error raised by lmcache_async."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type[LMCacheError], args: tuple[Any, ...], state: dict[str, Any]) -> LMCacheError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class LMCacheTimeoutError(LMCacheError, TimeoutError):
    """No reply arrived before the deadline.

    The LMCache server never sends error replies: a request it rejects looks exactly
    like a slow one. The outcome of the operation is therefore unknown.

    Attributes:
        operation: wire operation (or client method) that timed out.
        request_id: the request uid on the wire, when there was one.
        elapsed: seconds waited.
    """

    def __init__(self, operation: str, elapsed: float, request_id: int | None = None) -> None:
        self.operation = operation
        self.elapsed = elapsed
        self.request_id = request_id
        rid = f" (request {request_id})" if request_id is not None else ""
        super().__init__(f"{operation}{rid}: no reply from the LMCache server after {elapsed:.3f}s")


class LMCacheConnectionError(LMCacheError, ConnectionError):
    """The server could not be reached, or the connection was lost mid-call."""


class ServerReplacedError(LMCacheConnectionError):
    """The server behind the connection was replaced (restarted with a new instance id,
    e.g. behind a proxy that kept the connection up) while this operation ran, and it
    could not be run again on the new server: it had already been run again once, or its
    caller had left. Nothing it did on the old server survives; the client has registered
    with the new server, so the next operation works."""


class ClientStateError(LMCacheError, RuntimeError):
    """The client cannot take this call in its present state or from where it was made.

    Raised before anything is sent. The subclasses say why; this class itself is raised
    for a second ``open()`` of a client.
    """


class ClientClosedError(LMCacheConnectionError, ClientStateError):
    """The client was closed (or is closing); no new calls are accepted.

    Also a :class:`LMCacheConnectionError` and a
    :class:`ClientStateError`.
    """


class ClientNotOpenError(ClientStateError):
    """The client was not opened yet (or is still opening): use ``async with`` or
    :func:`lmcache_async.connect`."""


class WrongEventLoopError(ClientStateError):
    """An :class:`~lmcache_async.AsyncClient` was used from an event loop other than the
    one that opened it (its socket and HTTP session belong to that loop)."""


class ForkedClientError(ClientStateError):
    """The client was created in another process and inherited across ``os.fork()``;
    its socket, session and loop thread belong to the parent. Create a new client.

    Attributes:
        owner_pid: the process that created the client.
    """

    def __init__(self, message: str, owner_pid: int) -> None:
        super().__init__(message)
        self.owner_pid = owner_pid


class SyncUsageError(ClientStateError):
    """A blocking :class:`~lmcache_async.Client` call was made where it cannot work.

    Raised as one of its two subclasses; still a ``RuntimeError`` as before.

    Attributes:
        reason: ``"loop_thread"`` (:class:`LoopThreadCallError`: called from the client's
            own event-loop thread, where waiting would deadlock) or ``"forked"``
            (:class:`ForkedSyncClientError`: the client was created in the parent of a
            fork; create a new one in this process).
    """

    def __init__(self, message: str, reason: Literal["loop_thread", "forked"]) -> None:
        super().__init__(message)
        self.reason = reason


class LoopThreadCallError(SyncUsageError):
    """A blocking call made from the ``lmcache-async-loop`` thread it would wait for
    (e.g. from a ``progress`` callback): it raises at once instead of deadlocking.
    ``reason`` is ``"loop_thread"``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "loop_thread")


class ForkedSyncClientError(SyncUsageError, ForkedClientError):
    """A :class:`~lmcache_async.Client` inherited across ``os.fork()`` was used in the
    child. ``reason`` is ``"forked"``; ``owner_pid`` the process that created it."""

    def __init__(self, message: str, owner_pid: int) -> None:
        ClientStateError.__init__(self, message)
        self.reason: Literal["loop_thread", "forked"] = "forked"
        self.owner_pid = owner_pid


class ServerError(LMCacheError):
    """The server answered, but not in the way the protocol promises."""


class ModelNotRegisteredError(ServerError, LookupError):
    """The model has no registration in ``/status`` and no geometry was given.

    Attributes:
        model_name: the model asked for.
        registered: model names ``/status`` lists.
    """

    def __init__(self, model_name: str, registered: list[str]) -> None:
        self.model_name = model_name
        self.registered = list(registered)
        known = ", ".join(repr(m) for m in registered) if registered else "none"
        super().__init__(
            f"model {model_name!r} is not registered on the server (registered: {known}); "
            "start the inference engine first or pass geometry=KVGeometry(...) to connect()"
        )


class HybridLayoutError(ServerError):
    """The model's registration in ``/status`` has several KV groups (a hybrid model: vLLM
    registers one group per kind of layer when a model mixes full attention with
    sliding-window or Mamba layers), which no single :class:`~lmcache_async.KVGeometry`
    describes; the client does not guess one.

    Attributes:
        model_name: the model asked for.
        groups: one description per group, as the message shows them (its layers, the
            engine's KV format and shape, its tokens per block).
    """

    def __init__(self, model_name: str, groups: list[str]) -> None:
        self.model_name = model_name
        self.groups = list(groups)
        super().__init__(
            f"model {model_name!r} is registered with {len(groups)} KV groups (a hybrid model, e.g. "
            f"attention mixed with sliding-window or Mamba layers): {'; '.join(groups)}. "
            "lmcache_async reads and writes models whose KV is one group, which one KVGeometry "
            "describes; it does not guess a geometry for this one"
        )


class ProtocolError(ServerError):
    """A reply was malformed, out of range or otherwise not what the protocol allows."""


class UnsafePayloadError(ProtocolError):
    """A pickle payload referenced something other than plain CPU tensors."""


class TransferError(LMCacheError):
    """The data of a store or retrieve could not be moved (e.g. SHM unusable)."""


class UnsupportedServerVersionError(ServerError):
    """The server's ``/lmc_version`` names a version this client cannot talk to.

    Attributes:
        version: what the server reported.
    """

    def __init__(self, version: object, reason: str) -> None:
        self.version = version
        super().__init__(f"unsupported LMCache server version {version!r}: {reason}")


class KVEventsDisabledError(ServerError):
    """The server's KV-event channel is off (``--kv-event-log-size 0`` or
    ``--disable-observability``): it answers subscriptions with ``enabled=False``
    (:meth:`lmcache_async.AsyncClient.kv_events`)."""


class UnsupportedHashAlgorithmError(ServerError):
    """The server hashes chunks with an algorithm a client cannot reproduce (only the
    default ``--hash-algorithm blake3`` can be: :mod:`lmcache_async.hashing`)."""


class HTTPStatusError(ServerError):
    """An HTTP route of the server answered with a status other than 200.

    Attributes:
        status: the HTTP status code.
        url: the URL requested.
        body: the start of the response body (at most 512 characters).
    """

    def __init__(self, status: int, url: str, body: str = "", message: str | None = None) -> None:
        self.status = status
        self.url = url
        self.body = body
        super().__init__(message or f"GET {url} answered HTTP {status}" + (f": {body}" if body else ""))


class AuthenticationError(HTTPStatusError, PermissionError):
    """HTTP 401: the server requires an API key and none, or a wrong one, was sent.

    Pass ``api_key=`` (or set ``LMCACHE_API_KEY``); it is sent as
    ``Authorization: Bearer KEY`` on every HTTP call.
    """

    def __init__(self, status: int, url: str, body: str = "", *, key_sent: bool = False) -> None:
        hint = (
            "the API key sent was rejected (wrong key?)"
            if key_sent
            else "the server requires an API key: pass api_key= or set LMCACHE_API_KEY"
        )
        self.key_sent = key_sent
        super().__init__(status, url, body, f"GET {url} answered HTTP {status}: {hint}")


class UnfilledReservationError(TransferError):
    """Slots the server reserved for a store could not be filled with the caller's data.

    The reservation stays pending on the server, invisible to readers; the registration
    that holds it is retired (never unregistered) so that it is never admitted: see
    docs/internals/design.md, "A store that fails after prepare_store".
    """


class LayoutMismatchError(ProtocolError):
    """A slot or tensor of a reply has another shape or dtype than the client's geometry
    gives: a hostile server, or (the usual case) KV stored under the same model name by a
    client of another geometry. Nothing was read from it.

    Attributes:
        what: ``"slot shape"``, ``"slot dtype"``, ``"tensor shape"`` or ``"tensor dtype"``.
        got: what the reply has, as the message shows it.
        expected: what the geometry gives, as the message shows it.
        model_name: the model the KV was stored under, once known (see :meth:`for_model`).
    """

    def __init__(self, what: str, got: str, expected: str, model_name: str | None = None) -> None:
        self.what = what
        self.got = got
        self.expected = expected
        self.model_name = model_name
        detail = f"{what} {got} != expected {expected}"
        if model_name is None:
            super().__init__(detail)
        else:
            super().__init__(
                f"the KV stored under model {model_name!r} does not match this client's geometry "
                f"({detail}): it was stored with another geometry under the same model name; "
                "check geometry= (the KVGeometry given to this client)"
            )

    def for_model(self, model_name: str) -> LayoutMismatchError:
        """The same mismatch, its message naming the model and the likely cause."""
        return LayoutMismatchError(self.what, self.got, self.expected, model_name)


class UnknownServerVersionWarning(UserWarning):
    """The server reports an LMCache version this client was not built against; the
    client talks to it with the newest wire generation it knows (best effort)."""
