"""The offload store used in the RL cycle train → offload → rollout → onload → train.

``local``
    per rank, one CPU flat buffer per dtype holding every offloaded local shard; each
    slot remembers the tensor's mesh, placements, global shape, stride, local shape and
    offset. While offloaded, the live tensors' memory is released (their storage is
    resized to 0, as FSDP2 does for unsharded parameters): the store holds the only copy,
    so a checkpoint can be written straight from it.
``local_dedup``
    as ``local``, but for a tensor replicated across ranks (a ``Replicate`` placement on
    a mesh dimension of size > 1, e.g. HSDP) each rank keeps only its segment of the flat
    data, 1/R of it; the local shard is rebuilt with an all-gather over that dimension's
    ranks when it is needed again (onload, or a checkpoint). The all-gathers run on gloo
    groups of the store's own (the same ranks as the mesh dimension's group): a checkpoint
    rebuilds in its writer thread, where a collective on the training's groups would
    interleave with the training's own; only one rebuild runs at a time (``rebuild_lock``).

Buffer lifetime: a checkpoint that writes from the store holds it (:meth:`hold`) until
its write has finished. :meth:`offload` (which overwrites the buffers) and :meth:`free`
wait for every hold to be released, so a checkpoint never mixes two steps.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from roll_ckpt.plugin import collective, local_tensor, rewrap_dtensor, set_local_tensor

from .alias import exact_alias

__all__ = ["OffloadStore", "Slot"]

log = logging.getLogger("roll_ckpt")


@dataclass
class Slot:
    name: str
    """The flattened state-dict key (``model.layers.0.weight``, ``optimizer.state.w.exp_avg``)."""
    dtensor: DTensor
    """The live tensor whose local memory is released while offloaded."""
    dtype: torch.dtype
    offset: int
    """Element offset into the dtype's flat buffer."""
    numel: int
    """Elements this rank keeps in the buffer (the whole local shard, or one segment)."""
    local_shape: torch.Size
    storage_nbytes: int
    """Bytes of the live local storage before it was released (FSDP2 pads shards)."""
    segments: int = 1
    """R for a deduplicated tensor: the local shard is split in R segments."""
    segment: int = 0
    group: Any = None
    device: torch.device | None = None
    replaced: bool = False
    """The live local tensor was swapped for an empty one (its storage cannot be resized)."""
    param: bool = True
    """A module's parameter (else an optimizer state)."""
    kept: bool = False
    """The live local tensor keeps its memory: a parameter whose storage cannot be resized
    (FSDP2 computes from views of it, so it may not be swapped either)."""
    alias: DTensor | None = None
    """The zero-copy DTensor over this slot's part of the buffer, built once per layout."""

    @property
    def local_numel(self) -> int:
        n = 1
        for d in self.local_shape:
            n *= d
        return n


def _release(slot: Slot) -> bool:
    """Free the live local tensor's memory; the store now holds the only copy. False when
    it must keep it: a parameter whose storage cannot be resized."""
    local = local_tensor(slot.dtensor)
    slot.device = local.device
    storage = local.untyped_storage()
    slot.replaced = slot.kept = False
    if storage.resizable():
        storage.resize_(0)  # keeps the tensor object (FSDP2 holds views of it)
    elif not slot.param:
        # e.g. optimizer states in memory torch does not own: the optimizer holds the
        # DTensor, not its local tensor, so the local tensor can be swapped.
        set_local_tensor(slot.dtensor, local.new_empty(0))
        slot.replaced = True
    else:
        slot.kept = True
    return not slot.kept


def _restore(slot: Slot) -> torch.Tensor:
    """Give the live local tensor its memory back (uninitialised) and return it."""
    if slot.kept:
        slot.kept = False
        return local_tensor(slot.dtensor)
    if slot.replaced:
        local = torch.empty(slot.local_shape, dtype=slot.dtype, device=slot.device)
        set_local_tensor(slot.dtensor, local)
        slot.replaced = False
        return local
    local = local_tensor(slot.dtensor)
    local.untyped_storage().resize_(slot.storage_nbytes)
    return local


