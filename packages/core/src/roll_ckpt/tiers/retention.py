"""Retention: keep the newest ``max_ckpt_to_keep`` committed checkpoints.

Order is :attr:`CheckpointRef.order` (run, then step as a number). The newest committed
checkpoint and any checkpoint still being written are never removed. Steps with
components go whole: a committed step with all its parts, or a step that can no longer
be committed (a part is missing and a newer step is whole). A checkpoint is
un-committed (manifest removed) before its files go, so a crash halfway through a
removal never leaves a folder that looks committed but is not whole.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable

from ..contracts import Storage
from ..format.layout import CheckpointRef, basename, parent, scan
from ..format.manifest import MANIFEST_NAME
from ..format.commit import held, MARKER_PREFIX, is_mine, live_writers, owner_gone, write_marker

__all__ = ["Retention", "plan_retention", "remove_checkpoint", "apply_retention", "note_open_run", "live_foreign_runs",
           "drop_empty_runs"]

log = logging.getLogger("roll_ckpt")

_open_runs: dict[str, "weakref.WeakMethod[Callable[[], bool]]"] = {}
"""Run folders of this process's launches: a run of this process is live while its manager says so."""


def note_open_run(path: str, alive: Callable[[], bool]) -> None:
    """Record that the run folder ``path`` is written by a launch of this process while
    ``alive()`` (a bound method of its manager, held weakly: a manager that is gone writes nothing)."""
    _open_runs[path.rstrip("/")] = weakref.WeakMethod(alive)  # type: ignore[arg-type]


def _open_in_this_process(path: str) -> bool:
    ref = _open_runs.get(path.rstrip("/"))
    alive = ref() if ref is not None else None
    return alive is not None and bool(alive())


def plan_retention(refs: list[CheckpointRef], keep: int, protect: set[str] = frozenset()) -> list[CheckpointRef]:
    """The committed checkpoints to remove so that ``keep`` remain (0 keeps all)."""
    done = sorted((r for r in refs if r.committed), key=lambda r: r.order)
    if keep <= 0 or len(done) <= keep:
        return []
    keep = max(keep, 1)
    return [r for r in done[:-keep] if r.path not in protect]


def remove_checkpoint(storage: Storage, path: str) -> None:
    """Un-commit, then remove the checkpoint at ``path``.

    An owner marker (as a save leaves one) claims the folder meanwhile: if this process
    dies halfway, the next start (``owners.clean_stale``) finds the marker of a writer that
    is gone and removes the rest of the folder, which no longer has a manifest.
    """
    import uuid

    marker = storage.join(parent(path), f"{MARKER_PREFIX}{basename(path)}-remove-{uuid.uuid4().hex[:12]}.json")
    write_marker(storage, marker, path, path)
    storage.remove(storage.join(path, MANIFEST_NAME))
    for e in storage.list(path):  # a step's parts too: complete_pending must not commit it again
        if e.is_dir:
            storage.remove(storage.join(e.path, MANIFEST_NAME))
    storage.sync_dir(path)
    storage.remove_tree(path)
    storage.remove(marker)


def live_foreign_runs(storage: Storage, output_dir: str, own_run: str | None) -> set[str]:
    """Names of the run folders under ``output_dir`` (``own_run`` aside) whose owner process
    still runs: another job's checkpoints are its own. Retention, the backup's pruning of the
    local copy (:mod:`.replication`) and the space check (:mod:`.space`) leave them alone."""
    import json

    from ..format.layout import RUN_RECORD, run_folders

    live = set()
    for name, path in run_folders(storage, output_dir):
        if own_run is not None and path.rstrip("/") == own_run.rstrip("/"):
            continue
        try:
            with storage.open_read(storage.join(path, RUN_RECORD)) as f:
                owner = json.loads(f.read().decode())
        except (OSError, ValueError):
            continue
        if not isinstance(owner, dict) or "pid" not in owner:
            continue
        if is_mine(owner):  # another manager of this process (two runs in one job): live while it is open
            if _open_in_this_process(path):
                live.add(name)
        elif not owner_gone(owner):
            live.add(name)
    return live


