"""The SDK-comparison suite: each section times lmcache_async and the official SDK side by
side in the same run, against real LMCache servers (``make bench``; ``run.py``), and the
page generator (``render.py``: ``docs/benchmarks.md`` from the JSON in :data:`RESULTS_DIR`
and the hand-written notes in :data:`NOTES_DIR`). The sections use the public API and the
library's trace hook; what they need of the internals (the bare DEALER's request encoding,
a raw request, the facade's loop thread) ``benchmarks/harness.py`` alone takes
(``benchmarks/README.md``).
"""

from __future__ import annotations

from pathlib import Path

from lmcache_async import __version__

#: Where the suite writes its JSON and the renderer reads it: one directory per release.
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results" / __version__
#: The hand-written prose of the page, one ``<section>.md`` per section (see render.py).
NOTES_DIR = Path(__file__).resolve().parent / "notes"
