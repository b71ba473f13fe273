"""ROLL's own checkpoint keys, mapped onto roll-ckpt's.

* ``max_ckpt_to_keep`` at top level (ROLL's ``BaseConfig``) is
  ``checkpoint_config.max_ckpt_to_keep``; both set differently is an error naming both.
* ``checkpoint_config.keep_local_file`` is ``checkpoint_config.backup.keep_local``
  (``false``: 1, ``true``: 0); without a backup it has no effect (logged).
* ``checkpoint_config.async_upload: true`` makes saves asynchronous (``Config.async_save``);
  ``false`` has no effect (logged).
* A worker section's ``strategy_args.strategy_config`` (``actor_train``, ``critic``...)
  overrides ``async_save_ckpt`` and the plugins' keys for that component
  (``Config.for_component``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

from .values import count, expect, section, staging_budget
from ..errors import ConfigError

__all__ = ["WORKER_STRATEGY", "max_ckpt_to_keep", "keep_local_file", "log_keys_without_effect", "worker_overrides"]

log = logging.getLogger("roll_ckpt")

WORKER_STRATEGY = ("strategy_args", "strategy_config")
"""Where a ROLL worker section (``actor_train``, ``critic``...) holds its strategy settings."""


def max_ckpt_to_keep(raw: Mapping[str, Any], value: Mapping[str, Any]) -> int:
    """ROLL sets it at top level, roll-ckpt in checkpoint_config: either, or both alike."""
    given = {}
    if raw.get("max_ckpt_to_keep") is not None:
        given["max_ckpt_to_keep"] = count("max_ckpt_to_keep", raw["max_ckpt_to_keep"])
    if "max_ckpt_to_keep" in value:
        given["checkpoint_config.max_ckpt_to_keep"] = count("checkpoint_config.max_ckpt_to_keep",
                                                            value["max_ckpt_to_keep"])
    if len(set(given.values())) > 1:
        raise ConfigError("max_ckpt_to_keep", "is set twice with different values: "
                          + " and ".join(f"{k}: {v}" for k, v in given.items()), None,
                          "one of the two keys, or the same value in both")
    return next(iter(given.values()), 0)


def keep_local_file(value: Mapping[str, Any], backup: Any) -> tuple[bool | None, Any]:
    """ROLL's ``keep_local_file`` and what it makes of ``backup.keep_local``."""
    key = "checkpoint_config.keep_local_file"
    keep = value.get("keep_local_file")
    if keep is None:
        return None, backup
    expect(key, keep, bool, "true or false")
    if backup is None:
        return keep, None
    mapped = 0 if keep else 1  # the newest local checkpoint is never removed: false keeps that one
    if "keep_local" in value["backup"] and backup.keep_local != mapped:
        raise ConfigError(key, f"is {str(keep).lower()}, which means checkpoint_config.backup.keep_local: {mapped}, "
                          f"but checkpoint_config.backup.keep_local is {backup.keep_local}", None,
                          "one of the two keys, or values that agree (keep_local_file: false = keep_local: 1, "
                          "true = keep_local: 0)")
    return keep, dataclasses.replace(backup, keep_local=mapped)


def log_keys_without_effect(cfg: Any, raw: Mapping[str, Any]) -> None:
    """One log line for each ROLL key that is accepted but changes nothing here."""
    cc = cfg.checkpoint_config
    given = raw.get("checkpoint_config")
    given = given if isinstance(given, Mapping) else {}
    if cc.keep_local_file is not None and cc.backup is None:
        log.warning("roll-ckpt: checkpoint_config.keep_local_file: %s has no effect: checkpoints are written "
                    "straight to checkpoint_config.output_dir, there is no local copy to keep or remove "
                    "(with checkpoint_config.backup, false keeps only the newest local checkpoint once "
                    "replicated)", str(cc.keep_local_file).lower())
    if "async_upload" in given and not cc.async_upload:
        log.warning("roll-ckpt: checkpoint_config.async_upload: false has no effect: saves are asynchronous "
                    "exactly when strategy_config.async_save_ckpt is true (a worker's own, with component=)")


def worker_overrides(extra: Mapping[str, Any], name: str, strategy: Any, options: Mapping[str, Any],
                     plugin_keys: Mapping[str, Any], roll: bool = False) -> tuple[Any, dict[str, Any]]:
    """``strategy`` (a ``StrategyConfig``) and ``options`` with worker ``name``'s
    ``strategy_args.strategy_config`` applied: its ``async_save_ckpt`` and the plugins' keys.
    ``roll``: ROLL's defaults apply (an FSDP2 worker saves asynchronously unless it says not)."""
    from .roll_defaults import worker_async_default

    values, where = section(extra, (name, *WORKER_STRATEGY))
    worker = extra.get(name)
    if roll and isinstance(worker, Mapping) and worker_async_default(worker):
        strategy = dataclasses.replace(strategy, async_save_ckpt=True)
    if "async_save_ckpt" in values:
        asv = expect(f"{where}.async_save_ckpt", values["async_save_ckpt"], bool, "true or false")
        strategy = dataclasses.replace(strategy, async_save_ckpt=asv)
    if "save_only_model" in values:
        strategy = dataclasses.replace(strategy, save_only_model=expect(
            f"{where}.save_only_model", values["save_only_model"], bool, "true or false"))
    megatron, at = section(extra, (name, "training_args"))
    if megatron.get("save_hf_model") is not None:  # Megatron's: the HF model only, as save_only_model
        strategy = dataclasses.replace(strategy, save_only_model=expect(
            f"{at}.save_hf_model", megatron["save_hf_model"], bool, "true or false"))
    if "max_staging_bytes" in values:
        strategy = dataclasses.replace(strategy, max_staging_bytes=staging_budget(
            f"{where}.max_staging_bytes", values["max_staging_bytes"]))
    if "keep_staging_buffers" in values:
        strategy = dataclasses.replace(strategy, keep_staging_buffers=expect(
            f"{where}.keep_staging_buffers", values["keep_staging_buffers"], bool, "true or false"))
    opts = dict(options)
    for record in plugin_keys.values():
        short = record.key.rpartition(".")[2]
        if short in values:
            opts[short] = record.validate(f"{where}.{short}", values[short])
    return strategy, opts
