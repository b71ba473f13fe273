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
(:mod:`roll_ckpt.format.owners`) claims the save meanwhile, so a crashed save is cleaned up by
a later start. What a failed save could not remove is removed by the next save of the
process (:class:`Leftovers`).
"""

from __future__ import annotations

import logging
import shutil
import time

from ..contracts import Storage, TakesOver
from ..errors import CheckpointNotFoundError, RollCkptError
from .layout import TMP_PREFIX, basename, parent
from .manifest import MANIFEST_NAME
from .owners import MARKER_PREFIX, markers_named, owner_gone, write_marker

__all__ = ["PendingCheckpoint", "RenameIntoPlace", "ManifestLast", "Leftovers", "pending_checkpoint",
           "require_committed", "take_over_file"]

log = logging.getLogger("roll_ckpt")


class PendingCheckpoint:
    """A checkpoint being written to :attr:`final_path`; a subclass per commit protocol."""

    def __init__(self, storage: Storage, final_path: str, token: str) -> None:
        self.storage = storage
        self.final_path = final_path
        self.marker_path = storage.join(parent(final_path), f"{MARKER_PREFIX}{basename(final_path)}-{token}.json")
        self.write_path = self._write_path(token)

    def _write_path(self, token: str) -> str:
        raise NotImplementedError

    def begin(self) -> None:
        """Claim the save (coordinator only): owner marker first, then the folder."""
        storage = self.storage
        if storage.exists(storage.join(self.final_path, MANIFEST_NAME)):
            raise RollCkptError(f"a committed checkpoint already exists at {self.final_path}; "
                                "choose another step or delete it with 'roll-ckpt prune'")
        storage.makedirs(parent(self.final_path))
        write_marker(storage, self.marker_path, self.write_path, self.final_path)
        self._claim()
        storage.makedirs(self.write_path)

    def _claim(self) -> None:
        """Protocol-specific checks once the marker is written."""

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

    def _write_path(self, token: str) -> str:
        return self.storage.join(parent(self.final_path), f"{TMP_PREFIX}{basename(self.final_path)}-{token}")

    def _publish(self, manifest: bytes) -> None:
        storage, w = self.storage, self.write_path
        with storage.open_write(storage.join(w, MANIFEST_NAME)) as f:
            f.write(manifest)
        for folder in _folders_deepest_first(storage, w):
            storage.sync_dir(folder)
        storage.rename_dir(w, self.final_path)
        storage.sync_dir(parent(self.final_path))

    def _discard(self) -> None:
        self.storage.remove_tree(self.write_path)

    def abandon(self) -> None:
        self.storage.remove_tree(self.write_path)


class ManifestLast(PendingCheckpoint):
    """Write in place, then the manifest last, create-only."""

    def _write_path(self, token: str) -> str:
        return self.final_path

    def _claim(self) -> None:
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


def require_committed(storage: Storage, path: str) -> None:
    if not storage.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the folder does not exist")
    if not storage.exists(storage.join(path, MANIFEST_NAME)):
        raise CheckpointNotFoundError(
            f"{path} is not a committed checkpoint (no {MANIFEST_NAME}): it is either not a "
            "roll-ckpt checkpoint or a save that never finished; resume from another one"
        )


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
