"""What a :class:`~roll_ckpt.CheckpointManager` shows beside its calls, grouped by subject:
its saves (``manager.stats``), the checkpoint it resumed from (``manager.resumed``), its backup
location (``manager.backup``), its fast recovery tier (``manager.local``) and a preemption
(``manager.preemption``).

Each is a view: it holds nothing of its own and reads the manager's parts when asked, so
it is never stale. ``manager.backup`` and ``manager.local`` are ``None`` when the config has
no ``checkpoint_config.backup`` / ``checkpoint_config.local``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

from .contracts import NetworkCounts, Storage
from .errors import RollCkptDeprecationWarning

if TYPE_CHECKING:
    from .load.resume import Resumer
    from .runtime.preemption import PreemptionWatch
    from .save.pipeline import SavePipeline, SaveStats
    from .tiers.backup import BackupLink
    from .tiers.local_tier import LocalTier

__all__ = ["SaveReport", "ResumeReport", "BackupView", "LocalView", "PreemptionView"]  # (moved, warn_moved: the manager's)


class SaveReport:
    """``manager.stats``: what this manager's saves cost and where they stand."""

    def __init__(self, saves: "SavePipeline", storage: Callable[[], Storage]) -> None:
        self._saves, self._storage = saves, storage

    @property
    def last(self) -> "SaveStats | None":
        """What the latest finished save cost (a :class:`~roll_ckpt.SaveStats`); ``None`` before the first."""
        return self._saves.last_save

    @property
    def failed(self) -> int:
        """Periodic saves that failed and were let go (``checkpoint_config.on_save_error: warn``)."""
        return self._saves.errors.failed_saves

    @property
    def in_flight(self) -> bool:
        """True while an asynchronous save is still writing; never waits."""
        return self._saves.in_flight

    @property
    def network(self) -> NetworkCounts:
        """The network faults this manager's storage met so far, retries and time lost included
        (all zero on a local disk); each save's own are in ``stats.last.network``."""
        from .save.pipeline import read_counts

        return read_counts(self._storage()) or NetworkCounts()

    @property
    def space_estimate(self) -> Any:
        """The size estimated for the latest save (a ``SpaceEstimate``; ``None`` before the first)."""
        return None if self._saves.space is None else self._saves.space.last_estimate


class ResumeReport:
    """``manager.resumed``: the checkpoint :meth:`~roll_ckpt.CheckpointManager.resume` loaded."""

    def __init__(self, resumer: "Resumer", storage: Callable[[], Storage]) -> None:
        self._resumer, self._storage = resumer, storage

    @property
    def path(self) -> str | None:
        """Its path (or the replica's URL); ``None`` on a fresh start or before ``resume``."""
        return self._resumer.path

    @property
    def from_backup(self) -> bool:
        """True when it was taken from ``checkpoint_config.backup``."""
        return self._resumer.resumed_from_backup

    @property
    def trainer_state(self) -> dict[str, Any]:
        """Its ``trainer_state.json`` (empty on a fresh start)."""
        return self._resumer.trainer_state

    def candidates(self, target: str | None = None) -> tuple[Storage, str] | None:
        """The storage and path ``resume(state, target)`` would load, or ``None`` for a fresh start.

        ``"latest"`` is the newest committed checkpoint under ``output_dir`` and, with
        ``checkpoint_config.backup``, at the backup location; when both hold it, the local
        copy (``resume`` falls back to the replica if the local copy is damaged)."""
        found = self._resumer.candidates(self._storage(), target)
        return (found[0][0], found[0][1]) if found else None


class BackupView:
    """``manager.backup``: replication to ``checkpoint_config.backup``."""

    def __init__(self, link: "BackupLink", saves: "SavePipeline") -> None:
        self._link, self._saves = link, saves

    @property
    def storage(self) -> Storage:
        """The backup location's storage; assignable before the first save (e.g. to wrap it)."""
        return self._link.replica

    @storage.setter
    def storage(self, storage: Storage) -> None:
        self._link.replica = storage

    @property
    def status(self) -> Any:
        """Where replication stands (a ``BackupStatus``): per checkpoint ``queued``, ``copying``,
        ``committed``, ``failed``, ``interrupted`` or ``skipped``, with attempts and the last error."""
        return self._link.status

    def wait(self, timeout: float | None = None) -> Any:
        """Block until every checkpoint handed to replication is copied (or failed for good);
        the save in flight first. Returns :attr:`status`; ``timeout`` (seconds) bounds the wait.
        Training never needs this: ``close()`` waits at most ``checkpoint_config.backup.max_wait_s``."""
        self._saves.wait()
        self._link.wait(timeout)
        return self._link.status


