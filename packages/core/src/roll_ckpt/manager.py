"""CheckpointManager: the public entry point for saving and resuming a training job."""

from __future__ import annotations

import concurrent.futures as cf
import errno
import json
import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping, MutableMapping

from . import commit as commit_mod
from . import layout
from .config import Config, load_config
from .errors import (CheckpointNotFoundError, RollCkptError, carried, SaveError, StorageError,
                     StorageFullError)
from .manifest import FileEntry, Manifest
from .digest import hash_bytes
from .plugins import Plugins, get_plugins
from .progress import Progress
from .retention import apply_retention, note_open_run
from .savectx import CommitInfo, SaveContext
from .storage import Storage
from .verify import read_manifest, verify

__all__ = ["CheckpointManager", "SaveStats", "open_storage", "TRAINER_STATE", "DCP_DIR"]

log = logging.getLogger("roll_ckpt")

TRAINER_STATE = "trainer_state.json"
DCP_DIR = "dcp"


@dataclass(frozen=True)
class SaveStats:
    """What one save cost; ``manager.last_save`` holds the latest."""

    step: int
    path: str
    is_async: bool
    blocked_s: float
    """Seconds the training loop waited inside ``save``."""
    total_s: float
    """Seconds from the call until the checkpoint was committed."""
    bytes: int
    bytes_copied: int
    """Bytes copied while staging (0 when every tensor was staged without a copy)."""
    policies: Mapping[str, int] = field(default_factory=dict)
    """How many tensors each staging policy took (``regular``, ``zero_copy``...)."""


def open_storage(plugins: Plugins, type_: str, url: str, options: Mapping[str, Any]) -> Storage:
    return plugins.backend(type_).factory(url, dict(options))


