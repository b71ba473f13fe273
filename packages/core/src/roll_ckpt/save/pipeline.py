"""The saver: state dict → space check → staging → write → commit → retention, and what a
failed save raises (one module: a save read in one sitting).

::

    SavePipeline.save            caller's thread
        strategy.state_dict          the live state dict (without the HF module's weights
                                     when only the HF files are kept)
        SpaceGuard.check             coordinator: does it fit?
        stage_state_dict             each tensor captured by its staging policy
        refuse                       a rank that failed so far meets the others at their
                                     first agreement, which raises its error everywhere
    SavePipeline.write_and_commit  caller's thread, or the background thread when async
        _begin                       coordinator: owner marker, data folder; every rank agrees
        StagedSave.local_unit        the fast tier's unit of the same staged state, if due
        io.write                     the strategy's I/O (DCPIO: DCP's format), every file hashed while written
        Committer.commit             coordinator: the manifest's parts (HF files), manifest last (rename / create-only),
                                     then the commit hooks: the step of components, retention, replication
        strategy.agree               every rank: the commit's outcome
      _failed                      a failure of either: what was written removed, the
                                     error one roll-ckpt error (save_error, below)

One save is in flight at most: a save issued while an asynchronous one is still writing
waits for it first (and raises its error, if it failed).

``checkpoint_config.on_save_error: warn`` makes a failed periodic save (a storage error:
disk full, store unreachable, permission denied) a logged, counted event wherever it
surfaces (the save itself, or the next call that waits for a background one); nothing of
it is committed and the next save tries again. Final saves always raise.

A save can fail on any rank at any step; whatever it met (an ``OSError`` of the disk,
DCP's ``CheckpointException`` carrying another rank's error, a refusal of ours) becomes
one roll-ckpt error that says which checkpoint, what happened and what to do
(:func:`save_error`); :class:`WarnMode` is ``on_save_error``. What one save cost is a
:class:`SaveStats` (``manager.stats.last``).
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import functools
import json
import logging
import posixpath
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NoReturn, Sequence

from ..contracts import CountsNetwork, NetworkCounts, SaveContext, Storage, StrategyIO
from ..errors import RollCkptError, SaveError, StorageError, StorageFullError, carried_roll_error, disk_full
from ..format import layout
from ..format.commit import Leftovers, PendingCheckpoint, pending_checkpoint, utc_now
from ..format.components import check_part_free
from ..format.manifest import hash_bytes, BESIDE_KEY, FileEntry, Manifest
from ..format.layout import TRAINER_STATE
from ..hf.export import HFPart
from ..runtime.background import lower_priority
from ..runtime.collector import CollectorPause
from ..runtime.units import human_bytes
from ..tiers.retention import Retention
from ..tiers.space import SpaceGuard
from ..tiers.run import Run, Setup
from .staging import stage_state_dict

__all__ = ["SavePipeline", "StagedSave", "SaveStats", "Committer", "ManifestPart", "WarnMode", "save_error",
           "agreed_failure", "check_step", "read_counts", "report_save", "check_objects"]

log = logging.getLogger("roll_ckpt")


# --------------------------------------------------------------------------- what one save cost


@dataclass(frozen=True)
class SaveStats:
    """What one save cost; ``manager.stats.last`` holds the latest."""

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
    bytes_allocated: int = 0
    """Staging memory allocated inside the call (its page faults in the blocked time): the first
    save, or a save nobody announced (:meth:`~roll_ckpt.CheckpointManager.prepare_save`) while
    the buffers' memory was freed between saves; 0 when they were ready."""
    policies: Mapping[str, int] = field(default_factory=dict)
    """How many tensors each staging policy took (``regular``, ``zero_copy``...)."""
    network: NetworkCounts | None = None
    """Network faults this process met while writing and committing (``None``: not a networked store)."""
    bytes_taken_over: int = 0
    """Of :attr:`bytes`, those taken over unchanged from the newest committed checkpoint
    (incremental saves, :mod:`roll_ckpt.dcp.writer`): linked or copied by the storage,
    not written. Like :attr:`bytes`, counted on the coordinator for every process."""

    @property
    def bytes_written(self) -> int:
        return self.bytes - self.bytes_taken_over


