"""CheckpointManager: the public entry point for saving and resuming a training job.

The manager guards and dispatches; the work is done in modules of their own:
:mod:`roll_ckpt.saving` (the save pipeline), :mod:`roll_ckpt.resuming` (which checkpoint
to resume from, and loading it), :mod:`roll_ckpt.runs` (run folders),
:mod:`roll_ckpt.components` (steps made of several parts) and
:mod:`roll_ckpt.backup` (replication to ``checkpoint_config.backup``).
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

from .backup import BackupLink
from .components import check_component
from .config import Config, load_config
from .contracts import Storage, Strategy
from .errors import RollCkptError
from .job import Job, open_storage
from .plugins import Plugins, get_plugins
from .resuming import Resumer
from .layout import TRAINER_STATE
from .saving import SavePipeline, SaveStats

__all__ = ["CheckpointManager", "SaveStats", "open_storage", "TRAINER_STATE"]


class CheckpointManager:
    """Saves and resumes the full training state of one job.

    >>> manager = CheckpointManager.from_config(load_config("run.yaml"))
    >>> start = manager.resume(state)            # 0 for a fresh start
    >>> manager.maybe_save(step, state)          # every save_steps
    >>> manager.save(max_steps, state, final=True)
    >>> manager.close()

    One save is in flight at most: a save issued while an asynchronous one is still
    writing waits for it first (and raises its error, if it failed).

    ``component`` names this manager's part of a job whose steps are made of several
    (``checkpoint_config.components``: actor, critic, driver...): it saves into
    ``checkpoint-<step>/<component>/`` with its own processes, and a step counts once every
    component has committed its part (see :mod:`roll_ckpt.components`). ``resume`` loads
    this component's part of the newest step that every component committed.
    """

    def __init__(self, config: Config, *, component: str | None = None, plugins: Plugins | None = None,
                 quiet: bool = False) -> None:
        cc = config.checkpoint_config
        component = check_component(component, cc)
        plugins = plugins or get_plugins()
        if component is not None:  # the worker section's strategy_config (ROLL's actor_train...) first
            config = config.for_component(component, plugins=plugins)
        storage = open_storage(plugins, cc.type, cc.output_dir, cc.storage_options)
        self.config = config
        self.component = component
        self.plugins = plugins
        self.quiet = quiet
        self._job = Job(config, component, storage, plugins, quiet=quiet, manager=self)
        if cc.backup is not None:
            replica = open_storage(plugins, cc.backup.type, cc.backup.output_dir, cc.backup.storage_options)
            self._job.backup = BackupLink(lambda: self._job.storage, replica, cc.backup, lock=self._job.local_lock,
                                          own_run=lambda: self._job.run_dir)
        self._saves = SavePipeline(self._job)
        self._resumer = Resumer(self._job)
        self._closed = False

    @classmethod
    def from_config(cls, config: Config | Mapping[str, Any] | str, **kwargs: Any) -> "CheckpointManager":
        if not isinstance(config, Config):
            config = load_config(config)
        return cls(config, **kwargs)

    @property
    def storage(self) -> Storage:
        """Where checkpoints are written (``checkpoint_config.type`` at ``output_dir``).

        Assignable before the first save (e.g. to wrap it with instrumentation)."""
        return self._job.storage

    @storage.setter
    def storage(self, storage: Storage) -> None:
        self._job.storage = storage

    @property
    def root(self) -> str:
        """``output_dir`` as a path of :attr:`storage`."""
        return self._job.storage.root

    # ------------------------------------------------------------------ strategy

    @property
    def strategy(self) -> Strategy:
        """The strategy in use; chosen from the state at the first ``resume``/``save``."""
        if self._job.strategy is None:
            raise RollCkptError("the strategy is chosen from the state: call bind(state), resume(state) "
                                "or save(step, state) first")
        return self._job.strategy

    def bind(self, state: Mapping[str, Any]) -> Strategy:
        """Choose the strategy for ``state`` (done by the first resume/save)."""
        return self._job.bind(state)

    @property
    def is_coordinator(self) -> bool:
        return self._job.is_coordinator

    @property
    def run_dir(self) -> str | None:
        """This run's folder (created by the first save)."""
        return self._job.run_dir

    # ------------------------------------------------------------------ saving

    def maybe_save(self, step: int, state: Mapping[str, Any]) -> str | None:
        """Save when ``step`` is a multiple of ``save_steps``; returns the checkpoint's path."""
        every = self.config.save_steps
        if every > 0 and step > 0 and step % every == 0:
            return self.save(step, state)
        return None

    def save(self, step: int, state: Mapping[str, Any], *, final: bool = False,
             metadata: Mapping[str, Any] | None = None) -> str:
        """Save ``state`` as ``checkpoint-<step>``; returns the path it is committed at.

        With ``strategy_config.async_save_ckpt`` (or ``checkpoint_config.async_upload``;
        :attr:`Config.async_save`) this returns once the state is staged
        and the write goes on in the background; ``final=True`` always returns after
        the checkpoint is committed. ``metadata`` (JSON values) goes to
        ``trainer_state.json`` under ``user``. Saving a step this manager has already
        committed does nothing.
        """
        self._check_open()
        return self._saves.save(step, state, final=final, metadata=metadata)

    def wait(self) -> SaveStats | None:
        """Wait for the save in flight; raise its error if it failed."""
        return self._saves.wait()

    @property
    def save_in_flight(self) -> bool:
        """True while an asynchronous save is still writing; never waits."""
        return self._saves.in_flight

    @property
    def last_save(self) -> SaveStats | None:
        """What the latest finished save cost (a :class:`SaveStats`)."""
        return self._saves.last_save

    @property
    def space_estimate(self) -> Any:
        """The size estimated for the latest save (a ``SpaceEstimate``; ``None`` before the first)."""
        return None if self._saves.space is None else self._saves.space.last_estimate

    # ------------------------------------------------------------------ resuming

    def resolve_resume(self, target: str | None = None) -> tuple[Storage, str] | None:
        """The storage and path to resume from, or ``None`` for a fresh start.

        ``"latest"`` is the newest committed checkpoint under ``output_dir`` and, with
        ``checkpoint_config.backup``, at the backup location; when both hold it, the local
        copy (``resume`` falls back to the replica if the local copy is damaged).
        """
        candidates = self._resumer.candidates(target)
        return (candidates[0][0], candidates[0][1]) if candidates else None

    def resume(self, state: MutableMapping[str, Any], target: str | None = None) -> int:
        """Restore ``state`` from the configured checkpoint; return its step (0: fresh start).

        The checkpoint is verified (sizes and checksums) before torch reads any of it;
        a damaged or uncommitted one is refused with an error naming the file. With
        ``checkpoint_config.backup``, ``"latest"`` is the newest committed checkpoint of
        both locations; a local copy that is gone or damaged is replaced by its replica
        (verified the same way; a warning names the damaged file).
        """
        self._check_open()
        return self._resumer.resume(state, target)

    @property
    def trainer_state(self) -> dict[str, Any]:
        """The ``trainer_state.json`` of the checkpoint resumed from (empty on a fresh start)."""
        return self._resumer.trainer_state

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint ``resume`` loaded (its path, or the replica's URL)."""
        return self._job.resumed_from

    @property
    def resumed_from_backup(self) -> bool:
        """True when ``resume`` took its checkpoint from ``checkpoint_config.backup``."""
        return self._resumer.resumed_from_backup

    # ------------------------------------------------------------------ backup

    @property
    def backup_storage(self) -> Storage | None:
        """The backup location's storage (``checkpoint_config.backup``), or ``None``.

        Assignable before the first save (e.g. to wrap it), like the manager's other storages.
        """
        return None if self._job.backup is None else self._job.backup.replica

    @backup_storage.setter
    def backup_storage(self, storage: Storage) -> None:
        if self._job.backup is None:
            raise RollCkptError("this manager has no checkpoint_config.backup")
        self._job.backup.replica = storage

    @property
    def backup_status(self) -> Any:
        """Where replication stands (a ``BackupStatus``), or ``None`` without ``checkpoint_config.backup``.

        Per checkpoint: ``queued``, ``copying``, ``committed``, ``failed``, ``interrupted``
        or ``skipped``, with attempts and the last error.
        """
        return None if self._job.backup is None else self._job.backup.status

    def wait_for_backup(self, timeout: float | None = None) -> Any:
        """Block until every checkpoint handed to replication is copied (or failed for good).

        Waits for the save in flight first. Returns :attr:`backup_status`; ``timeout``
        (seconds) bounds the wait. Training never needs to call this: ``close()`` waits
        at most ``checkpoint_config.backup.max_wait_s``.
        """
        self.wait()
        if self._job.backup is not None:
            self._job.backup.wait(timeout)
        return self.backup_status

    # ------------------------------------------------------------------ closing

    def _check_open(self) -> None:
        if self._closed:
            raise RollCkptError("this CheckpointManager is closed")

    def close(self) -> None:
        """Drain the save in flight and re-raise its error; the manager is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            self._saves.close()
        finally:
            try:
                if self._job.strategy is not None:
                    self._job.strategy.close()
            finally:
                backup_error = self._job.backup.close() if self._job.backup is not None else None
        if backup_error is not None:
            raise backup_error

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
