"""The API for plugin authors: what a backend, strategy, staging policy or command builds on.

roll-ckpt's own plugins (``roll_ckpt_fs``, ``roll_ckpt_fsdp2``, ``roll_ckpt_demo``) import
nothing else from core (``tests/core/test_architecture.py`` holds them to it), and neither
should a third party's: every other module of ``roll_ckpt`` is private and may change.

* **Hooks**: :data:`hookimpl` marks a plugin's implementation of a hook of
  :mod:`roll_ckpt.hookspecs` (where every hook is documented); the records the registration
  hooks return (:class:`BackendRecord`, :class:`StrategyRecord`, :class:`StagingPolicyRecord`,
  :class:`ConfigKeyRecord`, :class:`CommandRecord`).
* **Storage**: the :class:`Storage` protocol (with :class:`Entry`), its optional features as
  protocols checked with ``isinstance`` (:data:`STORAGE_CAPABILITIES`: :class:`TakesOver`,
  :class:`ListsByPrefix`, :class:`CountsNetwork`; a write's :class:`AbortableWrite`), and
  :class:`NetworkCounts`. ``roll_ckpt.testing.BackendConformance`` is the suite a backend passes.
* **Strategies**: :class:`Strategy`, the base class every strategy subclasses (its defaults
  make the optional members optional), :class:`StrategyIO`, the base class of what writes and
  reads a strategy's files, :class:`SpaceEstimate`, and :class:`DCPStrategy` with its
  :class:`DCPIO`, the base a strategy on DCP subclasses and the I/O it keeps (imported on
  first use: they import torch).
* **Staging**: :class:`StagingPolicy`, :class:`SaveContext` and :class:`StagingGate`.
* **State values**: :class:`GlobalState`, an object whose state dict is the job's (a
  framework's wrapper of its sharded model parts or optimizers): saved as a module's is, as
  global DCP entries under its key, resharded on resume, not per process (what an integration
  hands the manager for such objects; also ``roll_ckpt.GlobalState``).
* **Errors**: the whole hierarchy, from :class:`RollCkptError` down.
* **torch across releases** (imported on first use): the accessors of
  ``roll_ckpt.runtime.torch_compat`` a plugin needs (:func:`local_tensor`,
  :func:`set_local_tensor`, :func:`rewrap_dtensor`, :func:`local_chunk`, :func:`collective`,
  :func:`fsdp2_options`)
  and :func:`exact_alias`; each works on every torch of the supported range.
* **Reading DCP folders safely** (imported on first use): :func:`read_dcp_metadata` (the
  restricted unpickler), :func:`load_dcp` (a folder read into a state dict, resharded, byte
  values with ``weights_only``), :func:`dcp_placeholders` (a structure to load into, from the
  metadata alone), :func:`dcp_folder_problems` (what keeps another framework's DCP folder from
  loading: its ``.metadata`` refused, a data file missing or cut short), :func:`write_dcp` (a plain DCP folder, for an export to a framework's own
  layout); what a format plugin reads another framework's checkpoints with;
  :func:`verify_checkpoint` (a committed checkpoint checked whole, its manifest returned), before
  a plugin reads one of roll-ckpt's.
* **Reading ``torch.save`` files safely** (imported on first use): :func:`torch_load`
  (``weights_only``, DTensors with their mesh and placements, NumPy arrays when asked,
  memory-mapped where the backend hands out local files) and :func:`torch_file_problem` (is a
  file a whole ``torch.save`` archive, its data unread): what a format plugin reads a
  framework's per-rank ``torch.save`` files with (verl's); :func:`local_chunk` (where this
  process's shard of a live DTensor lies in the global tensor), to reshard what it read;
  :func:`safetensors_problems` (are a folder's Hugging Face weights whole: each shard by its own
  header, every shard its index names), before a format plugin calls a checkpoint whole.
* **Helpers for commands**: :func:`get_plugins`, :func:`open_storage`, :func:`read_yaml`,
  :func:`committed_checkpoints`, :func:`latest_checkpoint`, :func:`human_bytes`, :data:`RUN_RE` (a run
  folder's name),
  :func:`cli_main`.

Importing this module does not import torch nor any plugin.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config.schema import read_yaml
from .contracts import (STORAGE_CAPABILITIES, AbortableWrite, BackendRecord, CommandRecord, CommitInfo,
                        ConfigKeyRecord, CountsNetwork, Entry, ForeignCheckpoint, FormatRecord, ListsByPrefix,
                        NetworkCounts, SaveContext,
                        SpaceEstimate, StagingGate, StagingPolicy, StagingPolicyRecord, Storage, Strategy,
                        StrategyIO, StrategyRecord, TakesOver, capabilities)
from .errors import (BackupError, CheckpointCorruptError, CheckpointNotFoundError, CollectiveTimeoutError,
                     ConfigError, PartlyLoadedError, PluginError, RollCkptError, SaveError, StorageError,
                     StorageFullError, TorchCompatError, UnknownPluginError, UnsafeCheckpointError)
from .format.global_state import GlobalState
from .format.layout import RUN_RE, committed as committed_checkpoints, latest as latest_checkpoint
from .hookspecs import hookimpl, hookspec
from .plugins import get_plugins
from .runtime.units import human_bytes

if TYPE_CHECKING:  # for type checkers and the API reference; at run time _LAZY below imports them
    from .cli import main as cli_main
    from .cli.inspection import verify_checkpoint
    from .dcp.files import exact_alias
    from .runtime.torch_compat import (collective, fsdp2_options, local_chunk, local_tensor, rewrap_dtensor,
                                       set_local_tensor)
    from .strategies.dcp import DCPIO, DCPStrategy
    from .tiers.run import open_storage
    from .dcp.reader import placeholders as dcp_placeholders
    from .load.dcp_folder import dcp_folder_problems, load_dcp, read_dcp_metadata, write_dcp
    from .load.torch_file import torch_file_problem, torch_load
    from .format.hf_files import safetensors_problems

__all__ = [
    # hooks and records
    "hookimpl", "hookspec", "BackendRecord", "StrategyRecord", "StagingPolicyRecord", "ConfigKeyRecord",
    "CommandRecord", "CommitInfo", "FormatRecord", "ForeignCheckpoint",
    # storage
    "Storage", "Entry", "NetworkCounts", "TakesOver", "ListsByPrefix", "CountsNetwork", "AbortableWrite",
    "STORAGE_CAPABILITIES", "capabilities",
    # strategies
    "Strategy", "StrategyIO", "SpaceEstimate", "DCPStrategy", "DCPIO",
    # staging
    "StagingPolicy", "SaveContext", "StagingGate",
    # state values
    "GlobalState",
    # errors
    "RollCkptError", "ConfigError", "PluginError", "UnknownPluginError", "StorageError", "StorageFullError",
    "CheckpointNotFoundError", "CheckpointCorruptError", "PartlyLoadedError", "UnsafeCheckpointError",
    "SaveError", "BackupError", "CollectiveTimeoutError", "TorchCompatError",
    # torch across releases
    "local_tensor", "set_local_tensor", "rewrap_dtensor", "local_chunk", "collective", "fsdp2_options", "exact_alias",
    # reading DCP folders safely
    "read_dcp_metadata", "dcp_folder_problems", "load_dcp", "dcp_placeholders", "write_dcp", "verify_checkpoint",
    # reading torch.save files safely
    "torch_load", "torch_file_problem", "safetensors_problems",
    # helpers for commands
    "get_plugins", "open_storage", "read_yaml", "committed_checkpoints", "latest_checkpoint", "human_bytes", "RUN_RE",
    "cli_main",
]

_LAZY = {
    "safetensors_problems": "roll_ckpt.format.hf_files",
    "DCPStrategy": "roll_ckpt.strategies.dcp",
    "DCPIO": "roll_ckpt.strategies.dcp",
    "local_tensor": "roll_ckpt.runtime.torch_compat",
    "set_local_tensor": "roll_ckpt.runtime.torch_compat",
    "rewrap_dtensor": "roll_ckpt.runtime.torch_compat",
    "local_chunk": "roll_ckpt.runtime.torch_compat",
    "collective": "roll_ckpt.runtime.torch_compat",
    "fsdp2_options": "roll_ckpt.runtime.torch_compat",
    "exact_alias": "roll_ckpt.dcp.files",
    "open_storage": "roll_ckpt.tiers.run",
    "cli_main": "roll_ckpt.cli",
    "verify_checkpoint": "roll_ckpt.cli.inspection",
    "read_dcp_metadata": "roll_ckpt.load.dcp_folder",
    "dcp_folder_problems": "roll_ckpt.load.dcp_folder",
    "load_dcp": "roll_ckpt.load.dcp_folder",
    "write_dcp": "roll_ckpt.load.dcp_folder",
    "dcp_placeholders": "roll_ckpt.dcp.reader",
    "torch_load": "roll_ckpt.load.torch_file",
    "torch_file_problem": "roll_ckpt.load.torch_file",
}
"""Names whose modules import torch (or much else): imported when first asked for."""


def __getattr__(name: str) -> Any:
    if name in ("StrategyDefaults", "strategy_member"):  # the defaults are Strategy's own now
        import warnings

        from .errors import RollCkptDeprecationWarning

        warnings.warn(f"roll_ckpt.plugin.{name} is deprecated: subclass roll_ckpt.plugin.Strategy, whose defaults "
                      "every strategy then has, and call its members directly (the old name goes at 1.0)",
                      RollCkptDeprecationWarning, stacklevel=2)
        return _StrategyDefaults if name == "StrategyDefaults" else _strategy_member
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'roll_ckpt.plugin' has no attribute {name!r}")
    attr = {"cli_main": "main", "dcp_placeholders": "placeholders"}.get(name, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


class _StrategyDefaults:
    """What ``StrategyDefaults`` was: the three optional members' defaults alone (a subclass
    keeps its other bases' members; it is adapted, with the warning, as any strategy that does
    not subclass :class:`Strategy`)."""

    collective_timeout_s: float = 0.0
    increments: Any = None
    agree = Strategy.agree


def _strategy_member(strategy: Any, name: str) -> Any:
    """What ``strategy_member`` was: ``strategy.<name>``, or :class:`Strategy`'s default for it."""
    try:
        return getattr(strategy, name)
    except AttributeError:
        default = getattr(Strategy, name, None) or getattr(_StrategyDefaults, name)  # (increments: the I/O's now)
        return default.__get__(strategy) if callable(default) else default