def _replicated_dim(t: DTensor) -> int | None:
    for dim, p in enumerate(t.placements):
        if isinstance(p, Replicate) and t.device_mesh.size(dim) > 1:
            return dim
    return None


class OffloadStore:
    def __init__(self, kind: str = "local", timeout_s: float = 0.0) -> None:
        if kind not in ("local", "local_dedup"):
            raise ValueError(f"unknown offload_backend {kind!r}")
        self.kind = kind
        self.timeout_s = timeout_s
        """``checkpoint_config.collective_timeout_s``: how long a rebuild's all-gather waits for its peers (0: gloo's default)."""
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.slots: dict[str, Slot] = {}
        self.offloaded = False
        self._holds = 0
        self._cond = threading.Condition()
        self._told_kept = False
        self._gather_groups: dict[tuple[int, int], Any] = {}
        self.rebuild_lock = threading.Lock()
        """Held while a thread rebuilds the deduplicated slots (all of them, in slot order):
        the all-gathers of an onload and of a checkpoint's writer never interleave."""

    # ----------------------------------------------------------------- lifetime

    def hold(self) -> None:
        with self._cond:
            self._holds += 1

    def release(self) -> None:
        with self._cond:
            self._holds -= 1
            self._cond.notify_all()

    def wait_released(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._holds == 0, timeout)

    @property
    def holds(self) -> int:
        return self._holds

    def free(self) -> None:
        """Drop the buffers (waits for writes still reading them)."""
        self.wait_released()
        if self.offloaded:
            raise RuntimeError("the store holds offloaded state; call load_states first")
        self.buffers.clear()
        self.slots.clear()

    # ----------------------------------------------------------------- offload / onload

    @staticmethod
    def _tensors(state: Mapping[str, Any], optimizer: bool) -> Iterator[tuple[str, DTensor, bool]]:
        """``(state-dict key, DTensor, is a module's parameter)`` of every tensor to offload."""
        modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
        for key, mod in modules.items():
            if hasattr(mod, "reshard"):
                mod.reshard()  # FSDP2: make sure the sharded parameters are registered
            for fqn, p in mod.named_parameters():
                if isinstance(p, DTensor):
                    yield f"{key}.{fqn}", p, True
        if not optimizer:
            return
        for key, opt in state.items():
            if not isinstance(opt, torch.optim.Optimizer):
                continue
            names = {id(p): fqn for m in modules.values() for fqn, p in m.named_parameters()}
            for p, st in opt.state.items():
                fqn = names.get(id(p))
                if fqn is None:
                    continue
                for k, v in st.items():
                    if isinstance(v, DTensor):
                        yield f"{key}.state.{fqn}.{k}", v, False

    def _layout(self, tensors: list[tuple[str, DTensor, bool]]) -> None:
        sizes: dict[torch.dtype, int] = {}
        slots: dict[str, Slot] = {}
        for name, t, param in tensors:
            local = local_tensor(t)
            segments, segment, group = 1, 0, None
            numel = local.numel()
            if self.kind == "local_dedup":
                dim = _replicated_dim(t)
                if dim is not None:
                    segments = t.device_mesh.size(dim)
                    segment = t.device_mesh.get_local_rank(dim)
                    group = self._gather_group(t.device_mesh, dim)
                    numel = -(-local.numel() // segments)
            off = sizes.get(local.dtype, 0)
            slots[name] = Slot(name, t, local.dtype, off, numel, local.shape, local.untyped_storage().nbytes(),
                               segments, segment, group, param=param)
            sizes[local.dtype] = off + numel
        for dtype, n in sizes.items():
            buf = self.buffers.get(dtype)
            if buf is None or buf.numel() != n:
                pin = torch.cuda.is_available()
                self.buffers[dtype] = torch.empty(n, dtype=dtype, device="cpu", pin_memory=pin)
        self.slots = slots

    def _slice(self, slot: Slot) -> torch.Tensor:
        return self.buffers[slot.dtype].narrow(0, slot.offset, slot.numel)

    def offload(self, state: Mapping[str, Any], *, optimizer: bool = False) -> int:
        """Move the local shards into the store and release their memory. Returns bytes moved."""
        if self.offloaded:
            return 0
        self.wait_released()  # a checkpoint may still be writing from these buffers
        tensors = list(self._tensors(state, optimizer))
        same = set(self.slots) == {n for n, _, _ in tensors} and all(
            self.slots[n].dtensor is t and self.slots[n].local_shape == local_tensor(t).shape for n, t, _ in tensors)
        if not same:
            self._layout(tensors)
        moved = 0
        with torch.no_grad():
            for slot in self.slots.values():
                local = local_tensor(slot.dtensor)
                flat = local.reshape(-1)
                if slot.segments > 1:
                    start = slot.segment * slot.numel
                    n = max(0, min(slot.numel, flat.numel() - start))
                    self._slice(slot)[:n].copy_(flat[start:start + n], non_blocking=True)
                    moved += n * local.element_size()
                else:
                    self._slice(slot).copy_(flat, non_blocking=True)
                    moved += slot.numel * local.element_size()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            kept = [slot.name for slot in self.slots.values() if not _release(slot)]
        if kept and not self._told_kept:
            self._told_kept = True
            log.warning("roll-ckpt: offload_states kept the memory of %d parameter(s) (e.g. %s): their storage "
                        "cannot be resized, so it cannot be freed without breaking FSDP2's views of it",
                        len(kept), kept[0])
        self.offloaded = True
        return moved

    def load(self) -> int:
        """Bring every offloaded shard back into its live tensor. Returns bytes moved."""
        if not self.offloaded:
            return 0
        moved = 0
        with torch.no_grad(), self.rebuild_lock:
            for slot in self.slots.values():
                local = _restore(slot)
                local.reshape(-1).copy_(self.rebuild(slot), non_blocking=True)
                moved += slot.local_numel * local.element_size()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        self.offloaded = False
        return moved

    # ----------------------------------------------------------------- checkpoint views

    def rebuild(self, slot: Slot) -> torch.Tensor:
        """The slot's whole local shard as a flat CPU tensor (all-gathers a deduplicated one)."""
        seg = self._slice(slot)
        if slot.segments == 1:
            return seg
        out = torch.empty(slot.segments * slot.numel, dtype=slot.dtype)
        return self.rebuild_into(slot, out)

    def rebuild_into(self, slot: Slot, out: torch.Tensor) -> torch.Tensor:
        """All-gather a deduplicated slot's segments straight into ``out`` (flat, at least
        ``segments * numel`` elements); its first ``local_numel`` elements are the shard."""
        seg = self._slice(slot).contiguous()
        parts = list(out[: slot.segments * slot.numel].view(slot.segments, slot.numel).unbind(0))
        collective(dist.all_gather, (seg, *parts), parts, seg, group=slot.group)
        return out[: slot.local_numel]

    def _gather_group(self, mesh: Any, dim: int) -> Any:
        """A gloo group of the ranks of ``mesh``'s dimension ``dim`` this rank is in (made once)."""
        key = (id(mesh), dim)
        group = self._gather_groups.get(key)
        if group is None:
            ranks = dist.get_process_group_ranks(mesh.get_group(dim))
            bound = {"timeout": timedelta(seconds=self.timeout_s)} if self.timeout_s else {}
            group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True, **bound)
            self._gather_groups[key] = group
        return group

    def lookup(self, name: str) -> Slot | None:
        """The slot of an offloaded tensor, by its state-dict key."""
        return self.slots.get(name) if self.offloaded else None

    def zero_copy(self, slot: Slot) -> DTensor:
        """The slot as a DTensor whose local tensor is an exact-size alias of the buffer.

        Built once per layout and reused by every later save: the buffer (hence the
        alias) only changes when :meth:`offload` lays the store out anew, which makes
        new slots. Nothing writes through it.
        """
        if slot.alias is None:
            slot.alias = rewrap_dtensor(slot.dtensor, exact_alias(self._slice(slot)).view(slot.local_shape))
        return slot.alias

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

