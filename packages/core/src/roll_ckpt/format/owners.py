"""Who writes what: owner records, in-flight markers, and the cleanup of crashed saves.

Each save in flight leaves an owner marker ``.inflight-<name>-<id>.json`` (host, pid, PID
namespace, where it writes) next to its folder; a run folder records its owner in
``.run.json``. A later start removes the folders of owners that are gone. A pid means
something only on its own host, in its own PID namespace and boot; records written by
another host are trusted to be stale only after :data:`STALE_FOREIGN_S`.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time

from ..contracts import ListsByPrefix, Storage
from .layout import TMP_PREFIX, basename, parent, parse_step, run_folders
from .manifest import MANIFEST_NAME

__all__ = ["MARKER_PREFIX", "STALE_FOREIGN_S", "owner_record", "owner_gone", "is_mine", "markers_named",
           "read_markers", "write_marker", "clean_stale", "live_writers"]

MARKER_PREFIX = ".inflight-"
STALE_FOREIGN_S = 24 * 3600.0
"""Markers written by another host are only trusted to be stale after this long."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def is_mine(owner: dict) -> bool:
    """True when ``owner`` records this very process."""
    return owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname() \
        and owner.get("pidns", _pid_namespace()) == _pid_namespace()


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


def write_marker(storage: Storage, path: str, write_path: str, final_path: str) -> None:
    """Claim ``write_path`` (to become ``final_path``) with an owner marker at ``path``."""
    with storage.open_write(path) as f:
        f.write(json.dumps(dict(owner_record(), write_path=write_path, final_path=final_path)).encode())


def markers_named(storage: Storage, folder: str, name: str) -> list[tuple[object, dict]]:
    """The owner markers in ``folder`` of the save of ``name`` (every writer's token). Backends
    that list by prefix (``list_prefix``, optional: object stores) list only those; the others
    list the folder."""
    prefix = f"{MARKER_PREFIX}{name}-"
    entries = storage.list_prefix(folder, prefix) if isinstance(storage, ListsByPrefix) else \
        [e for e in storage.list(folder) if e.name.startswith(prefix)]
    return read_markers(storage, entries)


def read_markers(storage: Storage, entries: list) -> list[tuple[object, dict]]:
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
    for e, owner in read_markers(storage, entries):
        if owner and not _stale(owner, now):
            live_writes.add(owner.get("write_path"))
            continue
        wp = owner.get("write_path")
        if isinstance(wp, str) and parent(wp) == folder.rstrip("/"):
            # A temporary folder is never a checkpoint, even with a manifest inside (the writer
            # died between writing it and the rename); a folder written in place (object
            # stores) is one once its manifest exists.
            temporary = basename(wp).startswith(TMP_PREFIX)
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
    return any(owner and not _stale(owner, now) for _, owner in read_markers(storage, storage.list(folder)))