def model_only(state: Mapping[str, Any], hf: "HFPart | None") -> Mapping[str, Any]:
    """What a save writes of ``state`` with ``save_only_model``: the module alone."""
    import torch

    key = hf.config.key if hf is not None else "model"
    if not isinstance(state.get(key), torch.nn.Module):
        raise RollCkptError(f"strategy_config.save_only_model: state['{key}'] is not a torch.nn.Module (the state "
                            f"holds {', '.join(repr(k) for k in state) or 'nothing'}); set "
                            "checkpoint_config.hf_weights.key to the model's state key")
    return {key: state[key]}


# --------------------------------------------------------------------------- what the network did to a save
#
# A networked backend counts the faults it met (``Storage.network_counts()``; the S3 backend's
# policy is in ``roll_ckpt_fs.network``). The saver reads the counts when a save starts and
# when it ends: the difference is ``SaveStats.network``, and a save that met any fault says so
# in one WARNING line (retried requests are otherwise silent). Before the manifest of an
# object-store checkpoint is written, every object is checked to be there with the size the
# writer wrote (:func:`check_objects`): a checkpoint with a missing or short object is never
# committed.


def read_counts(storage: Storage) -> NetworkCounts | None:
    """The backend's fault counts now (``None``: it keeps none, e.g. a local disk)."""
    return storage.network_counts() if isinstance(storage, CountsNetwork) else None


def report_save(what: str, rank: int, counts: NetworkCounts | None, *, failed: bool = False) -> None:
    """One line for a save that met network faults (nothing when it met none)."""
    if counts is None or not counts.faults:
        return
    outcome = "failed" if failed else "committed"
    log.warning("roll-ckpt: %s %s on rank %d after %s", what, outcome, rank, counts.describe())


def check_objects(storage: Storage, folder: str, sizes: Mapping[str, int]) -> None:
    """Every file of ``sizes`` (relative to ``folder``) is listed there with that size, or a
    :class:`SaveError` names the first that is not (nothing is committed then)."""
    listed: dict[str, dict[str, int]] = {}
    for name, size in sorted(sizes.items()):
        sub = posixpath.dirname(name)
        if sub not in listed:
            where = storage.join(folder, sub) if sub else folder
            listed[sub] = {e.name: e.size for e in storage.list(where) if not e.is_dir}
        found = listed[sub].get(posixpath.basename(name))
        if found != size:
            state = "is missing" if found is None else f"holds {found} bytes"
            raise SaveError(f"{storage.join(folder, name)} {state}, the writer wrote {size}: the upload did not "
                            "complete; nothing of this checkpoint was committed and the next save tries again")


# --------------------------------------------------------------------------- what a failed save raises

def save_error(exc: BaseException, step: int, url: str, world_size: int) -> RollCkptError:
    """``exc`` as the roll-ckpt error the save of ``checkpoint-<step>`` under ``url`` raises;
    one that DCP carried from another rank (its ``CheckpointException``) names the first
    rank that failed."""
    if isinstance(exc, RollCkptError):  # a refusal, an error agreed on by every rank: as it is
        return exc
    failures = getattr(exc, "failures", None)
    failed_rank = min(failures) if isinstance(failures, dict) and failures else None
    error = _translate(exc, failures[failed_rank] if failed_rank is not None else None, f"checkpoint-{step} under {url}")
    if failed_rank is not None and error.origin_rank is None and world_size > 1:
        error.origin_rank = failed_rank
    return error


def agreed_failure(exc: BaseException, step: int, url: str, world_size: int) -> RollCkptError:
    """What this rank hands to an agreement of the save: its failure as the error every rank raises."""
    error = save_error(exc, step, url, world_size)
    if error is not exc and error.__cause__ is None:
        error.__cause__ = exc  # (on this rank; the others get the message)
    return error


