"""Core's own hook implementations: the ``dcp`` and ``json`` strategies and regular staging."""

from __future__ import annotations

from typing import Any

from .hookspecs import hookimpl
from .records import StagingPolicyRecord, StrategyRecord


def _make_dcp(config: Any, plugins: Any) -> Any:
    from .strategy import DCPStrategy

    return DCPStrategy(config, plugins)


def _make_json(config: Any, plugins: Any) -> Any:
    from .driver_state import JSONStrategy

    return JSONStrategy(config, plugins)


def _holds_driver_state(state: Any) -> bool:
    from .driver_state import holds_driver_state

    return holds_driver_state(state)


@hookimpl
def roll_ckpt_strategies() -> list[StrategyRecord]:
    return [StrategyRecord(
        name="dcp", factory=_make_dcp, applies=lambda state: True, priority=0,
        description="torch.distributed.checkpoint for one process or replicated modules",
    ), StrategyRecord(
        name="json", factory=_make_json, applies=_holds_driver_state, priority=20,
        description="DriverState values (a driver's step, counters, data position, history) as JSON, no pickle",
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
