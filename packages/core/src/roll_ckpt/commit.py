"""The commit protocol: a checkpoint exists only once its manifest is committed.

Two forms, chosen by :attr:`Storage.atomic_rename`:

* POSIX disks — write everything into a temporary sibling ``.tmp-checkpoint-<step>-<id>``,
  fsync files and folders, rename it to ``checkpoint-<step>``, fsync the parent.
* object stores — write the data in place, then ``manifest.json`` last with create-only
  semantics. A folder without a manifest is never listed as committed.

Each save in flight leaves an owner marker ``.inflight-<id>.json`` (host, pid) next to
its folder; a later start removes the folders of owners that are gone.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from dataclasses import dataclass

from .errors import CheckpointNotFoundError, RollCkptError
from .layout import TMP_PREFIX, parse_step, run_folders
from .manifest import MANIFEST_NAME
from .storage import Storage

__all__ = ["PendingCheckpoint", "owner_record", "owner_gone", "plan", "begin", "commit", "abort", "clean_stale", "live_writers",
           "STALE_FOREIGN_S"]

MARKER_PREFIX = ".inflight-"
STALE_FOREIGN_S = 24 * 3600.0
"""Markers written by another host are only trusted to be stale after this long."""


@dataclass(frozen=True)
class PendingCheckpoint:
    final_path: str
    write_path: str
    marker_path: str


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parent(storage: Storage, path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] or "/"


def plan(storage: Storage, final_path: str, token: str) -> PendingCheckpoint:
    """Where a save of ``final_path`` writes; the same on every rank for the same token."""
    parent = _parent(storage, final_path)
    name = final_path.rstrip("/").rsplit("/", 1)[-1]
    marker = storage.join(parent, f"{MARKER_PREFIX}{name}-{token}.json")
    write_path = storage.join(parent, f"{TMP_PREFIX}{name}-{token}") if storage.atomic_rename else final_path
    return PendingCheckpoint(final_path, write_path, marker)


def begin(storage: Storage, pending: PendingCheckpoint) -> None:
    """Claim ``pending`` (coordinator only): owner marker first, then the folder."""
    if storage.exists(storage.join(pending.final_path, MANIFEST_NAME)):
        raise RollCkptError(
            f"a committed checkpoint already exists at {pending.final_path}; "
            "choose another step or delete it with 'roll-ckpt prune'"
        )
    owner = dict(owner_record(), write_path=pending.write_path, final_path=pending.final_path)
    storage.makedirs(_parent(storage, pending.final_path))
    with storage.open_write(pending.marker_path) as f:
        f.write(json.dumps(owner).encode())
    if not storage.atomic_rename:
        # Written in place: another live writer of the same folder (two replications of one
        # step) would see its files deleted under it; a crashed writer's leftovers would mix
        # with ours and are removed.
        now = time.time()
        mine = pending.marker_path.rstrip("/").rsplit("/", 1)[-1]
        busy = [o for e, o in _markers(storage, storage.list(_parent(storage, pending.final_path)))
                if e.name != mine and str(o.get("final_path", "")).rstrip("/") == pending.final_path.rstrip("/")
                and not _stale(o, now)]
        if busy:
            storage.remove(pending.marker_path)
            raise RollCkptError(f"{pending.final_path} is being written by another process "
                                f"(host {busy[0].get('host')}, pid {busy[0].get('pid')}); try again once it is done")
        storage.remove_tree(pending.final_path)
    storage.makedirs(pending.write_path)


def commit(storage: Storage, pending: PendingCheckpoint, manifest: bytes, subdirs: list[str]) -> None:
    """Publish ``pending``: after this returns the checkpoint is durable and listed."""
    w = pending.write_path
    if storage.atomic_rename:
        with storage.open_write(storage.join(w, MANIFEST_NAME)) as f:
            f.write(manifest)
        for sub in subdirs:
            storage.sync_dir(storage.join(w, sub))
        storage.sync_dir(w)
        storage.rename_dir(w, pending.final_path)
        storage.sync_dir(_parent(storage, pending.final_path))
    else:
        storage.write_create(storage.join(w, MANIFEST_NAME), manifest)
    storage.remove(pending.marker_path)


def abort(storage: Storage, pending: PendingCheckpoint) -> None:
    """Remove what a failed save wrote; never touches a committed checkpoint."""
    if storage.atomic_rename:
        storage.remove_tree(pending.write_path)
    elif not storage.exists(storage.join(pending.final_path, MANIFEST_NAME)):
        storage.remove_tree(pending.final_path)
    storage.remove(pending.marker_path)


@functools.lru_cache(maxsize=1)
def _pid_namespace() -> str:
    """This process's PID namespace and boot (Linux): a pid means something only within both.

    Containers that share a host name (host networking) each have their own pids; a
    component in one must not judge a writer in another dead by its pid.
    """
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{ns}:{boot}"


def owner_record() -> dict:
    """Who is writing: recorded in markers and run folders so others can tell if we are gone."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pidns": _pid_namespace(), "started": time.time()}


