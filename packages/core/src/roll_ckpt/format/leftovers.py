"""What a failed save could not remove, removed by the next save.

A save that fails removes what it wrote (``PendingCheckpoint.abort``). When that cleanup
fails too — the store that failed the save is still unreachable — the folder and its owner
marker stay, and since the marker names a process that is still running, no later start
would judge them stale. :class:`Leftovers` keeps such saves and tries again before each
next save of the process (and ``close()``); a process that exits first leaves a marker of
a process that is gone, which the next start or ``roll-ckpt prune`` cleans.
"""

from __future__ import annotations

import logging

from .commit import PendingCheckpoint

__all__ = ["Leftovers"]

log = logging.getLogger("roll_ckpt")


class Leftovers:
    def __init__(self) -> None:
        self.pending: list[tuple[PendingCheckpoint, bool]] = []

    def discard(self, pending: PendingCheckpoint, begun: bool) -> None:
        """Remove what the failed save ``pending`` wrote (``begun``: it claimed its folder);
        kept for later if that fails."""
        try:
            pending.abort() if begun else pending.abandon()
        except Exception as exc:
            log.warning("roll-ckpt: could not clean up %s (%s: %s); the next save tries again",
                        pending.write_path, type(exc).__name__, exc)
            self.pending.append((pending, begun))

    def retry(self) -> None:
        """Try again to remove what earlier failed saves left."""
        left, self.pending = self.pending, []
        for pending, begun in left:
            self.discard(pending, begun)
            if not self.pending or self.pending[-1][0] is not pending:
                log.info("roll-ckpt: removed %s, left by a failed save", pending.write_path)
