"""Entry point ``torchtitan``: torchtitan's step folders as a roll-ckpt format (listed,
verified, inspected, resumed read-only; written by ``roll-ckpt export --format torchtitan``).
Imports nothing heavy (not torchtitan: the format works without it)."""

from __future__ import annotations

from typing import Any

from roll_ckpt.plugin import FormatRecord, hookimpl

from .tt_format import FOLDER_PATTERN, recognize


def _export(*args: Any, **kwargs: Any) -> str:
    from .export import export_torchtitan

    return export_torchtitan(*args, **kwargs)


@hookimpl
def roll_ckpt_formats() -> list[FormatRecord]:
    return [FormatRecord(
        name="torchtitan", recognize=recognize, folder_pattern=FOLDER_PATTERN, export=_export,
        install_hint='pip install "roll-ckpt[torchtitan]"',
        description="torchtitan's DCP checkpoints (step-N/{.metadata, __<rank>_0.distcp}: the model at the top level, "
                    "optimizer, lr_scheduler, dataloader, train_state)",
    )]
