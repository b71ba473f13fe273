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


def apply_retention(storage: Storage, output_dir: str, keep: int, protect: set[str] = frozenset()) -> list[str]:
    removed = []
    for ref in plan_retention(committed(storage, output_dir), keep, protect):
        remove_checkpoint(storage, ref.path)
        removed.append(ref.path)
    _drop_empty_runs(storage, output_dir)
    return removed


def _drop_empty_runs(storage: Storage, output_dir: str) -> None:
    from .layout import run_folders

    for _, path in run_folders(storage, output_dir):
        if not storage.list(path):
            storage.remove_tree(path)
