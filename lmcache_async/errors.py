"""Exceptions raised by lmcache_async.

Every error the library raises on purpose derives from :class:`LMCacheError`.
Where callers already catch a builtin, the error also derives from it::

    LMCacheError
     +-- LMCacheTimeoutError        (also TimeoutError)   no reply before the deadline
     +-- LMCacheConnectionError     (also ConnectionError) socket/HTTP unreachable, lost
     |    +-- ClientClosedError                          the client was closed
     +-- ServerError                                      the server answered, but not as promised
     |    +-- ModelNotRegisteredError (also LookupError)  /status has no such model
     |    +-- ProtocolError                               a malformed or hostile reply
     |    +-- UnsupportedServerVersionError              /lmc_version: a generation not spoken
     |    +-- HTTPStatusError                             an HTTP route answered other than 200
     |         +-- AuthenticationError (also PermissionError)  401: an API key is needed or wrong
     +-- UnsafePayloadError                              a pickle reply that is not plain tensors
     +-- TransferError                                    a store/retrieve could not move the data

Argument errors are plain :class:`ValueError` / :class:`TypeError` raised before anything
is sent. No raw zmq, aiohttp or msgpack exception escapes the public API: they are
chained as ``__cause__``. All exceptions pickle (their ``__reduce__`` keeps the attributes).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AuthenticationError",
    "ClientClosedError",
    "HTTPStatusError",
    "LMCacheConnectionError",
    "LMCacheError",
    "LMCacheTimeoutError",
    "ModelNotRegisteredError",
    "ProtocolError",
    "ServerError",
    "TransferError",
    "UnsafePayloadError",
    "UnsupportedServerVersionError",
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


class ClientClosedError(LMCacheConnectionError):
    """The client was closed (or is closing); no new calls are accepted."""


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
