"""``RollCkptCheckpointManager``: verl's ``BaseCheckpointManager`` contract, served by roll-ckpt.

verl's FSDP engine calls its checkpoint manager on every rank of a role (SPMD)::

    save_checkpoint(local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None)
    load_checkpoint(local_path, hdfs_path=None, del_local_after_load=False)

``local_path`` is ``<dir>/global_step_<N>`` (the SFT ``CheckpointHandler``) or
``<dir>/global_step_<N>/<role>`` (the PPO trainer: ``actor``, ``critic``). One roll-ckpt
``CheckpointManager`` per ``<dir>`` (built on first use) saves into exactly those folders:

* SFT: each save is a whole checkpoint, committed before ``save_checkpoint`` returns (the
  handler writes its ``data_<dp>.pt`` files and the tracker right after: they are named in the
  manifest as files another program adds, ``checkpoint_config.beside``);
* PPO: each role's manager saves its part (``checkpoint_config.components: [role]``,
  ``commit_steps: false``) and the step is committed once it is whole, ``data.pt`` included
  (:mod:`roll_ckpt_verl.steps`). With ``checkpoint.async_save: true`` the save returns once the
  state is staged (the last step of training, ``global_step >= total_training_steps``, is
  saved synchronously: verl shuts Ray down right after it) and the tracker is written by
  roll-ckpt once the step is committed.

What is saved follows ``save_contents``/``load_contents``: ``model`` (required), ``optimizer``,
``extra`` (the LR scheduler; the RNG of every rank is always in a roll-ckpt checkpoint) and
``hf_model`` (the model as Hugging Face files in ``huggingface/``, written off the loop, with
the tokenizer/processor). ``max_ckpt_to_keep`` (verl's ``None``: keep all) keeps that many
committed steps under ``<dir>``, counted on disk, whole ``global_step_<N>`` folders removed.
A checkpoint verl's own manager wrote is resumed through roll-ckpt's ``verl`` format
(:mod:`roll_ckpt_verl.migrate`), at any world size; nothing in it is changed.

More roll-ckpt settings (a ``backup`` location, ``collective_timeout_s``...) come from the
checkpoint config's ``roll_ckpt`` mapping (:class:`roll_ckpt_verl.config.RollCkptCheckpointConfig`).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import weakref
from dataclasses import dataclass
from typing import Any

from roll_ckpt import CheckpointManager, load_config
from roll_ckpt.plugin import ConfigError, PluginError, RollCkptError, get_plugins
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

from .steps import RoleSteps, clear_for_save

__all__ = ["RollCkptCheckpointManager", "Where", "parse_path", "OWNED_KEYS"]

log = logging.getLogger("roll_ckpt")

_STEP = re.compile(r"^global_step_(\d+)$")
OWNED_KEYS = ("type", "output_dir", "timestamp_subdir", "name_format", "components", "commit_steps", "run_name",
              "max_ckpt_to_keep", "preemption")
"""roll-ckpt keys set from verl's own settings: ``checkpoint.roll_ckpt`` may not set them."""
_OPEN: "weakref.WeakSet[RollCkptCheckpointManager]" = weakref.WeakSet()


@dataclass(frozen=True)
class Where:
    """A ``local_path`` verl passes: its checkpoint folder ``root``, step and role."""

    root: str
    step: int
    role: str | None
    """``actor``, ``critic`` (the PPO trainer's roles); ``None`` for the SFT handler's step folder."""
    path: str


def parse_path(local_path: str) -> Where:
    """``<root>/global_step_<N>`` or ``<root>/global_step_<N>/<role>``, as verl names them."""
    path = os.path.abspath(os.fspath(local_path))
    name, parent = os.path.basename(path), os.path.dirname(path)
    m = _STEP.match(name)
    if m:
        return Where(parent, int(m.group(1)), None, path)
    m = _STEP.match(os.path.basename(parent))
    if m and name and not name.startswith("."):
        return Where(os.path.dirname(parent), int(m.group(1)), name, path)
    raise RollCkptError(f"{local_path}: roll-ckpt-verl saves and loads verl's folders, <dir>/global_step_<N> (the SFT "
                        "CheckpointHandler's) or <dir>/global_step_<N>/<role> (the PPO trainer's); this path is "
                        "neither. Resume a roll-ckpt checkpoint of another layout with roll-ckpt itself")


