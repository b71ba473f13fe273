"""``python -m bench [args]``: the benchmark run, :mod:`bench.run` (the same flags)."""

from __future__ import annotations

import sys

from .run import main

sys.exit(main())
