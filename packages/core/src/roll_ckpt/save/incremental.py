"""Incremental saves: a data file whose bytes are those of the file of the same name in the
newest committed checkpoint of the run is taken over from it, not written again.

*Unchanged is proven, not assumed.* A candidate file is first serialized into a sink that
only hashes (the very bytes the writer would write, frames and all); only when its size
and XXH3-128 checksum equal the ones recorded for the base checkpoint's file is the file
taken over, by the storage (:class:`~roll_ckpt.contracts.TakesOver`: a hard link on POSIX
disks, a server-side copy on object stores; a plain copy through this process where the
storage has neither). Anything else is written as before. ``requires_grad``, version
counters and the like decide nothing: they only choose which files are worth hashing first.

*The unit is a file.* The writer puts the tensors that no optimizer updates
(``requires_grad=False``, or in no optimizer's param groups) into files of their own
(:func:`roll_ckpt.save.writer.plan_files`), so a frozen base is whole files, and byte values
(counters, RNG states), which change at every step, never share a file with them. A
per-tensor unit would need a DCP folder whose items point into another checkpoint's files:
no longer self-contained, and no longer plain DCP. A file is hashed first when it holds
only such tensors or when it was taken over at the last save; every other file is written
straight away, so a full fine-tune pays nothing for the feature.

Every checkpoint stays a complete, plain DCP folder with all its files: deleting an older
checkpoint never breaks a newer one (a hard link keeps the bytes; a copy is a copy). On a
POSIX disk a linked file is one inode shared by both checkpoints: damage *to the disk's
blocks* of it shows in both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..contracts import Storage
from ..format.commit import take_over_file
from ..format.layout import CKPT_RE

__all__ = ["Base", "Increments", "TakeOver", "cold_names"]

log = logging.getLogger("roll_ckpt")


@dataclass(frozen=True)
class Base:
    """A committed checkpoint a save may take files over from: its DCP folder on ``url``
    and, per file this process may write, ``(size, checksum, chunks)``."""

    url: str
    dcp_path: str
    files: Mapping[str, tuple]

    @property
    def name(self) -> str:
        """The checkpoint within its run: ``checkpoint-<step>`` (or another name format), or
        ``checkpoint-<step>/<component>``."""
        parts = self.dcp_path.rstrip("/").split("/")[:-1]
        steps = [i for i, p in enumerate(parts) if CKPT_RE.fullmatch(p)]
        return "/".join(parts[steps[-1]:]) if steps else parts[-1]


@dataclass
class TakeOver:
    """What one save may take over: the base, the names of the tensors worth hashing first
    (no optimizer updates them), the files taken over at the last save. Collects what it did."""

    storage: Storage
    base: Base
    cold: frozenset[str]
    warm_files: frozenset[str]
    taken: dict[str, tuple] = field(default_factory=dict)
    """File name -> digest of each file taken over by this save."""

    def candidate(self, name: str, fqns: list[str]) -> tuple | None:
        """The base's digest of ``name`` when the file is worth hashing first, else ``None``."""
        previous = self.base.files.get(name)
        if previous is None or not fqns:
            return None
        if name in self.warm_files or all(f in self.cold for f in fqns):
            return previous
        return None

    def take(self, name: str, dst: str) -> bool:
        """Take ``name`` over from the base into ``dst``; False when the base's file is gone
        or the storage fails (the caller then writes it)."""
        src = self.storage.join(self.base.dcp_path, name)
        try:
            how = take_over_file(self.storage, src, dst)
        except (OSError, RuntimeError) as exc:  # the base pruned meanwhile, a store refusing: write it
            log.info("roll-ckpt: cannot take %s over from %s (%s: %s); writing it", name, self.base.dcp_path,
                     type(exc).__name__, exc)
            try:
                self.storage.remove(dst)
            except OSError:
                pass
            return False
        log.debug("roll-ckpt: %s taken over from %s (%s)", name, self.base.dcp_path, how)
        return True


def cold_names(state: Mapping[str, Any]) -> frozenset[str]:
    """DCP names (``<key>.<parameter>``) of the parameters of ``state``'s modules that no
    optimizer in ``state`` updates: ``requires_grad=False`` ones, and, when ``state`` holds
    optimizers, those in none of their param groups. Only a hint of what to hash first."""
    import torch

    optimizers = [o for o in state.values() if isinstance(o, torch.optim.Optimizer)]
    updated = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    out = set()
    for key, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            for name, p in obj.named_parameters():
                if not p.requires_grad or (optimizers and id(p) not in updated):
                    out.add(f"{key}.{name}")
    return frozenset(out)


class Increments:
    """One strategy's record, across saves, of the newest committed checkpoint it knows and
    of the files this process wrote into it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.base: Base | None = None
        self.cold: frozenset[str] = frozenset()
        """The state's tensors that no optimizer updates (:meth:`note_state`)."""
        self._cold_of = -1
        self._pending: tuple[str, dict[str, tuple], frozenset[str]] | None = None
        self._warm: frozenset[str] = frozenset()
        self._take: TakeOver | None = None

    def note_state(self, state: Mapping[str, Any], build: int) -> None:
        """Find :attr:`cold` for ``state`` once per build of its state dict (``build``: the
        cache's counter): a hint only, so a later ``requires_grad`` change may wait for one."""
        if self.enabled and build != self._cold_of:
            self.cold, self._cold_of = cold_names(state), build

    def writer_options(self, storage: Storage, alone: bool, gate: Any) -> dict[str, Any]:
        """The writer's ``cold`` and ``take`` for a save of the job's folder. Off for a folder a
        process writes alone (the fast tier's unit, on another storage) and for regular staging
        in waves, whose halves are reused once written (a file hashed first could not be)."""
        if not self.enabled or alone:
            return {}
        base = self.base
        usable = base is not None and gate is None and base.url == storage.url
        self._take = TakeOver(storage, base, self.cold, self._warm) if usable else None  # type: ignore[arg-type]
        return {"cold": self.cold, "take": self._take}

    def wrote(self, storage: Storage, writer: Any, digests: dict[str, tuple]) -> dict[str, tuple]:
        """The save's files are written (``writer``: this process's); kept until the save is
        committed (:meth:`committed`) or failed (:meth:`failed`). Returns ``digests``."""
        if self.enabled:
            take, self._take = self._take, None
            self._pending = (storage.url, dict(writer.own_digests()), frozenset(take.taken if take else ()))
        return digests

    def committed(self, storage: Storage, checkpoint_path: str, data_dir: str) -> None:
        """The save is committed at ``checkpoint_path``: it is the next save's base."""
        if self._pending is None:
            return
        url, files, taken = self._pending
        self._pending = None
        self.base = Base(url, storage.join(checkpoint_path, data_dir), files)
        self._warm = taken

    def failed(self) -> None:
        self._pending = None
        self._take = None

    def seed(self, storage: Storage, dcp_path: str, files: Mapping[str, Any]) -> None:
        """A checkpoint this job resumed from, with its manifest's entries for ``dcp_path``."""
        if self.enabled and files:
            self.base = Base(storage.url, dcp_path, {n: (e.size, e.checksum, tuple(e.chunks)) for n, e in files.items()})
            self._warm = frozenset()
