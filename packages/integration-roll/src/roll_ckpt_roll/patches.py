"""The ROLL methods :func:`roll_ckpt_roll.enable` replaces, and what each does instead.

Read from alibaba/ROLL at :data:`~roll_ckpt_roll.roll_format.ROLL_COMMIT`; each replacement keeps
the method's signature and what its callers rely on (arguments, return value, when it blocks):

``FSDP2StrategyBase.save_checkpoint(save_dir, global_step, ckpt_id, tag, local_state_path, is_last_step=)``
    (``roll/distributed/strategy/fsdp2_strategy.py``; called by every rank of ``ActorWorker``/
    ``CriticWorker.do_checkpoint``). This worker's part of step ``global_step``
    (``checkpoint-<step>/<cluster_name>/``, committed with its manifest and checksums) through
    the worker's roll-ckpt manager: asynchronous per ``async_save_ckpt`` /
    ``checkpoint_config.async_upload`` except on the last step, durable before it returns then;
    the model's Hugging Face files and the tokenizer in the part (ROLL's ``save_pretrained``),
    written off the loop from the DCP files, and published at the step's folder for every
    worker but the critic (ROLL's upload puts them there). No local staging folder: ``save_dir``
    and ``local_state_path`` name ROLL's, which nothing is written to (so there is nothing to
    upload or delete: ``keep_local_file`` is roll-ckpt's, with a ``backup``). Returns ROLL's
    metrics keys (``dcp_save``: the seconds the call blocked).
``FSDP2StrategyBase.load_checkpoint(load_dir, tag)``
    (``ActorWorker``/``CriticWorker.initialize``). Resumes this worker's part of the checkpoint
    ``load_dir`` -- the step the driver chose, ``<step>/<cluster_name>`` for the critic -- every
    parameter, every optimizer state tensor, the scheduler and the RNG, checked first; a
    ROLL checkpoint too (read-only). Raises instead of ROLL's silent no-op.
``FSDP2StrategyBase.offload_states``/``load_states``
    unchanged, unless the worker's ``strategy_config.offload_backend`` is set (roll-ckpt's key):
    then the model's and optimizer's local shards go into roll-ckpt's offload store, and a
    save while they are offloaded writes straight from it (zero-copy).
``BasePipeline.__init__``
    (``roll/pipeline/base_pipeline.py``) as ROLL's, but ``resume_from_checkpoint`` (``true``,
    ``latest`` or a path) is resolved by roll-ckpt -- the newest usable step across every
    launch's folder, ROLL's own checkpoints included, every folder passed over named -- and
    the driver's ``WorkerState`` comes from its part; ``pipeline_config.resume_from_checkpoint``
    is then that step's path, which every worker's ``initialize`` loads.
``BasePipeline.do_checkpoint(global_step, is_last_step)``
    ROLL's schedule (``save_steps``, the last step) and its calls to every checkpoint cluster's
    ``do_checkpoint``; the driver's ``WorkerState`` is the ``pipeline`` part. A preemption
    (SIGTERM to the driver or to any checkpoint worker) makes the next call save the step
    for every component durably; the workers' managers close (a worker's held SIGTERM then
    ends it as Ray's handler would), and the driver's part goes through its manager's
    preemption path, which raises :class:`roll_ckpt.Preempted` with the status of the handler
    it held the signal back from (Ray's: 15).
``roll.pipeline.base_worker.download_model``
    a checkpoint URL (``s3://...``) is returned as it is (ROLL's would try a model hub).

Left to ROLL: everything else -- training, rollout, model updates, ROLL's ``CheckpointManager``
(its uploader, created but unused), ``_cleanup_old_checkpoints`` of the local staging folder
(empty), Megatron's strategy.
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import json
import logging
import time
from typing import Any, Callable

from roll_ckpt import CheckpointManager, DriverState
from roll_ckpt.plugin import RollCkptError

from .roll_format import PIPELINE, ROLL_COMMIT
from .settings import checkpoint_root, config_for
from .state_map import WORKER_STATE_KEYS

__all__ = ["install", "installed", "WorkerPart", "PipelinePart", "preemption_flag", "close_part"]

log = logging.getLogger("roll_ckpt")

_ORIGINALS: dict[tuple[type, str], Any] = {}
_EXPECTED = {
    "save_checkpoint": ["self", "save_dir", "global_step", "ckpt_id", "tag", "local_state_path"],
    "load_checkpoint": ["self", "load_dir", "tag"],
    "offload_states": ["self", "include", "non_blocking"],
    "load_states": ["self", "include", "non_blocking"],
    "__init__": ["self", "pipeline_config"],
    "do_checkpoint": ["self", "global_step", "is_last_step"],
}


def installed() -> bool:
    return bool(_ORIGINALS)


def _check(cls: type, name: str) -> Any:
    """ROLL's ``cls.name``, checked to have the signature it was read with."""
    original = cls.__dict__.get(name)
    if original is None:
        raise RollCkptError(f"ROLL's {cls.__module__}.{cls.__qualname__} has no {name}: this ROLL is not the one "
                            f"roll-ckpt-roll was written for (alibaba/ROLL {ROLL_COMMIT[:8]}); nothing was changed")
    params = [p for p in inspect.signature(original).parameters if p not in ("args", "kwargs")]
    if params[:len(_EXPECTED[name])] != _EXPECTED[name]:
        raise RollCkptError(f"ROLL's {cls.__qualname__}.{name}{inspect.signature(original)} is not the method "
                            f"roll-ckpt-roll replaces ({', '.join(_EXPECTED[name])}; alibaba/ROLL {ROLL_COMMIT[:8]}); "
                            "nothing was changed")
    return original


