"""The commit protocol: a checkpoint exists only once its manifest is committed.

One class per protocol, chosen by the backend (:attr:`Storage.atomic_rename`):

* :class:`RenameIntoPlace` (POSIX disks) — write everything into a temporary sibling
  ``.tmp-checkpoint-<step>-<id>``, fsync files and folders, rename it to
  ``checkpoint-<step>``, fsync the parent.
* :class:`ManifestLast` (object stores) — write the data in place, then ``manifest.json``
  last with create-only semantics. A folder without a manifest is never listed as committed.

Every process of a save builds the same :class:`PendingCheckpoint` from the same token
(:func:`pending_checkpoint`) and writes into :attr:`~PendingCheckpoint.write_path`; the
coordinator alone calls :meth:`~PendingCheckpoint.begin`, then
:meth:`~PendingCheckpoint.commit` or :meth:`~PendingCheckpoint.abort`. An owner marker
(:mod:`roll_ckpt.format.commit`) claims the save meanwhile, so a crashed save is cleaned up by
a later start. What a failed save could not remove is removed by the next save of the
process (:class:`Leftovers`).

**Owners and holds.** Who owns what in a checkpoint folder: owner records and in-flight markers, run folders, and
holds on a resumed checkpoint.

**Owner records.** Each save in flight leaves an owner marker ``.inflight-<name>-<id>.json``
(host, pid, PID namespace, where it writes) next to its folder; a run folder records its
owner in ``.run.json``. A later start removes the folders of owners that are gone. A pid
means something only on its own host, in its own PID namespace and boot; records written by
another host are trusted to be stale only after :data:`STALE_FOREIGN_S`.

**Run folders.** Each launch of a job writes its checkpoints into a folder of its own.

``<output_dir>/<YYYYmmdd-HHMMSS[-n]>/`` (``timestamp_subdir: true``), claimed create-only
with an owner record (``.run.json``: host, pid) so that retention and other runs can tell
whether it is still being written. With ``checkpoint_config.run_name`` (required with
components) every component of a launch writes the same folder, picked once by the driver.
With ``timestamp_subdir: false`` a launch writes ``output_dir`` itself and claims it alone
(``.launch.json``): a second live launch there gets a clear error at its first save.
Components without run folders (verl's layout: ``global_step_N/actor``) share ``output_dir``
unclaimed: one launch at a time there is the framework's to ensure.

**Holds.** A checkpoint a live launch resumed from is not removed by anyone's retention.

Two launches may write one ``output_dir`` at once (a launch the scheduler thought dead and
restarted, a Ray actor that exists twice). Each writes a run folder of its own, and
retention never touches the checkpoints of a run whose owner still runs
(:mod:`roll_ckpt.tiers.retention`). The checkpoint a launch resumes from is usually in
another run's folder, though: an older launch's, which the other live launch's retention may
count as its own past. Before it reads that checkpoint the coordinator leaves a hold next to
it, ``.hold-<checkpoint>-<token>.json`` (an owner record, as markers
are); retention leaves a checkpoint with a live hold alone,
checking again just before it removes each one. The hold goes once the launch has committed
a checkpoint of its own (a restart would resume that one) or closes; a hold whose owner is
gone counts for nothing and is removed by the next retention.
"""

from __future__ import annotations

import logging
import shutil
import time
import functools
import json
import os
import socket
from datetime import datetime, timezone
from typing import Any

from ..contracts import Storage, TakesOver, ListsByPrefix
from ..errors import RollCkptError, StorageError
from .layout import MARKER_PREFIX, TMP_PREFIX, basename, parent, parse_step, run_folders
from .manifest import MANIFEST_NAME
from . import layout

__all__ = ['PendingCheckpoint', 'RenameIntoPlace', 'ManifestLast', 'Leftovers', 'pending_checkpoint', 'take_over_file', 'MARKER_PREFIX', 'STALE_FOREIGN_S', 'owner_record', 'owner_gone', 'is_mine', 'markers_named', 'read_markers', 'write_marker', 'clean_stale', 'live_writers', 'claim_run_folder', 'release_folder', 'utc_now', 'LAUNCH_RECORD', 'HOLD_PREFIX', 'hold', 'release', 'held']