class LocalView:
    """``manager.local``: the fast recovery tier (``checkpoint_config.local``)."""

    def __init__(self, tier: "LocalTier") -> None:
        self._tier = tier

    @property
    def bytes_used(self) -> int:
        """Bytes the tier holds in this node's folder (own units and the replicas kept for other
        nodes; tmpfs counts as memory)."""
        return self._tier.bytes_used()

    @property
    def last_save(self) -> dict[str, Any] | None:
        """What the latest local save did (step, ok, seconds, bytes, replicated_to, replicas_kept,
        node_bytes, blocked_s); ``None`` before the first."""
        return self._tier.last_save

    @property
    def failed_saves(self) -> int:
        """Local saves that failed (a full tmpfs...): logged, never raised."""
        return self._tier.failed_saves


class PreemptionView:
    """``manager.preemption``: a preemption save asked for (by a signal of
    ``checkpoint_config.preemption.signals``, or :meth:`request`) and committed."""

    def __init__(self, watch: "PreemptionWatch", committed: Callable[[], bool]) -> None:
        self._watch, self._committed = watch, committed

    def request(self) -> None:
        """Ask for a preemption save at the next ``maybe_save``, as a signal would: for code
        that learns of a preemption otherwise (a Ray actor off the main thread, a scheduler's API)."""
        self._watch.request()

    @property
    def requested(self) -> bool:
        """True once this process got a preemption signal or :meth:`request` (no collective)."""
        return self._watch.requested

    @property
    def committed(self) -> bool:
        """True once a preemption checkpoint is committed (``maybe_save`` returned its path; with
        ``preemption.exit: true``, the default, it raised :class:`~roll_ckpt.Preempted` instead)."""
        return self._committed()


class moved:  # noqa: N801 (used as a decorator-like descriptor: `last_save = moved("stats.last")`)
    """A manager attribute that moved (issue 37: a smaller surface): reads (and writes, where the
    new home takes them) go to ``new``, a dotted path from the manager, with a
    :class:`~roll_ckpt.errors.RollCkptDeprecationWarning`. ``absent`` is what the old name gave
    where the new home is ``None`` (no backup or local tier configured)."""

    def __init__(self, new: str, absent: Any = None, *, settable: bool = False, hint: str | None = None) -> None:
        self.new, self.absent, self.settable, self.hint = new, absent, settable, hint

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = name

    def __get__(self, manager: Any, owner: type | None = None) -> Any:
        if manager is None:
            return self
        warn_moved(self.old, self.new, self.hint)
        value = manager
        for part in self.new.split("."):
            if value is None:
                return self.absent
            value = getattr(value, part)
        return value

    def __set__(self, manager: Any, value: Any) -> None:
        if not self.settable:  # (as the old read-only property did)
            raise AttributeError(f"CheckpointManager.{self.old} cannot be set")
        warn_moved(self.old, self.new, self.hint)
        *parents, last = self.new.split(".")
        target = manager
        for part in parents:
            target = getattr(target, part)
        if target is None:
            from .errors import RollCkptError

            raise RollCkptError(f"manager.{self.new}: this manager has no {'.'.join(parents)} "
                                f"(checkpoint_config.{parents[0]} is not set)")
        setattr(target, last, value)


def warn_moved(old: str, new: str, hint: str | None = None) -> None:
    """Warn, at the caller of the manager's attribute, that ``CheckpointManager.<old>`` is now
    ``manager.<new>`` (or ``hint``; a private ``new`` without one: gone from the API, keep what
    the constructor was given)."""
    instead = f"use {hint}" if hint else \
        "keep what you gave the constructor" if new.startswith("_") else f"use manager.{new}"
    warnings.warn(f"CheckpointManager.{old} is deprecated: {instead} (the old name goes at 1.0)",
                  RollCkptDeprecationWarning, stacklevel=3)
