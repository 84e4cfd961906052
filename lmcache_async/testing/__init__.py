"""Local use and testing: an embedded LMCache-compatible MP server.

:class:`EmbeddedServer` speaks the wire protocol (ZMQ) and HTTP API of an LMCache MP
server generation -- ``protocol="0.5.6"`` (default) or ``"0.5.7"`` -- with an in-process
cache (SHM or inline transfers), so the client -- and code built on it -- runs and is
tested without an LMCache installation. :class:`InProcessServer` runs the same request
path without sockets (``await srv.handle(op, args)``, :class:`NoReply` where the real
server stays silent, :meth:`~InProcessServer.leftovers` to check nothing is left held).
See docs/guides/testing-your-code.md for how it differs from the real server.
"""

from lmcache_async.testing.dialect import LMC_VERSIONS, PROTOCOLS, Protocol
from lmcache_async.testing.inprocess import InProcessServer, NoReply
from lmcache_async.testing.server import EmbeddedServer, EmbeddedServerThread, ModelSpec, parse_size
from lmcache_async.testing.vocabulary import Leftovers

__all__ = [
    "LMC_VERSIONS",
    "PROTOCOLS",
    "EmbeddedServer",
    "EmbeddedServerThread",
    "InProcessServer",
    "Leftovers",
    "ModelSpec",
    "NoReply",
    "Protocol",
    "parse_size",
]