def install() -> None:
    """Replace the ROLL methods listed in the module doc (idempotent; imports ROLL). Every one
    is checked before any is replaced."""
    if installed():
        return
    from roll.distributed.strategy.fsdp2_strategy import FSDP2StrategyBase
    from roll.pipeline import base_pipeline, base_worker

    plan: list[tuple[type, str, Callable[..., Any]]] = [
        (FSDP2StrategyBase, "save_checkpoint", save_checkpoint),
        (FSDP2StrategyBase, "load_checkpoint", load_checkpoint),
        (FSDP2StrategyBase, "offload_states", offload_states),
        (FSDP2StrategyBase, "load_states", load_states),
        (base_pipeline.BasePipeline, "__init__", pipeline_init),
        (base_pipeline.BasePipeline, "do_checkpoint", do_checkpoint)]
    originals = {(cls, name): _check(cls, name) for cls, name, _ in plan}
    for cls, name, new in plan:
        setattr(cls, name, new)
    _ORIGINALS.update(originals)
    original_download = base_worker.download_model

    def download_model(model_name_or_path: str, local_dir: Any = None) -> str:
        if "://" in str(model_name_or_path):  # a checkpoint on an object store: roll-ckpt reads it there
            return model_name_or_path
        return original_download(model_name_or_path, local_dir)

    base_worker.download_model = download_model
    log.info("roll-ckpt: ROLL's FSDP2 checkpoints and pipeline state now go through roll-ckpt")


def _original(cls_name: str, name: str) -> Any:
    return next(fn for (cls, n), fn in _ORIGINALS.items() if n == name and cls.__name__ == cls_name)


# --------------------------------------------------------------------------- workers


class WorkerPart:
    """One ROLL worker's part of each step: its strategy's model, optimizer and scheduler."""

    def __init__(self, strategy: Any) -> None:
        from roll.pipeline.base_worker import CriticWorker

        worker = strategy.worker
        self.strategy = strategy
        self.component = str(worker.cluster_name)
        self.at_root = not isinstance(worker, CriticWorker)  # ROLL uploads every other worker's files to the step
        self.manager = CheckpointManager(config_for(worker.pipeline_config, [self.component, PIPELINE],
                                                    hf_step_root=self.at_root), component=self.component,
                                         quiet=worker.rank != 0)
        self.uses_store = _wants_store(strategy)
        """roll-ckpt's offload store holds the state between ROLL's offload_states and load_states."""
        self.files_handed = False
        self.offloaded = False
        atexit.register(self.close)

    def state(self) -> dict[str, Any]:
        s = self.strategy
        out = {"model": s.model}
        if getattr(s, "optimizer", None) is not None:
            out["optimizer"] = s.optimizer
        if getattr(s, "scheduler", None) is not None:
            out["scheduler"] = s.scheduler
        return out

    def resume(self, load_dir: str) -> int:
        step = self.manager.resume(self.state(), str(load_dir))
        if step == 0:
            raise RollCkptError(f"load_checkpoint({load_dir!r}): nothing was resumed")
        return step

    def save(self, step: int, final: bool) -> dict[str, float]:
        if not self.files_handed:  # the files ROLL's save_pretrained writes beside the weights
            extras = [getattr(self.strategy, n, None) for n in ("tokenizer", "processor")]
            self.manager.hf_files(*[x for x in extras if x is not None and hasattr(x, "save_pretrained")])
            self.files_handed = True
        t0 = time.perf_counter()
        self.manager.save(step, self.state(), final=final)
        return {"load": 0.0, "offload": 0.0, "dcp_save": time.perf_counter() - t0, "hf_save": 0.0}

    def close(self) -> None:
        try:
            self.manager.close()
        except RollCkptError as exc:  # at exit: said, not raised
            log.error("roll-ckpt: %s's last save failed: %s", self.component, exc)


