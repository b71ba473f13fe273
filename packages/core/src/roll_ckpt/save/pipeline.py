"""The save pipeline: state dict → space check → staging → write → commit → retention.

::

    SavePipeline.save            caller's thread
        strategy.state_dict          the live state dict
        check_space                  coordinator: does it fit? (refusals reach every rank)
        stage_state_dict             each tensor captured by its staging policy
    SavePipeline.write_and_commit  caller's thread, or the background thread when async
        strategy.write               DCP's format, every file hashed while written
        PendingCheckpoint.commit     coordinator: manifest last (rename / create-only)
        after_commit                 the step of components, retention, replication

One save is in flight at most: a save issued while an asynchronous one is still writing
waits for it first (and raises its error, if it failed).

``checkpoint_config.on_save_error: warn`` makes a failed periodic save (a storage error:
disk full, store unreachable, permission denied) a logged, counted event wherever it
surfaces (the save itself, or the next call that waits for a background one); nothing of
it is committed and the next save tries again. Final saves always raise.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import json
import logging
import time
from collections import Counter
from typing import Any, Mapping

from ..format import layout
from ..format.commit import PendingCheckpoint, pending_checkpoint
from ..format.components import check_part_free, try_complete
from ..runtime.background import lower_priority
from ..runtime.collector import CollectorPause
from ..contracts import NetworkCounts, SaveContext, Storage
from ..format.digest import hash_bytes
from ..hf.in_checkpoint import HFPart, saved_state
from ..errors import RollCkptError, SaveError, StorageError, StorageFullError, carried_roll_error, disk_full
from ..tiers.job import Job
from ..format.layout import TRAINER_STATE
from ..format.leftovers import Leftovers
from ..format.manifest import FileEntry, Manifest
from ..runtime.network import check_objects, read_counts, report_save
from ..tiers.retention import apply_retention
from ..format.runs import utc_now
from ..runtime.units import human_bytes
from .staging import stage_state_dict
from .stats import SaveStats

__all__ = ["SavePipeline", "SaveStats"]

log = logging.getLogger("roll_ckpt")


def _increments(strategy: Any) -> Any:
    """The strategy's record of the newest committed checkpoint (incremental saves), if it keeps one."""
    return getattr(strategy, "increments", None)


def _plugin_versions(job: Job) -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("roll-ckpt-core", "torch", *sorted(set(job.plugins.distributions()))):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


