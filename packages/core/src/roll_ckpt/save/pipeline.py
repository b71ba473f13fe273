"""The save pipeline: state dict → space check → staging → write → commit → retention.

::

    SavePipeline.save            caller's thread
        strategy.state_dict          the live state dict (without the HF module's weights
                                     when only the HF files are kept)
        _check_space                 coordinator: does it fit?
        stage_state_dict             each tensor captured by its staging policy
        refuse                       a rank that failed so far meets the others at their
                                     first agreement, which raises its error everywhere
    SavePipeline.write_and_commit  caller's thread, or the background thread when async
        _begin                       coordinator: owner marker, data folder; every rank agrees
        StagedSave.local_unit        the fast tier's unit of the same staged state, if due
        strategy.write               DCP's format, every file hashed while written
        Committer.commit             coordinator: HF files, manifest last (rename / create-only),
                                     the step of components, retention, replication
        _agree                       every rank: the commit's outcome
      _failing_cleanly             around both: a failure removes what was written and
                                     becomes one roll-ckpt error (save/failures.py)

One save is in flight at most: a save issued while an asynchronous one is still writing
waits for it first (and raises its error, if it failed).

``checkpoint_config.on_save_error: warn`` makes a failed periodic save (a storage error:
disk full, store unreachable, permission denied) a logged, counted event wherever it
surfaces (the save itself, or the next call that waits for a background one); nothing of
it is committed and the next save tries again. Final saves always raise.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NoReturn

from ..format import layout
from ..format.commit import PendingCheckpoint, pending_checkpoint
from ..format.components import check_part_free
from ..runtime.background import lower_priority
from ..runtime.collector import CollectorPause
from ..contracts import NetworkCounts, SaveContext
from ..hf.in_checkpoint import HFPart, saved_state
from ..errors import RollCkptError, SaveError
from ..tiers.job import Job
from ..format.leftovers import Leftovers
from ..runtime.network import read_counts, report_save
from ..tiers.retention import apply_retention
from .committer import Committer
from .failures import WarnMode, agreed_failure, save_error
from .staging import stage_state_dict
from .stats import SaveStats

__all__ = ["SavePipeline", "SaveStats", "StagedSave"]

log = logging.getLogger("roll_ckpt")


class SavePipeline:
    def __init__(self, job: Job) -> None:
        self.job = job
        self.errors = WarnMode(job.config.checkpoint_config.on_save_error)
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
        self.committer = Committer(job, self.hf)


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
        except RollCkptError as exc:
            if not self.errors.absorbs(exc, final):
                raise
            self.errors.tolerate(step, exc)
            return None

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
                          budget=job.config.strategy_config.max_staging_bytes,
                          keep_buffers=job.config.strategy_config.keep_staging_buffers)
        job.plugins.hook.roll_ckpt_save(save=ctx)
        with CollectorPause(job.config.checkpoint_config.pause_gc):
            staged = self._stage(strategy.state_dict(state), ctx)
        trainer_state = self.committer.trainer_state(ctx, {})

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
            blocked = _blocked_s(ctx, time.perf_counter() - t0)
            job.local.last_save = {**(job.local.last_save or {}), "blocked_s": blocked,
                                   "policies": dict(Counter(ctx.staging.values()))}

        self._launch(ctx, t0, write)
    def prepare(self) -> cf.Future | None:
        """A save is near: the staging policies make their buffers ready in the writer thread,
        after the write in flight (which then keeps them instead of freeing them)."""
        job = self.job
        if not job.config.async_save or job.config.strategy_config.keep_staging_buffers:
            return None
        if self._policies is None:
            self._policies = job.plugins.staging_order()
        work = [w for p in self._policies if hasattr(p, "prepare") and (w := p.prepare(self._reuse)) is not None]
        if not work:
            return None  # nothing staged yet: the first save lays its buffers out in the call

        def ready() -> None:
            for w in work:
                w()

        return self._writer().submit(ready)

    def _writer(self) -> cf.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(
                1, thread_name_prefix="roll-ckpt-save", initializer=lower_priority,
                initargs=(self.job.config.checkpoint_config.background_nice,))
        return self._executor

    def _stage(self, sd: dict[str, Any], ctx: SaveContext) -> dict[str, Any]:
        if self._policies is None:
            self._policies = self.job.plugins.staging_order()
        return stage_state_dict(sd, ctx, self._policies)
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
        self._inflight = self._writer().submit(write)
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
    def _save(self, step: int, state: Mapping[str, Any], *, final: bool, metadata: Mapping[str, Any] | None,
              local: bool = False) -> str:
        t0 = time.perf_counter()
        job = self.job
        strategy = job.strategy
        final_path = job.storage.join(job.ensure_run_dir(),
                                      layout.checkpoint_name(step, job.config.checkpoint_config.name_format))
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
                          budget=sc.max_staging_bytes, keep_buffers=sc.keep_staging_buffers)
        if local:  # (every rank makes the tier's group at the same point)
            job.local.bind(strategy, forget_after=step - 1)
        try:
            job.plugins.hook.roll_ckpt_save(save=ctx)
            with CollectorPause(job.config.checkpoint_config.pause_gc):  # (the loop waits for this part)
                sd = strategy.state_dict(saved_state(state, self.hf, job.config.strategy_config.save_only_model))
                refusal = self._check_space(sd, ctx, user) if strategy.is_coordinator else None
                if refusal is not None:  # refused before anything is staged or written
                    raise refusal
                staged = self._stage(sd, ctx)
        except Exception as exc:  # the other ranks go on to the write's first agreement: meet them there
            self.refuse(ctx, exc)
        save = StagedSave(staged, ctx, user, t0)
        if local and ctx.gate is None:  # (staged in waves, the state is written once: persistently)
            trainer_state = self.committer.trainer_state(ctx, user)
            save.local_unit = lambda: job.local.save(staged, step, trainer_state, save=ctx)
        if self.hf is not None:
            save.hf_module = state.get(self.hf.config.key)
        self._launch(ctx, t0, lambda: self.write_and_commit(save))
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
                return apply_retention(job.storage, job.root, k, protect=self.committer.protected(ctx.path),
                                       own_run=job.run_dir)

        return self.space.check(estimate, path=job.run_dir or job.root, step=ctx.step, keep=keep,
                                retention=retention, sizes=lambda: committed_sizes(job.storage, job.root, job.run_dir))


    def write_and_commit(self, save: StagedSave) -> SaveStats:
        """Write the staged state and commit it (the coordinator), every rank agreeing twice:
        before the write (a rank's refusal, or the coordinator's failed begin, ends every
        rank's save there) and after the commit (no rank reports a step the coordinator did
        not commit)."""
        job, ctx = self.job, save.ctx
        strategy, storage = job.strategy, job.storage
        attempt = self._attempt(ctx)
        with self._failing_cleanly(ctx, attempt):
            self._begin(ctx, attempt)
            if save.local_unit is not None:  # the local tier's unit of the same staged state, first (never raises)
                save.local_unit()
            with job.progress(f"save step {ctx.step}") as progress:
                digests = strategy.write(save.sd, storage, attempt.data_path, progress, save=ctx)
            failed = None
            if strategy.is_coordinator:
                try:
                    attempt.total, attempt.taken = self.committer.commit(attempt.pending, ctx, save.user, digests,
                                                                         save.hf_module)
                    attempt.committed = True
                except Exception as exc:
                    failed = exc
            self._agree(ctx, failed, "save: committing")
            self.committed_steps.add(ctx.step)
            if (increments := strategy.increments) is not None:
                increments.committed(storage, ctx.path, strategy.data_dir)
        total_s = time.perf_counter() - save.t0
        stats = SaveStats(step=ctx.step, path=ctx.path, is_async=ctx.is_async, blocked_s=_blocked_s(ctx, total_s),
                          total_s=total_s, bytes=attempt.total, bytes_copied=ctx.bytes_copied,
                          bytes_allocated=ctx.bytes_allocated,
                          policies=dict(Counter(ctx.staging.values())),
                          network=_since(read_counts(storage), attempt.counts), bytes_taken_over=attempt.taken)
        report_save(f"checkpoint-{ctx.step}", strategy.rank, stats.network)
        self.last_save = stats
        return stats

    def refuse(self, ctx: SaveContext, exc: BaseException) -> NoReturn:
        """This rank's save failed before its write (a refusal, a state dict that cannot be
        built): the other ranks are on their way to the write's first agreement, so meet them
        there with ``exc``, which every rank then raises."""
        with self._failing_cleanly(ctx, attempt := self._attempt(ctx)):
            self._agree(ctx, exc, "save: starting")
        raise AssertionError("unreachable: the agreement raises the refusal") from exc

    def _attempt(self, ctx: SaveContext) -> "_Attempt":
        job = self.job
        pending = pending_checkpoint(job.storage, ctx.path, job.token)
        return _Attempt(pending, job.storage.join(pending.write_path, job.strategy.data_dir), read_counts(job.storage))

    def _begin(self, ctx: SaveContext, attempt: "_Attempt") -> None:
        """Coordinator: claim the checkpoint's folder (its owner marker) and make the data
        folder, before any rank writes; every rank agrees that it worked."""
        job = self.job
        failed: BaseException | None = None
        try:
            ctx.run_before_write_callbacks()
            if job.strategy.is_coordinator:
                self.leftovers.retry()
                if job.component:
                    check_part_free(job.storage, ctx.path, ctx.step, job.component)
                attempt.pending.begin()
                attempt.begun = True
                job.storage.makedirs(attempt.data_path)
        except Exception as exc:
            failed = exc
        self._agree(ctx, failed, "save: starting")

    def _agree(self, ctx: SaveContext, failed: BaseException | None, phase: str) -> None:
        """Every rank: raise the failure of any rank (the first), or go on together."""
        job = self.job
        error = agreed_failure(failed, ctx.step, job.storage.url, ctx.world_size)
        job.strategy.agree(error, phase, ctx.step)

    @contextlib.contextmanager
    def _failing_cleanly(self, ctx: SaveContext, attempt: "_Attempt") -> Iterator[None]:
        """A save's failure, wherever it happens: nothing of it left (the coordinator removes
        what it wrote), the caller's next wave not waited for, the error raised as a roll-ckpt
        one; the callbacks and ``roll_ckpt_save_finished`` told in every case."""
        job = self.job
        strategy = job.strategy
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = exc
            if (increments := strategy.increments) is not None:
                increments.failed()
            if ctx.gate is not None:
                ctx.gate.abort(exc)  # the caller may be waiting to stage the next wave
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            if not attempt.committed and (attempt.begun or strategy.is_coordinator):
                self.leftovers.discard(attempt.pending, attempt.begun)
            report_save(f"checkpoint-{ctx.step}", strategy.rank, _since(read_counts(job.storage), attempt.counts),
                        failed=True)
            translated = save_error(exc, ctx.step, job.storage.url, ctx.world_size)
            if translated is exc:
                raise
            raise translated from exc
        finally:
            ctx.run_finished_callbacks()
            job.plugins.hook.roll_ckpt_save_finished(save=ctx, error=error)

    def close(self) -> None:
        """Drain the save in flight (re-raising its error), then stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self.leftovers.retry()
            self._reuse.clear()


@dataclass
class StagedSave:
    """One save, staged: what its write and its commit need."""

    sd: dict[str, Any]
    """The staged state dict."""
    ctx: SaveContext
    user: dict[str, Any]
    """The caller's ``metadata`` for the manifest."""
    t0: float
    """When the save began (``time.perf_counter``)."""
    local_unit: Callable[[], None] | None = None
    """Writes the fast recovery tier's unit of the same staged state (before the persistent write)."""
    hf_module: Any = None
    """The module whose Hugging Face files the commit writes (``hf_weights``), or ``None``."""


@dataclass
class _Attempt:
    """How far one save got: what its failure has to undo."""

    pending: PendingCheckpoint
    data_path: str
    """Where the strategy writes (its ``data_dir`` in the folder being written)."""
    counts: NetworkCounts | None
    """The storage's network counts before the save."""
    begun: bool = False
    committed: bool = False
    total: int = 0
    taken: int = 0



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


def _since(now: NetworkCounts | None, before: NetworkCounts | None) -> NetworkCounts | None:
    return None if now is None or before is None else now.since(before)
