"""roll-ckpt: save and resume the full training state of PyTorch jobs.

Importing this package is cheap: it does not import ``torch.distributed`` nor any
plugin. The public API is what ``__all__`` lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config.schema import BackupConfig, CheckpointConfig, Config, InitialLoadConfig, PreemptionConfig, StrategyConfig, load_config
from .errors import (BackupError, CheckpointCorruptError, CheckpointNotFoundError, ConfigError, PartlyLoadedError,
                     PluginError, RollCkptError, SaveError, StorageError, StorageFullError, UnknownPluginError,
                     UnsafeCheckpointError)
from .contracts import (BackendRecord, CommandRecord, CommitInfo, ConfigKeyRecord, Entry, ForeignCheckpoint,
                        FormatRecord, NetworkCounts, SaveContext, StagingPolicy, StagingPolicyRecord, Storage, Strategy,
                        StrategyRecord, TakesOver)
from .format.driver_state import DriverState
from .format.global_state import GlobalState
from .hookspecs import hookimpl, hookspec
from .format.layout import new_run_name
from .runtime.preemption import Preempted

if TYPE_CHECKING:
    from .hf.export import export_hf
    from .manager import CheckpointManager, SaveStats

__all__ = [
    "__version__",
    "CheckpointManager",
    "SaveStats",
    "NetworkCounts",
    "export_hf",
    "DriverState",
    "GlobalState",
    "Preempted",
    "new_run_name",
    "load_config",
    "Config",
    "CheckpointConfig",
    "BackupConfig",
    "PreemptionConfig",
    "InitialLoadConfig",
    "StrategyConfig",
    "hookimpl",
    "hookspec",
    "BackendRecord",
    "StrategyRecord",
    "StagingPolicyRecord",
    "ConfigKeyRecord",
    "CommandRecord",
    "FormatRecord",
    "ForeignCheckpoint",
    "Strategy",
    "StagingPolicy",
    "SaveContext",
    "CommitInfo",
    "Storage",
    "TakesOver",
    "Entry",
    "RollCkptError",
    "ConfigError",
    "PluginError",
    "UnknownPluginError",
    "StorageError",
    "StorageFullError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "PartlyLoadedError",
    "UnsafeCheckpointError",
    "SaveError",
    "BackupError",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # from the installed metadata (importlib.metadata costs ~10 ms: only when asked)
        from importlib.metadata import version

        return version("roll-ckpt-core")
    # The manager and the export pull in torch; keep `import roll_ckpt` light for entry points and the CLI.
    if name in ("CheckpointManager", "SaveStats"):
        from . import manager

        return getattr(manager, name)
    if name == "export_hf":
        from .hf import export as hf_export

        return hf_export.export_hf
    raise AttributeError(f"module 'roll_ckpt' has no attribute {name!r}")
