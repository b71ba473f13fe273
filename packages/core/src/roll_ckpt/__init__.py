"""roll-ckpt: save and resume the full training state of PyTorch jobs.

Importing this package is cheap: it does not import ``torch.distributed`` nor any
plugin. The public API is what ``__all__`` lists: the manager and what a training script
uses with it. The rest has a home of its own: every error in :mod:`roll_ckpt.errors`, each
config section's dataclass in :mod:`roll_ckpt.config`, what a plugin author builds on
(hooks, records, contracts) in :mod:`roll_ckpt.plugin`. The names that used to be here
as well still work, with a :class:`~roll_ckpt.errors.RollCkptDeprecationWarning` naming
their home, until 1.0.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from .config.schema import Config, load_config
from .errors import (CheckpointCorruptError, CheckpointNotFoundError, ConfigError, RollCkptDeprecationWarning,
                     RollCkptError, SaveError, StorageError)
from .format.driver_state import DriverState
from .format.global_state import GlobalState
from .format.layout import new_run_name
from .runtime.preemption import Preempted

if TYPE_CHECKING:
    from .hf.export import export_hf
    from .manager import CheckpointManager, SaveStats

__all__ = [
    "__version__",
    # the manager and what it returns
    "CheckpointManager",
    "SaveStats",
    "Preempted",
    # configuration
    "load_config",
    "Config",
    # what a training script hands the manager, names or exports
    "DriverState",
    "GlobalState",
    "new_run_name",
    "export_hf",
    # the errors a training script catches (all of them: roll_ckpt.errors)
    "RollCkptError",
    "ConfigError",
    "StorageError",
    "SaveError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
]

# The manager and the export pull in torch: imported when first asked for, so that
# `import roll_ckpt` stays light for entry points and the CLI.
_LAZY = {"CheckpointManager": "roll_ckpt.manager", "SaveStats": "roll_ckpt.manager", "export_hf": "roll_ckpt.hf.export"}

# Names this package exported before the surface was made smaller, and their home now (issue 37: a smaller surface).
_MOVED = {
    **dict.fromkeys(["PluginError", "UnknownPluginError", "StorageFullError", "PartlyLoadedError",
                     "UnsafeCheckpointError", "BackupError"], "roll_ckpt.errors"),
    **dict.fromkeys(["CheckpointConfig", "BackupConfig", "PreemptionConfig", "InitialLoadConfig", "StrategyConfig"],
                    "roll_ckpt.config"),
    **dict.fromkeys(["hookimpl", "hookspec", "BackendRecord", "StrategyRecord", "StagingPolicyRecord",
                     "ConfigKeyRecord", "CommandRecord", "FormatRecord", "ForeignCheckpoint", "Strategy",
                     "StagingPolicy", "SaveContext", "CommitInfo", "Storage", "TakesOver", "Entry", "NetworkCounts"],
                    "roll_ckpt.plugin"),
}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # from the installed metadata (importlib.metadata costs ~10 ms: only when asked)
        from importlib.metadata import version

        return version("roll-ckpt-core")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MOVED:
        home = _MOVED[name]
        warnings.warn(f"roll_ckpt.{name} moved to {home}.{name}: import it from there (the old name goes at 1.0)",
                      RollCkptDeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'roll_ckpt' has no attribute {name!r}")

