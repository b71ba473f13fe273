"""The FSDP2 plugin's staging policies: how a save captures tensors held by the offload store.

Both claim a tensor by looking its state-dict key up in the strategy's
:class:`~roll_ckpt_fsdp2.offload.OffloadStore` (only while the state is offloaded: the
live tensors then hold no memory, the store holds the only copy):

* :class:`ZeroCopy` (``zero_copy``) — a ``local`` slot is handed to DCP as an exact-size
  alias of its part of the flat buffer, wrapped as a DTensor with the same mesh,
  placements, global shape and stride: no copy, no clone in the writer. The store is held
  until the write has finished; ``offload_states`` waits for that before it overwrites
  the buffers.
* :class:`LocalDedup` (``local_dedup``) — a slot the ``local_dedup`` store keeps one
  segment of per rank: ``save`` only reserves the staging buffers (reused across saves)
  and holds the store; the local shard is rebuilt into them by an all-gather over the
  replicated mesh dimension in the writer thread, before anything is written.

This module imports no torch: the plugin's registration stays cheap.
"""

from __future__ import annotations

from typing import Any, Sequence

from roll_ckpt.plugin import SaveContext

__all__ = ["ZeroCopy", "LocalDedup"]


class _FromStore:
    """A policy for tensors the offload store holds: it claims nothing in a save while the
    state is not offloaded, so it is not asked for each tensor then (``claims`` is asked only
    where ``active`` is true: the strategy has a store)."""

    def active(self, save: SaveContext) -> bool:
        store = getattr(save.strategy, "store", None)
        return store is not None and store.offloaded


class ZeroCopy(_FromStore):
    name = "zero_copy"
    description = ("tensors resident in the 'local' offload store are written from its flat buffers "
                   "through exact-size aliases: no copy, no clone")

    def claims(self, name: str, tensor: Any, save: SaveContext) -> bool:
        slot = save.strategy.store.lookup(name)
        return slot is not None and slot.segments == 1

    def stage(self, items: Sequence[tuple[str, Any]], save: SaveContext) -> list[Any]:
        store = save.strategy.store
        store.hold()  # released by release(), once the write has read the buffers
        out = []
        for name, _ in items:
            out.append(store.zero_copy(store.lookup(name)))
            if save.is_async:
                save.note_staged(name, self.name, 0)
        return out

    def release(self, save: SaveContext) -> None:
        save.strategy.store.release()


class LocalDedup(_FromStore):
    name = "local_dedup"
    description = ("tensors the 'local_dedup' store keeps one segment of per rank: the local shard is "
                   "rebuilt by an all-gather in the writer thread, into staging buffers reused across saves")

    def claims(self, name: str, tensor: Any, save: SaveContext) -> bool:
        slot = save.strategy.store.lookup(name)
        return slot is not None and slot.segments > 1

    def stage(self, items: Sequence[tuple[str, Any]], save: SaveContext) -> list[Any]:
        import torch

        from roll_ckpt.plugin import rewrap_dtensor

        store = save.strategy.store
        buffers = save.reuse.setdefault(self.name, {})
        out, jobs = [], []
        for name, _ in items:
            slot = store.lookup(name)
            size = slot.segments * slot.numel
            buf = buffers.get(name)
            if buf is None or buf.numel() != size or buf.dtype != slot.dtype:
                buf = buffers[name] = torch.empty(size, dtype=slot.dtype)
            jobs.append((slot, buf))
            out.append(rewrap_dtensor(slot.dtensor, buf[: slot.local_numel].view(slot.local_shape)))
            if save.is_async:
                save.note_staged(name, self.name, slot.local_numel * buf.element_size())
        store.hold()  # the segments stay as they are until they are gathered
        pending = [True]

        def rebuild() -> None:
            try:
                with store.rebuild_lock:
                    for slot, buf in jobs:
                        store.rebuild_into(slot, buf)
            finally:
                pending[0] = False
                store.release()

        save.before_write(rebuild)
        save.reuse[f"{self.name}.pending"] = (pending, store)
        return out

    def release(self, save: SaveContext) -> None:
        pending, store = save.reuse.pop(f"{self.name}.pending", ([False], None))
        if pending[0]:  # the write ended before it rebuilt anything
            pending[0] = False
            store.release()
