"""Run folders: each launch of a job writes its checkpoints into a folder of its own.

``<output_dir>/<YYYYmmdd-HHMMSS[-n]>/`` (``timestamp_subdir: true``), claimed create-only
with an owner record (``.run.json``: host, pid) so that retention and other runs can
tell whether it is still being written. With ``checkpoint_config.run_name`` (required
with components) every component of a launch writes the same folder, picked once by the
driver.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from . import layout
from .contracts import Storage
from .errors import RollCkptError, StorageError
from .owners import clean_stale, owner_record

__all__ = ["claim_run_folder", "utc_now"]


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _record(exp_name: str) -> bytes:
    return json.dumps(dict(owner_record(), created=utc_now(), exp_name=exp_name)).encode()


def claim_run_folder(storage: Storage, root: str, cc: Any, exp_name: str, component: str | None) -> str:
    """Create (or join, with ``run_name``) this run's folder under ``root``; its name ("" when
    checkpoints go straight into ``root``). Removes what crashed saves left there first.
    Coordinator only."""
    storage.makedirs(root)
    clean_stale(storage, root)
    if not cc.timestamp_subdir:
        return ""
    wanted = cc.run_name
    if wanted:  # shared by the job's components: whoever comes first records it
        path = storage.join(root, wanted)
        done = [r.step for r in layout.committed(storage, path)] if component and storage.isdir(path) else []
        if done:
            # No step of a launch is whole before every component has resumed, so a whole
            # step here was written by an earlier launch: parts of the two would mix.
            raise RollCkptError(
                f"checkpoint_config.run_name '{wanted}' was used by an earlier launch (it holds committed "
                f"step {max(done)}); each launch needs a new one, picked once by the driver "
                "(roll_ckpt.new_run_name()) and given to every component. A component that died cannot "
                "rejoin a running launch: restart every component together")
        storage.makedirs(path)
        try:
            storage.write_create(storage.join(path, layout.RUN_RECORD), _record(exp_name))
        except FileExistsError:
            pass
        return wanted
    now = datetime.now()
    for attempt in range(100):
        name = layout.run_name(now, attempt)
        path = storage.join(root, name)
        try:
            storage.makedirs(path)
            storage.write_create(storage.join(path, layout.RUN_RECORD), _record(exp_name))
            return name
        except FileExistsError:
            continue
    raise StorageError(f"could not create a run folder under {root}")
