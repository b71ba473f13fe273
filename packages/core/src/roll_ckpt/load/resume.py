"""Resume: which checkpoint, agreed by every process (and every component), verified, loaded.

::

    Resumer.resume
        agreed_candidates        coordinator lists, every rank takes its choice
        resume_from              coordinator verifies the manifest and small files; the
                                 strategy loads, checking each data file as it reads it
        _initial_load            nothing to resume: checkpoint_config.initial_load's
                                 Hugging Face weights, if configured (load/hf_folder.py)

``"latest"`` is the newest committed checkpoint under ``output_dir`` (run, then step)
and, with ``checkpoint_config.backup``, at the backup location; when both hold it, the
local copy goes first and the replica is tried when the local copy is damaged.
"""

from __future__ import annotations

import functools
import json
import logging
import warnings
from typing import Any, Callable, MutableMapping

from ..format import layout
from ..runtime.distributed import decide
from ..format.components import complete_pending, open_part, read_resume_record
from ..contracts import Storage, Strategy, StrategyIO
from ..errors import CheckpointNotFoundError, RollCkptError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.manifest import read_manifest, verify
from ..tiers.run import LaunchHold, Run, Setup, open_storage
from ..format.layout import TRAINER_STATE, Found, recognize, survey, what_is
from ..format.commit import utc_now

__all__ = ['Resumer']


# ---- resume ------------------------------------------------------------

log = logging.getLogger("roll_ckpt")

Candidate = tuple[Storage, str, bool]
"""``(storage, path, from_backup)``."""


