"""Entry point ``fsdp2``: registers the FSDP2 strategy without importing torch.distributed."""

from __future__ import annotations

from typing import Any, Mapping

from roll_ckpt import StrategyRecord, hookimpl


def _holds_dtensors(state: Mapping[str, Any]) -> bool:
    import sys

    torch = sys.modules.get("torch")
    if torch is None:  # no module can hold DTensors yet; a driver-only process never imports torch
        return False
    for obj in state.values():
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                return type(p).__name__ == "DTensor"
    return False


def _factory(config: Any, plugins: Any) -> Any:
    from .strategy import FSDP2Strategy

    return FSDP2Strategy(config, plugins)


@hookimpl
def roll_ckpt_strategies() -> list[StrategyRecord]:
    return [StrategyRecord(
        name="fsdp2", factory=_factory, applies=_holds_dtensors, priority=10,
        install_hint='pip install "roll-ckpt[fsdp2]"',
        description="FSDP2 (DTensor) state through DCP on its own process group",
    )]


@hookimpl
def roll_ckpt_staging_policies() -> list[Any]:
    from roll_ckpt import StagingPolicyRecord

    return [StagingPolicyRecord(
        name="zero_copy",
        description="tensors resident in the 'local' offload store are written from its flat "
                    "buffers through exact-size aliases: no copy, no clone")]


@hookimpl
def roll_ckpt_stage(name: str, tensor: Any, save: Any) -> Any:
    strategy = save.strategy
    is_zero_copy = getattr(strategy, "is_zero_copy", None)
    if is_zero_copy is None or not is_zero_copy(tensor):
        return None
    save.note_staged(name, "zero_copy", 0)
    return tensor