# ---- the commit ------------------------------------------------------------

log = logging.getLogger("roll_ckpt")


class PendingCheckpoint:
    """A checkpoint being written to :attr:`final_path`; a subclass per commit protocol."""

    in_place: bool
    """The protocol writes into ``final_path`` itself (else into a temporary sibling)."""

    def __init__(self, storage: Storage, final_path: str, token: str) -> None:
        self.storage = storage
        self.final_path = final_path
        folder, name = parent(final_path), basename(final_path)
        self.marker_path = storage.join(folder, f"{MARKER_PREFIX}{name}-{token}.json")
        self.write_path = final_path if self.in_place else storage.join(folder, f"{TMP_PREFIX}{name}-{token}")

    def begin(self) -> None:
        """Claim the save (coordinator only): owner marker first, then the folder."""
        storage = self.storage
        if storage.exists(storage.join(self.final_path, MANIFEST_NAME)):
            raise RollCkptError(f"a committed checkpoint already exists at {self.final_path}; "
                                "choose another step or delete it with 'roll-ckpt prune'")
        storage.makedirs(parent(self.final_path))
        write_marker(storage, self.marker_path, self.write_path, self.final_path)
        if self.in_place:
            self._claim_in_place()
        storage.makedirs(self.write_path)

    def commit(self, manifest: bytes) -> None:
        """Publish: after this returns the checkpoint is durable and listed."""
        self._publish(manifest)
        self.storage.remove(self.marker_path)

    def _publish(self, manifest: bytes) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Remove what a failed save wrote; never touches a committed checkpoint."""
        self._discard()
        self.storage.remove(self.marker_path)

    def _discard(self) -> None:
        raise NotImplementedError

    def abandon(self) -> None:
        """A save refused before :meth:`begin`: other processes may have made this save's own
        folder in DCP's planning step; remove it when it is ours alone to remove."""


class RenameIntoPlace(PendingCheckpoint):
    """Write into a temporary sibling, fsync, rename into place, fsync the parent."""

    in_place = False

    def _publish(self, manifest: bytes) -> None:
        storage, w = self.storage, self.write_path
        with storage.open_write(storage.join(w, MANIFEST_NAME)) as f:
            f.write(manifest)
        for folder in _folders_deepest_first(storage, w):
            storage.sync_dir(folder)
        storage.rename_dir(w, self.final_path)  # durable on return (the Storage protocol): no sync of its own

    def _discard(self) -> None:
        self.storage.remove_tree(self.write_path)

    abandon = _discard  # the temporary folder is this save's alone, begun or not


class ManifestLast(PendingCheckpoint):
    """Write in place, then the manifest last, create-only."""

    in_place = True

    def _claim_in_place(self) -> None:
        # Written in place: another live writer of the same folder (two replications of one
        # step) would see its files deleted under it; a crashed writer's leftovers would mix
        # with ours and are removed.
        storage = self.storage
        now = time.time()
        mine = basename(self.marker_path)
        # (by prefix: on an object store this listing must not grow with the checkpoints kept)
        busy = [o for e, o in markers_named(storage, parent(self.final_path), basename(self.final_path))
                if e.name != mine and str(o.get("final_path", "")).rstrip("/") == self.final_path.rstrip("/")
                and not owner_gone(o, now)]
        if busy:
            storage.remove(self.marker_path)
            raise RollCkptError(f"{self.final_path} is being written by another process "
                                f"(host {busy[0].get('host')}, pid {busy[0].get('pid')}); try again once it is done")
        storage.remove_tree(self.final_path)

    def _publish(self, manifest: bytes) -> None:
        self.storage.write_create(self.storage.join(self.write_path, MANIFEST_NAME), manifest)

    def _discard(self) -> None:
        if not self.storage.exists(self.storage.join(self.final_path, MANIFEST_NAME)):
            self.storage.remove_tree(self.final_path)


