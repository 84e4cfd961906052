"""Local use and testing: an embedded LMCache-compatible MP server.

:class:`EmbeddedServer` speaks the LMCache 0.5.6 MP server's wire protocol (ZMQ) and
HTTP API, with an in-process cache (SHM or pickle transfers), so the client -- and code
built on it -- runs and is tested without an LMCache installation. See
docs/embedded-server.md for how it differs from the real server.
"""

from lmcache_async.testing.server import EmbeddedServer, EmbeddedServerThread, ModelSpec, parse_size

__all__ = ["EmbeddedServer", "EmbeddedServerThread", "ModelSpec", "parse_size"]
