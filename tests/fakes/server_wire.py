"""The server side of the wire, for the tests' scripted fake ROUTER (``fake_router.py``).

The library is a client: it encodes requests and decodes replies (``lmcache_async._protocol.wire``).
The scripted fake server needs the other two directions, which only the tests use, so
they live here: decode a request as a ROUTER sees it, and echo its uid and op frames in a
reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from lmcache_async._protocol.wire import Op, PreEncoded, packb, unpackb
from lmcache_async.errors import ProtocolError

__all__ = ["NO_PAYLOAD", "Request", "decode_request", "encode_reply"]

#: Marks a reply without a payload frame.
NO_PAYLOAD: Final = object()


@dataclass(frozen=True, slots=True)
class Request:
    """A decoded request: raw uid/op frames kept for the echo."""

    uid_frame: bytes
    op_frame: bytes
    op: Op | str
    args: tuple[bytes | memoryview, ...]


def decode_request(frames: Sequence[bytes | memoryview]) -> Request:
    """Decode a request as the ROUTER sees it, without the identity frame.

    Raises :class:`ProtocolError` for fewer than two frames, an unknown legacy id, or an
    op frame that is neither int nor str (the real server logs and drops these).
    """
    if len(frames) < 2:
        raise ProtocolError("a request has at least two frames")
    raw_op = unpackb(frames[1])
    if isinstance(raw_op, bool) or not isinstance(raw_op, int | str):
        raise ProtocolError(f"operation frame must be an int or str, got {type(raw_op).__name__}")
    op: Op | str
    try:
        op = Op.from_wire(raw_op)
    except ValueError:
        if isinstance(raw_op, int):
            raise ProtocolError(f"unknown operation id {raw_op}") from None
        op = raw_op
    return Request(bytes(frames[0]), bytes(frames[1]), op, tuple(frames[2:]))


def encode_reply(request: Request, value: Any = NO_PAYLOAD) -> list[bytes | bytearray | memoryview]:
    """Build a reply echoing the request's uid and op frames."""
    frames: list[bytes | bytearray | memoryview] = [request.uid_frame, request.op_frame]
    if value is not NO_PAYLOAD and value is not None:
        frames.append(value.frame if isinstance(value, PreEncoded) else packb(value))
    return frames