class SavePipeline:
    def __init__(self, job: Job) -> None:
        self.job = job
        self.tolerant = job.config.checkpoint_config.on_save_error == "warn"
        self.failed_saves = 0
        self.last_save: SaveStats | None = None
        self.committed_steps: set[int] = set()
        self.space: Any = None
        self._reuse: dict[str, Any] = {}
        self._policies: list[Any] | None = None
        self._executor: cf.ThreadPoolExecutor | None = None
        self._inflight: cf.Future[SaveStats] | None = None
        self.leftovers = Leftovers()
        self.hf = HFPart.of(job.config.checkpoint_config, job.config.strategy_config)
        """The Hugging Face files each checkpoint carries (``hf_weights``, ``save_only_model``), or ``None``."""


    def save(self, step: int, state: Mapping[str, Any], *, final: bool,
             metadata: Mapping[str, Any] | None, local: bool = False) -> str | None:
        """The path ``checkpoint-<step>`` is committed at; ``None`` when a periodic save failed
        and ``on_save_error`` is ``warn``. ``local``: the fast recovery tier saves the same
        staged state too (written first, in the same writer job; see :mod:`roll_ckpt.tiers.local_tier`)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise RollCkptError(f"step must be an integer >= 0, got {step!r}")
        self.job.bind(state)
        self.wait()
        try:
            return self._save(step, state, final=final, metadata=metadata, local=local)
        except (StorageError, SaveError) as exc:
            if final or not self.tolerant:
                raise
            self._tolerate(step, exc)
            return None
    def _tolerate(self, step: int | None, exc: BaseException) -> None:
        self.failed_saves += 1
        what = f"checkpoint-{step}" if step is not None else "the background save"
        log.warning("roll-ckpt: saving %s failed: %s -- training goes on and the next save tries again "
                    "(checkpoint_config.on_save_error: warn; %d failed save(s) so far)", what, exc, self.failed_saves)
    def save_local(self, step: int, state: Mapping[str, Any]) -> None:
        """A checkpoint of the fast recovery tier alone (no persistent save at ``step``): the
        same staging, the unit written (and replicated) by the writer; never raises a storage error."""
        job = self.job
        strategy = job.bind(state)
        self.wait()
        job.local.bind(strategy, forget_after=step - 1)
        t0 = time.perf_counter()
        ctx = SaveContext(step=step, path=job.local.unit_path(step, strategy.rank), is_async=job.config.async_save,
                          rank=strategy.rank, world_size=strategy.world_size, strategy=strategy, reuse=self._reuse,
                          budget=job.config.strategy_config.max_staging_bytes)
        job.plugins.hook.roll_ckpt_save(save=ctx)
        with CollectorPause(job.config.checkpoint_config.pause_gc):
            staged = self._stage(strategy.state_dict(state), ctx)
        trainer_state = self._trainer_state(ctx, {})

        def write() -> None:
            error: BaseException | None = None
            try:
                ctx.run_before_write_callbacks()
                job.local.save(staged, step, trainer_state, save=ctx)
            except BaseException as exc:
                error = exc
                raise
            finally:
                ctx.run_finished_callbacks()
                job.plugins.hook.roll_ckpt_save_finished(save=ctx, error=error)
            blocked = ctx.blocked_s if ctx.is_async else time.perf_counter() - t0
            job.local.last_save = {**(job.local.last_save or {}), "blocked_s": blocked,
                                   "policies": dict(Counter(ctx.staging.values()))}

        self._launch(ctx, t0, write)
    def _stage(self, sd: dict[str, Any], ctx: SaveContext) -> dict[str, Any]:
        if self._policies is None:
            self._policies = self.job.plugins.staging_order()
        return stage_state_dict(sd, ctx, self._policies)
    def _launch(self, ctx: SaveContext, t0: float, write: Any) -> None:
        """Run ``write`` now, or in the writer thread for an asynchronous save."""
        if not ctx.is_async:
            write()
            return
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(
                1, thread_name_prefix="roll-ckpt-save", initializer=lower_priority,
                initargs=(self.job.config.checkpoint_config.background_nice,))
        if ctx.gate is None:
            ctx.blocked_s = time.perf_counter() - t0
        self._inflight = self._executor.submit(write)
        if ctx.gate is not None:  # staged in waves within the budget, as the write goes on
            try:
                ctx.gate.fill()
            except BaseException:  # the write failed; its error surfaces at the next wait
                pass
            ctx.blocked_s = time.perf_counter() - t0
            ctx.gate.caller_done.set()
    def _save(self, step: int, state: Mapping[str, Any], *, final: bool, metadata: Mapping[str, Any] | None,
              local: bool = False) -> str:
        t0 = time.perf_counter()
        job = self.job
        strategy = job.strategy
        final_path = job.storage.join(job.ensure_run_dir(), layout.checkpoint_name(step))
        if job.component:
            final_path = job.storage.join(final_path, job.component)
        if step in self.committed_steps:
            return final_path
        user = dict(metadata or {})
        try:
            json.dumps(user)
        except TypeError as exc:
            raise RollCkptError(f"save(metadata=...) must hold JSON values: {exc}") from None
        sc = job.config.strategy_config
        ctx = SaveContext(step=step, path=final_path, is_async=job.config.async_save and not final, rank=strategy.rank,
                          world_size=strategy.world_size, strategy=strategy, reuse=self._reuse,
                          budget=sc.max_staging_bytes)
        job.plugins.hook.roll_ckpt_save(save=ctx)
        if local:  # (before the space check: every rank makes the tier's group at the same point)
            job.local.bind(strategy, forget_after=step - 1)
        with CollectorPause(job.config.checkpoint_config.pause_gc):  # (the loop waits for this part)
            sd = strategy.state_dict(saved_state(state, self.hf, job.config.strategy_config.save_only_model))
            refusal = self._check_space(sd, ctx, user) if strategy.is_coordinator else None
            if refusal is not None:  # refused before anything is staged or written
                self.write_and_commit(sd, ctx, user, t0, refuse=refusal)  # raises it, on every rank
            staged = self._stage(sd, ctx)
        also = None
        if local and ctx.gate is None:  # (staged in waves, the state is written once: persistently)
            trainer_state = self._trainer_state(ctx, user)
            also = lambda: job.local.save(staged, step, trainer_state, save=ctx)  # noqa: E731
        module = state.get(self.hf.config.key) if self.hf is not None else None
        self._launch(ctx, t0, lambda: self.write_and_commit(staged, ctx, user, t0, also=also, module=module))
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
        except (StorageError, SaveError) as exc:
            if not self.tolerant:
                raise
            self._tolerate(None, exc)
            return None
        except RollCkptError:
            raise
        except BaseException as exc:
            error = SaveError(f"the background save failed: {type(exc).__name__}: {exc}")
            if not self.tolerant:
                raise error from exc
            self._tolerate(None, error)
            return None
        if stats is not None:  # (None: a save of the local tier alone)
            self.last_save = stats
        return stats

    def _check_space(self, sd: dict[str, Any], ctx: SaveContext, user: dict[str, Any]) -> BaseException | None:
        """The coordinator's check that ``checkpoint-<step>`` fits; the refusal to raise, or ``None``."""
        from ..tiers.space import SpaceGuard, committed_sizes

        job = self.job
        if self.space is None:
            self.space = SpaceGuard(job.storage, job.root, job.config.checkpoint_config.output_dir)
        if not self.space.can_tell(job.run_dir or job.root):
            return None  # an object store: nothing to check, nothing to estimate
        estimate = job.strategy.estimate(sd, user)
        keep = job.config.checkpoint_config.max_ckpt_to_keep

        def retention(k: int) -> list[str]:
            with job.local_lock:
                return apply_retention(job.storage, job.root, k, protect=self._protected(ctx.path),
                                       own_run=job.run_dir)

        return self.space.check(estimate, path=job.run_dir or job.root, step=ctx.step, keep=keep,
                                retention=retention, sizes=lambda: committed_sizes(job.storage, job.root, job.run_dir))


    def write_and_commit(self, sd: dict[str, Any], ctx: SaveContext, user: dict[str, Any], t0: float,
                         refuse: BaseException | None = None, also: Any = None, module: Any = None) -> SaveStats:
        job = self.job
        strategy, storage = job.strategy, job.storage
        pending = pending_checkpoint(storage, ctx.path, job.token)
        before = read_counts(storage)
        error: BaseException | None = None
        begun = False
        total = taken = 0
        try:
            if strategy.is_coordinator and refuse is None:
                self.leftovers.retry()
                try:
                    if job.component:
                        check_part_free(storage, ctx.path, ctx.step, job.component)
                    pending.begin()
                    begun = True
                except Exception as exc:  # refused like a save that does not fit (below)
                    refuse = exc
            # A refused save (no space, a part already there, an unwritable folder) fails in
            # DCP's planning step, before any data is written, and DCP carries the refusal to
            # every rank: none is left waiting in a collective for a coordinator that gave up.
            target = storage if refuse is None else _refusing(storage, refuse)
            ctx.run_before_write_callbacks()
            if also is not None:  # the local tier's unit of the same staged state, first (never raises)
                also()
            with job.progress(f"save step {ctx.step}") as progress:
                digests = strategy.write(sd, target, storage.join(pending.write_path, strategy.data_dir), progress,
                                         save=ctx)
            if strategy.is_coordinator:
                total, taken = self._commit(pending, ctx, user, digests, module)
            self.committed_steps.add(ctx.step)
            if (increments := _increments(strategy)) is not None:
                increments.committed(storage, ctx.path, strategy.data_dir)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = exc
            if (increments := _increments(strategy)) is not None:
                increments.failed()
            if ctx.gate is not None:
                ctx.gate.abort(exc)  # the caller may be waiting to stage the next wave
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            if begun or strategy.is_coordinator:
                self.leftovers.discard(pending, begun)
            report_save(f"checkpoint-{ctx.step}", strategy.rank, _since(read_counts(storage), before), failed=True)
            raise self._save_error(ctx, exc) from exc
        finally:
            ctx.run_finished_callbacks()
            job.plugins.hook.roll_ckpt_save_finished(save=ctx, error=error)
        if ctx.gate is not None:  # the caller records how long it was blocked once the last wave is in
            ctx.gate.caller_done.wait(60)
        stats = SaveStats(step=ctx.step, path=ctx.path, is_async=ctx.is_async,
                          blocked_s=ctx.blocked_s if ctx.is_async else time.perf_counter() - t0,
                          total_s=time.perf_counter() - t0, bytes=total, bytes_copied=ctx.bytes_copied,
                          policies=dict(Counter(ctx.staging.values())),
                          network=_since(read_counts(storage), before), bytes_taken_over=taken)
        report_save(f"checkpoint-{ctx.step}", strategy.rank, stats.network)
        self.last_save = stats
        return stats

    def _commit(self, pending: PendingCheckpoint, ctx: SaveContext, user: dict[str, Any],
                digests: dict[str, tuple], module: Any = None) -> tuple[int, int]:
        """Coordinator: the HF files, trainer state, manifest, commit; then the step, retention, replication."""
        job = self.job
        storage, strategy = job.storage, job.strategy
        files = {f"{strategy.data_dir}/{name}": FileEntry(*digest) for name, digest in digests.items()}
        extra: dict[str, Any] = {"strategy": strategy.name}
        if job.config.strategy_config.save_only_model:
            extra["save_only_model"] = self.hf.config.key  # type: ignore[union-attr]
        if self.hf is not None and module is not None:  # from the dcp/ files just written (hf_in_checkpoint)
            hf_files, extra["hf"] = self.hf.write(storage, pending.write_path, module,
                                                  storage.join(pending.write_path, strategy.data_dir))
            files.update(hf_files)
        ts = self._trainer_state(ctx, user)
        with storage.open_write(storage.join(pending.write_path, TRAINER_STATE)) as f:
            f.write(ts)
        files[TRAINER_STATE] = FileEntry(*hash_bytes(ts))
        if not storage.atomic_rename:  # an object store: every upload completed, whole
            check_objects(storage, pending.write_path, {name: e.size for name, e in files.items()})
        manifest = Manifest(step=ctx.step, files=files, created=utc_now(), world_size=strategy.world_size,
                            component=job.component, plugins=_plugin_versions(job), extra=extra)
        pending.commit(manifest.to_bytes())
        job.announce(ctx.path, manifest, job.component)
        step_path = layout.parent(ctx.path) if job.component else ctx.path
        if self._commit_step(step_path, ctx.step):  # the whole checkpoint, or the last part of the step
            self._after_commit(step_path, ctx.step)
        total, taken = sum(e.size for e in files.values()), sum(e.size for e in files.values() if e.taken_over)
        if taken:
            log.info("roll-ckpt: %s: %s written, %s taken over unchanged from %s", layout.basename(ctx.path),
                     human_bytes(total - taken), human_bytes(taken),
                     ", ".join(sorted({e.taken_over for e in files.values() if e.taken_over})))
        return total, taken

    def _commit_step(self, step_path: str, step: int) -> bool:
        """True when the step is committed by this process: always without components;
        with them, when this part was the last one and this process's create won."""
        job = self.job
        if not job.component:
            return True
        try:
            manifest = try_complete(job.storage, step_path, step, job.config.checkpoint_config.components or ())
        except Exception as exc:  # this part is committed; the step can be committed later
            log.warning("roll-ckpt: the part of %s is committed, but committing step %d failed (%s: %s); the "
                        "next resume commits the step once every part is there", job.component, step,
                        type(exc).__name__, exc)
            return False
        if manifest is None:
            return False
        job.announce(step_path, manifest)
        log.info("roll-ckpt: step %d committed (every component's part is in %s)", step, step_path)
        return True

    def _protected(self, path: str) -> set[str]:
        """Local checkpoints retention must leave alone: the one just written, the one being replicated."""
        copying = self.job.backup.copying if self.job.backup is not None else None
        return {path} | ({copying} if copying else set())

    def _after_commit(self, path: str, step: int) -> None:
        """Retention and replication for the checkpoint just committed at ``path``."""
        job = self.job
        keep = job.config.checkpoint_config.max_ckpt_to_keep
        if keep:
            with job.local_lock:
                removed = apply_retention(job.storage, job.root, keep, protect=self._protected(path),
                                          own_run=job.run_dir)
            for removed_path in removed:
                log.info("roll-ckpt: retention removed %s", removed_path)
        if job.backup is not None:
            job.backup.submit(path, step)

    def _save_error(self, ctx: SaveContext, exc: BaseException) -> RollCkptError:
        ours = carried_roll_error(exc, include_self=False)  # e.g. the space refusal, carried by DCP from the coordinator
        if ours is not None:
            return ours
        where = f"checkpoint-{ctx.step} under {self.job.storage.url}"
        if disk_full(exc):
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
        if isinstance(cause, OSError) and cause.errno == errno.EROFS:
            return StorageError(f"cannot write {where}: {cause.strerror}; nothing of it was committed "
                                "and earlier checkpoints are intact; choose a writable checkpoint_config.output_dir")
        if isinstance(exc, RollCkptError):
            return exc
        return SaveError(f"saving {where} failed ({type(cause).__name__}: {cause}); nothing of it was "
                         "committed and earlier checkpoints are intact")

    def _trainer_state(self, ctx: SaveContext, user: dict[str, Any]) -> bytes:
        job = self.job
        body = {
            "step": ctx.step,
            "time": utc_now(),
            "timestamp": time.time(),
            "world_size": ctx.world_size,
            "strategy": job.strategy.name,
            "exp_name": job.config.exp_name,
            "component": job.component,
            "resumed_from": job.resumed_from,
            "user": user,
        }
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    def close(self) -> None:
        """Drain the save in flight (re-raising its error), then stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self.leftovers.retry()
            self._reuse.clear()


def _refusing(storage: Storage, error: BaseException) -> Storage:
    from ..tiers.space import RefusingStorage

    return RefusingStorage(storage, error)  # type: ignore[return-value]


def _since(now: NetworkCounts | None, before: NetworkCounts | None) -> NetworkCounts | None:
    return None if now is None or before is None else now.since(before)
