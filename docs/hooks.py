"""mkdocs hook of the documentation build (``hooks:`` in mkdocs.yml; not a page).

``mkdocs build --strict`` fails on every warning. A few warnings come from files the
documentation does not own: the generated benchmarks page (its notes link pages that
moved) and docstrings in ``lmcache_async/`` that the API pages render. Each is listed in
``KNOWN`` with the fix it waits for, and is logged as INFO (with that fix) instead of
failing the build; every other warning still fails it. An entry is removed with its fix.
Line numbers are not matched, so that edits elsewhere in a file keep an entry valid.
"""

from __future__ import annotations

import logging
import re
from typing import Any

#: (pattern of the warning's message, the fix it waits for).
KNOWN: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), fix)
    for pattern, fix in (
        (
            r"Doc file 'benchmarks\.md' contains a link 'bulk-and-cli\.md', but the target is not found",
            "docs/benchmarks.md, keep:notes-remap: link guides/bulk-and-cli.md",
        ),
        (
            r"Doc file 'benchmarks\.md' contains a link 'sync-facade\.md', but the target is not found",
            "docs/benchmarks.md, keep:notes-facade: link guides/blocking-client.md",
        ),
        (
            r"^griffe: lmcache_async/bulk\.py:\d+: Failed to get 'exception: description' pair from "
            r"'Whatever failed first, when ``return_exceptions`` is False\.'",
            "remap_many's Raises: one 'ExceptionType: description' per line",
        ),
        (
            r"^griffe: lmcache_async/bulk\.py:\d+: (No type or annotation for parameter 'Others'"
            r"|Parameter 'Others' does not appear in the function signature)",
            "store_many/retrieve_many: 'Others: as for remap_many' out of Args, into the text",
        ),
        (
            r"^griffe: lmcache_async/client\.py:\d+: Failed to get 'exception: description' pair from "
            r"'(LMCacheConnectionError, LMCacheTimeoutError, ModelNotRegisteredError,"
            r"|ServerError \(server not serving engine-driven transfers\), TransferError"
            r"|\(``transfer=\"shm\"`` but SHM unusable\)\.)'",
            "AsyncClient.open's Raises: one 'ExceptionType: description' per line",
        ),
        (
            r"^griffe: lmcache_async/testing/inprocess\.py:\d+: (No type or annotation for parameter"
            r"|Parameter) 'session_ttl, read_lock_ttl, write_ttl'",
            "InProcessServer's Args: session_ttl, read_lock_ttl and write_ttl one per line",
        ),
    )
)


def known_fix(message: str) -> str | None:
    """The fix a known warning waits for, or None for any other message."""
    for pattern, fix in KNOWN:
        if pattern.search(message):
            return fix
    return None


class _KnownWarnings(logging.Filter):
    """On one handler of the ``mkdocs`` logger: a known warning becomes INFO, which the
    strict mode's counting handler (level WARNING) then drops."""

    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and (fix := known_fix(record.getMessage())):
            record.msg, record.args = f"{record.getMessage()} [known; waits for: {fix}]", None
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return record.levelno >= self.handler.level


def on_config(config: Any) -> Any:
    """Runs at the start of each build, after strict mode added its counting handler."""
    for handler in logging.getLogger("mkdocs").handlers:
        if not any(isinstance(f, _KnownWarnings) for f in handler.filters):
            handler.addFilter(_KnownWarnings(handler))
    return config
