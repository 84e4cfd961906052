"""Sans-IO: what a client needs of the server's ``/config`` (and ``/status``), parsed once
into one frozen :class:`ServerConfig`, at open and again at each re-registration (a
restarted server may have another chunk size, pool or instance id) (docs/internals/design.md,
section "Server generations: data, not branches").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from lmcache_async.errors import ProtocolError, ServerError

__all__ = ["POOL_PREFIX", "ServerConfig", "expected_pool", "mp_section", "server_instance"]

#: The prefix of the LMCache server's pool segment: ``--shm-name NAME`` is
#: ``/dev/shm/lmcache_l1_pool_NAME``.
POOL_PREFIX = "lmcache_l1_pool_"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """A server's configuration as the client uses it.

    Attributes:
        chunk_size: tokens per chunk (0 before the first read).
        instance: ``/config`` ``mp.instance_id``: new for every server process.
        fifo_cpu: the server runs one CPU worker (``mp.max_cpu_workers == 1``): its
            requests are served in order.
        write_ttl: seconds an SHM write reservation lives (``write_ttl_seconds``), when said.
        registration_grace: seconds a silent, never-pinged registration lives
            (``mp.worker_registration_grace_seconds``), when said.
        expected_pool: the ``(shm_name, pool_size)`` a registration must answer, ``("", 0)``
            for a server without an SHM pool, or ``None`` when ``/config`` does not say
            (:func:`expected_pool`).
    """

    chunk_size: int = 0
    instance: object = None
    fifo_cpu: bool = False
    write_ttl: float | None = None
    registration_grace: float | None = None
    expected_pool: tuple[str, int] | None = None

    @classmethod
    def parse(cls, config: Mapping[str, Any], status: Mapping[str, Any] | None = None) -> ServerConfig:
        """The configuration of ``/config``; the chunk size from ``status`` (``/status``)
        when given (0.5.7, where the configured one is a minimum the server may round up).

        Raises:
            ProtocolError: ``/config`` has no ``mp`` section, or no usable chunk size.
            ServerError: the server does not serve engine-driven transfers.
        """
        mp = mp_section(config)
        if status is not None:
            chunk_size, where = status.get("chunk_size"), "/status chunk_size"
        else:
            chunk_size, where = mp.get("chunk_size"), "/config mp.chunk_size"
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ProtocolError(f"{where} is {chunk_size!r}")
        mode = mp.get("supported_transfer_mode", "engine_driven")
        if mode not in ("engine_driven", "auto"):
            raise ServerError(
                f"the server runs --supported-transfer-mode {mode}; engine-driven requests would "
                "go unanswered (start it with --supported-transfer-mode auto or engine_driven)"
            )
        grace = mp.get("worker_registration_grace_seconds")
        return cls(
            chunk_size=chunk_size,
            instance=mp.get("instance_id"),
            fifo_cpu=mp.get("max_cpu_workers") == 1,
            write_ttl=_find_number(config, "write_ttl_seconds"),
            registration_grace=float(grace) if _is_number(grace) else None,
            expected_pool=expected_pool(config),
        )

    def with_instance(self, instance: object) -> ServerConfig:
        """The same configuration of a server now known by ``instance``."""
        return dataclasses.replace(self, instance=instance)


def mp_section(config: Mapping[str, Any]) -> dict[str, Any]:
    """``/config``'s ``mp`` section (the MP server's own settings).

    Raises:
        ProtocolError: there is none.
    """
    mp = config.get("mp")
    if not isinstance(mp, dict):
        raise ProtocolError("/config has no 'mp' section")
    return mp


def server_instance(config: Mapping[str, Any]) -> object:
    """The server's identity in ``/config``: ``mp.instance_id``, new for every server process.

    Raises:
        ProtocolError: ``/config`` has no ``mp`` section.
    """
    return mp_section(config).get("instance_id")


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def expected_pool(config: Mapping[str, Any]) -> tuple[str, int] | None:
    """The ``(shm_name, pool_size)`` a registration with the server whose ``/config`` this
    is answers, or ``None`` when ``/config`` does not say (then nothing is checked).

    ``("", 0)`` (no SHM pool) when the server has several L1 managers
    (``l1_manager_configs``), a lazy pool, a DAX device (``devdax_path``) or no
    ``shm_name``; the name carries the pool prefix the server adds.
    """
    sm = config.get("storage_manager")
    if not isinstance(sm, dict):
        return None
    configs = sm.get("l1_manager_configs")
    if isinstance(configs, list) and len(configs) != 1:
        return ("", 0)
    l1 = sm.get("l1_manager_config")
    mem = l1.get("memory_config") if isinstance(l1, dict) else None
    if not isinstance(mem, dict):
        return None
    name = mem.get("shm_name") or ""
    if not isinstance(name, str):
        return None
    if not name or mem.get("use_lazy") or mem.get("devdax_path"):
        return ("", 0)
    size = mem.get("size_in_bytes")
    if isinstance(size, bool) or not isinstance(size, int):
        return None
    if not name.lstrip("/").startswith(POOL_PREFIX):
        name = POOL_PREFIX + name.lstrip("/")
    return (name, size)


def _find_number(doc: object, name: str) -> float | None:
    """The first number under key ``name`` anywhere in a JSON document (depth first)."""
    if isinstance(doc, dict):
        value = doc.get(name)
        if _is_number(value):
            return float(value)
        for v in doc.values():
            found = _find_number(v, name)
            if found is not None:
                return found
    elif isinstance(doc, list):
        for v in doc:
            found = _find_number(v, name)
            if found is not None:
                return found
    return None