def _translate(exc: BaseException, first: Any, where: str) -> RollCkptError:
    ours = carried_roll_error(exc, include_self=False)  # e.g. a refusal, carried by DCP from another rank
    if ours is not None:
        return ours
    if disk_full(exc):
        return StorageFullError(
            f"no space left while writing {where}; nothing of it was committed and earlier "
            "checkpoints are intact. Free space or lower checkpoint_config.max_ckpt_to_keep; "
            "training can go on and the next save will try again")
    cause = exc
    if first is not None:  # DCP's CheckpointException: what the first rank hit, not its traceback
        cause = first[0] if isinstance(first, tuple) and first else first
    if isinstance(cause, PermissionError):
        return StorageError(f"permission denied while writing {where}: {cause}; choose a writable "
                            "checkpoint_config.output_dir")
    if isinstance(cause, OSError) and cause.errno == errno.EROFS:
        return StorageError(f"cannot write {where}: {cause.strerror}; nothing of it was committed "
                            "and earlier checkpoints are intact; choose a writable checkpoint_config.output_dir")
    return SaveError(f"saving {where} failed ({type(cause).__name__}: {cause}); nothing of it was "
                     "committed and earlier checkpoints are intact")


class WarnMode:
    """``checkpoint_config.on_save_error``: whether a failed periodic save is raised or absorbed."""

    def __init__(self, on_save_error: str) -> None:
        self.tolerant = on_save_error == "warn"
        self.failed_saves = 0
        """Saves that failed and were absorbed (``manager.stats.failed``)."""

    def absorbs(self, exc: BaseException, final: bool = False) -> bool:
        """Whether ``exc`` (a save's failure) is logged and counted instead of raised."""
        return self.tolerant and not final and isinstance(exc, (StorageError, SaveError))

    def tolerate(self, step: int | None, exc: BaseException) -> None:
        self.failed_saves += 1
        what = f"checkpoint-{step}" if step is not None else "the background save"
        log.warning("roll-ckpt: saving %s failed: %s -- training goes on and the next save tries again "
                    "(checkpoint_config.on_save_error: warn; %d failed save(s) so far)", what, exc, self.failed_saves)


# --------------------------------------------------------------------------- the commit, and what follows it


def plugin_versions(distributions: tuple[str, ...]) -> dict[str, str]:
    """The manifest's ``plugins``: the versions of roll-ckpt, torch and each plugin's distribution."""
    from importlib import metadata

    out = {}
    for dist in ("roll-ckpt-core", "torch", *distributions):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


ManifestPart = Callable[[Storage, str, SaveContext, Mapping[str, Any]], tuple[dict[str, FileEntry], dict[str, Any]]]
"""What a checkpoint carries beside the strategy's files, written before its manifest:
``part(storage, write_path, save, state) -> (files, extra)``: the files it wrote into the
folder being committed (their manifest entries) and the manifest's ``extra`` keys."""