def _disk_full(exc: BaseException) -> bool:
    return any((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
               or "No space left on device" in str(e) for e in carried(exc))


def _checked_while_loading(name: str) -> bool:
    # DCP's data files are checked by SafeReader as they are read; anything else up front.
    return name.startswith(f"{DCP_DIR}/") and name != f"{DCP_DIR}/.metadata"


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _plugin_versions(plugins: Plugins) -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("roll-ckpt-core", "torch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    for dist in sorted(set(plugins.distributions())):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _check_component(component: str | None, cc: Any) -> str | None:
    from .errors import ConfigError

    names = cc.components or ()
    if component is None:
        if names:
            raise ConfigError("checkpoint_config.components", "lists the parts of each step, so every manager "
                              "saves one of them", list(names),
                              "CheckpointManager(config, component=<one of them>)")
        return None
    if not names:
        raise ConfigError("checkpoint_config.components", f"is not set, but a manager was created for "
                          f"component '{component}'", None,
                          f"the list of every component that saves a step, e.g. [{component}, ...]")
    if component not in names:
        raise ConfigError("checkpoint_config.components", f"does not list component '{component}'",
                          list(names), "one of the listed names")
    if not cc.run_name:
        raise ConfigError("checkpoint_config.run_name", "is needed with components: every component of one "
                          "launch must write the same run folder", None,
                          "a name the driver picks once per launch (roll_ckpt.new_run_name()) and gives to "
                          "every component, e.g. run_name: ${env:ROLL_CKPT_RUN_NAME}")
    return component


def _read_resume_record(storage: Storage, path: str) -> list[tuple[str, bool]] | None:
    """The resume candidates another component of this launch chose (``None``: none yet)."""
    try:
        with storage.open_read(path) as f:
            body = json.loads(f.read().decode())
        return [(str(p), bool(b)) for p, b in body["candidates"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RollCkptError(f"{path} is damaged ({exc}): it records where this launch's components resume "
                            "from; remove it and restart every component") from None


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
        self.config = config
        cc = config.checkpoint_config
        self.component = _check_component(component, cc)
        self.plugins = plugins or get_plugins()
        self.storage = open_storage(self.plugins, cc.type, cc.output_dir, cc.storage_options)
        self.root = self.storage.root
        self.quiet = quiet
        self._strategy: Any = None
        self._run_dir: str | None = None
        self._token = ""
        self._executor: cf.ThreadPoolExecutor | None = None
        self._inflight: cf.Future[SaveStats] | None = None
        self._committed_steps: set[int] = set()
        self._closed = False
        self.last_save: SaveStats | None = None
        self.trainer_state: dict[str, Any] = {}
        """The ``trainer_state.json`` of the checkpoint resumed from (empty on a fresh start)."""
        self.resumed_from: str | None = None
        # -- backup and space (checkpoint_config.backup; the check before each save)
        self.resumed_from_backup = False
        """True when ``resume`` took its checkpoint from ``checkpoint_config.backup``."""
        self._local_lock = threading.Lock()  # retention and keep_local remove local checkpoints
        self._space: Any = None
        self._replicator: Any = None
        self.backup_storage: Storage | None = None
        """The backup location's storage (``checkpoint_config.backup``), or ``None``."""
        if cc.backup is not None:
            self.backup_storage = open_storage(self.plugins, cc.backup.type, cc.backup.output_dir,
                                               cc.backup.storage_options)

    @classmethod
    def from_config(cls, config: Config | Mapping[str, Any] | str, **kwargs: Any) -> "CheckpointManager":
        if not isinstance(config, Config):
            config = load_config(config)
        return cls(config, **kwargs)

    # ------------------------------------------------------------------ strategy

    @property
    def strategy(self) -> Any:
        """The strategy in use; chosen from the state at the first ``resume``/``save``."""
        if self._strategy is None:
            raise RollCkptError("the strategy is chosen from the state: call bind(state), resume(state) "
                                "or save(step, state) first")
        return self._strategy

    def bind(self, state: Mapping[str, Any]) -> Any:
        """Choose the strategy for ``state`` (done by the first resume/save)."""
        if self._strategy is not None:
            return self._strategy
        forced = self.config.strategy_config.strategy_name
        if forced:
            record = self.plugins.strategy(forced)
        else:
            fitting = [r for r in self.plugins.strategies().values() if r.applies(state)]
            if not fitting:
                raise RollCkptError("no installed strategy can save this state; `roll-ckpt plugins` lists them")
            record = max(fitting, key=lambda r: r.priority)
        self._strategy = record.factory(self.config, self.plugins)
        self._token = self._strategy.broadcast(uuid.uuid4().hex[:12])
        return self._strategy

    @property
    def is_coordinator(self) -> bool:
        return self._strategy is None or self._strategy.is_coordinator

    def _progress(self, desc: str, total: int | None = None) -> Progress:
        return Progress(desc, total, enabled=not self.quiet and self.is_coordinator)

    # ------------------------------------------------------------------ run folder

    def _ensure_run_dir(self) -> str:
        if self._run_dir is not None:
            return self._run_dir
        name = ""
        if self.is_coordinator:
            try:
                self.storage.makedirs(self.root)
                commit_mod.clean_stale(self.storage, self.root)
                name = self._claim_run_folder() if self.config.checkpoint_config.timestamp_subdir else ""
            except OSError as exc:
                name = f"{'!full!' if _disk_full(exc) else '!'}{exc}"
            except RollCkptError as exc:
                name = f"!ours!{exc}"
        name = self._strategy.broadcast(name)
        if name.startswith("!ours!"):
            raise RollCkptError(name[6:])
        if name.startswith("!full!"):
            raise StorageFullError(f"no space left under checkpoint_config.output_dir "
                                   f"{self.config.checkpoint_config.output_dir}: {name[6:]}; free space "
                                   "there; training can go on and the next save will try again")
        if name.startswith("!"):
            raise StorageError(f"cannot write under checkpoint_config.output_dir {self.config.checkpoint_config.output_dir}: "
                               f"{name[1:]}; choose a writable location")
        self._run_dir = self.storage.join(self.root, name) if name else self.root
        if name:
            note_open_run(self._run_dir, self)  # retention by other managers leaves it alone
        return self._run_dir

    def _claim_run_folder(self) -> str:
        wanted = self.config.checkpoint_config.run_name
        if wanted:  # shared by the job's components: whoever comes first records it
            path = self.storage.join(self.root, wanted)
            done = [r.step for r in layout.committed(self.storage, path)] \
                if self.component and self.storage.isdir(path) else []
            if done:
                # No step of a launch is whole before every component has resumed, so a whole
                # step here was written by an earlier launch: parts of the two would mix.
                raise RollCkptError(
                    f"checkpoint_config.run_name '{wanted}' was used by an earlier launch (it holds committed "
                    f"step {max(done)}); each launch needs a new one, picked once by the driver "
                    "(roll_ckpt.new_run_name()) and given to every component. A component that died cannot "
                    "rejoin a running launch: restart every component together")
            self.storage.makedirs(path)
            record = dict(commit_mod.owner_record(), created=_utc_now(), exp_name=self.config.exp_name)
            try:
                self.storage.write_create(self.storage.join(path, layout.RUN_RECORD), json.dumps(record).encode())
            except FileExistsError:
                pass
            return wanted
        now = datetime.now()
        for attempt in range(100):
            name = layout.run_name(now, attempt)
            path = self.storage.join(self.root, name)
            try:
                self.storage.makedirs(path)
                record = dict(commit_mod.owner_record(), created=_utc_now(), exp_name=self.config.exp_name)
                self.storage.write_create(self.storage.join(path, layout.RUN_RECORD), json.dumps(record).encode())
                return name
            except FileExistsError:
                continue
        raise StorageError(f"could not create a run folder under {self.root}")

    @property
    def run_dir(self) -> str | None:
        """This run's folder (created by the first save)."""
        return self._run_dir

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

        With ``strategy_config.async_save_ckpt`` this returns once the state is staged
        and the write goes on in the background; ``final=True`` always returns after
        the checkpoint is committed. ``metadata`` (JSON values) goes to
        ``trainer_state.json`` under ``user``. Saving a step this manager has already
        committed does nothing.
        """
        t0 = time.perf_counter()
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise RollCkptError(f"step must be an integer >= 0, got {step!r}")
        strategy = self.bind(state)
        self.wait()  # one save in flight at most; raises the previous one's error
        run_dir = self._ensure_run_dir()
        final_path = self.storage.join(run_dir, layout.checkpoint_name(step))
        if self.component:
            final_path = self.storage.join(final_path, self.component)
        if step in self._committed_steps:
            return final_path
        is_async = self.config.strategy_config.async_save_ckpt and not final
        ctx = SaveContext(step=step, path=final_path, is_async=is_async, rank=strategy.rank,
                          world_size=strategy.world_size, strategy=strategy)
        user = dict(metadata or {})
        try:
            json.dumps(user)
        except TypeError as exc:
            raise RollCkptError(f"save(metadata=...) must hold JSON values: {exc}") from None
        self.plugins.hook.roll_ckpt_save(save=ctx)
        sd = strategy.state_dict(state)
        refusal = self._check_space(sd, ctx, user) if strategy.is_coordinator else None
        if refusal is not None:  # refused before anything is staged or written
            self._write_and_commit(sd, ctx, user, t0, refuse=refusal)  # raises it, on every rank
        if is_async:
            staged = strategy.stage(sd, ctx)
            ctx.blocked_s = time.perf_counter() - t0
            if self._executor is None:
                self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="roll-ckpt-save")
            self._inflight = self._executor.submit(self._write_and_commit, staged, ctx, user, t0)
        else:
            self.last_save = self._write_and_commit(sd, ctx, user, t0)
        return final_path

    def _write_and_commit(self, sd: dict[str, Any], ctx: SaveContext, user: dict[str, Any], t0: float,
                          refuse: BaseException | None = None) -> SaveStats:
        strategy = self._strategy
        storage = self.storage
        pending = commit_mod.plan(storage, ctx.path, f"{self._token}")
        error: BaseException | None = None
        begun = False
        try:
            if strategy.is_coordinator and refuse is None:
                try:
                    if self.component:
                        self._check_part_free(ctx)
                    commit_mod.begin(storage, pending)
                    begun = True
                except Exception as exc:  # refused like a save that does not fit (below)
                    refuse = exc
            # A refused save (no space, a part already there, an unwritable folder) fails in
            # DCP's planning step, before any data is written, and DCP carries the refusal to
            # every rank: none is left waiting in a collective for a coordinator that gave up.
            target = storage if refuse is None else self._refusing(refuse)
            data_dir = strategy.data_dir
            with self._progress(f"save step {ctx.step}") as progress:
                digests = strategy.write(sd, target, storage.join(pending.write_path, data_dir), progress)
            total = 0
            if strategy.is_coordinator:
                files = {f"{data_dir}/{name}": FileEntry(size, digest) for name, (size, digest) in digests.items()}
                ts = self._trainer_state(ctx, user)
                with storage.open_write(storage.join(pending.write_path, TRAINER_STATE)) as f:
                    f.write(ts)
                size, digest = hash_bytes(ts)
                files[TRAINER_STATE] = FileEntry(size, digest)
                manifest = Manifest(step=ctx.step, files=files, created=_utc_now(),
                                    world_size=strategy.world_size, component=self.component,
                                    plugins=_plugin_versions(self.plugins), extra={"strategy": strategy.name})
                commit_mod.commit(storage, pending, manifest.to_bytes(), [data_dir])
                total = sum(e.size for e in files.values())
                self._committed_steps.add(ctx.step)
                self._announce(ctx.path, manifest, self.component)
                if self._commit_step(ctx):  # the whole checkpoint, or the last part of the step
                    self._after_commit(self._step_path(ctx.path), ctx.step)
            else:
                self._committed_steps.add(ctx.step)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = exc
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            try:
                if begun:
                    commit_mod.abort(storage, pending)
                elif strategy.is_coordinator and storage.atomic_rename:
                    # Refused before it began: the other ranks may have made this save's own
                    # temporary folder in DCP's planning step (in place, it is not ours to remove).
                    storage.remove_tree(pending.write_path)
            except Exception:
                log.warning("roll-ckpt: could not clean up %s", pending.write_path, exc_info=True)
            raise self._save_error(ctx, exc) from exc
        finally:
            ctx.run_finished_callbacks()
            self.plugins.hook.roll_ckpt_save_finished(save=ctx, error=error)
        stats = SaveStats(step=ctx.step, path=ctx.path, is_async=ctx.is_async,
                          blocked_s=ctx.blocked_s if ctx.is_async else time.perf_counter() - t0,
                          total_s=time.perf_counter() - t0, bytes=total, bytes_copied=ctx.bytes_copied,
                          policies=dict(Counter(ctx.staging.values())))
        self.last_save = stats
        return stats

    def _step_path(self, path: str) -> str:
        """The checkpoint folder of ``path`` (a part's parent with components)."""
        return path.rstrip("/").rsplit("/", 1)[0] if self.component else path

    def _check_part_free(self, ctx: SaveContext) -> None:
        from .manifest import MANIFEST_NAME

        step_path = self._step_path(ctx.path)
        if self.storage.exists(self.storage.join(step_path, MANIFEST_NAME)):
            raise RollCkptError(f"step {ctx.step} is already committed at {step_path}; a part cannot be added "
                                "to it. Save another step, or delete it with 'roll-ckpt prune'")
        if self.storage.exists(self.storage.join(ctx.path, MANIFEST_NAME)):
            raise RollCkptError(
                f"{ctx.path} is already committed: by an earlier launch that used the same "
                "checkpoint_config.run_name (each launch needs a new one, roll_ckpt.new_run_name(), picked "
                "once by the driver), or by a second manager for component "
                f"'{self.component}' in this launch")

    def _commit_step(self, ctx: SaveContext) -> bool:
        """True when the step is committed by this process: always without components;
        with them, when this part was the last one and this process's create won."""
        if not self.component:
            return True
        from .components import try_complete

        step_path = self._step_path(ctx.path)
        try:
            manifest = try_complete(self.storage, step_path, ctx.step, self.config.checkpoint_config.components or ())
        except Exception as exc:  # this part is committed; the step can be committed later
            log.warning("roll-ckpt: the part %s is committed, but committing step %d failed (%s: %s); the "
                        "next resume commits the step once every part is there", ctx.path, ctx.step,
                        type(exc).__name__, exc)
            return False
        if manifest is None:
            return False
        self._announce(step_path, manifest)
        log.info("roll-ckpt: step %d committed (every component's part is in %s)", ctx.step, step_path)
        return True

    def _announce(self, path: str, manifest: Manifest, component: str | None = None) -> None:
        """``roll_ckpt_on_commit`` for a checkpoint, a step or a part just committed here."""
        self.plugins.hook.roll_ckpt_on_commit(info=CommitInfo(
            path=path, step=manifest.step, url=self.storage.url, manifest=json.loads(manifest.to_bytes()),
            component=component))

    def _after_commit(self, path: str, step: int) -> None:
        """Retention and replication for the checkpoint just committed at ``path``."""
        keep = self.config.checkpoint_config.max_ckpt_to_keep
        if keep:
            with self._local_lock:
                removed = apply_retention(self.storage, self.root, keep, protect=self._protected(path),
                                          own_run=self._run_dir)
            for removed_path in removed:
                log.info("roll-ckpt: retention removed %s", removed_path)
        self._replicate(path, step)

    def _save_error(self, ctx: SaveContext, exc: BaseException) -> RollCkptError:
        from .space import wrapped_roll_error

        ours = wrapped_roll_error(exc)  # e.g. the space check's refusal, carried by DCP from the coordinator
        if ours is not None:
            return ours
        where = f"checkpoint-{ctx.step} under {self.storage.url}"
        if _disk_full(exc):
            return StorageFullError(
                f"no space left while writing {where}; nothing of it was committed and earlier "
                "checkpoints are intact. Free space or lower checkpoint_config.max_ckpt_to_keep; "
                "training can go on and the next save will try again")
        cause = exc
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:  # DCP's CheckpointException: what a rank hit, not its traceback
            first = failures[min(failures)]
            cause = first[0] if isinstance(first, tuple) and first else first
        if isinstance(cause, PermissionError):
            return StorageError(f"permission denied while writing {where}: {cause}; choose a writable "
                                "checkpoint_config.output_dir")
        if isinstance(exc, RollCkptError):
            return exc
        return SaveError(f"saving {where} failed ({type(cause).__name__}: {cause}); nothing of it was "
                         "committed and earlier checkpoints are intact")

    def _trainer_state(self, ctx: SaveContext, user: dict[str, Any]) -> bytes:
        body = {
            "step": ctx.step,
            "time": _utc_now(),
            "timestamp": time.time(),
            "world_size": ctx.world_size,
            "strategy": self._strategy.name,
            "exp_name": self.config.exp_name,
            "component": self.component,
            "resumed_from": self.resumed_from,
            "user": user,
        }
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    def wait(self) -> SaveStats | None:
        """Wait for the save in flight; raise its error if it failed."""
        fut, self._inflight = self._inflight, None
        if fut is None:
            return None
        try:
            stats = fut.result()
        except RollCkptError:
            raise
        except BaseException as exc:
            raise SaveError(f"the background save failed: {type(exc).__name__}: {exc}") from exc
        self.last_save = stats
        return stats

    # ------------------------------------------------------------------ resuming

    def resolve_resume(self, target: str | None = None) -> tuple[Storage, str] | None:
        """The storage and path to resume from, or ``None`` for a fresh start.

        ``"latest"`` is the newest committed checkpoint under ``output_dir`` and, with
        ``checkpoint_config.backup``, at the backup location; when both hold it, the local
        copy (``resume`` falls back to the replica if the local copy is damaged).
        """
        candidates = self._resume_candidates(target)
        return (candidates[0][0], candidates[0][1]) if candidates else None

    def _resume_candidates(self, target: str | None) -> list[tuple[Storage, str, bool]]:
        """``(storage, path, from_backup)`` to try in turn: the newest checkpoint, local copy first."""
        target = self.config.resume_target if target is None else target
        if target is None:
            return []
        if target != "latest":
            cc = self.config.checkpoint_config
            storage = open_storage(self.plugins, cc.type, target, cc.storage_options)
            return [(storage, storage.root, False)]
        local = layout.latest(self.storage, self.root)
        remote = None
        backup = self.backup_storage
        if backup is not None:
            try:
                remote = layout.latest(backup, backup.root)
            except Exception as exc:  # an unreachable backup must not stop a local resume
                log.warning("roll-ckpt: cannot list the backup at %s (%s); only local checkpoints are "
                            "considered", backup.url, exc)
        if local is None and remote is None:
            where = self.storage.url + (f" nor at the backup {backup.url}" if backup is not None else "")
            log.info("roll-ckpt: no committed checkpoint under %s; starting fresh", where)
            return []
        if remote is None or (local is not None and local.order > remote.order):
            return [(self.storage, local.path, False)]
        if local is None or remote.order > local.order:
            return [(backup, remote.path, True)]
        return [(self.storage, local.path, False), (backup, remote.path, True)]

    def _agreed_candidates(self, target: str | None, strategy: Any) -> list[tuple[Storage, str, bool]]:
        """Where to resume from: the same on every rank and in every component of a launch.

        Ranks that listed the folders themselves could see different steps (one may be
        committed meanwhile), so the coordinator decides and broadcasts its choice. With
        components, the first component to resume records its choice in the run folder
        (``.resume.json``, create-only) and the others take it: every component of a launch
        starts from the same step, even if a straggler of an earlier launch commits one
        while they start.
        """
        target = self.config.resume_target if target is None else target
        if target != "latest":
            return self._resume_candidates(target)
        mine: list[tuple[str, bool]] | str = []
        if strategy.is_coordinator:
            try:
                mine = self._pick_latest()
            except RollCkptError as exc:
                mine = str(exc)
            except Exception as exc:  # sent to every rank: none may stay waiting in the broadcast
                mine = f"cannot find the checkpoint to resume from under {self.storage.url}: " \
                       f"{type(exc).__name__}: {exc}"
        agreed = strategy.broadcast(mine)
        if isinstance(agreed, str):
            raise RollCkptError(agreed)
        return [(self.backup_storage if from_backup else self.storage, path, from_backup)  # type: ignore[misc]
                for path, from_backup in agreed]

    def _pick_latest(self) -> list[tuple[str, bool]]:
        """The coordinator's ``(path, from_backup)`` candidates for ``latest``."""
        if not self.component:
            return [(path, from_backup) for _, path, from_backup in self._resume_candidates("latest")]
        from .components import complete_pending

        record = self.storage.join(self._ensure_run_dir(), layout.RESUME_RECORD)
        chosen = _read_resume_record(self.storage, record)
        if chosen is not None:
            return chosen
        for path, manifest in complete_pending(self.storage, self.root, self.config.checkpoint_config.components or ()):
            log.info("roll-ckpt: committed %s (its parts were all committed)", path)
            self._announce(path, manifest)
        mine = [(path, from_backup) for _, path, from_backup in self._resume_candidates("latest")]
        body = {"candidates": mine, "component": self.component, "time": _utc_now()}
        try:
            self.storage.write_create(record, json.dumps(body).encode())
        except FileExistsError:  # another component chose first
            chosen = _read_resume_record(self.storage, record)
            if chosen is not None:
                return chosen
        return mine

    def resume(self, state: MutableMapping[str, Any], target: str | None = None) -> int:
        """Restore ``state`` from the configured checkpoint; return its step (0: fresh start).

        The checkpoint is verified (sizes and checksums) before torch reads any of it;
        a damaged or uncommitted one is refused with an error naming the file. With
        ``checkpoint_config.backup``, ``"latest"`` is the newest committed checkpoint of
        both locations; a local copy that is gone or damaged is replaced by its replica
        (verified the same way; a warning names the damaged file).
        """
        self._check_open()
        strategy = self.bind(state)
        if self.component:
            self._ensure_run_dir()  # refuses a run_name an earlier launch used, before anything loads
        candidates = self._agreed_candidates(target, strategy)
        first_error: RollCkptError | None = None
        for i, (storage, path, from_backup) in enumerate(candidates):
            try:
                step = self._resume_from(state, storage, path)
            except RollCkptError as exc:  # raised alike on every rank (verification is broadcast)
                if i + 1 < len(candidates):
                    from .replication import replica_url

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
                from .replication import replica_url

                self.resumed_from = replica_url(storage, path)
                log.info("roll-ckpt: resumed step %d from the backup %s", step, self.resumed_from)
            return step
        return 0

    def _resume_from(self, state: MutableMapping[str, Any], storage: Storage, path: str) -> int:
        """Verify the checkpoint at ``path``, load it into ``state``; return its step."""
        strategy = self._strategy
        problem: RollCkptError | None = None
        manifest = None
        part = path
        if strategy.is_coordinator:
            try:
                part = self._part_to_load(storage, path)
                # DCP's data files are checked while they are read, once, by the rank that
                # reads them (before anything is deserialized); everything else here.
                with self._progress("verify") as progress:
                    manifest = verify(storage, part, on_bytes=progress, defer=_checked_while_loading).manifest
                self._check_written_by(manifest, part, strategy)
            except RollCkptError as exc:
                problem = exc
        message, part = strategy.broadcast((str(problem) if problem else "", part))
        if problem is not None:
            raise problem
        if message:
            raise RollCkptError(message)
        if manifest is None:
            manifest = read_manifest(storage, part)
        data_dir = strategy.data_dir
        files = {name[len(data_dir) + 1:]: entry for name, entry in manifest.files.items()
                 if name.startswith(f"{data_dir}/")}
        with storage.open_read(storage.join(part, TRAINER_STATE)) as f:
            trainer_state = json.loads(f.read().decode())
        with self._progress(f"load step {trainer_state.get('step')}") as progress:
            strategy.load(state, storage, storage.join(part, data_dir), progress, files=files, checkpoint=part)
        self.trainer_state = trainer_state
        self.resumed_from = storage.url if storage is not self.storage else path
        self.plugins.hook.roll_ckpt_load(path=path, state=state)
        return int(trainer_state["step"])

    def _part_to_load(self, storage: Storage, path: str) -> str:
        """The folder this manager loads from ``path``: the checkpoint itself, or its component's part."""
        from .components import components_of, open_part

        top = read_manifest(storage, path)
        parts = components_of(top)
        if self.component is None:
            if parts or top.component:
                what = f"made of components ({', '.join(sorted(parts))})" if parts else \
                    f"the part of component '{top.component}' of a step"
                raise RollCkptError(f"{path} is {what}; resume it with CheckpointManager(config, component=...) "
                                    "and checkpoint_config.components")
            return path
        if top.component == self.component:
            return path  # the part's own folder, named explicitly
        if top.component is not None:
            raise RollCkptError(f"{path} is the part of component '{top.component}', not of '{self.component}'; "
                                "resume from the step's folder or from this component's part")
        if not parts:
            raise RollCkptError(f"{path} was saved without components; resume it with a manager created "
                                "without component=")
        return open_part(storage, path, top, self.component)

    @staticmethod
    def _check_written_by(manifest: Manifest, path: str, strategy: Any) -> None:
        if not any(name.startswith(f"{strategy.data_dir}/") for name in manifest.files):
            raise RollCkptError(
                f"{path} was written by the '{manifest.extra.get('strategy')}' strategy and holds no "
                f"'{strategy.data_dir}/' folder, which the '{strategy.name}' strategy chosen for this state "
                "loads; resume it with the same kind of state it was saved from")

    # ------------------------------------------------------------------ backup and space

    def _check_space(self, sd: dict[str, Any], ctx: SaveContext, user: dict[str, Any]) -> BaseException | None:
        """The coordinator's check that ``checkpoint-<step>`` fits; the refusal to raise, or ``None``."""
        from .space import SpaceGuard, committed_sizes

        if self._space is None:
            self._space = SpaceGuard(self.storage, self.root, self.config.checkpoint_config.output_dir)
        if not self._space.can_tell(self._run_dir or self.root):
            return None  # an object store: nothing to check, nothing to estimate
        estimate = self._strategy.estimate(sd, user)
        keep = self.config.checkpoint_config.max_ckpt_to_keep

        def retention(k: int) -> list[str]:
            with self._local_lock:
                return apply_retention(self.storage, self.root, k, protect=self._protected(ctx.path),
                                       own_run=self._run_dir)

        return self._space.check(estimate, path=self._run_dir or self.root, step=ctx.step, keep=keep,
                                 retention=retention,
                                 sizes=lambda: committed_sizes(self.storage, self.root, self._run_dir))

    @property
    def space_estimate(self) -> Any:
        """The size estimated for the latest save (a ``SpaceEstimate``; ``None`` before the first)."""
        return None if self._space is None else self._space.last_estimate

    def _refusing(self, error: BaseException) -> Storage:
        from .space import RefusingStorage

        return RefusingStorage(self.storage, error)  # type: ignore[return-value]

    def _protected(self, path: str) -> set[str]:
        """Local checkpoints retention must leave alone: the one just written, the one being replicated."""
        current = self._replicator.current if self._replicator is not None else None
        return {path} | ({current} if current else set())

    def _replicate(self, path: str, step: int) -> None:
        """Queue a committed checkpoint for the backup (coordinator; starts the thread once)."""
        if self.backup_storage is None:
            return
        if self._replicator is None:
            from .replication import Replicator

            self._replicator = Replicator(self.storage, self.root, self.backup_storage,
                                          self.config.checkpoint_config.backup, lock=self._local_lock,
                                          own_run=lambda: self._run_dir)
            self._replicator.start(catch_up=True)
        self._replicator.submit(path, step)

    @property
    def backup_status(self) -> Any:
        """Where replication stands (a ``BackupStatus``), or ``None`` without ``checkpoint_config.backup``.

        Per checkpoint: ``queued``, ``copying``, ``committed``, ``failed``, ``interrupted``
        or ``skipped``, with attempts and the last error.
        """
        if self.backup_storage is None:
            return None
        if self._replicator is None:
            from .replication import BackupStatus

            return BackupStatus(self.backup_storage.url, (), False)
        return self._replicator.status

    def wait_for_backup(self, timeout: float | None = None) -> Any:
        """Block until every checkpoint handed to replication is copied (or failed for good).

        Waits for the save in flight first. Returns :attr:`backup_status`; ``timeout``
        (seconds) bounds the wait. Training never needs to call this: ``close()`` waits
        at most ``checkpoint_config.backup.max_wait_s``.
        """
        self.wait()
        if self._replicator is not None:
            self._replicator.wait(timeout)
        return self.backup_status

    def _close_backup(self) -> BaseException | None:
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
            self.wait()
        finally:
            try:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                if self._strategy is not None:
                    self._strategy.close()
            finally:
                backup_error = self._close_backup()
        if backup_error is not None:
            raise backup_error

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
