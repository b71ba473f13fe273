"""Entry point ``roll``: ROLL's checkpoint layout as a roll-ckpt format (resumed read-only,
written by ``roll-ckpt export --format roll``). Imports nothing heavy."""

from __future__ import annotations

from typing import Any

from roll_ckpt.plugin import FormatRecord, hookimpl

from .roll_format import recognize


def _export(*args: Any, **kwargs: Any) -> str:
    from .export import export_roll

    return export_roll(*args, **kwargs)


@hookimpl
def roll_ckpt_formats() -> list[FormatRecord]:
    return [FormatRecord(
        name="roll", recognize=recognize, export=_export, install_hint='pip install "roll-ckpt[roll]"',
        description="ROLL's FSDP2 checkpoints (checkpoint-N/{dcp, <cluster>/dcp, pipeline/}, HF files at the step)",
    )]
