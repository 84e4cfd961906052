"""``python -m benchmarks.suite``: the whole suite (:mod:`benchmarks.suite.run`)."""

import sys

from benchmarks.suite.run import main

sys.exit(main())
