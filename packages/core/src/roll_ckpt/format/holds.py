"""Holds: a checkpoint a live launch resumed from is not removed by anyone's retention.

Two launches may write one ``output_dir`` at once (a launch the scheduler thought dead and
restarted, a Ray actor that exists twice). Each writes a run folder of its own, and
retention never touches the checkpoints of a run whose owner still runs
(:mod:`roll_ckpt.tiers.retention`). The checkpoint a launch resumes from is usually in another
run's folder, though: an older launch's, which the other live launch's retention may
count as its own past. Before it reads that checkpoint the coordinator leaves a hold next
to it, ``.hold-<checkpoint>-<token>.json`` (an owner record, as markers are:
:mod:`roll_ckpt.format.owners`); retention leaves a checkpoint with a live hold alone, checking
again just before it removes each one. The hold goes once the launch has committed a
checkpoint of its own (a restart would resume that one) or closes; a hold whose owner is
gone counts for nothing and is removed by the next retention.
"""

from __future__ import annotations

import json

from ..contracts import Storage
from .layout import basename, parent
from .owners import is_mine, owner_gone, owner_record

__all__ = ["HOLD_PREFIX", "hold", "release", "held"]

HOLD_PREFIX = ".hold-"


def hold(storage: Storage, path: str, token: str) -> str:
    """Hold the checkpoint at ``path``; returns the hold's path (for :func:`release`)."""
    marker = storage.join(parent(path), f"{HOLD_PREFIX}{basename(path)}-{token}.json")
    with storage.open_write(marker) as f:
        f.write(json.dumps(dict(owner_record(), path=path)).encode())
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
