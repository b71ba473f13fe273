"""Run folders: each launch of a job writes its checkpoints into a folder of its own.

``<output_dir>/<YYYYmmdd-HHMMSS[-n]>/`` (``timestamp_subdir: true``), claimed create-only
with an owner record (``.run.json``: host, pid) so that retention and other runs can
tell whether it is still being written. With ``checkpoint_config.run_name`` (required
with components) every component of a launch writes the same folder, picked once by the
driver. With ``timestamp_subdir: false`` a launch writes ``output_dir`` itself and claims
it alone (``.launch.json``): a second live launch there gets a clear error at its first save.
Components without run folders (verl's layout: ``global_step_N/actor``) share ``output_dir``
unclaimed: one launch at a time there is the framework's to ensure.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from . import layout
from ..contracts import Storage
from ..errors import RollCkptError, StorageError
from .owners import clean_stale, is_mine, owner_gone, owner_record

__all__ = ["claim_run_folder", "release_folder", "utc_now", "LAUNCH_RECORD"]

LAUNCH_RECORD = ".launch.json"
"""With ``timestamp_subdir: false``: the owner of ``output_dir`` itself (one launch at a time)."""


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _record(exp_name: str) -> bytes:
    return json.dumps(dict(owner_record(), created=utc_now(), exp_name=exp_name)).encode()


def _claim_folder(storage: Storage, root: str, exp_name: str) -> None:
    """``timestamp_subdir: false``: this launch writes ``root`` itself, alone. Its owner
    record ``.launch.json`` is created create-only; a live owner's (another launch) is a
    clear error, a gone owner's is replaced."""
    path = storage.join(root, LAUNCH_RECORD)
    for _ in range(3):
        try:
            storage.write_create(path, _record(exp_name))
            return
        except FileExistsError:
            pass
        try:
            with storage.open_read(path) as f:
                owner = json.loads(f.read().decode())
        except FileNotFoundError:
            continue  # released meanwhile
        except (OSError, ValueError):
            owner = {}
        if isinstance(owner, dict) and owner and (is_mine(owner) or not owner_gone(owner)):
            if is_mine(owner):
                return  # another manager of this process (components, two runs in one job)
            raise RollCkptError(
                f"checkpoint_config.output_dir {root} is being written by another launch (host {owner.get('host')}, "
                f"pid {owner.get('pid')}, since {owner.get('created')}) and timestamp_subdir is false, so both would "
                "write the same checkpoint-<step> folders and each one's retention would count the other's. Stop "
                "that launch first, or set checkpoint_config.timestamp_subdir: true (each launch then writes a run "
                f"folder of its own), or, if that launch is gone for good (another host), delete {path}")
        storage.remove(path)  # its owner is gone
    raise StorageError(f"could not claim {root}: {path} keeps changing (launches starting at once?)")


def release_folder(storage: Storage, root: str) -> None:
    """Remove this process's ``.launch.json`` from ``root`` (``timestamp_subdir: false``)."""
    path = storage.join(root, LAUNCH_RECORD)
    try:
        with storage.open_read(path) as f:
            owner = json.loads(f.read().decode())
    except (OSError, ValueError):
        return
    if isinstance(owner, dict) and is_mine(owner):
        storage.remove(path)


def claim_run_folder(storage: Storage, root: str, cc: Any, exp_name: str, component: str | None) -> str:
    """Create (or join, with ``run_name``) this run's folder under ``root``; its name ("" when
    checkpoints go straight into ``root``). Removes what crashed saves left there first.
    Coordinator only."""
    storage.makedirs(root)
    clean_stale(storage, root)
    if not cc.timestamp_subdir:
        if component is None:  # the components of a launch write it together: none holds it alone
            _claim_folder(storage, root, exp_name)
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
        for _ in range(3):
            try:
                storage.makedirs(path)
                storage.write_create(storage.join(path, layout.RUN_RECORD), _record(exp_name))
                return name
            except FileExistsError:
                break  # another launch's: the next name
            except FileNotFoundError:
                # Between makedirs and the record the folder is empty, and another launch's
                # retention drops empty run folders: make it again.
                continue
    raise StorageError(f"could not create a run folder under {root}")
