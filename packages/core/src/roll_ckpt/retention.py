"""Retention: keep the newest ``max_ckpt_to_keep`` committed checkpoints.

Order is :attr:`CheckpointRef.order` (run, then step as a number). The newest committed
checkpoint and any checkpoint still being written are never removed. A checkpoint is
un-committed (manifest removed) before its files go, so a crash halfway through a
removal never leaves a folder that looks committed but is not whole.
"""

from __future__ import annotations

from .layout import CheckpointRef, committed
from .manifest import MANIFEST_NAME
from .storage import Storage

__all__ = ["plan_retention", "remove_checkpoint", "apply_retention"]


def plan_retention(refs: list[CheckpointRef], keep: int, protect: set[str] = frozenset()) -> list[CheckpointRef]:
    """The committed checkpoints to remove so that ``keep`` remain (0 keeps all)."""
    done = sorted((r for r in refs if r.committed), key=lambda r: r.order)
    if keep <= 0 or len(done) <= keep:
        return []
    keep = max(keep, 1)
    return [r for r in done[:-keep] if r.path not in protect]


def remove_checkpoint(storage: Storage, path: str) -> None:
    storage.remove(storage.join(path, MANIFEST_NAME))
    storage.sync_dir(path)
    storage.remove_tree(path)


def _live_foreign_runs(storage: Storage, output_dir: str, own_run: str | None) -> set[str]:
    """Run folders whose owner process still runs: another job's checkpoints are its own."""
    import json
    import os
    import socket

    from .commit import owner_gone
    from .layout import RUN_RECORD, run_folders

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
        mine = owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()
        if not mine and not owner_gone(owner):
            live.add(name)
    return live


def apply_retention(storage: Storage, output_dir: str, keep: int, protect: set[str] = frozenset(),
                    own_run: str | None = None) -> list[str]:
    """Remove the oldest committed checkpoints so that ``keep`` remain.

    Checkpoints of another run that is still alive (its run folder's owner process runs)
    are neither removed nor counted: two jobs sharing an ``output_dir`` never touch each
    other's checkpoints. ``own_run`` is the caller's run folder.
    """
    removed = []
    live = _live_foreign_runs(storage, output_dir, own_run)
    refs = [r for r in committed(storage, output_dir) if not r.run or r.run not in live]
    for ref in plan_retention(refs, keep, protect):
        remove_checkpoint(storage, ref.path)
        removed.append(ref.path)
    _drop_empty_runs(storage, output_dir)
    return removed


def _drop_empty_runs(storage: Storage, output_dir: str) -> None:
    from .layout import run_folders

    for _, path in run_folders(storage, output_dir):
        if not storage.list(path):
            storage.remove_tree(path)