def _get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    getter = getattr(config, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except (KeyError, AttributeError):
            return default
    return getattr(config, key, default)


def _plain(value: Any) -> Any:
    """An OmegaConf container (verl's configs) as plain dicts and lists."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class RollCkptCheckpointManager(BaseCheckpointManager):
    """verl's checkpoint manager for its FSDP2 engine, with roll-ckpt underneath (module doc).
    Same constructor as verl's ``FSDPCheckpointManager``, plus ``total_training_steps`` (the
    engine passes its optimizer config's: the last step is saved synchronously)."""

    def __init__(self, model: Any, optimizer: Any = None, lr_scheduler: Any = None, processing_class: Any = None,
                 checkpoint_config: Any = None, trust_remote_code: bool = False,
                 total_training_steps: int | None = None, **kwargs: Any) -> None:
        if processing_class is None and "tokenizer" in kwargs:
            processing_class = kwargs.pop("tokenizer")
        super().__init__(model, optimizer, lr_scheduler=lr_scheduler, processing_class=processing_class,
                         checkpoint_config=checkpoint_config)
        self.trust_remote_code = trust_remote_code
        self.total_training_steps = total_training_steps if total_training_steps and total_training_steps > 0 else None
        self.async_save = bool(_get(checkpoint_config, "async_save", False))
        self.options: dict[str, Any] = dict(_plain(_get(checkpoint_config, "roll_ckpt", None)) or {})
        self.manager: CheckpointManager | None = None
        """The roll-ckpt manager of the folder saved or loaded last (built on first use)."""
        self.steps: RoleSteps | None = None
        self._key: tuple[str, str | None, int] | None = None
        self._last_saved: int | None = None
        self._said: set[str] = set()
        _OPEN.add(self)

    # ------------------------------------------------------------------ the roll-ckpt manager

    def _check(self) -> None:
        if "model" not in self.checkpoint_save_contents or "model" not in self.checkpoint_load_contents:
            raise ConfigError("checkpoint.save_contents", "must list 'model' (and load_contents too): every roll-ckpt "
                              "checkpoint holds the model", list(self.checkpoint_save_contents),
                              "[model, optimizer, extra] (+ hf_model)")
        if any(type(p).__name__ == "FlatParameter" for p in self.model.parameters()) or \
                hasattr(self.model, "_fsdp_wrapped_module"):
            raise ConfigError("strategy", "is fsdp (FSDP1): roll-ckpt saves verl's FSDP2 engine's models", "fsdp",
                              "strategy: fsdp2 for the actor and critic, or unset VERL_ENGINE_VENDOR to keep verl's "
                              "own checkpoint manager")
        if self.should_save_lora_only and hasattr(self.model, "peft_config"):
            self._once("lora", "checkpoint.save_lora_only is set: roll-ckpt saves the whole model (LoRA adapters "
                               "included) with every checkpoint; LoRA-only saves are not covered")

    def _once(self, key: str, message: str) -> None:
        if key not in self._said and self.rank == 0:
            self._said.add(key)
            log.warning("roll-ckpt: %s", message)

    def _config(self, where: Where, keep: int) -> Any:
        user = dict(self.options)
        owned = sorted(k for k in user if k in OWNED_KEYS)
        if owned:
            raise ConfigError(f"checkpoint.roll_ckpt.{owned[0]}", "is set by roll-ckpt-verl from verl's own settings "
                              "(the path verl saves to, its folder names, max_ckpt_to_keep)", user[owned[0]],
                              "leave it out; set verl's own key instead")
        cc: dict[str, Any] = {"type": "file_system", "output_dir": where.root, "timestamp_subdir": False,
                              "name_format": "global_step_{step}", "max_ckpt_to_keep": keep,
                              "preemption": {"signals": []}, **user}
        if where.role is not None:
            cc.update(components=[where.role], commit_steps=False)
        else:  # written into the step folder by CheckpointHandler once the save returned
            cc["beside"] = ["data_*.pt", "lora_train_meta.json", *(user.get("beside") or [])]
        if self.should_save_hf_model:
            hf = user.get("hf_weights")
            cc["hf_weights"] = {**(hf if isinstance(hf, dict) else {}), "subdir": "huggingface"}
        asynchronous = self.async_save and where.role is not None
        # verl's trainer calls the manager at save steps only: no save can be announced a step
        # ahead (CheckpointManager.prepare_save), so the staging buffers stay between saves
        # rather than each save allocating its own in the call
        return load_config({"checkpoint_config": cc,
                            "strategy_config": {"async_save_ckpt": asynchronous, "keep_staging_buffers": True}})

    def _manager(self, where: Where, keep: int | None) -> CheckpointManager:
        keep = keep if isinstance(keep, int) and keep > 0 else 0
        key = (where.root, where.role, keep)
        if self.manager is not None and self._key is not None:
            if self._key == key or (keep == 0 and self._key[:2] == key[:2]):
                return self.manager  # (a load builds it with keep 0; the saves' value wins)
            self._close_manager()
        manager = CheckpointManager(self._config(where, keep), component=where.role, quiet=True)
        if "verl" not in get_plugins().formats():  # (the registry the manager uses) its format reads verl's folders
            manager.close()
            raise PluginError("roll-ckpt's verl plugin (entry point 'verl' of roll-ckpt-verl) is not loaded in this "
                              "process: ROLL_CKPT_PLUGINS or ROLL_CKPT_BLOCKED_PLUGINS leave it out, or "
                              "ROLL_CKPT_DISABLE_PLUGIN_AUTOLOAD is set; let it load (add verl to ROLL_CKPT_PLUGINS)")
        if self.should_save_hf_model and self.processing_class is not None:
            manager.hf_files(self.processing_class)
        manager.bind(self._state(saving=True))  # every rank of the role, here (a collective)
        self.manager, self._key = manager, key
        if where.role is not None and manager.strategy.is_coordinator:
            timeout = float(manager.config.checkpoint_config.collective_timeout_s)
            self.steps = RoleSteps(manager, where.role, tracker=self.async_save, timeout_s=timeout)
        if self.rank == 0:
            log.info("roll-ckpt: verl's %s checkpoints under %s (%s, keep %s)", where.role or "SFT", where.root,
                     "async" if self.async_save and where.role else "sync", keep or "all")
        return manager

    def _close_manager(self) -> None:
        manager, self.manager, self._key = self.manager, None, None
        steps, self.steps = self.steps, None
        try:
            if manager is not None:
                manager.wait()
                if steps is not None and self._last_saved is not None:
                    steps.look_again(self._last_saved + 1)
        finally:
            if steps is not None:
                steps.close()
            if manager is not None:
                manager.close()

    def _state(self, saving: bool) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model}
        if (self.should_save_optimizer if saving else self.should_load_optimizer) and self.optimizer is not None:
            state["optimizer"] = self.optimizer
        if (self.should_save_extra if saving else self.should_load_extra) and self.lr_scheduler is not None:
            state["scheduler"] = self.lr_scheduler
        return state

    # ------------------------------------------------------------------ verl's contract

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None) -> None:
        if local_path is None:
            return
        self.previous_global_step = global_step
        where = parse_path(local_path)
        if where.step != global_step:
            raise RollCkptError(f"{local_path} is step {where.step} (verl takes the step from the folder's name), but "
                                f"save_checkpoint was called for global_step {global_step}")
        if hdfs_path:
            self._once("hdfs", f"hdfs_path {hdfs_path} is not written (verl's FSDP manager ignores it too); a copy "
                               "elsewhere is checkpoint.roll_ckpt.backup")
        self._check()
        manager = self._manager(where, max_ckpt_to_keep)
        last = self.total_training_steps is not None and global_step >= self.total_training_steps
        asynchronous = self.async_save and where.role is not None and not last
        manager.wait()  # the save in flight (its step committed, or waited for) before this one's folder is touched
        if manager.strategy.is_coordinator:
            if self.steps is not None:
                self.steps.look_again(where.step)
            clear_for_save(manager.storage, os.path.join(where.root, f"global_step_{where.step}"), where.role)
            if self.steps is not None:
                self.steps.begin(where.step)
                self.steps.wait_in_writer = asynchronous
        manager.save(where.step, self._state(saving=True), final=not asynchronous)
        self._last_saved = where.step
        if self.steps is not None and self.async_save and not asynchronous:  # the last step, saved synchronously
            self.steps.await_later(where.step)

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False) -> None:
        if local_path is None:
            return
        where = parse_path(local_path)
        self._check()
        manager = self._manager(where, None)
        if self.steps is not None:  # a step resumed before its manifest was written (a synchronous last part)
            self.steps.look_again(where.step + 1)
        step = manager.resume(self._state(saving=False), where.path)
        if del_local_after_load:
            self._once("del", "del_local_after_load: a local checkpoint is never deleted by roll-ckpt (verl deletes "
                              "only downloaded copies of remote ones)")
        if step != where.step and self.rank == 0:
            log.warning("roll-ckpt: %s holds step %d, not the %d of its folder's name", local_path, step, where.step)

    def close(self) -> None:
        """Drain the save in flight and commit what it completes; then release the roll-ckpt manager."""
        _OPEN.discard(self)
        self._close_manager()


@atexit.register
def _close_all() -> None:
    """A verl worker ends without closing its engine: drain every save in flight first."""
    for manager in list(_OPEN):
        try:
            manager.close()
        except Exception as exc:  # the process is ending: say it, do not hide the other managers' drain
            log.error("roll-ckpt: closing the verl checkpoint manager failed: %s: %s", type(exc).__name__, exc)
