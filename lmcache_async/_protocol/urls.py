"""Sans-IO: the check of a ZMQ endpoint, before any socket exists."""

from __future__ import annotations

import ipaddress
import urllib.parse

__all__ = ["check_zmq_url", "is_ip_address"]


def check_zmq_url(url: object, name: str = "url") -> str:
    """Refuse, before any socket exists, a ZMQ endpoint a client cannot connect to.

    Accepted: ``tcp://host:port`` (a host name, an IPv4 address or a bracketed IPv6
    address, and a port in 1..65535, nothing after it) and ``ipc://path``.

    Returns:
        The host to resolve (``""`` for ``ipc://``).

    Raises:
        TypeError: ``url`` is not a str.
        ValueError: anything else (no scheme, another scheme, no host, a host that is
            not a valid host name, no port, a port out of range, more than one ':' after
            the host, a path or query after the port); the message says which.
    """
    if not isinstance(url, str):
        raise TypeError(f"{name} must be a str like tcp://host:port, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"{name} must look like tcp://host:port, got {url!r}")
    if scheme == "ipc":
        if not rest:
            raise ValueError(f"{name} {url!r} names no socket path (ipc://path)")
        return ""
    if scheme in ("http", "https"):
        raise ValueError(
            f"{name} {url!r} is an HTTP address: {name} is the server's ZMQ endpoint, "
            "tcp://host:port (the HTTP endpoint is http_url)"
        )
    if scheme != "tcp":
        raise ValueError(f"{name} must be tcp://host:port or ipc://path, got {url!r}")
    parts = urllib.parse.urlsplit(url)
    if parts.path or parts.query or parts.fragment or "@" in parts.netloc:
        raise ValueError(f"{name} {url!r} must be tcp://host:port and nothing else")
    if not parts.netloc.startswith("[") and parts.netloc.count(":") > 1:
        raise ValueError(
            f"{name} {url!r} has more than one ':' after the host (tcp://host:port; an IPv6 "
            "address goes in brackets, tcp://[::1]:5555)"
        )
    try:
        port = parts.port
    except ValueError:
        port_text = parts.netloc.rpartition(":")[2]
        raise ValueError(f"{name} {url!r}: port {port_text!r} is not a port number in 1..65535") from None
    if not parts.hostname or parts.hostname == "*":
        raise ValueError(f"{name} {url!r} names no host to connect to (tcp://host:port)")
    if port is None:
        raise ValueError(f"{name} {url!r} has no port (tcp://host:port; the server's --port, often 5555)")
    if port == 0:
        raise ValueError(f"{name} {url!r}: port 0 is not a port to connect to (1..65535)")
    host = parts.hostname
    if not is_ip_address(host):
        try:
            host.encode("idna")  # what name resolution does with it
        except UnicodeError:
            raise ValueError(
                f"{name} {url!r}: {host[:40]!r}{'...' if len(host) > 40 else ''} is not a host name "
                "(at most 253 characters, in dot-separated labels of 1 to 63)"
            ) from None
    return host


def is_ip_address(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address (nothing to resolve)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