def _trains(strategy: Any) -> bool:
    """A training worker's strategy (it has an optimizer); inference workers keep ROLL's own paths."""
    return getattr(strategy, "model", None) is not None and getattr(strategy, "optimizer", None) is not None


def _wants_store(strategy: Any) -> bool:
    """A training worker whose ``strategy_config`` sets roll-ckpt's ``offload_backend``."""
    config = getattr(getattr(strategy.worker_config, "strategy_args", None), "strategy_config", None) or {}
    return "offload_backend" in config and _trains(strategy)


def _part(strategy: Any) -> WorkerPart:
    part = strategy.__dict__.get("_roll_ckpt")
    if part is None:
        part = strategy._roll_ckpt = WorkerPart(strategy)
    return part


def save_checkpoint(self: Any, save_dir: str, global_step: int, ckpt_id: str, tag: str = "checkpoint",
                    local_state_path: Any = None, **kwargs: Any) -> dict[str, float]:
    """``FSDP2StrategyBase.save_checkpoint``, through roll-ckpt (the module doc)."""
    is_last_step = kwargs.get("is_last_step")
    if is_last_step is None:  # ROLL's own default when the caller does not say
        max_steps = getattr(self.worker_config.training_args, "max_steps", None)
        is_last_step = global_step == max_steps - 1 if max_steps is not None else True
    return _part(self).save(int(global_step), bool(is_last_step))


def load_checkpoint(self: Any, load_dir: str, tag: str = "checkpoint", **kwargs: Any) -> None:
    """``FSDP2StrategyBase.load_checkpoint``, through roll-ckpt (the module doc)."""
    step = _part(self).resume(load_dir)
    log.info("roll-ckpt: %s resumed step %d from %s", self.worker.cluster_name, step, load_dir)


def _covers_all(include: Any) -> bool:
    if include is None:
        return True
    names = {getattr(i, "name", str(i)).lower() for i in include}
    return {"model_params", "optimizer_states"} <= names


def offload_states(self: Any, include: Any = None, non_blocking: bool = False) -> Any:
    part = self.__dict__.get("_roll_ckpt")
    if part is None and _trains(self) and getattr(self.worker, "pipeline_config", None):
        # Made here, at the end of ROLL's initialize, so the worker's preemption handler is
        # installed before its first step; an inference worker keeps ROLL's own offload.
        part = _part(self)
    if part is not None and part.uses_store and _covers_all(include):
        part.manager.bind(part.state())
        part.manager.strategy.offload_states(part.state(), optimizer=True)
        part.offloaded = True
        return None
    return _original("FSDP2StrategyBase", "offload_states")(self, include, non_blocking)


def load_states(self: Any, include: Any = None, non_blocking: bool = False) -> Any:
    part = self.__dict__.get("_roll_ckpt")
    if part is not None and part.offloaded:
        part.manager.strategy.load_states(part.state())
        part.offloaded = False
        return None
    return _original("FSDP2StrategyBase", "load_states")(self, include, non_blocking)


def preemption_flag(worker: Any) -> bool:
    """Run in a worker actor (``__ray_call__``): whether its manager got a preemption signal."""
    part = getattr(getattr(worker, "strategy", None), "__dict__", {}).get("_roll_ckpt")
    return bool(part is not None and part.manager.preemption.requested)


