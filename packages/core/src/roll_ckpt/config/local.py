"""``checkpoint_config.local``: the fast recovery tier's settings (see :mod:`roll_ckpt.tiers.local_tier`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .values import count, expect, field_names, location, reject_unknown
from ..errors import ConfigError

__all__ = ["LocalTierConfig", "parse_local", "DEFAULT_LOCAL_DIR"]

DEFAULT_LOCAL_DIR = "/dev/shm/roll-ckpt/{exp_name}"


@dataclass(frozen=True)
class LocalTierConfig:
    """Node-local checkpoints every few steps, each rank's shard copied to peers on other nodes."""

    dir: str = ""
    """Node-local folder (default ``/dev/shm/roll-ckpt/${exp_name}``, tmpfs); each node writes
    into ``<dir>/<node>`` (the host name, or ``ROLL_CKPT_NODE``)."""
    save_steps: int = 1
    """A local checkpoint every N steps (>= 1). Persistent saves (``save_steps``) go on unchanged."""
    max_to_keep: int = 2
    """Local steps kept per node folder, the rank's own units and the replicas it holds (>= 1)."""
    replicas: int = 1
    """Peer copies of each rank's unit, on the next nodes of a ring over nodes (0: none; at most
    the number of other nodes)."""


def parse_local(value: Any, exp_name: str) -> LocalTierConfig | None:
    if value is None or value is False:
        return None
    key = "checkpoint_config.local"
    if value is True:
        value = {}
    expect(key, value, Mapping, "a mapping with dir, save_steps, max_to_keep, replicas")
    reject_unknown(key, value, field_names(LocalTierConfig))
    folder = location(f"{key}.dir", value.get("dir", DEFAULT_LOCAL_DIR.format(exp_name=exp_name)))
    if "://" in folder and not folder.startswith("file://"):
        raise ConfigError(f"{key}.dir", "must be a node-local folder", folder, "a local path such as /dev/shm/...")
    save_steps = count(f"{key}.save_steps", value.get("save_steps", 1))
    if save_steps < 1:
        raise ConfigError(f"{key}.save_steps", "must be at least 1", save_steps, "an integer >= 1")
    keep = count(f"{key}.max_to_keep", value.get("max_to_keep", 2))
    if keep < 1:
        raise ConfigError(f"{key}.max_to_keep", "must be at least 1", keep, "an integer >= 1")
    return LocalTierConfig(dir=folder.removeprefix("file://"), save_steps=save_steps, max_to_keep=keep,
                           replicas=count(f"{key}.replicas", value.get("replicas", 1)))