class Committer:
    """The coordinator's commit, with core's own hooks around it, each given by the manager:
    the manifest's parts (the Hugging Face files; a component's expected parts), then the two
    commit events -- the folder committed (``after_part``: a component's part makes its step
    committed once every part is, :class:`~roll_ckpt.format.components.ComponentSteps`) and the
    checkpoint committed (the commit hooks: retention, replication, in the manager's order)."""

    def __init__(self, setup: Setup, announce: Callable[..., None], *, parts: Sequence[ManifestPart] = (),
                 after_part: Callable[[Storage, str, int], str | None] | None = None,
                 after_commit: Sequence[Callable[[Run, str, int], None]] = ()) -> None:
        self.setup = setup
        self.parts = list(parts)
        """Run in order before the manifest is written (:data:`ManifestPart`)."""
        self.after_part = after_part
        """``after_part(storage, path, step)``: the checkpoint committed by this folder's commit
        (the step's folder, for a component's part), or ``None`` when none is yet; ``None``: the
        folder is the checkpoint."""
        self.announce = announce
        """``announce(path, manifest, component=None, data=None)``: ``roll_ckpt_on_commit`` for what
        was committed (``data``: the manifest's bytes as committed, when known)."""
        self.hooks = list(after_commit)
        """Run in order as ``hook(run, path, step)`` for each checkpoint (or step) committed here."""
        self.resumed_from: str | None = None
        """The checkpoint this launch resumed from (``trainer_state.json`` names it); set by the manager."""
        self._versions: tuple[int, dict[str, str]] | None = None
        """The manifest's ``plugins`` for the plugins registered (the versions are looked up again
        only when those change: each lookup scans ``sys.path``, about 1 ms of the writer's GIL)."""

    def commit(self, run: Run, pending: PendingCheckpoint, ctx: SaveContext, user: dict[str, Any],
               digests: dict[str, tuple], state: Mapping[str, Any]) -> tuple[int, int]:
        """Coordinator: the manifest's parts, trainer state, manifest, commit; then the step and
        the hooks. ``state``: what was saved (the parts read the live objects they need)."""
        setup = self.setup
        storage, strategy = run.storage, ctx.strategy
        files = {f"{strategy.data_dir}/{name}": FileEntry(*digest) for name, digest in digests.items()}
        extra: dict[str, Any] = {"strategy": strategy.name}
        for part in self.parts:  # in the manifest, so before it
            part_files, part_extra = part(storage, pending.write_path, ctx, state)
            files.update(part_files)
            extra.update(part_extra)
        cc = setup.config.checkpoint_config
        if cc.beside:  # files another program adds to the folder once it is committed
            extra[BESIDE_KEY] = list(cc.beside)
        ts = self.trainer_state(ctx, user)
        with storage.open_write(storage.join(pending.write_path, TRAINER_STATE)) as f:
            f.write(ts)
        files[TRAINER_STATE] = FileEntry(*hash_bytes(ts))
        if not storage.atomic_rename:  # an object store: every upload completed, whole
            check_objects(storage, pending.write_path, {name: e.size for name, e in files.items()})
        if self._versions is None or self._versions[0] != setup.plugins.generation:
            self._versions = (setup.plugins.generation, plugin_versions(tuple(setup.plugins.distributions())))
        manifest = Manifest(step=ctx.step, files=files, created=utc_now(), world_size=strategy.world_size,
                            component=setup.component, plugins=self._versions[1], extra=extra)
        data = manifest.to_bytes()
        pending.commit(data)
        self.announce(ctx.path, manifest, setup.component, data=data)  # (the bytes committed: not serialised again)
        committed = ctx.path if self.after_part is None else self.after_part(storage, ctx.path, ctx.step)
        if committed is not None:  # the checkpoint (a step of components once its last part is in)
            for hook in self.hooks:
                hook(run, committed, ctx.step)
        total, taken = sum(e.size for e in files.values()), sum(e.size for e in files.values() if e.taken_over)
        if taken:
            log.info("roll-ckpt: %s: %s written, %s taken over unchanged from %s", layout.basename(ctx.path),
                     human_bytes(total - taken), human_bytes(taken),
                     ", ".join(sorted({e.taken_over for e in files.values() if e.taken_over})))
        return total, taken

    def trainer_state(self, ctx: SaveContext, user: dict[str, Any]) -> bytes:
        body = {
            "step": ctx.step,
            "time": utc_now(),
            "timestamp": time.time(),
            "world_size": ctx.world_size,
            "strategy": ctx.strategy.name,
            "exp_name": self.setup.config.exp_name,
            "component": self.setup.component,
            "resumed_from": self.resumed_from,
            "user": user,
        }
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


# --------------------------------------------------------------------------- the pipeline


