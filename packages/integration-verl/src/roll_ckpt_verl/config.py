"""``RollCkptCheckpointConfig``: verl's ``CheckpointConfig`` with a ``roll_ckpt`` mapping of
roll-ckpt's own ``checkpoint_config`` keys, for the settings verl has no key for::

    actor_rollout_ref:
      actor:
        checkpoint:
          _target_: roll_ckpt_verl.config.RollCkptCheckpointConfig
          async_save: true
          roll_ckpt:
            backup: {type: file_system, output_dir: /mnt/backup/ckpt}
            collective_timeout_s: 300

(``critic.checkpoint`` and the SFT trainer's ``checkpoint`` the same way.) Keys roll-ckpt-verl
sets from verl's own settings (``output_dir``, ``name_format``, ``max_ckpt_to_keep``...) are
refused there, naming verl's key to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.trainer.config import CheckpointConfig

__all__ = ["RollCkptCheckpointConfig"]


@dataclass
class RollCkptCheckpointConfig(CheckpointConfig):
    roll_ckpt: dict[str, Any] = field(default_factory=dict)
    """roll-ckpt ``checkpoint_config`` keys (``backup``, ``collective_timeout_s``, ``hf_weights``...)."""
