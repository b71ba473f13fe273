"""``RollCkptCheckpointManager``: torchtitan's checkpoint manager contract, served by roll-ckpt.

A :class:`torchtitan.components.checkpointer.BaseCheckpointManager` (torchtitan 0.3.0's
contract: the ``Trainer`` builds it from ``config.checkpoint`` with its model parts,
optimizers, LR schedulers, dataloader and ``states={"train_state": trainer}``, and calls the
methods below). Its ``Config`` is torchtitan's ``CheckpointManager.Config`` with every
field, plus ``roll_config``; each torchtitan field keeps its meaning:

``save(curr_step, last_step)``
    torchtitan's rule: a save at every multiple of ``interval``, at step 1 with
    ``enable_first_step_checkpoint``, at the last step; none with ``load_only``. A save is a
    roll-ckpt checkpoint ``<dump_folder>/<folder>/step-<N>/`` (manifest written last,
    checksums, atomic commit), asynchronous with ``async_mode: async`` or
    ``async_with_pinned_mem`` (the state is staged before ``save`` returns; the write goes on in
    the background). The last step is durable before ``save`` returns. With
    ``last_save_model_only`` (torchtitan's default) the last step -- and a seed checkpoint at
    step 0 -- is written as torchtitan writes it, by torchtitan's own ``dcp_save``: the model
    alone in ``export_dtype`` (Hugging Face safetensors with ``last_save_in_hf``), the
    folder torchtitan's conversion scripts and ``initial_load_path`` read.
    Every step is also where a preemption signal (SIGTERM) is acted on: the step is saved
    durably and the process exits (roll-ckpt's ``checkpoint_config.preemption``).
    A save of step N replaces a ``step-<N>`` folder already there (an earlier launch's, or a
    torchtitan save cut short), as torchtitan's does: it is removed first, named in a warning.
``load(step=-1)``
    ``-1``: the newest checkpoint roll-ckpt can resume from under the folder -- its own
    committed ones, and torchtitan's own ``step-<N>`` folders (read-only, through the
    ``torchtitan`` format) -- every newer folder passed over named in a WARNING (a save cut
    short, a model-only last step). Nothing there: ``initial_load_path`` (a roll-ckpt
    checkpoint or a torchtitan folder; the model alone with ``initial_load_model_only``), or
    Hugging Face weights (``initial_load_in_hf``, torchtitan's own reader), else a fresh start
    (``False``). ``step=N``: that step (step 0: the model alone, as torchtitan loads seeds).
    ``exclude_from_loading`` leaves those states as they are. Sets ``train_state`` so the
    Trainer continues at the next step.
``maybe_wait_for_staging()``
    an asynchronous save copies the state in a thread of its own while the next step runs
    its forward and backward passes (neither changes the parameters nor the optimizer's
    state); the Trainer calls this just before ``optimizers.step()``, which waits for that
    copy. (Every state dict is taken in ``save`` itself: the dataloader and the train state
    move on at the next step.) With the fast recovery tier (``checkpoint_config.local``) the
    state is staged in ``save``, before it returns.
``maybe_wait_for_saving()``
    waits for the asynchronous save in flight (``save_future``) and raises its error.
``close()``
    waits for the save in flight and raises its error; idempotent.

``keep_latest_k`` is roll-ckpt's retention (``max_ckpt_to_keep``): it never removes the
newest committed checkpoint nor one being written, and never another framework's folder
(torchtitan's own steps stay until you remove them).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torchtitan.components.checkpointer import (BaseCheckpointManager, CheckpointManager, DATALOADER, LR_SCHEDULER,
                                                MODEL, ModelWrapper, OPTIMIZER)
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.config.override import derive, override
from torchtitan.tools import filesystem

from roll_ckpt import CheckpointManager as RollCkptManager
from roll_ckpt import GlobalState
from roll_ckpt.plugin import CheckpointNotFoundError, ConfigError, RollCkptError

from .settings import roll_config
from .state_map import DataloaderState, roll_state
from .tt_format import TORCHTITAN_VERSION

__all__ = ["RollCkptCheckpointManager", "use_roll_ckpt"]

log = logging.getLogger("roll_ckpt")


class _Staging(threading.Thread):
    """An asynchronous save's staging, overlapping the next step's forward and backward: the
    copies of the model's and optimizer's tensors are taken before ``maybe_wait_for_staging``
    returns, which the Trainer calls just before ``optimizers.step()`` changes them."""

    def __init__(self, save: Any) -> None:
        super().__init__(name="roll-ckpt-torchtitan-staging", daemon=True)
        self._save = save
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with torch.no_grad():
                self._save()
        except BaseException as exc:  # handed to the training thread by wait()
            self.error = exc

    def wait(self) -> None:
        self.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


class _SaveInFlight:
    """``save_future`` while roll-ckpt's asynchronous save stages and writes (torchtitan's
    manager keeps DCP's future there): ``result()`` waits for it and raises its error."""

    def __init__(self, manager: RollCkptManager, staging: _Staging | None = None) -> None:
        self._manager, self._staging = manager, staging

    def done(self) -> bool:
        return (self._staging is None or not self._staging.is_alive()) and not self._manager.stats.in_flight

    def result(self, timeout: float | None = None) -> None:
        if self._staging is not None:
            self._staging.wait()
        self._manager.wait()