class SavePipeline:
    """One manager's saves. ``local``: the fast recovery tier (or ``None``); ``retention``: what a
    save that needs room applies first; ``announce`` and ``after_commit``: the :class:`Committer`'s;
    ``steps``: a component's steps (:class:`~roll_ckpt.format.components.ComponentSteps`), or ``None``."""

    def __init__(self, setup: Setup, *, local: Any, retention: Retention, announce: Callable[..., None],
                 after_commit: Sequence[Callable[[Run, str, int], None]] = (), steps: Any = None) -> None:
        self.setup = setup
        self.local = local
        self.retention = retention
        config = setup.config
        self.is_async = config.async_save
        """Whether periodic saves are asynchronous (read once: the config is frozen)."""
        self.errors = WarnMode(config.checkpoint_config.on_save_error)
        self.last_save: SaveStats | None = None
        self.committed_steps: set[int] = set()
        self.space: Any = None
        self._reuse: dict[str, Any] = {}
        # the writer thread: started by the first job submitted (an executor starts no thread before)
        self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="roll-ckpt-save", initializer=lower_priority,
                                               initargs=(config.checkpoint_config.background_nice,))
        self._inflight: cf.Future[SaveStats] | None = None
        self.leftovers = Leftovers()
        self.hf = HFPart.of(config.checkpoint_config, config.strategy_config, setup.component)
        """The Hugging Face files each checkpoint carries (``hf_weights``, ``save_only_model``), or ``None``."""
        parts = ([steps.manifest_part] if steps is not None else []) + \
            ([self.hf.manifest_part] if self.hf is not None else [])
        self.committer = Committer(setup, announce, parts=parts, after_part=None if steps is None else steps.after_part,
                                   after_commit=after_commit)

    def save(self, run_of: Callable[[], Run], io: StrategyIO, step: int, state: Mapping[str, Any], *,
             final: bool, metadata: Mapping[str, Any] | None, local: bool = False) -> str | None:
        """The path ``checkpoint-<step>`` is committed at; ``None`` when a periodic save failed
        and ``on_save_error`` is ``warn``. ``run_of()``: the run to save into (its folder
        claimed by the first save: a failure to claim it is this save's). ``local``: the fast
        recovery tier saves the same staged state too (written first, in the same writer job;
        see :mod:`roll_ckpt.tiers.local_tier`)."""
        check_step(step)
        self.wait()
        try:
            return self._save(run_of(), io, step, state, final=final, metadata=metadata, local=local)
        except RollCkptError as exc:
            if not self.errors.absorbs(exc, final):
                raise
            self.errors.tolerate(step, exc)
            return None

    def save_local(self, io: StrategyIO, step: int, state: Mapping[str, Any]) -> None:
        """A checkpoint of the fast recovery tier alone (no persistent save at ``step``): the
        same staging, the unit written (and replicated) by the writer; never raises a storage error."""
        config, local, strategy = self.setup.config, self.local, io.strategy
        self.wait()
        local.bind(io, forget_after=step - 1)
        t0 = time.perf_counter()
        ctx = SaveContext(step=step, path=local.unit_path(step, strategy.rank), is_async=self.is_async,
                          rank=strategy.rank, world_size=strategy.world_size, strategy=strategy, reuse=self._reuse,
                          budget=config.strategy_config.max_staging_bytes,
                          keep_buffers=config.strategy_config.keep_staging_buffers)
        self.setup.plugins.hook.roll_ckpt_save(save=ctx)
        with CollectorPause(config.checkpoint_config.pause_gc):
            staged = stage_state_dict(strategy.state_dict(state), ctx, self._policies)
        trainer_state = self.committer.trainer_state(ctx, {})

        def write() -> None:
            error: BaseException | None = None
            try:
                ctx.run_before_write_callbacks()
                local.save(staged, step, trainer_state, save=ctx)
            except BaseException as exc:
                error = exc
                raise
            finally:
                ctx.run_finished_callbacks()
                self.setup.plugins.hook.roll_ckpt_save_finished(save=ctx, error=error)
            blocked = _blocked_s(ctx, time.perf_counter() - t0)
            local.last_save = {**(local.last_save or {}), "blocked_s": blocked,
                               "policies": dict(Counter(ctx.staging.values()))}

        self._launch(ctx, t0, write)

    def prepare(self) -> cf.Future | None:
        """A save is near: the staging policies make their buffers ready in the writer thread,
        after the write in flight (which then keeps them instead of freeing them). Each
        policy's work is a job of the writer thread, which runs them in order: the last one's
        future is done once all are (an earlier one's error stays in its own future, as a
        failed preparation only means the save allocates its buffers in the call)."""
        config = self.setup.config
        if not self.is_async or config.strategy_config.keep_staging_buffers:
            return None
        work = [w for p in self._policies if hasattr(p, "prepare") and (w := p.prepare(self._reuse)) is not None]
        # (no work: nothing staged yet; the first save lays its buffers out in the call)
        return [self._executor.submit(w) for w in work][-1] if work else None

    @functools.cached_property
    def _policies(self) -> list[Any]:
        """The staging policies in the order a save asks them, read at the first save (or prepare)."""
        return self.setup.plugins.staging_order()

    def _launch(self, ctx: SaveContext, t0: float, write: Any) -> None:
        """Run ``write`` now, or in the writer thread for an asynchronous save.

        The one place that measures how long an asynchronous save blocked its caller
        (``ctx.blocked_s``, from ``t0``, the call, until control goes back to it): before the
        write is submitted, or, staged in waves, once the last wave is in (the writer reads it
        after ``caller_done``, :func:`_blocked_s`). A synchronous save blocks for all of it."""
        if not ctx.is_async:
            write()
            return
        if ctx.gate is None:
            ctx.blocked_s = time.perf_counter() - t0
        self._inflight = self._executor.submit(write)
        if ctx.gate is not None:  # staged in waves within the budget, as the write goes on
            try:
                ctx.gate.fill()
            except BaseException as exc:  # the write failed, or staging a wave did
                if exc is not ctx.gate.error:
                    ctx.gate.abort(exc)  # the writer waits for no wave any more; it fails with this error
                if not isinstance(exc, Exception):  # Ctrl-C, SystemExit: the caller's
                    raise
                # else the write's error surfaces at the next wait (every rank's: the write carries it)
            ctx.blocked_s = time.perf_counter() - t0
            ctx.gate.caller_done.set()

    def _save(self, run: Run, io: StrategyIO, step: int, state: Mapping[str, Any], *, final: bool,
              metadata: Mapping[str, Any] | None, local: bool = False) -> str:
        t0 = time.perf_counter()
        config, component, strategy = self.setup.config, self.setup.component, io.strategy
        final_path = run.storage.join(run.folder, layout.checkpoint_name(step, config.checkpoint_config.name_format))
        if component:
            final_path = run.storage.join(final_path, component)
        if step in self.committed_steps:
            return final_path
        user = dict(metadata or {})
        try:
            json.dumps(user)
        except TypeError as exc:
            raise RollCkptError(f"save(metadata=...) must hold JSON values: {exc}") from None
        sc = config.strategy_config
        ctx = SaveContext(step=step, path=final_path, is_async=self.is_async and not final, rank=strategy.rank,
                          world_size=strategy.world_size, strategy=strategy, reuse=self._reuse,
                          budget=sc.max_staging_bytes, keep_buffers=sc.keep_staging_buffers)
        if local:  # (every rank makes the tier's group at the same point)
            self.local.bind(io, forget_after=step - 1)
        try:
            self.setup.plugins.hook.roll_ckpt_save(save=ctx)
            with CollectorPause(config.checkpoint_config.pause_gc):  # (the loop waits for this part)
                sd = strategy.state_dict(model_only(state, self.hf) if sc.save_only_model else state)
                if strategy.is_coordinator:  # does it fit? (refused before anything is staged or written)
                    if self.space is None:
                        self.space = SpaceGuard(run.storage, run.root, config.checkpoint_config.output_dir)
                    refusal = self.space.check(functools.partial(io.estimate, sd, user),
                                               path=run.folder or run.root, step=step, keep=self.retention.keep,
                                               own_run=run.folder,
                                               retention=functools.partial(self.retention.apply, run, ctx.path))
                    if refusal is not None:
                        raise refusal
                staged = stage_state_dict(sd, ctx, self._policies)
        except Exception as exc:  # the other ranks go on to the write's first agreement: meet them there
            self.refuse(run, io, ctx, exc)
        save = StagedSave(run, io, staged, ctx, user, t0, state=dict(state))
        if local and ctx.gate is None:  # (staged in waves, the state is written once: persistently)
            trainer_state = self.committer.trainer_state(ctx, user)
            save.local_unit = functools.partial(self.local.save, staged, step, trainer_state, save=ctx)
        self._launch(ctx, t0, functools.partial(self.write_and_commit, save))
        return final_path

    @property
    def in_flight(self) -> bool:
        """True while an asynchronous save is still writing (does not wait)."""
        return self._inflight is not None and not self._inflight.done()

    def wait(self) -> SaveStats | None:
        """Wait for the save in flight; raise its error if it failed (``warn``: log and count it)."""
        fut, self._inflight = self._inflight, None
        if fut is None:
            return None
        try:
            stats = fut.result()
        except RollCkptError as exc:
            if not self.errors.absorbs(exc):
                raise
            self.errors.tolerate(None, exc)
            return None
        except Exception as exc:
            error = SaveError(f"the background save failed: {type(exc).__name__}: {exc}")
            if not self.errors.absorbs(error):
                raise error from exc
            self.errors.tolerate(None, error)
            return None
        if stats is not None:  # (None: a save of the local tier alone)
            self.last_save = stats
        return stats

    def write_and_commit(self, save: StagedSave, refusal: BaseException | None = None) -> SaveStats:
        """Write the staged state and commit it (the coordinator), every rank agreeing twice:
        before the write (a rank's refusal, or the coordinator's failed begin, ends every
        rank's save there) and after the commit (no rank reports a step the coordinator did
        not commit). A failure anywhere is :meth:`_failed`'s; the callbacks and
        ``roll_ckpt_save_finished`` are told in every case. ``refusal``: this rank's failure
        before the write, as every rank raises it (:meth:`refuse`)."""
        ctx, run, io = save.ctx, save.run, save.io
        strategy, storage = ctx.strategy, run.storage
        pending = pending_checkpoint(storage, ctx.path, run.token)
        attempt = _Attempt(run, pending, storage.join(pending.write_path, strategy.data_dir), read_counts(storage))
        error: BaseException | None = None
        try:
            self._begin(ctx, attempt, refusal)
            if save.local_unit is not None:  # the local tier's unit of the same staged state, first (never raises)
                save.local_unit()
            with self.setup.progress(f"save step {ctx.step}", strategy) as progress:
                digests = io.write(save.sd, storage, attempt.data_path, progress, save=ctx)
            failed = None
            if strategy.is_coordinator:
                try:
                    attempt.total, attempt.taken = self.committer.commit(run, pending, ctx, save.user, digests,
                                                                         save.state)
                    attempt.committed = True
                except Exception as exc:
                    failed = agreed_failure(exc, ctx.step, storage.url, ctx.world_size)
            strategy.agree(failed, "save: committing", ctx.step)
            self.committed_steps.add(ctx.step)
            if (increments := io.increments) is not None:
                increments.committed(storage, ctx.path, strategy.data_dir)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = exc
            self._failed(save, attempt, exc)
        finally:
            ctx.run_finished_callbacks()
            self.setup.plugins.hook.roll_ckpt_save_finished(save=ctx, error=error)
        total_s = time.perf_counter() - save.t0
        stats = SaveStats(step=ctx.step, path=ctx.path, is_async=ctx.is_async, blocked_s=_blocked_s(ctx, total_s),
                          total_s=total_s, bytes=attempt.total, bytes_copied=ctx.bytes_copied,
                          bytes_allocated=ctx.bytes_allocated,
                          policies=dict(Counter(ctx.staging.values())),
                          network=None if attempt.counts is None else _since(storage, attempt.counts),
                          bytes_taken_over=attempt.taken)
        if stats.network is not None:
            report_save(f"checkpoint-{ctx.step}", strategy.rank, stats.network)
        self.last_save = stats
        return stats

    def refuse(self, run: Run, io: StrategyIO, ctx: SaveContext, exc: BaseException) -> NoReturn:
        """This rank's save failed before its write (a refusal, a state dict that cannot be
        built): the other ranks are on their way to the write's first agreement, so meet them
        there with ``exc``, which every rank then raises (nothing staged: nothing written)."""
        self.write_and_commit(StagedSave(run, io, {}, ctx, {}, 0.0),
                              refusal=agreed_failure(exc, ctx.step, run.storage.url, ctx.world_size))
        raise AssertionError("unreachable: the agreement raises the refusal") from exc

    def _begin(self, ctx: SaveContext, attempt: "_Attempt", refusal: BaseException | None) -> None:
        """Coordinator: claim the checkpoint's folder (its owner marker) and make the data
        folder, before any rank writes; every rank agrees that it worked (and raises the first
        rank's failure: this one's ``refusal``, when it has one, before anything is begun)."""
        storage, component = attempt.run.storage, self.setup.component
        failed = refusal
        if refusal is None:
            try:
                ctx.run_before_write_callbacks()
                if ctx.strategy.is_coordinator:
                    self.leftovers.retry()
                    if component:
                        check_part_free(storage, ctx.path, ctx.step, component)
                    attempt.pending.begin()
                    attempt.begun = True
                    storage.makedirs(attempt.data_path)
            except Exception as exc:
                failed = agreed_failure(exc, ctx.step, storage.url, ctx.world_size)
        ctx.strategy.agree(failed, "save: starting", ctx.step)

    def _failed(self, save: StagedSave, attempt: "_Attempt", exc: BaseException) -> NoReturn:
        """A save's failure, wherever it happened: nothing of it left (the coordinator removes
        what it wrote), the caller's next wave not waited for, the error raised as a roll-ckpt one."""
        ctx, storage = save.ctx, attempt.run.storage
        strategy = ctx.strategy
        if (increments := save.io.increments) is not None:
            increments.failed()
        if ctx.gate is not None:
            ctx.gate.abort(exc)  # the caller may be waiting to stage the next wave
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        if not attempt.committed and (attempt.begun or strategy.is_coordinator):
            self.leftovers.discard(attempt.pending, attempt.begun)
        if attempt.counts is not None:
            report_save(f"checkpoint-{ctx.step}", strategy.rank, _since(storage, attempt.counts), failed=True)
        translated = save_error(exc, ctx.step, storage.url, ctx.world_size)
        if translated is exc:
            raise exc
        raise translated from exc

    def close(self) -> None:
        """Drain the save in flight (re-raising its error), then stop the writer thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self.leftovers.retry()
            self._reuse.clear()


@dataclass
class StagedSave:
    """One save, staged: what its write and its commit need."""

    run: Run
    io: StrategyIO
    """What writes the strategy's files (the manager's)."""
    sd: dict[str, Any]
    """The staged state dict."""
    ctx: SaveContext
    user: dict[str, Any]
    """The caller's ``metadata`` for the manifest."""
    t0: float
    """When the save began (``time.perf_counter``)."""
    local_unit: Callable[[], None] | None = None
    """Writes the fast recovery tier's unit of the same staged state (before the persistent write)."""
    state: Mapping[str, Any] = field(default_factory=dict)
    """What was saved, as the caller gave it (its keys, the live objects): the manifest's parts
    read what they need of it (the Hugging Face files: the module's config)."""


