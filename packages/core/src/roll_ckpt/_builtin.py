"""Core's own hook implementations: the ``dcp`` strategy and regular staging."""

from __future__ import annotations

from typing import Any

from .hookspecs import hookimpl
from .records import StagingPolicyRecord, StrategyRecord


def _make_dcp(config: Any, plugins: Any) -> Any:
    from .strategy import DCPStrategy

    return DCPStrategy(config, plugins)


@hookimpl
def roll_ckpt_strategies() -> list[StrategyRecord]:
    return [StrategyRecord(
        name="dcp", factory=_make_dcp, applies=lambda state: True, priority=0,
        description="torch.distributed.checkpoint for one process or replicated modules",
    )]


@hookimpl
def roll_ckpt_staging_policies() -> list[StagingPolicyRecord]:
    return [StagingPolicyRecord(
        name="regular", description="copy into CPU staging buffers reused across saves (pinned on GPU machines)")]


@hookimpl(trylast=True)
def roll_ckpt_stage(name: str, tensor: Any, save: Any) -> Any:
    strategy = save.strategy
    staged, nbytes = strategy.pool.stage(name, tensor)
    save.note_staged(name, "regular", nbytes)
    return staged