def pending_checkpoint(storage: Storage, final_path: str, token: str) -> PendingCheckpoint:
    """The pending checkpoint for ``final_path`` under the backend's protocol; the same on
    every process for the same ``token``."""
    protocol = RenameIntoPlace if storage.atomic_rename else ManifestLast
    return protocol(storage, final_path, token)


def _folders_deepest_first(storage: Storage, root: str) -> list[str]:
    """Every folder below ``root``, then ``root``: each is synced after what it holds."""
    out: list[str] = []
    for e in storage.list(root):
        if e.is_dir:
            out += _folders_deepest_first(storage, e.path)
    return out + [root]


def take_over_file(storage: Storage, src: str, dst: str) -> str:
    """``dst`` made a file with ``src``'s bytes, independent of ``src`` (it survives its
    removal); how: ``link``, ``server_copy``, or ``copy`` (read and written here)."""
    if isinstance(storage, TakesOver):
        return storage.take_over(src, dst)
    with storage.open_read(src) as f, storage.open_write(dst) as out:
        shutil.copyfileobj(f, out, 8 << 20)
    return "copy"


class Leftovers:
    """What a failed save could not remove, removed by the next save.

    A save that fails removes what it wrote (``PendingCheckpoint.abort``). When that cleanup
    fails too — the store that failed the save is still unreachable — the folder and its owner
    marker stay, and since the marker names a process that is still running, no later start
    would judge them stale. This keeps such saves and tries again before each next save of the
    process (and ``close()``); a process that exits first leaves a marker of a process that is
    gone, which the next start or ``roll-ckpt prune`` cleans."""

    def __init__(self) -> None:
        self.pending: list[tuple[PendingCheckpoint, bool]] = []

    def discard(self, pending: PendingCheckpoint, begun: bool) -> None:
        """Remove what the failed save ``pending`` wrote (``begun``: it claimed its folder);
        kept for later if that fails."""
        try:
            pending.abort() if begun else pending.abandon()
        except Exception as exc:
            log.warning("roll-ckpt: could not clean up %s (%s: %s); the next save tries again",
                        pending.write_path, type(exc).__name__, exc)
            self.pending.append((pending, begun))

    def retry(self) -> None:
        """Try again to remove what earlier failed saves left."""
        left, self.pending = self.pending, []
        for pending, begun in left:
            self.discard(pending, begun)
            if not self.pending or self.pending[-1][0] is not pending:
                log.info("roll-ckpt: removed %s, left by a failed save", pending.write_path)


# ---- owners and holds ------------------------------------------------------

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


# ----------------------------------------------------------------------------- run folders


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


# ----------------------------------------------------------------------------- holds


HOLD_PREFIX = ".hold-"


def hold(storage: Storage, path: str, token: str) -> str:
    """Hold the checkpoint at ``path``; returns the hold's path (for :func:`release`).

    Written create-only, so it appears whole: another launch's retention reads holds at any
    time, and one it cannot read holds nothing (:func:`held`)."""
    marker = storage.join(parent(path), f"{HOLD_PREFIX}{basename(path)}-{token}.json")
    try:
        storage.write_create(marker, json.dumps(dict(owner_record(), path=path)).encode())
    except FileExistsError:  # this launch's own hold (the token is the launch's), left by an earlier resume
        pass
    return marker


def release(storage: Storage, marker: str | None) -> None:
    if marker is not None:
        storage.remove(marker)


def held(storage: Storage, path: str, *, clean: bool = False) -> bool:
    """True when a live process (another one, or this one) holds the checkpoint at ``path``.
    ``clean``: remove the holds of processes that are gone."""
    live = False
    for e in storage.list(parent(path)):
        if e.is_dir or not e.name.startswith(f"{HOLD_PREFIX}{basename(path)}-"):
            continue
        try:
            with storage.open_read(e.path) as f:
                owner = json.loads(f.read().decode())
        except (OSError, ValueError):
            continue
        if not isinstance(owner, dict) or str(owner.get("path", "")).rstrip("/") != path.rstrip("/"):
            continue
        if is_mine(owner) or not owner_gone(owner):
            live = True
        elif clean:
            storage.remove(e.path)
    return live
