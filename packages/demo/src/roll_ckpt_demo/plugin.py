"""Entry point ``demo``: adds ``roll-ckpt demo`` without importing torch."""

from __future__ import annotations

from roll_ckpt.plugin import CommandRecord, hookimpl

from .launch import add_demo_arguments, run


@hookimpl
def roll_ckpt_commands() -> list[CommandRecord]:
    return [CommandRecord(name="demo", help="a small RL training job that saves, crashes and resumes",
                          add_arguments=add_demo_arguments, run=run,
                          description="REINFORCE on a contextual bandit: stop it, resume it, compare the losses")]
