"""The roll-ckpt configuration of torchtitan's ``checkpoint`` section.

torchtitan's own fields decide what they decide in torchtitan; roll-ckpt's keys come from
them, so one setting is never given twice:

=====================================  ==============================================
torchtitan (``--checkpoint.*``)        roll-ckpt
=====================================  ==============================================
``<dump_folder>/<folder>``             ``checkpoint_config.output_dir`` (a path or an
                                       fsspec URL, as torchtitan joins them)
(its ``step-<N>`` folders, no run      ``checkpoint_config.name_format: step-{step}``,
folders)                               ``timestamp_subdir: false``
``interval``                           ``save_steps``
``keep_latest_k``                      ``checkpoint_config.max_ckpt_to_keep``
``async_mode`` (``async``,             ``strategy_config.async_save_ckpt: true``
``async_with_pinned_mem``)
=====================================  ==============================================

Every other roll-ckpt key (``storage_options``, ``backup``, ``preemption``,
``on_unusable_checkpoint``, ``verify_before_load``, ``incremental``, ``local``,
``collective_timeout_s``, ``strategy_config.max_staging_bytes``...) comes from the YAML file
the manager's ``roll_config`` field names: its ``checkpoint_config`` and ``strategy_config``
sections, nothing else. A key of the table above set there too is an error naming the
torchtitan field that sets it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from roll_ckpt import Config, load_config
from roll_ckpt.plugin import ConfigError, read_yaml

__all__ = ["roll_config", "OWNED"]

OWNED = {
    "checkpoint_config.output_dir": "--checkpoint.folder (joined to --dump_folder)",
    "checkpoint_config.name_format": "torchtitan's layout (step-<N> folders)",
    "checkpoint_config.timestamp_subdir": "torchtitan's layout (no run folders)",
    "checkpoint_config.run_name": "torchtitan's layout (no run folders)",
    "checkpoint_config.max_ckpt_to_keep": "--checkpoint.keep_latest_k",
    "checkpoint_config.async_upload": "--checkpoint.async_mode",
    "strategy_config.async_save_ckpt": "--checkpoint.async_mode",
    "strategy_config.save_only_model": "--checkpoint.last_save_model_only (the last step only)",
}
"""roll-ckpt keys torchtitan's own fields set, and the field that sets each."""


def _sections(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    raw = read_yaml(Path(path))
    extra = sorted(set(raw) - {"checkpoint_config", "strategy_config"})
    if extra:
        raise ConfigError(extra[0], f"is set in {path}, the roll_config of torchtitan's checkpoint section; only "
                          "checkpoint_config and strategy_config are read from it (torchtitan's config sets the rest)",
                          raw[extra[0]], "checkpoint_config: {...}, strategy_config: {...}")
    cc, sc = raw.get("checkpoint_config") or {}, raw.get("strategy_config") or {}
    for name, section in (("checkpoint_config", cc), ("strategy_config", sc)):
        if not isinstance(section, dict):
            raise ConfigError(name, f"in {path} must be a mapping", section, "a mapping of roll-ckpt keys")
        for key in section:
            owner = OWNED.get(f"{name}.{key}")
            if owner is not None:
                raise ConfigError(f"{name}.{key}", f"is set in {path}, but torchtitan's config sets it: {owner}",
                                  section[key], f"remove it from {path}")
    return dict(cc), dict(sc)


def roll_config(folder: str, *, interval: int, keep_latest_k: int, async_mode: str, roll_config_file: str = "") -> Config:
    """roll-ckpt's :class:`~roll_ckpt.Config` for torchtitan's checkpoint section (the module doc)."""
    cc, sc = _sections(roll_config_file) if roll_config_file else ({}, {})
    cc.setdefault("type", "file_system")
    cc.update(output_dir=folder, name_format="step-{step}", timestamp_subdir=False, max_ckpt_to_keep=keep_latest_k)
    sc["async_save_ckpt"] = async_mode != "disabled"
    return load_config({"checkpoint_config": cc, "strategy_config": sc, "save_steps": interval,
                        "resume_from_checkpoint": False}, defaults="roll-ckpt")
