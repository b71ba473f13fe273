"""The demo's settings: its default configuration, the command line's overrides applied
to it, the demo's own keys checked. Shared by the launcher (:mod:`.launch`) and the job
(:mod:`.job`), which otherwise do not know each other."""

from __future__ import annotations

import copy
import os
from typing import Any

__all__ = ["DEFAULT_CONFIG", "build_config", "params", "distributed_child"]

DEFAULT_CONFIG: dict[str, Any] = {
    "exp_name": "rlvr-demo",
    "seed": 42,
    "logging_dir": "${output_dir}/logs",
    "output_dir": "./output/demo",
    "checkpoint_config": {
        "type": "file_system",
        "output_dir": "${output_dir}/checkpoints/${exp_name}",
    },
    "resume_from_checkpoint": False,
    "max_steps": 80,
    "save_steps": 20,
    "logging_steps": 5,
    "eval_steps": 20,
    "strategy_config": {"async_save_ckpt": True},
    "offload_backend": "local",
    "demo": {
        "contexts": 4096,
        "eval_contexts": 1024,
        "features": 16,
        "arms": 8,
        "hidden": 128,
        "dropout": 0.1,
        "batch_size": 128,
        "lr": 0.01,
        "weight_decay": 0.01,
        "value_coef": 0.5,
        "entropy_coef": 0.01,
    },
}
"""The demo's configuration when no ``--config`` is given; ``examples/rlvr_demo.yaml`` holds the same."""


def build_config(args: Any) -> Any:
    """The resolved :class:`~roll_ckpt.config.schema.Config`, with the command-line overrides applied."""
    from pathlib import Path

    from roll_ckpt import load_config
    from roll_ckpt.plugin import read_yaml

    raw = read_yaml(Path(args.config)) if args.config else copy.deepcopy(DEFAULT_CONFIG)
    if args.output:
        raw["output_dir"] = args.output
    if args.resume:
        raw["resume_from_checkpoint"] = "latest"
    return load_config(raw)


def params(cfg: Any) -> dict[str, Any]:
    from roll_ckpt import ConfigError

    params = dict(DEFAULT_CONFIG["demo"])
    given = cfg.extra.get("demo") or {}
    if not isinstance(given, dict):
        raise ConfigError("demo", "must be a mapping of demo settings", given)
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise ConfigError(f"demo.{unknown[0]}", "is not a demo setting", None, ", ".join(sorted(params)))
    params.update(given)
    for key in ("logging_steps", "eval_steps"):
        value = cfg.extra.get(key, DEFAULT_CONFIG[key])
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(key, "must be a whole number >= 0", value)
        params[key] = value
    if cfg.max_steps < 1:
        raise ConfigError("max_steps", "the demo needs at least one step", cfg.max_steps)
    return params


def distributed_child() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
