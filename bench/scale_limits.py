"""The limits of the scale targets (T12-T14), shared by ``scale`` (which judges them),
``scale_jobs`` (whose summary carries T14's) and ``run`` (which reports them when the group
``scale`` did not run): one module below all three, so none imports another for them."""

from __future__ import annotations

KIB = 1 << 10

T12_LIMIT = 0.02
"""T12: coordinator CPU per save of an unchanged structure, roll-ckpt / DCP with plan caching."""
T12_OVERHEAD_LIMIT = KIB
"""T12 too: each rank's bytes sent per save, less its files' checksums."""
T13_LIMIT = 2.0
"""T13: bytes read for ``.metadata`` on a resume (all ranks) / its size."""
OPS_LIMIT = 40
"""T14: storage operations per rank per save."""