def close_part(worker: Any) -> None:
    """Run in a worker actor after a preemption checkpoint: close its manager, which runs the
    signal handler its SIGTERM was held back from (Ray's: the actor exits)."""
    part = getattr(getattr(worker, "strategy", None), "__dict__", {}).get("_roll_ckpt")
    if part is not None:
        part.close()


def prepare_part(worker: Any) -> None:
    """Run in a worker actor the step before a save step: its manager makes its staging buffers
    ready in its writer thread while the step runs (their memory is freed between saves)."""
    part = getattr(getattr(worker, "strategy", None), "__dict__", {}).get("_roll_ckpt")
    if part is not None:
        part.manager.prepare_save()


# --------------------------------------------------------------------------- the driver


class PipelinePart:
    """The driver's part: ROLL's ``WorkerState`` as a :class:`roll_ckpt.DriverState`."""

    def __init__(self, pipeline_config: Any) -> None:
        self.pipeline_config = pipeline_config
        self.enabled = checkpoint_root(pipeline_config) is not None
        self.saver: CheckpointManager | None = None
        self.watch: CheckpointManager | None = None
        if self.enabled:  # watches for preemption signals from the start (main thread)
            self.watch = CheckpointManager(config_for(pipeline_config, [PIPELINE]), component=PIPELINE)
            atexit.register(self.close)

    def resume(self, target: Any) -> tuple[str, dict[str, Any]] | None:
        """``resume_from_checkpoint`` resolved and the driver's state loaded: ``(step path, values)``."""
        if not self.enabled or target in (None, False, ""):
            return None
        driver = DriverState()
        assert self.watch is not None
        step = self.watch.resume({"driver": driver}, "latest" if target is True else str(target))
        if step == 0 and self.watch.resumed.path is None:
            return None
        return str(self.watch.resumed.path), dict(driver)

    def requested(self, clusters: list[Any]) -> bool:
        """A preemption signal reached the driver or a worker of a checkpoint cluster."""
        if self.watch is not None and self.watch.preemption.requested:
            return True
        import ray

        refs = []
        for cluster in clusters:
            for worker in getattr(cluster, "workers", []):
                call = getattr(worker, "__ray_call__", None)
                if call is not None:
                    refs.append(call.remote(preemption_flag))
        return any(ray.get(refs, timeout=60)) if refs else False

    @staticmethod
    def announce(clusters: list[Any]) -> None:
        """The next step saves: every worker of a checkpoint cluster prepares its buffers (a call
        that returns at once; the work goes on in the worker's writer thread)."""
        import ray

        refs = [w.__ray_call__.remote(prepare_part) for cluster in clusters for w in getattr(cluster, "workers", [])
                if getattr(w, "__ray_call__", None) is not None]
        if refs:
            ray.get(refs, timeout=60)

    def _saver(self, clusters: list[Any]) -> CheckpointManager:
        """The manager that saves the driver's parts: it lists every checkpoint cluster, which
        only the pipeline knows (it names them after its workers are built)."""
        if self.saver is None:
            names = [str(c.cluster_name) for c in clusters] + [PIPELINE]
            self.saver = CheckpointManager(config_for(self.pipeline_config, names), component=PIPELINE)
        return self.saver

    @staticmethod
    def _state(state: Any) -> dict[str, Any]:
        values = json.loads(json.dumps(dataclasses.asdict(state)))  # NumPy floats in metrics become floats
        return {"driver": DriverState(values)}

    def save(self, step: int, state: Any, final: bool, clusters: list[Any]) -> None:
        self._saver(clusters).save(step, self._state(state), final=final)

    def preempted(self, step: int, state: Any, clusters: list[Any]) -> str | None:
        """Every worker's part of ``step`` is committed: the driver's, through its manager's own
        preemption path -- saved durably, then the signal held back from the handler that was
        there before (Ray's, in a driver) is passed on and :class:`roll_ckpt.Preempted` raised
        with that handler's status (``preemption.exit``; ``false``: returns, ROLL goes on)."""
        saver = self._saver(clusters)
        if saver.config.checkpoint_config.preemption.exit:
            self._close_workers(clusters)  # their held SIGTERMs now end them, as Ray's handler would
        if self.watch is not None:
            self.watch.close()  # the held signal stays for the saver's preemption save to pass on
            self.watch = None
        saver.preemption.request()
        return saver.maybe_save(step, self._state(state))

    @staticmethod
    def _close_workers(clusters: list[Any]) -> None:
        import ray

        for cluster in clusters:
            refs = [w.__ray_call__.remote(close_part) for w in getattr(cluster, "workers", [])
                    if getattr(w, "__ray_call__", None) is not None]
            for ref in refs:
                try:
                    ray.get(ref, timeout=600)
                except Exception as exc:  # an actor its own SIGTERM handler ended meanwhile
                    log.info("roll-ckpt: a worker of %s ended: %s", cluster.cluster_name, type(exc).__name__)

    def close(self) -> None:
        """Close the driver's managers (at exit)."""
        for manager in (self.saver, self.watch):
            if manager is not None:
                manager.close()


