"""Entry point ``verl`` of roll-ckpt's plugins: verl's checkpoint layout as a roll-ckpt format
(its ``global_step_N`` folders recognized, checked, described and resumed read-only). The
commit hooks through which a PPO step's roles commit the step are registered by each role's
:class:`roll_ckpt_verl.steps.RoleSteps` while it lives, not here: a process without them runs
none of verl's code at its saves.
Imports nothing of verl, nor torch."""

from __future__ import annotations

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
