"""Core's own hook implementations: the ``dcp`` and ``json`` strategies and the regular copy."""

from __future__ import annotations

from typing import Any

from .contracts import StagingPolicyRecord, Strategy, StrategyRecord
from .format.driver_state import holds_driver_state
from .hookspecs import hookimpl
from .save.staging import RegularCopy

FALLBACK = -(2 ** 31)
"""The regular copy's priority: every plugin's policy is asked before it."""


def _make_dcp(config: Any, plugins: Any) -> Strategy:
    from .strategies.dcp import DCPStrategy

    return DCPStrategy(config, plugins)


def _make_json(config: Any, plugins: Any) -> Strategy:
    from .format.driver_state import JSONStrategy

    return JSONStrategy(config, plugins)


def _always(state: Any) -> bool:
    return True


@hookimpl
def roll_ckpt_strategies() -> list[StrategyRecord]:
    return [StrategyRecord(
        name="dcp", factory=_make_dcp, applies=_always, priority=0,
        description="torch.distributed.checkpoint for one process or replicated modules",
    ), StrategyRecord(
        name="json", factory=_make_json, applies=holds_driver_state, priority=20,
        description="DriverState values (a driver's step, counters, data position, history) as JSON, no pickle",
    )]


@hookimpl
def roll_ckpt_staging_policies() -> list[StagingPolicyRecord]:
    return [StagingPolicyRecord(RegularCopy(), priority=FALLBACK)]
