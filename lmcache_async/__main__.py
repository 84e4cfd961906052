"""``python -m lmcache_async`` runs the command line."""

import sys

from lmcache_async.cli import main

sys.exit(main())
