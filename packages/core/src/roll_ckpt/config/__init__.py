"""Configuration: the keys (:mod:`.schema`), reading files and composing them with Hydra
(:mod:`.file`), values and interpolation, ROLL's key names and defaults, the report of
where each setting came from, and each section's own dataclass.

Layer 4: imports ``dcp``, ``format``, ``runtime``, the base modules, and the plugin registry
(``roll_ckpt.plugins``) to validate plugins' keys.
"""

from .schema import (BackupConfig, CheckpointConfig, Config, InitialLoadConfig, LocalTierConfig, PreemptionConfig,
                     StrategyConfig, load_config, read_yaml)

__all__ = ["Config", "CheckpointConfig", "BackupConfig", "InitialLoadConfig", "LocalTierConfig", "PreemptionConfig",
           "StrategyConfig", "load_config", "read_yaml"]
