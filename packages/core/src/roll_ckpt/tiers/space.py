"""Storage space: a checkpoint's size estimated from its state dict, checked before a save.

The estimate follows what DCP writes, item by item, for the state dict the save is about
to write (the one already built in the save path: nothing is copied):

* a tensor — its bytes, plus the framing ``torch.save`` puts around each one (measured
  once per process); a ``DTensor`` counts its global size (its shards together) and one
  framing per shard;
* any other value — exactly the bytes ``torch.save`` produces for it (counted, not kept);
* DCP's ``.metadata`` (a measured amount per item), ``trainer_state.json`` and
  ``manifest.json``.

Values under ``per_rank`` exist once per process: the coordinator counts its own
``world_size`` times. The estimate lands within a few percent of the checkpoint's real
size (the tests hold it to 5%).

The check (:class:`SpaceGuard`) asks the backend for the free space
(:meth:`Storage.free_bytes`; object stores answer ``None`` and are not checked). When the
checkpoint does not fit and ``max_ckpt_to_keep`` is set, retention runs first — it would
remove those checkpoints after the save anyway — and the check is repeated. A save that
still cannot fit is refused with :class:`~roll_ckpt.errors.StorageFullError` before any
of its data is written, naming both sizes and the ``max_ckpt_to_keep`` that would make
room. In a job of several processes only the coordinator checks; its refusal reaches the
others at the save's first agreement, before any rank writes (``strategy.agree``, in
:meth:`roll_ckpt.save.pipeline.SavePipeline.write_and_commit`), so none is left waiting.
"""

from __future__ import annotations

import functools
import json
import logging
import pickle
from typing import Any, Callable, Mapping

from ..contracts import SpaceEstimate, Storage
from ..errors import StorageFullError
from ..runtime.units import human_bytes

__all__ = ["estimate_checkpoint_bytes", "estimate_items", "SpaceGuard", "committed_sizes"]

log = logging.getLogger("roll_ckpt")

_METADATA_PER_ITEM = 190
"""Bytes of DCP's pickled ``.metadata`` per item, besides the item's name (measured)."""
_FIXED_BYTES = 200
"""``.metadata`` header, ``trainer_state.json`` and ``manifest.json`` headers (measured)."""
_MANIFEST_PER_FILE = 110
_SLACK_PER_FILE = 4096
"""File systems allocate whole blocks: a little room per file on top of the estimate."""


