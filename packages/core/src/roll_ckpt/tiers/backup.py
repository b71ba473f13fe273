"""A manager's link to ``checkpoint_config.backup``: the replica's storage and the one
background :class:`~roll_ckpt.tiers.replication.Replicator` that copies committed checkpoints
to it (started by the first commit, on the coordinator only: :meth:`BackupLink.submit` is a
commit hook of the saver)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from ..contracts import Storage

if TYPE_CHECKING:
    from .run import Run

__all__ = ["BackupLink"]

log = logging.getLogger("roll_ckpt")


class BackupLink:
    def __init__(self, replica: Storage, config: Any, *, lock: threading.Lock, nice: int = 0) -> None:
        self.replica, self.config = replica, config
        self._lock = lock
        self._nice = nice  # the copying thread's nice value (roll_ckpt.runtime.background)
        self._replicator: Any = None

    @property
    def copying(self) -> str | None:
        """The local checkpoint being copied now (retention leaves it alone)."""
        return self._replicator.current if self._replicator is not None else None

    def submit(self, run: "Run", path: str, step: int) -> None:
        """Queue a checkpoint of ``run`` just committed at ``path``; the first call starts
        replication from ``run``'s storage and also queues every older checkpoint without a replica."""
        if self._replicator is None:
            from .replication import Replicator

            self._replicator = Replicator(run.storage, run.root, self.replica, self.config, lock=self._lock,
                                          own_run=run.folder, nice=self._nice)
            self._replicator.start(catch_up=True)
        self._replicator.submit(path, step)

    @property
    def status(self) -> Any:
        from .replication import BackupStatus

        if self._replicator is None:
            return BackupStatus(self.replica.url, (), False)
        return self._replicator.status

    def wait(self, timeout: float | None = None) -> None:
        if self._replicator is not None:
            self._replicator.wait(timeout)

    def close(self) -> BaseException | None:
        """Stop replication within ``backup.max_wait_s``; the error to raise for copies that failed."""
        if self._replicator is None:
            return None
        try:
            status = self._replicator.close()
            log.info("roll-ckpt: %s", status)
            return self._replicator.error()
        except Exception as exc:  # closing must go on; report it
            log.error("roll-ckpt: stopping replication failed: %s", exc, exc_info=True)
            return None
