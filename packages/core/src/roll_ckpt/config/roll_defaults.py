"""ROLL's defaults for the keys of a ROLL pipeline config that the file leaves unset.

**Recognized as a ROLL pipeline config**: a config with at least one top-level section that
is a ROLL worker -- a mapping holding ``strategy_args`` (a mapping with ``strategy_name``)
or ``worker_cls``, as ROLL's ``WorkerConfig`` sections (``actor_train``, ``actor_infer``,
``reference``, ``critic``, ``sft_train``...) do. A plain roll-ckpt config has no such
section and keeps roll-ckpt's defaults. ``load_config(..., defaults="roll" | "roll-ckpt")``
decides it explicitly.

ROLL's defaults, with where ROLL sets them (alibaba/ROLL, read for this module):

===========================================  =====  ==============================================
key                                          value  where ROLL sets it
===========================================  =====  ==============================================
``save_steps``                               50     ``roll/configs/base_config.py: BaseConfig``
``max_steps``                                500    ``roll/configs/base_config.py: BaseConfig``
``checkpoint_config.async_upload``           true   ``roll/distributed/strategy/fsdp2_strategy.py:
                                                    save_checkpoint`` (``.get("async_upload", True)``)
``checkpoint_config.keep_local_file``        false  same place (``.get("keep_local_file", False)``);
                                                    applied only with a ``backup``
``<worker>...strategy_config.async_save_ckpt``  true  ROLL's FSDP2 strategy, for ``fsdp2_train`` workers
===========================================  =====  ==============================================

``max_ckpt_to_keep`` (0), ``resume_from_checkpoint`` (false), ``seed`` (42), ``output_dir``
(``./output``) and the timestamped run folder are the same in both.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["ROLL", "ROLL_CKPT", "ROLL_DEFAULTS", "WORKER_ASYNC_DEFAULT", "recognize", "apply_roll_defaults",
           "roll_workers", "worker_async_default"]

ROLL = "roll"
ROLL_CKPT = "roll-ckpt"

ROLL_DEFAULTS: dict[str, tuple[Any, str]] = {
    "save_steps": (50, "roll/configs/base_config.py: BaseConfig.save_steps"),
    "max_steps": (500, "roll/configs/base_config.py: BaseConfig.max_steps"),
    "checkpoint_config.async_upload": (True, "roll/distributed/strategy/fsdp2_strategy.py: save_checkpoint"),
    "checkpoint_config.keep_local_file": (False, "roll/distributed/strategy/fsdp2_strategy.py: save_checkpoint"),
}
"""Top-level keys: ``dotted key -> (ROLL's value, where ROLL sets it)``."""

WORKER_ASYNC_DEFAULT = (True, "ROLL's FSDP2 strategy (async_save_ckpt), for fsdp2_train workers")
FSDP2_WORKER = "fsdp2_train"


def roll_workers(raw: Mapping[str, Any]) -> dict[str, str | None]:
    """The ROLL worker sections of ``raw``: ``{section: strategy_name or None}``."""
    out: dict[str, str | None] = {}
    for name, section in raw.items():
        if not isinstance(name, str) or not isinstance(section, Mapping):
            continue
        strategy = section.get("strategy_args")
        if isinstance(strategy, Mapping) and "strategy_name" in strategy:
            out[name] = str(strategy.get("strategy_name"))
        elif "worker_cls" in section:
            out[name] = None
    return out


def recognize(raw: Mapping[str, Any], defaults: str | None = None) -> str:
    """``"roll"`` for a ROLL pipeline config (or ``defaults="roll"``), else ``"roll-ckpt"``."""
    if defaults is not None:
        if defaults not in (ROLL, ROLL_CKPT):
            from ..errors import ConfigError

            raise ConfigError("<defaults>", "is not a set of defaults roll-ckpt knows", defaults,
                              f"{ROLL!r}, {ROLL_CKPT!r} or None (recognized from the config)")
        return defaults
    return ROLL if roll_workers(raw) else ROLL_CKPT


def apply_roll_defaults(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``raw`` with ROLL's value for each top-level key of :data:`ROLL_DEFAULTS` it leaves
    unset, and ``{dotted key: where ROLL sets it}`` for those applied."""
    out = dict(raw)
    applied: dict[str, str] = {}
    cc = out.get("checkpoint_config")
    cc = dict(cc) if isinstance(cc, Mapping) else ({} if cc is None else cc)
    for dotted, (value, source) in ROLL_DEFAULTS.items():
        where, _, name = dotted.rpartition(".")
        if not where:
            if out.get(name) is None:
                out[name] = value
                applied[dotted] = source
            continue
        if not isinstance(cc, dict) or name in cc:
            continue
        if name == "keep_local_file" and (not isinstance(cc.get("backup"), Mapping) or "keep_local" in cc["backup"]):
            continue  # only means something with a backup (roll_keys.keep_local_file)
        cc[name] = value
        applied[dotted] = source
    if applied.keys() & {k for k in ROLL_DEFAULTS if k.startswith("checkpoint_config.")}:
        out["checkpoint_config"] = cc
    return out, applied


def worker_async_default(raw_worker: Mapping[str, Any]) -> bool:
    """Whether ROLL's default ``async_save_ckpt: true`` applies to this worker section (an
    FSDP2 trainer whose ``strategy_config`` does not set it)."""
    strategy = raw_worker.get("strategy_args")
    if not isinstance(strategy, Mapping) or strategy.get("strategy_name") != FSDP2_WORKER:
        return False
    config = strategy.get("strategy_config")
    return not (isinstance(config, Mapping) and "async_save_ckpt" in config)
