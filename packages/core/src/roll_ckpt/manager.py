"""CheckpointManager: the public entry point for saving and resuming a training job.

The manager owns the launch's state -- the strategy, the :class:`~roll_ckpt.tiers.run.Run` (storage,
token, run folder: an immutable value, replaced when the folder is claimed or the storage
wrapped), the hold on the checkpoint it resumed from, the backup link and the local tier -- and
hands each part what it needs; the work is done in modules of their own:
:mod:`roll_ckpt.save.pipeline` (the saver, with retention and replication as its commit hooks),
:mod:`roll_ckpt.load.resume` (which checkpoint to resume from, and loading it),
:mod:`roll_ckpt.tiers.run` (the strategy chosen, the run folder claimed),
:mod:`roll_ckpt.format.components` (steps made of several parts) and
:mod:`roll_ckpt.tiers.backup` (replication to ``checkpoint_config.backup``).
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future
from typing import Any, Iterable, Mapping, MutableMapping

from .tiers.backup import BackupLink
from .format.components import ComponentSteps, check_component
from .format.commit import release_folder
from .config.schema import Config, load_config
from .contracts import CommitInfo, Storage, Strategy, StrategyIO
from .errors import RollCkptError
from .tiers.retention import Retention
from .tiers.run import LaunchHold, Run, Setup, choose_strategy, claim_run, open_storage
from .plugins import Plugins, get_plugins
from .runtime.preemption import PreemptionWatch, pass_on, preemption_done, run_without_interruption
from .load.resume import Resumer
from .format.layout import TRAINER_STATE
from .save.pipeline import SavePipeline, SaveStats, check_step
from .views import BackupView, LocalView, PreemptionView, ResumeReport, SaveReport, moved, warn_moved

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

    Beside its calls, the manager shows five subjects (:mod:`roll_ckpt.views`): ``stats`` (what
    its saves cost: ``stats.last``, ``stats.failed``, ``stats.in_flight``, ``stats.network``),
    ``resumed`` (the checkpoint ``resume`` loaded: ``path``, ``from_backup``, ``trainer_state``),
    ``backup`` (``storage``, ``status``, ``wait()``; ``None`` without ``checkpoint_config.backup``),
    ``local`` (the fast recovery tier; ``None`` without ``checkpoint_config.local``) and
    ``preemption`` (``request()``, ``requested``, ``committed``).
    """

    def __init__(self, config: Config, *, component: str | None = None, plugins: Plugins | None = None,
                 quiet: bool = False) -> None:
        cc = config.checkpoint_config
        component = check_component(component, cc)
        plugins = plugins or get_plugins()
        if component is not None:  # the worker section's strategy_config (ROLL's actor_train...) first
            config = config.for_component(component, plugins=plugins)
        self.config = config
        self._setup = Setup(config, component, plugins, quiet)
        self._storage = open_storage(plugins, cc.type, cc.output_dir, cc.storage_options)
        self._strategy: Strategy | None = None
        self._io: StrategyIO | None = None
        """What writes and reads the strategy's files (made with it, :func:`~roll_ckpt.tiers.run.choose_strategy`)."""
        self._token = ""
        self._run: Run | None = None
        """This launch's run, once its folder is claimed (:meth:`_claimed_run`)."""
        self._holds = LaunchHold()
        lock = threading.Lock()  # held by retention and backup.keep_local while they remove local checkpoints
        self._backup: BackupLink | None = None
        if cc.backup is not None:
            replica = open_storage(plugins, cc.backup.type, cc.backup.output_dir, cc.backup.storage_options)
            self._backup = BackupLink(replica, cc.backup, lock=lock, nice=cc.background_nice)
        self._local: Any = None
        if cc.local is not None:
            if component is not None:
                raise RollCkptError("checkpoint_config.local (the fast recovery tier) does not work with "
                                    "components yet; remove one of them")
            from .tiers.local_tier import LocalTier

            self._local = LocalTier(cc.local, open_storage(plugins, "file_system", cc.local.dir, {}))
        retention = Retention(cc.max_ckpt_to_keep, lock, self._backup)
        # core's commit hooks: a component's part commits its step once every part is in; then, for
        # each checkpoint (or step) committed, in order: retention (with max_ckpt_to_keep), replication
        self._steps = None if component is None else ComponentSteps(component, cc, self._announce)
        self._after_commit = ([retention.after_commit] if retention.keep else []) + \
            ([self._backup.submit] if self._backup is not None else [])
        self._saves = SavePipeline(self._setup, local=self._local, retention=retention, announce=self._announce,
                                   after_commit=self._after_commit, steps=self._steps)
        self._resumer = Resumer(self._setup, local=self._local, backup=self._backup, announce=self._announce,
                                holds=self._holds)
        self.stats = SaveReport(self._saves, lambda: self._storage)
        self.resumed = ResumeReport(self._resumer, lambda: self._storage)
        self.backup = None if self._backup is None else BackupView(self._backup, self._saves)
        self.local = None if self._local is None else LocalView(self._local)
        self._closed = False
        self._preempted = False  # a preemption checkpoint committed (manager.preemption.committed)
        self._watch = PreemptionWatch(cc.preemption.signals)
        self.preemption = PreemptionView(self._watch, lambda: self._preempted)
        self._watch.install()

    @classmethod
    def from_config(cls, config: Config | Mapping[str, Any] | str, **kwargs: Any) -> "CheckpointManager":
        if not isinstance(config, Config):
            config = load_config(config)
        return cls(config, **kwargs)

    @property
    def storage(self) -> Storage:
        """Where checkpoints are written (``checkpoint_config.type`` at ``output_dir``).

        Assignable (e.g. to wrap it with instrumentation): the saves after it write through it.
        A wrapper keeps the backend's optional capabilities (``network_counts``, ``take_over``,
        ``list_prefix``: :data:`roll_ckpt.plugin.STORAGE_CAPABILITIES`) only by defining each as a
        method of its own: they are found with ``isinstance``, which does not call a wrapper's
        ``__getattr__`` from Python 3.12 on."""
        return self._storage

    @storage.setter
    def storage(self, storage: Storage) -> None:
        self._storage = storage
        if self._run is not None:
            self._run = Run(storage, self._run.token, self._run.folder)

    # ------------------------------------------------------------------ strategy

    @property
    def strategy(self) -> Strategy:
        """The strategy in use; chosen from the state at the first ``resume``/``save``."""
        if self._strategy is None:
            raise RollCkptError("the strategy is chosen from the state: call bind(state), resume(state) "
                                "or save(step, state) first")
        return self._strategy

    @property
    def io(self) -> StrategyIO:
        """What writes and reads the strategy's files (a :class:`~roll_ckpt.contracts.StrategyIO`:
        ``DCPIO`` for DCP), made with the strategy and owned by this manager."""
        self.strategy  # (the same error before the first resume/save)
        return self._io

    def bind(self, state: Mapping[str, Any]) -> Strategy:
        """Choose the strategy for ``state`` (done by the first resume/save): every process
        of the job calls it, and they agree on this launch's token."""
        if self._strategy is None:
            self._strategy, self._io, self._token = choose_strategy(self.config, self._setup.plugins, state)
        return self._strategy

    @property
    def run_dir(self) -> str | None:
        """This run's folder (created by the first save)."""
        return None if self._run is None else self._run.folder

    def _claimed_run(self) -> Run:
        """This launch's run, its folder claimed by the coordinator on first use."""
        if self._run is None:
            assert self._strategy is not None
            self._run = claim_run(Run(self._storage, self._token), self._strategy, self.config,
                                  self._setup.component, self._writing)
        return self._run

    def _writing(self) -> bool:
        """Whether this launch may still write its run folder (retention by other managers of
        this process leaves it alone while it may)."""
        return not self._closed

    def _announce(self, path: str, manifest: Any, component: str | None = None, data: bytes | None = None) -> None:
        """``roll_ckpt_on_commit`` for a checkpoint, a step or a part just committed here
        (the checkpoint this launch resumed from need not be held any longer). ``data``: the
        bytes of ``manifest.json`` as committed, when the caller has them (not serialised again)."""
        self._holds.release()
        self._setup.plugins.hook.roll_ckpt_on_commit(info=CommitInfo(
            path=path, step=manifest.step, url=self._storage.url,
            manifest=json.loads(manifest.to_bytes() if data is None else data), component=component))

    # ------------------------------------------------------------------ saving

    def maybe_save(self, step: int, state: Mapping[str, Any]) -> str | None:
        """Save when ``step`` is a multiple of ``save_steps``; returns the checkpoint's path.

        Call it once per step on every process: it is also where a preemption request (a
        signal, or ``manager.preemption.request()``) is acted on. The processes agree on it (one
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
        local = self._local

        def due(k: int) -> tuple[bool, bool]:
            return (every > 0 and k > 0 and k % every == 0,
                    local is not None and k > 0 and k % local.config.save_steps == 0)

        persistent, local_due = due(step)
        path = None
        if persistent:
            self.bind(state)
            path = self._saves.save(self._claimed_run, self._io, step, state, final=False, metadata=None,
                                    local=local_due)
        elif local_due:
            self.bind(state)
            self._saves.save_local(self._io, step, state)
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

    def _preempt(self, step: int, state: Mapping[str, Any]) -> str | None:
        pc = self.config.checkpoint_config.preemption
        log.warning("roll-ckpt: preemption (%s): saving step %d durably%s", self._watch.describe(), step,
                    ", then exiting" if pc.exit else "")
        try:
            try:
                self._saves.wait()  # the save in flight first; its failure must not cost this one
            except RollCkptError as exc:
                log.error("roll-ckpt: the save in flight failed: %s; saving step %d anyway", exc, step)
            self.bind(state)
            path = run_without_interruption(self._watch, lambda: self._saves.save(
                self._claimed_run, self._io, step, state, final=True,
                metadata={"preempted": self._watch.describe()}))
            self._watch.committed = True  # the signals held so far are passed on below, not by close()
        except BaseException as exc:  # close() passes the signal on: the error must not vanish with the process
            log.error("roll-ckpt: the preemption save of step %d failed: %s", step, exc)
            raise
        finally:
            self.close()
        self._preempted = True
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
        save that is not final returns ``None`` (logged, counted in ``stats.failed``).
        """
        self._check_open()
        check_step(step)  # before the strategy is chosen (a collective on first use)
        self.bind(state)
        return self._saves.save(self._claimed_run, self._io, step, state, final=final, metadata=metadata)

    def commit_step(self, step: int, parts: Iterable[str], files: Iterable[str] = ()) -> bool:
        """Commit step ``step`` once ``parts`` are all committed, for a job whose steps something
        else completes (``checkpoint_config.commit_steps: false``: a framework integration that
        knows which parts a step has, as verl's trainer does). ``files``: the step's own files at
        its root, written by that framework (hashed now, covered by the step's manifest). Then
        retention and replication run, as after any commit. True when this call committed it;
        False when a part is missing or another process committed it first. Coordinator."""
        from .format.layout import checkpoint_name

        if self._steps is None:
            raise RollCkptError("commit_step commits a step of components: this manager saves none "
                                "(CheckpointManager(config, component=...))")
        run = self._claimed_run()
        step_path = run.storage.join(run.folder, checkpoint_name(step, self.config.checkpoint_config.name_format))
        if not self._steps.commit(run.storage, step_path, step, list(parts), list(files)):
            return False
        for hook in self._after_commit:
            hook(run, step_path, step)
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

    # ------------------------------------------------------------------ resuming

    def resume(self, state: MutableMapping[str, Any], target: str | None = None) -> int:
        """Restore ``state`` from the configured checkpoint; return its step (0: fresh start).

        The checkpoint is verified (sizes and checksums) before torch reads any of it;
        a damaged or uncommitted one is refused with an error naming the file. With
        ``checkpoint_config.backup``, ``"latest"`` is the newest committed checkpoint of
        both locations; a local copy that is gone or damaged is replaced by its replica
        (verified the same way; a warning names the damaged file).
        """
        self._check_open()
        self.bind(state)
        # with components the run folder is claimed first: a run_name an earlier launch used is
        # refused before anything loads, and the launch's choice is recorded there
        run = self._claimed_run() if self._setup.component else Run(self._storage, self._token)
        step = self._resumer.resume(run, self._io, state, target)
        self._saves.committer.resumed_from = self._resumer.path  # (trainer_state.json names it)
        if self._local is not None:
            self._local.started(step)
        return step

    # ------------------------------------------------------------------ moved (deprecated until 1.0)

    root = moved("storage.root")
    save_in_flight = moved("stats.in_flight")
    failed_saves = moved("stats.failed")
    network = moved("stats.network")
    last_save = moved("stats.last")
    space_estimate = moved("stats.space_estimate")
    resolve_resume = moved("resumed.candidates")
    trainer_state = moved("resumed.trainer_state")
    resumed_from = moved("resumed.path")
    resumed_from_backup = moved("resumed.from_backup")
    local_tier_bytes = moved("local.bytes_used", absent=0)
    local_last_save = moved("local.last_save")
    local_failed_saves = moved("local.failed_saves", absent=0)
    backup_storage = moved("backup.storage", settable=True)
    backup_status = moved("backup.status")
    component = moved("_setup.component")
    plugins = moved("_setup.plugins")
    quiet = moved("_setup.quiet")
    is_coordinator = moved("_coordinator", hint="manager.strategy.is_coordinator (after bind)")
    preemption_requested = moved("preemption.requested")
    preempted = moved("preemption.committed")

    def request_preemption(self) -> None:
        """Deprecated (until 1.0): ``manager.preemption.request()``."""
        warn_moved("request_preemption", "preemption.request()")
        self.preemption.request()

    def wait_for_backup(self, timeout: float | None = None) -> Any:
        """Deprecated (until 1.0): ``manager.backup.wait(timeout)``."""
        warn_moved("wait_for_backup", "backup.wait(timeout)")
        self.wait()
        return None if self.backup is None else self.backup.wait(timeout)

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
        held = self._watch.uninstall()  # signals that came after the last maybe_save: passed on last
        try:
            try:
                self._saves.close()
            finally:
                try:
                    if self._strategy is not None:
                        self._strategy.close()
                        self._io.close()
                    self._release()
                finally:
                    backup_error = self._backup.close() if self._backup is not None else None
            if backup_error is not None:
                raise backup_error
        except BaseException as exc:
            if held:  # the signal passed on below may end the process: the error must not vanish with it
                log.error("roll-ckpt: close() failed: %s", exc)
            raise
        finally:
            pass_on(held)

    def _release(self) -> None:
        """Let go of the hold and, with ``timestamp_subdir: false``, of ``output_dir`` (coordinator)."""
        try:
            self._holds.release()
            if self._run is not None and self._run.folder == self._run.root and self._coordinator:
                release_folder(self._storage, self._run.root)
        except Exception as exc:  # a hold or lock of a process that is gone counts for nothing
            log.warning("roll-ckpt: could not remove this launch's hold or lock under %s (%s: %s)",
                        self._storage.root, type(exc).__name__, exc)

    @property
    def _coordinator(self) -> bool:
        return self._strategy is None or self._strategy.is_coordinator

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
