"""``checkpoint_config.initial_load``: the weights a fresh start loads (see :mod:`roll_ckpt.load.hf_folder`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .values import expect, field_names, location, reject_unknown, string
from ..errors import ConfigError

__all__ = ["InitialLoadConfig", "parse_initial_load"]


@dataclass(frozen=True)
class InitialLoadConfig:
    """Weights a fresh start loads into the state, when no checkpoint is resumed."""

    path: str = ""
    """A local Hugging Face folder: ``model.safetensors``, or shards and ``model.safetensors.index.json``."""
    format: str = "hf"
    """The folder's format; ``hf`` is the only one."""
    key: str = "model"
    """The state key of the module the weights go into."""


def parse_initial_load(value: Any) -> InitialLoadConfig | None:
    if value is None:
        return None
    key = "checkpoint_config.initial_load"
    expect(key, value, Mapping, "a mapping with path, format (hf) and optionally key")
    reject_unknown(key, value, field_names(InitialLoadConfig))
    if "path" not in value:
        raise ConfigError(f"{key}.path", "is required: the Hugging Face folder to load")
    path = location(f"{key}.path", value["path"])
    if "://" in path and not path.startswith("file://"):
        raise ConfigError(f"{key}.path", "must be a local folder (safetensors files are memory-mapped)", path,
                          "a local path; copy the folder from the store first")
    if "format" not in value:
        raise ConfigError(f"{key}.format", "is required", None, "hf")
    if value["format"] != "hf":
        raise ConfigError(f"{key}.format", "is not a format roll-ckpt loads", value["format"], "hf")
    return InitialLoadConfig(path=path.removeprefix("file://"), format="hf",
                             key=string(f"{key}.key", value.get("key", "model")))