class _Taken:
    """Set once roll-ckpt took every value of a save's state (and the processes' RNG, which
    it takes with them): ``save()`` returns then, before the next step draws from the RNG."""

    def __init__(self, n: int) -> None:
        self.left, self.done, self._lock = n, threading.Event(), threading.Lock()

    def one(self) -> None:
        with self._lock:
            self.left -= 1
            if self.left <= 0:
                self.done.set()

    def wait(self, staging: threading.Thread) -> None:
        while not self.done.wait(0.002) and staging.is_alive():
            pass


class _Frozen:
    """A state dict taken at ``save()``: its tensors are the live ones (copied by the staging
    before the optimizer changes them), every other value as it was then."""

    def __init__(self, sd: Any, taken: _Taken) -> None:
        self.sd = _copy_structure(sd)
        self.taken = taken

    def state_dict(self) -> Any:
        self.taken.one()
        return self.sd

    def load_state_dict(self, sd: Any) -> None:
        raise RollCkptError("a state taken for a save is not loaded into")


def _copy_structure(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy_structure(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_structure(v) for v in value]
    return value


def _check_torchtitan() -> None:
    from importlib import metadata

    try:
        found = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:  # a source checkout
        return
    if found.split("+")[0].rsplit(".", 1)[0] != TORCHTITAN_VERSION.rsplit(".", 1)[0]:
        log.warning("roll-ckpt: torchtitan %s: roll-ckpt-torchtitan was written for and tested with torchtitan %s; "
                    "its checkpoint manager contract may have changed", found, TORCHTITAN_VERSION)


class RollCkptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager, backed by roll-ckpt (see the module doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's ``CheckpointManager.Config`` (every field, ``async_mode`` included), plus:"""

        roll_config: str = ""
        """A roll-ckpt YAML file whose ``checkpoint_config`` and ``strategy_config`` add roll-ckpt's
        own keys (``storage_options``, ``backup``, ``preemption``, ``local``...); the keys
        torchtitan's fields set are refused there. Empty: none."""

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future: Any = None
        if not self.enable:
            return
        _check_torchtitan()
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        unknown = [k for k in config.exclude_from_loading if k not in self.states]
        if unknown:
            raise ConfigError("checkpoint.exclude_from_loading", "names a state torchtitan does not save", unknown[0],
                              ", ".join(k for k in self.states if k != MODEL))
        self.sd_adapter = sd_adapter
        self.last_save_in_hf = config.last_save_in_hf
        if self.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided.")
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._closed = False
        self._staging: _Staging | None = None
        self.manager = RollCkptManager(roll_config(self.folder, interval=config.interval,
                                                   keep_latest_k=config.keep_latest_k, async_mode=config.async_mode,
                                                   roll_config_file=config.roll_config), quiet=True)
        self._cc = cc = self.manager.config.checkpoint_config
        self._overlap = config.async_mode != "disabled" and cc.local is None
        """Asynchronous saves stage while the next step computes (not with the fast recovery tier,
        whose local saves go with the persistent ones in the training thread)."""
        self._preemption = bool(cc.preemption.signals)
        self._agreeing: Any = None
        self._agree_group: Any = None
        dist = torch.distributed
        if self._preemption and dist.is_initialized() and dist.get_world_size() > 1:
            self._agree_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cc.collective_timeout_s))
        log.info("roll-ckpt: torchtitan's checkpoints are saved and resumed by roll-ckpt in %s (interval %d, %s, "
                 "keep_latest_k %d)", self.folder, self.interval,
                 "synchronous" if config.async_mode == "disabled" else "asynchronous", config.keep_latest_k)

    # ------------------------------------------------------------------ the roll-ckpt state

    def _state(self, *, loading: bool = False, model_only: bool = False) -> dict[str, Any]:
        exclude = tuple(self.config.exclude_from_loading) if loading else ()
        return roll_state(self.states, exclude, model_only)

    def _frozen_state(self) -> tuple[dict[str, Any], _Taken]:
        """The state of this step for a save that stages in another thread: every state dict
        taken now, in this thread (the dataloader and the train state move on at the next
        step; torch's state-dict helpers may run collectives on the training's group)."""
        live = {key: value for key, value in self.states.items() if value is not None}
        taken = _Taken(len(live))
        out: dict[str, Any] = {}
        for key, value in live.items():
            frozen = _Frozen(value.state_dict(), taken)
            out[key] = DataloaderState(frozen) if key == DATALOADER else GlobalState(frozen)
        return out, taken

    def _step_path(self, step: int) -> str:
        return filesystem.join(self.folder, f"step-{step}")

    def _is_coordinator(self) -> bool:
        return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0

    def _clear(self, step: int) -> None:
        """torchtitan's rule: a save of step N replaces the ``step-<N>`` folder there (an earlier
        launch's checkpoint of that step, or a save cut short). Coordinator only, before the save."""
        if not self._is_coordinator():
            return
        storage = self.manager.storage
        path = storage.join(self.manager.storage.root, f"step-{step}")
        if not storage.isdir(path) or path == self.manager.resumed.path:
            return
        log.warning("roll-ckpt: step-%d is already in %s (an earlier launch's, or a save cut short): the save of step "
                    "%d replaces it, as torchtitan's own does", step, self.folder, step)
        storage.remove_tree(path)

    # ------------------------------------------------------------------ saving

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self._closed or self.config.load_only:
            return False
        self._join_staging()  # a loop that did not call maybe_wait_for_staging
        begin = time.monotonic()
        self.save_future = None
        if last_step:
            if self.config.last_save_model_only or curr_step == 0:
                self._save_model_only(curr_step)
            else:
                self._clear(curr_step)
                self.manager.save(curr_step, self._state(), final=True)
            log.info("roll-ckpt: saved the last step, %d, in %.2f s", curr_step, time.monotonic() - begin)
            return True
        first = curr_step == 1 and self.config.enable_first_step_checkpoint
        due = curr_step % self.interval == 0
        state = self._state()
        self.manager.bind(state)  # (the first bind makes process groups: a collective, in this thread)
        if self._preemption_agreed(curr_step):  # a rank got a signal: every rank saves this step durably
            self._clear(curr_step)
            self.manager.maybe_save(curr_step, state)  # raises Preempted (preemption.exit) once committed
            self._closed = self.manager.preemption.committed
            return True
        local = self._cc.local
        if not (due or first or (local is not None and curr_step % local.save_steps == 0)):
            if (curr_step + 1) % self.interval == 0:  # the next step saves: its staging buffers made ready meanwhile
                self.manager.prepare_save()
            return False
        if due or first:
            self._clear(curr_step)
        if (due or first) and self._overlap:
            frozen, taken = self._frozen_state()
            self._staging = _Staging(lambda: self.manager.save(curr_step, frozen))
            self._staging.start()
            taken.wait(self._staging)  # (and the save in flight before it is written: torchtitan's waits too)
            self.save_future = _SaveInFlight(self.manager, self._staging)
            log.info("roll-ckpt: staging step %d while the next step computes (%.3f s here)", curr_step,
                     time.monotonic() - begin)
            return True
        path = self.manager.maybe_save(curr_step, state)  # every interval; the fast tier's saves
        if path is None and first and not due:
            path = self.manager.save(curr_step, state)
        if path is None:
            return False
        if self.config.async_mode != "disabled":  # as torchtitan's: set by every asynchronous save
            self.save_future = _SaveInFlight(self.manager)
        log.info("roll-ckpt: %s step %d in %.2f s", "staged" if self.save_future is not None else "saved", curr_step,
                 time.monotonic() - begin)
        return True

    def _preemption_agreed(self, step: int) -> bool:
        """Whether a rank got a preemption signal, agreed by every rank without waiting for the
        slowest: each step starts a small all-reduce of the ranks' flags on a gloo group of its
        own and reads the one the step before started (done long since: the ranks met in the
        training's collectives meanwhile). A signal is acted on at the step after the one it
        came in, on every rank at the same step."""
        if not self._preemption:
            return False
        if self._agree_group is None:  # one process
            return self.manager.preemption.requested
        seen = False
        if self._agreeing is not None:
            work, flag = self._agreeing
            work.wait()
            seen = bool(flag.item())
        flag = torch.tensor([1 if self.manager.preemption.requested else 0], dtype=torch.int32)
        dist = torch.distributed
        self._agreeing = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._agree_group, async_op=True), flag)
        return seen

    def _join_staging(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.wait()

    def _save_model_only(self, step: int) -> None:
        """The model alone in ``export_dtype``, as torchtitan writes a last step with
        ``last_save_model_only`` (and a seed at step 0): torchtitan's own ``dcp_save``."""
        self.manager.wait()
        states = {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                  and v.dtype != self.export_dtype else v for k, v in self.states[MODEL].state_dict().items()}
        self._clear(step)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # the old folder is gone before any rank writes into the new one
        CheckpointManager.dcp_save(self, states, checkpoint_id=self._step_path(step),  # type: ignore[arg-type]
                                   async_mode=AsyncMode.DISABLED, enable_garbage_collection=True,
                                   to_hf=self.last_save_in_hf)
        log.info("roll-ckpt: step %d written as torchtitan's model-only checkpoint (%s%s) at %s", step,
                 str(self.export_dtype).replace("torch.", ""), ", Hugging Face safetensors" if self.last_save_in_hf
                 else "", self._step_path(step))

    # ------------------------------------------------------------------ loading

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        if self._closed:
            raise RollCkptError("this checkpoint manager is closed")
        begin = time.monotonic()
        if step == -1:
            self.manager.resume(self._state(loading=True), "latest")
            if self.manager.resumed.path is None:
                return self._initial_load(begin)
            where = self.manager.resumed.path
        else:
            where = self._step_path(step)
            self.manager.resume(self._state(loading=True, model_only=step == 0), where)
        log.info("roll-ckpt: loaded %s in %.2f s", where, time.monotonic() - begin)
        return True

    def _initial_load(self, begin: float) -> bool:
        """Nothing to resume under the folder: torchtitan's ``initial_load_*`` options."""
        cfg = self.config
        path = cfg.initial_load_path
        if cfg.initial_load_in_hf:
            if not path:
                if not (self.sd_adapter is not None and getattr(self.sd_adapter, "hf_assets_path", None)):
                    raise ConfigError("checkpoint.initial_load_in_hf", "needs --checkpoint.initial_load_path or "
                                      "the model's hf_assets_path", True)
                path = self.sd_adapter.hf_assets_path
            if not filesystem.isdir(path):
                raise CheckpointNotFoundError(f"no Hugging Face folder at {path} (checkpoint.initial_load_in_hf)")
            # torchtitan's own reader of Hugging Face safetensors (no pickle), through its state dict adapter
            CheckpointManager.dcp_load(self, self.states[MODEL].state_dict(), checkpoint_id=path,  # type: ignore[arg-type]
                                       from_hf=True, from_quantized=cfg.initial_load_in_hf_quantized)
        elif path:
            self._load_initial(path, self._state(loading=True, model_only=cfg.initial_load_model_only))
        else:
            log.info("roll-ckpt: no checkpoint in %s and no initial_load_path: a fresh start", self.folder)
            return False
        log.info("roll-ckpt: loaded %s (initial_load_path%s) in %.2f s", path,
                 ", the model only" if cfg.initial_load_model_only else "", time.monotonic() - begin)
        return True

    def _load_initial(self, path: str, state: dict[str, Any]) -> None:
        """``initial_load_path``: a roll-ckpt checkpoint, or any torchtitan folder (a model-only
        last step too), read into ``state`` on every rank; an error on one is raised on all."""
        from roll_ckpt.plugin import get_plugins, open_storage

        from .state_map import load_torchtitan_folder
        from .tt_format import recognize

        cc = self.manager.config.checkpoint_config
        storage = open_storage(get_plugins(), cc.type, path, cc.storage_options)
        if storage.exists(storage.join(storage.root, "manifest.json")):
            self.manager.resume(state, path)
            return
        strategy = self.manager.bind(state)
        error: BaseException | None = None
        try:
            found = recognize(storage, storage.root)
            if found is None:
                raise CheckpointNotFoundError(f"{path} (checkpoint.initial_load_path) is neither a roll-ckpt "
                                              "checkpoint nor a torchtitan one")
            if found.problems:
                raise CheckpointNotFoundError(f"{path} (checkpoint.initial_load_path) is a torchtitan checkpoint that "
                                              f"was never finished: {'; '.join(found.problems)}")
            if found.kind == "hf":
                raise RollCkptError(f"{path} holds Hugging Face safetensors: set --checkpoint.initial_load_in_hf")
            load_torchtitan_folder(storage, storage.root, {MODEL: state[MODEL]} if found.model_only else state)
        except Exception as exc:
            error = exc
        strategy.agree(error, f"initial load of {path}")

    # ------------------------------------------------------------------ waiting and closing

    def _maybe_wait_for_staging(self) -> None:
        """Wait until the asynchronous save's staging has copied the state (the optimizer may
        change it then); raises its error."""
        self._join_staging()

    def _wait_for_saving(self) -> None:
        future, self.save_future = self.save_future, None
        if future is not None:
            future.result()

    def _close(self) -> None:
        manager = getattr(self, "manager", None)  # None: closed already (close() may come twice)
        self._closed = True
        self.save_future = None
        agreeing, self._agreeing = getattr(self, "_agreeing", None), None
        try:
            self._join_staging()
            if agreeing is not None:
                agreeing[0].wait()  # the last step's preemption check: every rank started it
        finally:
            self.manager = None
            if manager is not None:
                manager.close()


def use_roll_ckpt(cfg: CheckpointManager.Config, roll_config: str = "") -> RollCkptCheckpointManager.Config:
    """The switch (``--override.imports roll_ckpt_torchtitan.use_roll_ckpt``): torchtitan's
    checkpoint config as :class:`RollCkptCheckpointManager`'s, every field kept (torchtitan's
    ``derive``); ``roll_config``: a roll-ckpt YAML file, as JSON after the name:
    ``'roll_ckpt_torchtitan.use_roll_ckpt={"roll_config": "/path/roll.yaml"}'``.

    Registered as ``roll_ckpt_torchtitan.use_roll_ckpt`` (torchtitan keys an override by its
    function's module and name); claims torchtitan's stock ``CheckpointManager.Config`` only
    (``exact``), not another framework's subclass of it."""
    return derive(cfg, RollCkptCheckpointManager.Config, roll_config=roll_config)


use_roll_ckpt.__module__ = "roll_ckpt_torchtitan"  # the name users list in --override.imports
use_roll_ckpt = override(target=CheckpointManager.Config, exact=True,
                         description="roll-ckpt saves and resumes torchtitan's checkpoints")(use_roll_ckpt)
