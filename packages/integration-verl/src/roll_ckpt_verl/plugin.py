"""Entry point ``verl`` of roll-ckpt's plugins: verl's checkpoint layout as a roll-ckpt format
(its ``global_step_N`` folders recognized, checked, described and resumed read-only) and the
commit hook through which a PPO step's roles commit the step (:mod:`roll_ckpt_verl.steps`).
Imports nothing of verl, nor torch."""

from __future__ import annotations

from typing import Any

from roll_ckpt.plugin import FormatRecord, hookimpl

from .layout import FOLDER_PATTERN
from .verl_format import recognize


@hookimpl
def roll_ckpt_formats() -> list[FormatRecord]:
    return [FormatRecord(
        name="verl", recognize=recognize, folder_pattern=FOLDER_PATTERN, install_hint='pip install "roll-ckpt[verl]"',
        description="verl's FSDP2 checkpoints (global_step_N/ or global_step_N/{actor,critic}/: per-rank "
                    "model/optim/extra_state files, fsdp_config.json)",
    )]


@hookimpl
def roll_ckpt_on_commit(info: Any) -> None:
    """A part of a PPO step committed in this process: its role's marker goes."""
    if info.component is None:
        return
    from .steps import part_committed

    part_committed(info)


@hookimpl
def roll_ckpt_save_finished(save: Any, error: Any) -> None:
    """An asynchronous part of a PPO step written and committed: its coordinator waits for the
    trainer's data.pt and commits the step (:mod:`roll_ckpt_verl.steps`)."""
    from .steps import part_written

    part_written(save, error)