class Resumer:
    """One manager's resumes. ``local``: the fast recovery tier (or ``None``); ``backup``: the
    link to ``checkpoint_config.backup`` (or ``None``); ``announce``: ``roll_ckpt_on_commit``
    for a step this resume commits; ``holds``: the launch's hold on what it resumes from."""

    def __init__(self, setup: Setup, *, local: Any, backup: Any, announce: Callable[..., None],
                 holds: LaunchHold) -> None:
        self.setup = setup
        self.local, self.backup, self.announce, self.holds = local, backup, announce, holds
        self.path: str | None = None
        """The checkpoint the resume loaded (its path, or the replica's URL); ``None``: none."""
        self.trainer_state: dict[str, Any] = {}
        self.resumed_from_backup = False
        self.initial_load: Any = None
        """What ``checkpoint_config.initial_load`` loaded (an ``HFLoadReport``), on a fresh start."""

    # ------------------------------------------------------------------ where from

    def candidates(self, storage: Storage, target: str | None) -> list[Candidate]:
        """What to try in turn (this process's view): the newest checkpoint, local copy first.

        For ``latest``, the newest *usable* folder under ``output_dir``: a committed
        checkpoint, or another framework's that a format plugin recognizes complete
        (:mod:`roll_ckpt.format.layout`). Every newer folder passed over is named in a
        WARNING with the reason, or, with ``checkpoint_config.on_unusable_checkpoint:
        raise``, stops the resume. ``storage``: this manager's.
        """
        setup = self.setup
        cc = setup.config.checkpoint_config
        target = setup.config.resume_target if target is None else target
        if target is None:
            return []
        if target != "latest":
            there = open_storage(setup.plugins, cc.type, target, cc.storage_options)
            return [(there, there.root, False)]
        found = survey(storage, storage.root, setup.plugins.formats, cc.components if setup.component else None)
        usable = [f for f in found if f.usable]
        local = usable[-1] if usable else None
        remote = None
        backup = self.backup.replica if self.backup is not None else None
        if backup is not None:
            try:
                remote = layout.latest(backup, backup.root)
            except Exception as exc:  # an unreachable backup must not stop a local resume
                log.warning("roll-ckpt: cannot list the backup at %s (%s); only local checkpoints are "
                            "considered", backup.url, exc)
        newest = max((r.order for r in (local, remote) if r is not None), default=None)
        self._passed_over(storage, [f for f in found if not f.usable and (newest is None or f.order > newest)], newest)
        if local is None and remote is None:
            where = storage.url + (f" nor at the backup {backup.url}" if backup is not None else "")
            log.info("roll-ckpt: no checkpoint to resume from under %s; starting fresh", where)
            return []
        if remote is None or (local is not None and local.order > remote.order):
            return [(storage, local.path, False)]
        if local is None or remote.order > local.order:
            return [(backup, remote.path, True)]
        return [(storage, local.path, False), (backup, remote.path, True)]

    def _passed_over(self, storage: Storage, passed: list[Found], newest: Any) -> None:
        """Name the folders ``latest`` could not use: a WARNING, or the error the config asks for."""
        if not passed:
            return
        what = "starting fresh (step 0)" if newest is None else "resuming from an older checkpoint"
        lines = [f"  {f.path}: {f.reason}" for f in passed]
        if self.setup.config.checkpoint_config.on_unusable_checkpoint == "raise":
            raise CheckpointNotFoundError(
                f"resume_from_checkpoint: latest would be {what}, passing over {len(passed)} folder(s) it cannot "
                f"use under {storage.url}:\n" + "\n".join(lines) + "\n(checkpoint_config."
                "on_unusable_checkpoint: raise.) Resume one of them by hand once it is whole, remove them, or set "
                "on_unusable_checkpoint: warn to go on without them")
        log.warning("roll-ckpt: %s; passed over %d folder(s) that cannot be resumed from:\n%s\n"
                    "(checkpoint_config.on_unusable_checkpoint: raise makes this an error)", what, len(passed),
                    "\n".join(lines))

    def agreed_candidates(self, run: Run, strategy: Strategy, target: str | None) -> list[Candidate]:
        """Where to resume from: the same on every rank and in every component of a launch.

        Ranks that listed the folders themselves could see different steps (one may be
        committed meanwhile), so the coordinator decides and broadcasts its choice. With
        components, the first component to resume records its choice in the run folder
        (``.resume.json``, create-only) and the others take it: every component of a launch
        starts from the same step, even if a straggler of an earlier launch commits one
        while they start.
        """
        target = self.setup.config.resume_target if target is None else target
        if target != "latest":
            return self.candidates(run.storage, target)
        agreed = decide(strategy, functools.partial(self._pick_latest, run),
                        where=f"cannot find the checkpoint to resume from under {run.storage.url}",
                        phase="resume: choosing the checkpoint")
        backup = self.backup.replica if self.backup is not None else None
        return [(backup if from_backup else run.storage, path, from_backup)  # type: ignore[misc]
                for path, from_backup in agreed]

    def _pick_latest(self, run: Run) -> list[tuple[str, bool]]:
        """The coordinator's ``(path, from_backup)`` candidates for ``latest`` (with components,
        ``run``'s folder is claimed: the launch's choice is recorded there)."""
        storage, component = run.storage, self.setup.component
        if not component:
            return [(path, from_backup) for _, path, from_backup in self.candidates(storage, "latest")]
        assert run.folder is not None
        shared = run.folder != run.root  # without run folders there is no launch's own folder to record in
        record = storage.join(run.folder, layout.RESUME_RECORD)
        chosen = read_resume_record(storage, record) if shared else None
        if chosen is not None:
            return chosen
        cc = self.setup.config.checkpoint_config
        if cc.commit_steps:  # else something else commits the steps (roll_ckpt_verl)
            for path, manifest in complete_pending(storage, run.root, cc.components or ()):
                log.info("roll-ckpt: committed %s (its parts were all committed)", path)
                self.announce(path, manifest)
        mine = [(path, from_backup) for _, path, from_backup in self.candidates(storage, "latest")]
        if not shared:
            return mine
        body = {"candidates": mine, "component": component, "time": utc_now()}
        try:
            storage.write_create(record, json.dumps(body).encode())
        except FileExistsError:  # another component chose first
            chosen = read_resume_record(storage, record)
            if chosen is not None:
                return chosen
        return mine

    # ------------------------------------------------------------------ loading

    def resume(self, run: Run, io: StrategyIO, state: MutableMapping[str, Any], target: str | None) -> int:
        """Restore ``state``; its step (0: a fresh start). ``run``: this launch's (with components,
        its folder claimed first: a ``run_name`` an earlier launch used is refused before anything loads)."""
        config, strategy = self.setup.config, io.strategy
        candidates = self.agreed_candidates(run, strategy, target)
        if self.local is not None and (config.resume_target if target is None else target) == "latest":
            newest = max((layout.parse_step(layout.basename(p)) or 0 for _, p, _ in candidates), default=-1)
            stream = not config.checkpoint_config.verify_before_load
            found = self.local.resume(state, io, newest, stream=stream)
            if found is not None:
                step, self.trainer_state, self.path = found
                log.info("roll-ckpt: resumed step %d from the local tier (%s; the newest persistent step is %s)",
                         step, self.path, newest if newest >= 0 else "none")
                return step
            if self.local.partly_loaded and not candidates:
                raise RollCkptError("loading the newest local checkpoint failed after it began (logged above) and "
                                    f"there is no persistent checkpoint under {run.storage.url}: the state is partly "
                                    "loaded; start again from scratch")
        first_error: RollCkptError | None = None
        for i, (storage, path, from_backup) in enumerate(candidates):
            try:
                step = self._resume_from(run, io, state, storage, path)
            except RollCkptError as exc:  # raised alike on every rank (verification is broadcast)
                if i + 1 < len(candidates):
                    from ..tiers.replication import replica_url

                    nxt_storage, nxt_path, _ = candidates[i + 1]
                    log.warning("roll-ckpt: cannot resume from the local copy %s: %s -- resuming from its "
                                "replica %s instead (verified first)", path, exc, replica_url(nxt_storage, nxt_path))
                    first_error = first_error or exc
                    continue
                if first_error is not None:
                    log.warning("roll-ckpt: the replica %s cannot be resumed from either: %s", path, exc)
                    raise first_error from None
                raise
            self.resumed_from_backup = from_backup
            if from_backup:
                from ..tiers.replication import replica_url

                self.path = replica_url(storage, path)
                log.info("roll-ckpt: resumed step %d from the backup %s", step, self.path)
            return step
        return self._initial_load(strategy, state)

    def _initial_load(self, strategy: Strategy, state: MutableMapping[str, Any]) -> int:
        """A fresh start: ``checkpoint_config.initial_load``'s weights, if any, into ``state``. Returns 0."""
        initial = self.setup.config.checkpoint_config.initial_load
        if initial is not None:
            from .hf_folder import load_initial

            self.initial_load = load_initial(state, initial, strategy,
                                             functools.partial(self.setup.progress, strategy=strategy))
        return 0

    def _check(self, run: Run, strategy: Strategy, storage: Storage, path: str) -> tuple[Any, Manifest | None, bytes]:
        """Coordinator: what ``path`` is, and everything of it but the data files checked:
        ``(folder to load, its manifest, trainer_state.json's bytes)``, or, for another
        framework's checkpoint, ``((folder, component), None, b"")``."""
        foreign = self._foreign_part(storage, path)
        if foreign is not None:
            return foreign, None, b""
        if storage is run.storage:  # another launch's retention must leave it alone meanwhile
            self.holds.hold(run, path)
        part, manifest = self._part_to_load(storage, path)
        # DCP's files are checked while they are read, once for the job (before anything is
        # deserialized): .metadata by the coordinator, each data file by one rank
        # (roll_ckpt.dcp.reader); everything else here.
        data_dir = f"{strategy.data_dir}/"
        with self.setup.progress("verify", strategy) as progress:
            manifest = verify(storage, part, on_bytes=progress, defer=data_dir, manifest=manifest).manifest
        if not any(name.startswith(data_dir) for name in manifest.files):
            raise RollCkptError(
                f"{part} was written by the '{manifest.extra.get('strategy')}' strategy and holds no "
                f"'{data_dir}' folder, which the '{strategy.name}' strategy chosen for this state "
                "loads; resume it with the same kind of state it was saved from")
        with storage.open_read(storage.join(part, TRAINER_STATE)) as f:
            return part, manifest, f.read()

    def _resume_from(self, run: Run, io: StrategyIO, state: MutableMapping[str, Any], storage: Storage,
                     path: str) -> int:
        """Verify the checkpoint at ``path`` (of ``storage``), load it into ``state``; return its step."""
        # The coordinator alone tells what the folder is, reads the manifest and the trainer
        # state, in one decision (the manifest grows with the job: read by every rank, its
        # bytes would grow with the square of it).
        strategy = io.strategy
        part, manifest, trainer_bytes = decide(strategy, functools.partial(self._check, run, strategy, storage, path),
                                               where=f"cannot resume from {path}", phase="resume: verifying",
                                               step=layout.parse_step(layout.basename(path)))
        if manifest is None:  # another framework's checkpoint: (its folder, component)
            return self._resume_foreign(strategy, state, storage, *part)
        data_dir = strategy.data_dir
        files = {name[len(data_dir) + 1:]: entry for name, entry in manifest.files.items()
                 if name.startswith(f"{data_dir}/")}
        trainer_state = json.loads(trainer_bytes.decode())
        into = only_model(state, manifest, part)
        with self.setup.progress(f"load step {trainer_state.get('step')}", strategy) as progress:
            io.load(into, storage, storage.join(part, data_dir), progress, files=files, checkpoint=part,
                          stream=not self.setup.config.checkpoint_config.verify_before_load)
        self.trainer_state = trainer_state
        self.path = storage.url if storage is not run.storage else path
        self.setup.plugins.hook.roll_ckpt_load(path=path, state=state)
        return int(trainer_state["step"])

    def _foreign_part(self, storage: Storage, path: str) -> tuple[str, str | None] | None:
        """Coordinator: ``None`` when ``path`` is a roll-ckpt checkpoint (or one's part: its
        manifest is there); ``(folder, component)`` of another framework's checkpoint that a
        format recognizes whole; otherwise an error saying what the folder is."""
        if storage.exists(storage.join(path, MANIFEST_NAME)):
            return None
        if not storage.isdir(path):
            raise CheckpointNotFoundError(f"no checkpoint at {path}: the folder does not exist")
        setup = self.setup
        formats = setup.plugins.formats
        components = setup.config.checkpoint_config.components if setup.component else None
        step_folder, name = layout.parent(path), layout.basename(path)
        outer = recognize(storage, step_folder, formats()) if step_folder else None
        if outer is not None and name in outer.components() and setup.component in (None, name):
            found = what_is(storage, step_folder, formats)  # one part of another framework's step, named
            if found.usable:
                return step_folder, name
        else:
            found = what_is(storage, path, formats, components)
        if found.foreign is not None and found.usable:
            return path, setup.component
        others = f"resume from another checkpoint (`roll-ckpt ls {layout.parent(path)}` lists them)"
        if found.foreign is not None:
            raise CheckpointNotFoundError(f"{path} is {found.reason}; it is never resumed from: {others}")
        if found.kind == "roll-ckpt":
            raise CheckpointNotFoundError(f"{path} is not a committed checkpoint: {found.reason}; it is never "
                                          f"resumed from: {others}")
        raise CheckpointNotFoundError(f"{path} is not a committed checkpoint, nor one another framework wrote that "
                                      f"roll-ckpt can read: {found.reason}. Install the format plugin of the "
                                      f"framework that wrote it, or {others}")

    def _resume_foreign(self, strategy: Strategy, state: MutableMapping[str, Any], storage: Storage, path: str,
                        component: str | None) -> int:
        """Load another framework's checkpoint (read-only) into ``state``; every process
        recognizes it and loads its share; a failure on one process is raised on all."""
        found = recognize(storage, path, self.setup.plugins.formats(), any_name=True)
        error: BaseException | None = None
        trainer_state: dict[str, Any] = {}
        try:
            if found is None:  # seen by the coordinator a moment ago
                raise CheckpointNotFoundError(f"{path}: no format recognizes it on rank {strategy.rank}")
            trainer_state = found.resume(state, strategy, component)
        except Exception as exc:
            error = exc
        strategy.agree(error, f"resume: loading {path}", layout.parse_step(layout.basename(path)))
        assert found is not None
        self.trainer_state = trainer_state
        self.path = path
        log.info("roll-ckpt: resumed step %s from %s, a %s (read as it is: no checksums to verify, nothing in it "
                 "modified)", trainer_state.get("step"), path, found.title)
        self.setup.plugins.hook.roll_ckpt_load(path=path, state=state)
        return int(trainer_state["step"])

    def _part_to_load(self, storage: Storage, path: str) -> tuple[str, Manifest | None]:
        """The folder this manager loads from ``path``: the checkpoint itself, with the manifest
        just read (verified next, not read again), or its component's part (``None``: its own
        manifest is read when it is verified)."""
        component = self.setup.component
        top = read_manifest(storage, path)
        parts = top.parts
        if component is None:
            if parts or top.component:
                what = f"made of components ({', '.join(sorted(parts))})" if parts else \
                    f"the part of component '{top.component}' of a step"
                raise RollCkptError(f"{path} is {what}; resume it with CheckpointManager(config, component=...) "
                                    "and checkpoint_config.components")
            return path, top
        if top.component == component:
            return path, top  # the part's own folder, named explicitly
        if top.component is not None:
            raise RollCkptError(f"{path} is the part of component '{top.component}', not of '{component}'; "
                                "resume from the step's folder or from this component's part")
        if not parts:
            raise RollCkptError(f"{path} was saved without components; resume it with a manager created "
                                "without component=")
        return open_part(storage, path, top, component), None


def only_model(state: MutableMapping[str, Any], manifest: Manifest, path: str) -> MutableMapping[str, Any]:
    """What a resume loads of ``state``: all of it; from a ``save_only_model`` checkpoint the
    module alone, the rest starting afresh (said in a warning)."""
    key = manifest.extra.get("save_only_model")
    if not key:
        return state
    if key not in state:
        raise RollCkptError(f"{path} was saved with save_only_model and holds the weights of state['{key}'] only; "
                            f"this state has no '{key}' ({', '.join(repr(k) for k in state)}): resume it into a "
                            "state with the same model key")
    fresh = [k for k in state if k != key]
    warnings.warn(f"roll-ckpt: {path} was saved with save_only_model: it holds the weights of state['{key}'] and the "
                  f"trainer state only; {', '.join(f'state[{k!r}]' for k in fresh) or 'nothing else'} start"
                  f"{'' if len(fresh) > 1 else 's'} fresh (the optimizer's moments, the scheduler, the data "
                  "position)", stacklevel=3)
    return {key: state[key]}