class _CountingSink:
    """A write-only stream that only counts (``torch.save`` into it keeps nothing)."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self.n += n
        return n

    def flush(self) -> None:
        pass


def _saved_size(obj: Any) -> int:
    import torch

    sink = _CountingSink()
    torch.save(obj, sink)
    return sink.n


_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_VALUE_FRAMING: int | None = None


def _plain(obj: Any, budget: list[int]) -> bool:
    """Plain Python data (numbers, strings, containers of them): ``pickle`` sizes it like ``torch.save``."""
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if isinstance(obj, _PLAIN):
        return True
    if type(obj) in (tuple, list):
        return all(_plain(x, budget) for x in obj)
    if type(obj) is dict:
        return all(_plain(k, budget) and _plain(v, budget) for k, v in obj.items())
    return False


def _value_size(obj: Any) -> int:
    """The bytes the writer gives a non-tensor value: ``torch.save(obj)`` (DCP writes every
    such value that way) in its slot (:func:`roll_ckpt.dcp.files.slot_capacity`)."""
    from ..dcp.files import slot_slack  # (torch: only a DCP save's values are sized so)

    global _VALUE_FRAMING
    if _plain(obj, [10_000]):
        if _VALUE_FRAMING is None:
            _VALUE_FRAMING = _saved_size(None) - len(pickle.dumps(None, protocol=2))
        # torch.save's zip records around the pickle; within its 64-byte alignment of the real size.
        n = _VALUE_FRAMING + len(pickle.dumps(obj, protocol=2))
    else:
        n = _saved_size(obj)  # counted, not kept (tensors inside, custom classes...)
    return n + slot_slack(n)


@functools.cache
def _tensor_framing() -> int:
    """What ``torch.save`` adds around one tensor's bytes (zip records, pickle, padding);
    measured once per process."""
    import torch

    # One element, so the data record and its alignment padding are counted too.
    return _saved_size(torch.zeros(1, dtype=torch.float32)) - 4


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local") and hasattr(t, "placements")


def _shards(t: Any) -> int:
    """How many pieces a DTensor is written as (its sharded mesh dimensions)."""
    n = 1
    try:
        mesh = t.device_mesh
        for dim, p in enumerate(t.placements):
            if p.is_shard():
                n *= mesh.size(dim)
    except Exception:  # an exotic placement: count one piece
        return 1
    return n


def estimate_checkpoint_bytes(sd: Mapping[str, Any], *, world_size: int = 1,
                              user: Mapping[str, Any] | None = None,
                              per_rank_key: str = "per_rank", base: SpaceEstimate | None = None) -> SpaceEstimate:
    """Estimate the bytes a save of ``sd`` writes (every process's files together).

    ``sd`` is the strategy's state dict (live tensors); nothing is copied. Non-tensor
    values are serialised into a counter, as DCP will serialise them. ``base``, the
    estimate of the rest of the state dict made with :func:`estimate_items`, is added (a
    strategy's I/O estimates the parts that keep their structure once).
    """
    import torch

    acc, framing = [0, 0, 0], _tensor_framing()  # total, tensor bytes, items; what torch.save adds per tensor
    for key, value in sd.items():
        _walk(value, len(str(key)), world_size if key == per_rank_key else 1, acc, torch.Tensor, framing)
    total, tensor_bytes, items = acc
    if base is not None:
        total, tensor_bytes, items = total + base.total, tensor_bytes + base.tensor_bytes, items + base.items
    files = world_size + 3  # one .distcp per process, .metadata, trainer_state.json, manifest.json
    user_bytes = len(json.dumps(dict(user or {}), indent=1, sort_keys=True)) if user else 0
    total += _FIXED_BYTES + user_bytes + files * _MANIFEST_PER_FILE
    return SpaceEstimate(total=total, tensor_bytes=tensor_bytes, items=items, files=files)


def _walk(node: Any, name_len: int, copies: int, acc: list[int], tensor_type: type, framing: int) -> None:
    """Add what ``node`` (named with ``name_len`` characters, saved ``copies`` times) writes to
    ``acc`` (total, tensor bytes, items), walking its containers as DCP flattens them."""
    if type(node) is dict or (not isinstance(node, tensor_type) and isinstance(node, Mapping)):
        sep = 1 if name_len else 0
        for k, v in node.items():
            _walk(v, name_len + sep + (len(k) if type(k) is str else len(str(k))), copies, acc, tensor_type, framing)
        return
    if isinstance(node, list) and not _terminal_list(node, tensor_type):
        for i, v in enumerate(node):
            _walk(v, name_len + len(str(i)) + 1, copies, acc, tensor_type, framing)
        return
    if type(node) is not tensor_type and _is_dtensor(node):
        pieces = _shards(node)
        nbytes = node.numel() * node.element_size()  # global: all shards together
        acc[0] += nbytes + pieces * (framing + _METADATA_PER_ITEM + name_len)
        acc[1] += nbytes
        acc[2] += pieces
        return
    if isinstance(node, tensor_type):
        nbytes = node.numel() * node.element_size()
        acc[1] += nbytes * copies
        size = nbytes + framing
    else:
        size = _value_size(node)
    acc[0] += copies * (size + _METADATA_PER_ITEM + name_len)
    acc[2] += copies


def _terminal_list(values: list, tensor_type: type) -> bool:
    """DCP's flattening (``torch.distributed.checkpoint._traverse``): a list is one value
    unless it holds a tensor or a container that is not one value itself."""
    for v in values:
        if type(v) in _PLAIN:
            continue
        if isinstance(v, tensor_type) or isinstance(v, Mapping):
            return False
        if isinstance(v, list) and not _terminal_list(v, tensor_type):
            return False
    return True


def estimate_items(sd: Mapping[str, Any], *, world_size: int = 1) -> SpaceEstimate:
    """The bytes the items of ``sd`` take, without a checkpoint's fixed files (a ``base``)."""
    whole = estimate_checkpoint_bytes(sd, world_size=world_size)
    fixed = _FIXED_BYTES + whole.files * _MANIFEST_PER_FILE
    return SpaceEstimate(total=whole.total - fixed, tensor_bytes=whole.tensor_bytes, items=whole.items, files=0)


# --------------------------------------------------------------------------- the check


class SpaceGuard:
    """Checks, before a save, that the checkpoint fits where it is written."""

    def __init__(self, storage: Storage, root: str, where: str) -> None:
        self.storage = storage
        self.root = root
        self.where = where
        """The configured output_dir, for messages."""
        self._told_unknown = False
        self.last_estimate: SpaceEstimate | None = None
        self.last_free: int | None = None

    def free(self, path: str) -> int | None:
        """The bytes free at ``path``; ``None`` where the store cannot tell (said once, in the
        log: saves there are not checked)."""
        try:
            free = self.storage.free_bytes(path)
        except (OSError, NotImplementedError, AttributeError):
            free = None
        if free is None and not self._told_unknown:
            self._told_unknown = True
            log.info("roll-ckpt: %s cannot tell its free space; saves there are not checked "
                     "for space beforehand", self.storage.url)
        return free

    def check(self, estimate: Callable[[], SpaceEstimate], *, path: str, step: int, keep: int,
              retention: Callable[[int], list[str]] | None = None,
              own_run: str | None = None) -> StorageFullError | None:
        """``None`` when checkpoint-``step``, written under ``path``, fits; else the error to
        raise. ``estimate()`` sizes it; it is not called where the store cannot tell its free
        space (:meth:`free`: nothing to compare with).

        ``retention(k)`` keeps the newest ``k`` committed checkpoints and returns what it
        removed; it is not called when the checkpoint fits. ``own_run``: the saving launch's
        run folder (the hint counts the checkpoints retention may remove: :func:`committed_sizes`).
        """
        free = self.free(path)
        if free is None:
            return None
        estimate = self.last_estimate = estimate()
        need = estimate.total + estimate.files * _SLACK_PER_FILE
        self.last_free = free
        if need <= free:
            return None
        if keep and retention is not None:
            removed = retention(max(keep - 1, 1))
            for p in removed:
                log.info("roll-ckpt: retention removed %s to make room for checkpoint-%d", p, step)
            if removed:
                free = self.free(path)
                self.last_free = free
                if free is None or need <= free:
                    return None
        hint = self._hint(need, free, keep, committed_sizes(self.storage, self.root, own_run))
        return StorageFullError(
            f"no space left for checkpoint-{step} under {self.where}: it needs about {human_bytes(need)} "
            f"and only {human_bytes(free)} are free, so the save was refused before writing anything; "
            f"earlier checkpoints are intact. {hint}; training can go on and the next save will try again")

    @staticmethod
    def _hint(need: int, free: int, keep: int, sizes: list[int]) -> str:
        """Which ``max_ckpt_to_keep`` would make room (``sizes``: committed checkpoints, oldest first)."""
        now = f"now {keep}" if keep else "now 0, which keeps all"
        room = free
        # Before a save, retention keeps max(max_ckpt_to_keep - 1, 1) checkpoints: never the newest.
        for removed in range(1, len(sizes)):
            room += sizes[removed - 1]
            if room >= need:
                return (f"Free space there, or set checkpoint_config.max_ckpt_to_keep: {len(sizes) - removed + 1} "
                        f"({now}) so that older checkpoints are removed before a save")
        if len(sizes) <= 1:
            return ("Free space there or choose a larger checkpoint_config.output_dir (no older checkpoint is "
                    f"left to remove: the newest is always kept; checkpoint_config.max_ckpt_to_keep {now})")
        return ("Free space there or choose a larger checkpoint_config.output_dir (even "
                "checkpoint_config.max_ckpt_to_keep: 1, which keeps only the newest, would not make enough "
                f"room; {now})")

def committed_sizes(storage: Storage, root: str, own_run: str | None) -> list[int]:
    """Sizes (from their manifests) of the committed checkpoints retention may remove, oldest first."""
    from ..format.layout import committed
    from ..format.manifest import MANIFEST_NAME, Manifest
    from .retention import live_foreign_runs

    live = live_foreign_runs(storage, root, own_run)
    out = []
    for ref in committed(storage, root):
        if ref.run and ref.run in live:
            continue
        try:
            with storage.open_read(storage.join(ref.path, MANIFEST_NAME)) as f:
                manifest, _ = Manifest.from_bytes(f.read())
            out.append(sum(e.size for e in manifest.files.values()))
        except (OSError, ValueError):
            out.append(0)
    return out