class Retention:
    """``max_ckpt_to_keep`` for one manager: a commit hook of its saver (:meth:`after_commit`),
    and what a save that needs room applies first. Under the lock the backup's ``keep_local``
    shares; never the checkpoint just written nor the one ``backup`` is copying."""

    def __init__(self, keep: int, lock: threading.Lock, backup: Any = None) -> None:
        self.keep, self.lock, self.backup = keep, lock, backup

    def apply(self, run: Any, path: str, keep: int | None = None) -> list[str]:
        """Remove the oldest of ``run``'s (a :class:`~roll_ckpt.tiers.run.Run`) location's checkpoints so that ``keep`` (default:
        ``max_ckpt_to_keep``) remain; returns their paths."""
        copying = self.backup.copying if self.backup is not None else None
        with self.lock:
            return apply_retention(run.storage, run.root, self.keep if keep is None else keep,
                                   protect={path} | ({copying} if copying else set()), own_run=run.folder)

    def after_commit(self, run: Any, path: str, step: int) -> None:
        if self.keep:
            for removed in self.apply(run, path):
                log.info("roll-ckpt: retention removed %s", removed)


def apply_retention(storage: Storage, output_dir: str, keep: int, protect: set[str] = frozenset(),
                    own_run: str | None = None) -> list[str]:
    """Remove the oldest committed checkpoints so that ``keep`` remain.

    Checkpoints of another run that is still alive (its run folder's owner process runs;
    in this process: its manager is open) are neither removed nor counted: two jobs
    sharing an ``output_dir`` never touch each other's checkpoints. Nor is a checkpoint
    that a live launch resumed from (:mod:`roll_ckpt.format.commit`). ``own_run`` is the
    caller's run folder.
    """
    removed = []
    live = live_foreign_runs(storage, output_dir, own_run)
    refs = [r for r in scan(storage, output_dir) if not r.run or r.run not in live]
    for ref in plan_retention(refs, keep, protect):
        if held(storage, ref.path, clean=True):  # another launch resumed from it (roll_ckpt.format.commit)
            continue
        remove_checkpoint(storage, ref.path)
        removed.append(ref.path)
    refs = [r for r in refs if r.path not in removed]  # pending steps are judged by what is left
    for ref in _abandoned_steps(storage, refs, protect):
        remove_checkpoint(storage, ref.path)
        removed.append(ref.path)
    drop_empty_runs(storage, output_dir, keep_runs=live | {basename(own_run)} if own_run else live)
    return removed


def _abandoned_steps(storage: Storage, refs: list[CheckpointRef], protect: set[str]) -> list[CheckpointRef]:
    """Steps with components that will never be committed: some parts are, but a newer step
    is whole and nobody writes to them. Components save their steps in order, one at a
    time, so once a newer step has every part, no part of an older step is still coming."""
    from ..format.layout import committed_parts
    from ..format.manifest import read_manifest

    done = [r for r in refs if r.committed]
    if not done:
        return []
    newest = max(done, key=lambda r: r.order)
    out = []
    for r in refs:
        if r.committed or r.order >= newest.order or r.path in protect:
            continue
        parts = committed_parts(storage, r.path)
        if not parts or live_writers(storage, r.path):
            continue
        # Every part the whole steps of its run have is there: only the step's own manifest
        # is missing (its writer failed), and the next resume commits it.
        whole = [d for d in done if d.run == r.run] or [newest]
        if set(read_manifest(storage, max(whole, key=lambda d: d.order).path).parts) <= set(parts):
            continue
        out.append(r)
    return out


def drop_empty_runs(storage: Storage, output_dir: str, keep_runs: set[str] | None = None) -> None:
    """Remove run folders left empty; with ``keep_runs`` (the live runs), also those that
    hold nothing but their owner record (a launch that stopped before its first step)."""
    from ..format.layout import RESUME_RECORD, RUN_RECORD, run_folders

    for name, path in run_folders(storage, output_dir):
        names = {e.name for e in storage.list(path)}
        if not names or (keep_runs is not None and name not in keep_runs and names <= {RUN_RECORD, RESUME_RECORD}):
            storage.remove_tree(path)