@dataclass
class _Attempt:
    """How far one save got: what its failure has to undo."""

    run: Run
    pending: PendingCheckpoint
    data_path: str
    """Where the strategy writes (its ``data_dir`` in the folder being written)."""
    counts: NetworkCounts | None
    """The storage's network counts before the save."""
    begun: bool = False
    committed: bool = False
    total: int = 0
    taken: int = 0


def check_step(step: Any) -> None:
    """A save's step: an integer >= 0 (checked before anything else happens)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise RollCkptError(f"step must be an integer >= 0, got {step!r}")


def _blocked_s(ctx: SaveContext, total_s: float) -> float:
    """The writer's reading of how long the caller was blocked: a synchronous save's whole
    time (``total_s``, the caller waited for the write); an asynchronous one's as
    :meth:`SavePipeline._launch` measured it (staged in waves: once the caller says it has
    recorded it, after the last wave)."""
    if not ctx.is_async:
        return total_s
    if ctx.gate is not None:
        ctx.gate.caller_done.wait(60)
    return ctx.blocked_s


def _since(storage: Storage, before: NetworkCounts) -> NetworkCounts | None:
    """The storage's network counts since ``before`` (a storage that keeps none, whose
    ``before`` is ``None``, is not asked again)."""
    now = read_counts(storage)
    return None if now is None else now.since(before)
