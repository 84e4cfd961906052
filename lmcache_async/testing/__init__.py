"""Local use and testing: an embedded LMCache-compatible MP server.

:class:`EmbeddedServer` speaks the wire protocol (ZMQ) and HTTP API of an LMCache MP
server generation -- ``generation="0.5.6"`` (default) or ``"0.5.7"``, one of
:data:`GENERATIONS` -- with an in-process cache (SHM or inline transfers), so the client
-- and code built on it -- runs and is tested without an LMCache installation.
:class:`InProcessServer` runs the same request path without sockets
(``await srv.handle("noop", [])``, :meth:`~InProcessServer.register` for an engine-driven
:class:`Registration`, :class:`NoReply` where the real server stays silent,
:meth:`~InProcessServer.leftovers` to check nothing is left held). See
docs/guides/testing-your-code.md for how it differs from the real server.
"""

from lmcache_async.testing.dialect import (
    GENERATIONS,
    LMC_VERSIONS,
    ServerGeneration,
)
from lmcache_async.testing.inprocess import InProcessServer, NoReply, Registration
from lmcache_async.testing.server import (
    EmbeddedServer,
    EmbeddedServerThread,
    ModelSpec,
    ServerOptions,
    parse_size,
)
from lmcache_async.testing.vocabulary import Leftovers

__all__ = [
    "GENERATIONS",
    "LMC_VERSIONS",
    "EmbeddedServer",
    "EmbeddedServerThread",
    "InProcessServer",
    "Leftovers",
    "ModelSpec",
    "NoReply",
    "Registration",
    "ServerGeneration",
    "ServerOptions",
    "parse_size",
]
