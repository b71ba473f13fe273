"""CheckpointManager: the public entry point for saving and resuming a training job.

The manager guards and dispatches; the work is done in modules of their own:
:mod:`roll_ckpt.save.pipeline` (the save pipeline), :mod:`roll_ckpt.load.resume` (which checkpoint
to resume from, and loading it), :mod:`roll_ckpt.format.owners` (run folders),
:mod:`roll_ckpt.format.components` (steps made of several parts) and
:mod:`roll_ckpt.tiers.backup` (replication to ``checkpoint_config.backup``).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Iterable, Mapping, MutableMapping

from .tiers.backup import BackupLink
from .format.components import check_component
from .config.schema import Config, load_config
from .contracts import NetworkCounts, Storage, Strategy
from .errors import RollCkptError
from .tiers.job import Job, open_storage
from .plugins import Plugins, get_plugins
from .runtime.preemption import PreemptionWatch, pass_on, preemption_done, run_without_interruption
from .load.resume import Resumer
from .format.layout import TRAINER_STATE
from .save.pipeline import SavePipeline, SaveStats

__all__ = ["CheckpointManager", "SaveStats", "open_storage", "TRAINER_STATE"]

log = logging.getLogger("roll_ckpt")


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
    component has committed its part (see :mod:`roll_ckpt.format.components`). ``resume`` loads
    this component's part of the newest step that every component committed.

    Preemption (``checkpoint_config.preemption``, on by default for SIGTERM): the manager
    installs signal handlers when it is created (main thread only) and restores the previous
    ones at :meth:`close`; those get the signal only once the preemption checkpoint is
    committed (or at :meth:`close` without one); see :meth:`maybe_save` and
    :mod:`roll_ckpt.runtime.preemption`.
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
        self._job = Job(config, component, storage, plugins, quiet=quiet)
        if cc.backup is not None:
            replica = open_storage(plugins, cc.backup.type, cc.backup.output_dir, cc.backup.storage_options)
            self._job.backup = BackupLink(lambda: self._job.storage, replica, cc.backup, lock=self._job.local_lock,
                                          own_run=lambda: self._job.run_dir, nice=cc.background_nice)
        if cc.local is not None:
            if component is not None:
                raise RollCkptError("checkpoint_config.local (the fast recovery tier) does not work with "
                                    "components yet; remove one of them")
            from .tiers.local_tier import LocalTier

            self._job.local = LocalTier(cc.local, open_storage(plugins, "file_system", cc.local.dir, {}))
        self._saves = SavePipeline(self._job)
        self._resumer = Resumer(self._job)
        self._closed = False
        self.preempted = False
        """True once a preemption checkpoint is committed (with ``preemption.exit: false``)."""
        self._watch = PreemptionWatch(cc.preemption.signals)
        self._watch.install()

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
        """Save when ``step`` is a multiple of ``save_steps``; returns the checkpoint's path.

        Call it once per step on every process: it is also where a preemption request (a
        signal, or :meth:`request_preemption`) is acted on. The processes agree on it (one
        tiny all-reduce per call, even when only one process got the signal), then the
        manager waits for a save in flight, saves ``step`` synchronously and durably, closes,
        passes the signal on to the handler that was there before and, with
        ``preemption.exit`` (the default), raises :class:`~roll_ckpt.Preempted` (with that
        handler's exit status when it raised ``SystemExit``, as Ray's does).
        """
        self._check_open()
        if self._watch.signals:
            strategy = self.bind(state)
            if strategy.any_true(self._watch.requested, step):
                return self._preempt(step, state)
        every = self.config.save_steps
        local = self._job.local

        def due(k: int) -> tuple[bool, bool]:
            return (every > 0 and k > 0 and k % every == 0,
                    local is not None and k > 0 and k % local.config.save_steps == 0)

        persistent, local_due = due(step)
        path = None
        if persistent:
            path = self._saves.save(step, state, final=False, metadata=None, local=local_due)
        elif local_due:
            self._saves.save_local(step, state)
        if any(due(step + 1)):  # the next call saves: its staging buffers made ready meanwhile, off the loop
            self._saves.prepare()
        return path

    def prepare_save(self) -> "Future[None] | None":
        """Say that a save is near (the next call to :meth:`save`): the staging buffers, whose
        memory is freed between saves (``strategy_config.keep_staging_buffers: false``), are
        allocated and touched in the writer thread meanwhile, so the save only copies.
        :meth:`maybe_save` does this itself the step before a save step. Returns a future done
        once they are ready (``None``: nothing to prepare: a synchronous manager, buffers kept,
        or no save staged yet)."""
        self._check_open()
        return self._saves.prepare()

    def request_preemption(self) -> None:
        """Ask for a preemption save at the next :meth:`maybe_save`, as a signal would: for code
        that learns of a preemption otherwise (a Ray actor off the main thread, a scheduler's API)."""
        self._watch.request()

    @property
    def preemption_requested(self) -> bool:
        """True once this process got a preemption signal or request (no collective)."""
        return self._watch.requested

    def _preempt(self, step: int, state: Mapping[str, Any]) -> str | None:
        pc = self.config.checkpoint_config.preemption
        log.warning("roll-ckpt: preemption (%s): saving step %d durably%s", self._watch.describe(), step,
                    ", then exiting" if pc.exit else "")
        try:
            try:
                self._saves.wait()  # the save in flight first; its failure must not cost this one
            except RollCkptError as exc:
                log.error("roll-ckpt: the save in flight failed: %s; saving step %d anyway", exc, step)
            path = run_without_interruption(self._watch, lambda: self._saves.save(
                step, state, final=True, metadata={"preempted": self._watch.describe()}))
            self._watch.committed = True  # the signals held so far are passed on below, not by close()
        except BaseException as exc:  # close() passes the signal on: the error must not vanish with the process
            log.error("roll-ckpt: the preemption save of step %d failed: %s", step, exc)
            raise
        finally:
            self.close()
        self.preempted = True
        log.warning("roll-ckpt: preemption checkpoint of step %d committed at %s", step, path)
        # the handlers that were there before get the signal now; Preempted (exit) ends the loop
        return preemption_done(self._watch, pc.exit, pc.exit_code, step, path or "")

    def save(self, step: int, state: Mapping[str, Any], *, final: bool = False,
             metadata: Mapping[str, Any] | None = None) -> str | None:
        """Save ``state`` as ``checkpoint-<step>``; returns the path it is committed at.

        With ``strategy_config.async_save_ckpt`` (or ``checkpoint_config.async_upload``;
        :attr:`Config.async_save`) this returns once the state is staged
        and the write goes on in the background; ``final=True`` always returns after
        the checkpoint is committed. ``metadata`` (JSON values) goes to
        ``trainer_state.json`` under ``user``. Saving a step this manager has already
        committed does nothing. With ``checkpoint_config.on_save_error: warn`` a failed
        save that is not final returns ``None`` (logged, counted in :attr:`failed_saves`).
        """
        self._check_open()
        return self._saves.save(step, state, final=final, metadata=metadata)

    def commit_step(self, step: int, parts: Iterable[str], files: Iterable[str] = ()) -> bool:
        """Commit step ``step`` once ``parts`` are all committed, for a job whose steps something
        else completes (``checkpoint_config.commit_steps: false``: a framework integration that
        knows which parts a step has, as verl's trainer does). ``files``: the step's own files at
        its root, written by that framework (hashed now, covered by the step's manifest). Then
        retention and replication run, as after any commit. True when this call committed it;
        False when a part is missing or another process committed it first. Coordinator."""
        from .format.layout import checkpoint_name

        job = self._job
        cc = self.config.checkpoint_config
        step_path = job.storage.join(job.ensure_run_dir(), checkpoint_name(step, cc.name_format))
        committer = self._saves.committer
        if not committer.commit_step(step_path, step, parts=list(parts), files=list(files)):
            return False
        committer.after_commit(step_path, step)
        return True

    def hf_files(self, *objects: Any) -> None:
        """Hand over the tokenizer, processor... (objects with ``save_pretrained(dir)``) whose
        files every checkpoint's Hugging Face files include (``checkpoint_config.hf_weights``)."""
        if self._saves.hf is None:
            raise RollCkptError("manager.hf_files(...): checkpoints carry no Hugging Face files; set "
                                "checkpoint_config.hf_weights: true (or strategy_config.save_only_model)")
        self._saves.hf.extras.extend(objects)
        self._saves.hf.forget_files()

    def wait(self) -> SaveStats | None:
        """Wait for the save in flight; raise its error if it failed."""
        return self._saves.wait()

    @property
    def save_in_flight(self) -> bool:
        """True while an asynchronous save is still writing; never waits."""
        return self._saves.in_flight

    @property
    def failed_saves(self) -> int:
        """Periodic saves that failed and were let go (``checkpoint_config.on_save_error: warn``)."""
        return self._saves.errors.failed_saves

    @property
    def network(self) -> NetworkCounts:
        """The network faults this manager's storage met so far, retries and time lost
        included (all zero on a local disk); each save's own are in ``last_save.network``."""
        from .runtime.network import read_counts

        return read_counts(self._job.storage) or NetworkCounts()

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
        step = self._resumer.resume(state, target)
        if self._job.local is not None:
            self._job.local.started(step)
        return step

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

    # ------------------------------------------------------------------ fast recovery tier

    @property
    def local_tier_bytes(self) -> int:
        """Bytes the fast recovery tier holds in this node's folder (own units and the
        replicas kept for other nodes; tmpfs counts as memory); 0 without ``checkpoint_config.local``."""
        return 0 if self._job.local is None else self._job.local.bytes_used()

    @property
    def local_last_save(self) -> dict[str, Any] | None:
        """What the latest local save did (step, ok, seconds, bytes, replicated_to, replicas_kept,
        node_bytes, blocked_s); ``None`` before the first or without the tier."""
        return None if self._job.local is None else self._job.local.last_save

    @property
    def local_failed_saves(self) -> int:
        """Local saves that failed (a full tmpfs...): logged, never raised."""
        return 0 if self._job.local is None else self._job.local.failed_saves

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
        """Drain the save in flight and re-raise its error; the manager is unusable afterwards.

        A preemption signal that came after the last :meth:`maybe_save` is raised again at the
        very end, for the handler restored here (Ray's, the default action...): see
        :mod:`roll_ckpt.runtime.preemption`."""
        if self._closed:
            return
        self._closed = True
        self._job.open = False
        held = self._watch.uninstall()  # signals that came after the last maybe_save: passed on last
        try:
            try:
                self._saves.close()
            finally:
                try:
                    if self._job.strategy is not None:
                        self._job.strategy.close()
                    self._job.release()
                finally:
                    backup_error = self._job.backup.close() if self._job.backup is not None else None
            if backup_error is not None:
                raise backup_error
        except BaseException as exc:
            if held:  # the signal passed on below may end the process: the error must not vanish with it
                log.error("roll-ckpt: close() failed: %s", exc)
            raise
        finally:
            pass_on(held)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
