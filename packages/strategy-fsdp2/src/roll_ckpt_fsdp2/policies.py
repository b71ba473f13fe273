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
  segment of per rank: the local shard is rebuilt by an all-gather over the replicated
  mesh dimension, into fresh memory the write then owns.

This module imports no torch: the plugin's registration stays cheap.
"""

from __future__ import annotations

from typing import Any, Sequence

from roll_ckpt import SaveContext

__all__ = ["ZeroCopy", "LocalDedup"]


def _slot(name: str, save: SaveContext) -> Any:
    store = getattr(save.strategy, "store", None)
    return store.lookup(name) if store is not None else None


class ZeroCopy:
    name = "zero_copy"
    description = ("tensors resident in the 'local' offload store are written from its flat buffers "
                   "through exact-size aliases: no copy, no clone")

    def claims(self, name: str, tensor: Any, save: SaveContext) -> bool:
        slot = _slot(name, save)
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


class LocalDedup:
    name = "local_dedup"
    description = ("tensors the 'local_dedup' store keeps one segment of per rank: the local shard is "
                   "rebuilt by an all-gather over the replicated mesh dimension, into memory of its own")

    def claims(self, name: str, tensor: Any, save: SaveContext) -> bool:
        slot = _slot(name, save)
        return slot is not None and slot.segments > 1

    def stage(self, items: Sequence[tuple[str, Any]], save: SaveContext) -> list[Any]:
        from roll_ckpt.torch_compat import rewrap_dtensor

        store = save.strategy.store
        out = []
        for name, _ in items:
            slot = store.lookup(name)
            local = store.rebuild(slot).view(slot.local_shape)
            out.append(rewrap_dtensor(slot.dtensor, local))
            if save.is_async:
                save.note_staged(name, self.name, local.numel() * local.element_size())
        return out

    def release(self, save: SaveContext) -> None:
        """The rebuilt shards are the write's own memory: nothing to give back."""