def pipeline_init(self: Any, pipeline_config: Any) -> None:
    """``BasePipeline.__init__``: ROLL's, with ``resume_from_checkpoint`` resolved by roll-ckpt."""
    from roll.utils.worker_state import WorkerState

    target = pipeline_config.resume_from_checkpoint
    part = PipelinePart(pipeline_config)
    pipeline_config.resume_from_checkpoint = False  # ROLL's own lookup would miss roll-ckpt's steps
    try:
        _original("BasePipeline", "__init__")(self, pipeline_config)
    finally:
        pipeline_config.resume_from_checkpoint = target
    self._roll_ckpt = part
    found = part.resume(target)
    if found is None:
        pipeline_config.resume_from_checkpoint = False
        return
    path, values = found
    self.state = WorkerState(**{k: values[k] for k in WORKER_STATE_KEYS if k in values})
    self.resume_from_checkpoint = path
    pipeline_config.resume_from_checkpoint = path  # what every worker's initialize loads its part from
    log.info("roll-ckpt: the pipeline resumes after step %s from %s", self.state.step, path)

    def resume_metrics() -> None:  # as ROLL's __init__ does
        for metrics in self.state.log_history:
            self.tracker.log(values=metrics, step=metrics["system/step"])

    self.resume_futures.append(self.executor.submit(resume_metrics))


def do_checkpoint(self: Any, global_step: int, is_last_step: Any = None) -> None:
    """``BasePipeline.do_checkpoint``: ROLL's schedule and worker calls; the driver's part through roll-ckpt."""
    from concurrent import futures

    from roll.distributed.scheduler.protocol import DataProto
    from roll.utils.functionals import reduce_metrics

    cfg = self.pipeline_config
    if is_last_step is None:
        is_last_step = global_step == cfg.max_steps - 1
    metrics = self.state.log_history[-1]
    metrics["system/step"] = global_step
    part: PipelinePart = self._roll_ckpt
    clusters = list(self.checkpoint_clusters)
    preempt = part.enabled and part.requested(clusters)
    due = global_step > 0 and (global_step % cfg.save_steps == 0 or global_step == cfg.max_steps - 1)
    if part.enabled and (due or preempt):
        final = bool(is_last_step) or preempt
        refs = [cluster.do_checkpoint(global_step=global_step, is_last_step=final, blocking=False)
                for cluster in clusters]
        for ckpt_refs in refs:
            done = DataProto.materialize_concat(data_refs=ckpt_refs)
            metrics.update(reduce_metrics(done.meta_info.pop("metrics", {})))
        if not preempt:
            part.save(global_step, self.state, final, clusters)
    following = global_step + 1
    if part.enabled and not preempt and cfg.save_steps > 0 and following < cfg.max_steps - 1 \
            and following % cfg.save_steps == 0:
        part.announce(clusters)  # (the last step's save is synchronous: nothing to prepare)
    futures.wait(self.resume_futures)
    self.resume_futures.clear()
    if preempt:
        log.warning("roll-ckpt: preemption: every cluster's part of step %d is committed; the driver's follows, "
                    "then the job stops", global_step)
        part.preempted(global_step, self.state, clusters)  # raises roll_ckpt.Preempted (preemption.exit)
