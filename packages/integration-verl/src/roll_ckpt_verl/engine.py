"""The engines of vendor ``roll_ckpt`` in verl's engine registry: verl's own FSDP engines
(``FSDPEngineWithLMHead``, ``FSDPEngineWithValueHead``; backends ``fsdp``, ``fsdp2``), whose
``initialize()`` puts :class:`roll_ckpt_verl.manager.RollCkptCheckpointManager` where verl's
``FSDPCheckpointManager`` was. Nothing else of verl's engine changes; nothing of verl is patched.

verl picks them when ``VERL_ENGINE_VENDOR=roll_ckpt`` (``EngineRegistry.get_engine_cls``
reads it in each worker at lookup time); every other engine (Megatron's...) falls back to its
own device key, as without a vendor.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["VENDOR", "register", "registered"]

log = logging.getLogger("roll_ckpt")

VENDOR = "roll_ckpt"
"""The one setting: ``VERL_ENGINE_VENDOR=roll_ckpt``."""
DEVICES = ("cuda", "npu", "cpu")
_done: list[Any] = []


def _with_manager(base: type) -> type:
    from .manager import RollCkptCheckpointManager

    class Engine(base):  # type: ignore[misc, valid-type]
        def initialize(self) -> None:
            super().initialize()  # builds verl's FSDPCheckpointManager (cheap: nothing read or written), replaced
            theirs = getattr(self, "checkpoint_manager", None)
            if theirs is None:  # an engine that keeps no checkpoints
                return
            self.checkpoint_manager = RollCkptCheckpointManager(
                model=theirs.model, optimizer=theirs.optimizer, lr_scheduler=theirs.lr_scheduler,
                processing_class=theirs.processing_class, checkpoint_config=self.checkpoint_config,
                trust_remote_code=getattr(theirs, "trust_remote_code", False),
                total_training_steps=getattr(self.optimizer_config, "total_training_steps", None)
                if self.optimizer_config is not None else None)

    Engine.__name__ = Engine.__qualname__ = f"RollCkpt{base.__name__}"
    Engine.__module__ = __name__
    return Engine


def register() -> list[type]:
    """Register the engines of vendor ``roll_ckpt`` (once per process); they are returned."""
    if _done:
        return list(_done)
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, base in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        engine = _with_manager(base)
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device=list(DEVICES),
                                vendor=VENDOR)(engine)
        _done.append(engine)
    chosen = os.environ.get("VERL_ENGINE_VENDOR")
    log.info("roll-ckpt: verl engines of vendor %r registered (pid %d)%s", VENDOR, os.getpid(),
             "; in use (VERL_ENGINE_VENDOR=roll_ckpt)" if chosen == VENDOR else
             f"; not in use (VERL_ENGINE_VENDOR={chosen or 'unset'})")
    if chosen == VENDOR:
        print(f"roll-ckpt: verl's FSDP engines save and resume through roll-ckpt (VERL_ENGINE_VENDOR={VENDOR}, "
              f"pid {os.getpid()})", flush=True)
    return list(_done)


def registered() -> bool:
    return bool(_done)
