"""roll-ckpt as torchtitan's checkpoint manager, with nothing of torchtitan edited.

The switch is one setting on torchtitan's own command line (torchtitan's override hook)::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports roll_ckpt_torchtitan.use_roll_ckpt

or, in Python, ``Trainer.Config(checkpoint=RollCkptCheckpointManager.Config(...))``. Every
``--checkpoint.*`` flag keeps its meaning (:mod:`roll_ckpt_torchtitan.manager`).
torchtitan's own checkpoints need no line: the ``torchtitan`` format
(:mod:`roll_ckpt_torchtitan.tt_format`) is found through roll-ckpt's entry points, so the
switched job resumes from them, and ``roll-ckpt ls/verify/inspect`` read them, wherever
roll-ckpt-torchtitan is installed.

Importing this package imports neither torch nor torchtitan (roll-ckpt loads its entry point
in every command). torchtitan imports it to apply ``--override.imports``: torchtitan's
override module is loaded then, and the override is registered here.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["RollCkptCheckpointManager", "use_roll_ckpt"]


def __getattr__(name: str) -> Any:
    if name == "RollCkptCheckpointManager":
        from .manager import RollCkptCheckpointManager

        return RollCkptCheckpointManager
    if name == "use_roll_ckpt":
        from .manager import use_roll_ckpt

        return use_roll_ckpt
    raise AttributeError(f"module 'roll_ckpt_torchtitan' has no attribute {name!r}")


if "torchtitan.config.override" in sys.modules:  # imported by torchtitan's --override.imports
    from .manager import use_roll_ckpt  # noqa: F401  (registers the override)
