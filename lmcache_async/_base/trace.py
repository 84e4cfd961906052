"""The one trace hook (:func:`lmcache_async.observe.set_trace_hook`): a callable given
the name of each hand-over point a call passes, for profiling; ``None`` (the default)
costs one attribute read and test per point."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["hook"]

#: Called with the point's name ("submit", "start", "send", "sent", "finish", "wake"), in
#: the thread where the point is passed; ``None``: tracing is off.
hook: Callable[[str], None] | None = None
