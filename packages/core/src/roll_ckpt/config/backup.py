"""``checkpoint_config.backup``: a second location every committed checkpoint is replicated to."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import ConfigError
from .values import count, expect, field_names, location, options as options_map, reject_unknown, seconds, string

__all__ = ["BackupConfig", "parse_backup", "same_location"]


@dataclass(frozen=True)
class BackupConfig:
    """A second location every committed checkpoint is replicated to."""

    type: str = "file_system"
    """Backend plugin of the replica."""
    output_dir: str = ""
    """Path or fsspec URL of the replica's root."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to the replica's backend (``endpoint_url``, ``key``...)."""
    keep_local: int = 0
    """Local checkpoints kept once their replica is committed (the newest ones); 0 keeps them all.

    Only checkpoints whose replica is committed (and identical) are ever removed, and never
    the newest local one."""
    max_wait_s: float = 5.0
    """The most ``close()`` waits for replication still in flight (seconds); 0 does not wait.

    Saves never wait for replication. A copy cut off by this bound is removed from the
    replica (nothing of it is committed) and made again by the next run's first save."""
    retries: int = 3
    """Further attempts after a failed copy, with exponential backoff (1 s, 2 s, 4 s...)."""


def parse_backup(value: Any) -> BackupConfig | None:
    if value is None:
        return None
    key = "checkpoint_config.backup"
    expect(key, value, Mapping, "a mapping with type, output_dir, storage_options, keep_local, "
                                "max_wait_s, retries")
    reject_unknown(key, value, field_names(BackupConfig))
    if "output_dir" not in value:
        raise ConfigError(f"{key}.output_dir", "is required when a backup is configured")
    return BackupConfig(
        type=string(f"{key}.type", value.get("type", "file_system")),
        output_dir=location(f"{key}.output_dir", value["output_dir"]),
        storage_options=options_map(f"{key}.storage_options", value.get("storage_options")),
        keep_local=count(f"{key}.keep_local", value.get("keep_local", 0)),
        max_wait_s=seconds(f"{key}.max_wait_s", value.get("max_wait_s", 5.0)),
        retries=count(f"{key}.retries", value.get("retries", 3)),
    )


def same_location(a: str, b: str) -> bool:
    def norm(u: str) -> str:
        if "://" not in u or u.startswith("file://"):
            try:
                return os.path.normpath(os.path.abspath(os.path.expanduser(u.removeprefix("file://"))))
            except ValueError:  # a user name ~x that cannot be looked up
                return u
        return u.rstrip("/")
    return norm(a) == norm(b)
