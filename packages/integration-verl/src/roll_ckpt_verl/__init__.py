"""roll-ckpt as verl's checkpoint manager for its FSDP2 engine, with nothing of verl edited.

The switch, one environment variable in the shell that launches the job (verl's own engine
registry reads it in every worker)::

    export VERL_ENGINE_VENDOR=roll_ckpt

Installed, roll-ckpt-verl's ``verl.plugins`` entry point (:mod:`roll_ckpt_verl.verl_plugin`)
registers verl's FSDP engines again under vendor ``roll_ckpt`` with
:class:`roll_ckpt_verl.manager.RollCkptCheckpointManager` as their checkpoint manager
(:mod:`roll_ckpt_verl.engine`); ``VERL_ENGINE_VENDOR=roll_ckpt`` makes verl pick them. verl's
trainers, ``CheckpointHandler``, folder names, ``latest_checkpointed_iteration.txt`` and
``resume_mode`` work as before. ``python -m roll_ckpt_verl check`` says whether the switch
takes effect in an environment (verl hides a plugin that fails to load).

verl's own checkpoints need no switch: the ``verl`` format (:mod:`roll_ckpt_verl.verl_format`)
is found through roll-ckpt's entry points, so a resume through the integration,
``roll-ckpt ls/verify/inspect`` and roll-ckpt's ``resume_from_checkpoint`` read them wherever
roll-ckpt-verl is installed (:mod:`roll_ckpt_verl.migrate`).
"""

from __future__ import annotations

__all__ = ["VENDOR", "VERL_VERSION"]

VENDOR = "roll_ckpt"
"""``VERL_ENGINE_VENDOR=roll_ckpt`` switches roll-ckpt on."""
VERL_VERSION = "0.9.1"
"""The verl release whose code the integration was read from and tested against."""
