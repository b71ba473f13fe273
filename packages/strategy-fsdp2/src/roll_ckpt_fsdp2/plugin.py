"""Entry point ``fsdp2``: registers the FSDP2 strategy without importing torch.distributed."""

from __future__ import annotations

from typing import Any, Mapping

from roll_ckpt import StrategyRecord, hookimpl


def _holds_dtensors(state: Mapping[str, Any]) -> bool:
    import torch

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