def owner_gone(owner: dict, now: float | None = None) -> bool:
    """True when the process that wrote ``owner`` no longer runs (or is too old to trust)."""
    return _stale(owner, time.time() if now is None else now)


def _stale(owner: dict, now: float) -> bool:
    # A record without "pidns" (older writers, hand-made test markers) is judged by host alone.
    if owner.get("host") == socket.gethostname() and owner.get("pidns", _pid_namespace()) == _pid_namespace():
        pid = owner.get("pid")
        return not (isinstance(pid, int) and _pid_alive(pid))
    return now - float(owner.get("started", 0)) > STALE_FOREIGN_S


def _markers(storage: Storage, entries: list) -> list[tuple[object, dict]]:
    """The owner markers among ``entries``, with what each records (``{}`` if unreadable)."""
    out = []
    for e in entries:
        if not e.name.startswith(MARKER_PREFIX) or e.is_dir:
            continue
        try:
            with storage.open_read(e.path) as f:
                owner = json.loads(f.read().decode())
        except (OSError, ValueError):
            owner = {}
        out.append((e, owner if isinstance(owner, dict) else {}))
    return out


def _clean_folder(storage: Storage, folder: str, now: float) -> list[str]:
    removed = []
    entries = storage.list(folder)
    live_writes = set()
    for e, owner in _markers(storage, entries):
        if owner and not _stale(owner, now):
            live_writes.add(owner.get("write_path"))
            continue
        wp = owner.get("write_path")
        if isinstance(wp, str) and _parent(storage, wp) == folder.rstrip("/"):
            # A temporary folder is never a checkpoint, even with a manifest inside (the writer
            # died between writing it and the rename); a folder written in place (object
            # stores) is one once its manifest exists.
            temporary = wp.rstrip("/").rsplit("/", 1)[-1].startswith(TMP_PREFIX)
            if temporary or not storage.exists(storage.join(wp, MANIFEST_NAME)):
                storage.remove_tree(wp)
                removed.append(wp)
        storage.remove(e.path)
    for e in entries:
        # A temporary folder no live owner claims is left over from a crash; so is a
        # create-only write's temporary file (LocalStorage.write_create), once it is old.
        if e.path in removed:
            continue
        if e.is_dir and e.name.startswith(TMP_PREFIX) and e.path not in live_writes:
            if e.mtime is None or now - e.mtime > 5.0:
                storage.remove_tree(e.path)
                removed.append(e.path)
        elif not e.is_dir and e.name.startswith(TMP_PREFIX) and e.mtime is not None and now - e.mtime > 60.0:
            storage.remove(e.path)
            removed.append(e.path)
    return removed


def clean_stale(storage: Storage, output_dir: str) -> list[str]:
    """Remove the uncommitted folders of saves whose process is gone. Returns their paths.

    Parts of a step with components are written inside its (uncommitted) step folder, so
    those folders are looked into as well.
    """
    now = time.time()
    removed = []
    for folder in [output_dir, *(path for _, path in run_folders(storage, output_dir))]:
        removed += _clean_folder(storage, folder, now)
        for e in storage.list(folder):
            if e.is_dir and parse_step(e.name) is not None and not storage.exists(storage.join(e.path, MANIFEST_NAME)):
                removed += _clean_folder(storage, e.path, now)
    return removed


def live_writers(storage: Storage, folder: str) -> bool:
    """True when an owner marker in ``folder`` belongs to a process that still runs."""
    now = time.time()
    return any(owner and not _stale(owner, now) for _, owner in _markers(storage, storage.list(folder)))


def require_committed(storage: Storage, path: str) -> None:
    if not storage.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the folder does not exist")
    if not storage.exists(storage.join(path, MANIFEST_NAME)):
        raise CheckpointNotFoundError(
            f"{path} is not a committed checkpoint (no {MANIFEST_NAME}): it is either not a "
            "roll-ckpt checkpoint or a save that never finished; resume from another one"
        )
