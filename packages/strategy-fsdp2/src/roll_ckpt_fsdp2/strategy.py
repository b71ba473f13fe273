"""The FSDP2 strategy: DCP on FSDP2 state, its own process group, the offload store."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from roll_ckpt.strategy import DCPStrategy

from .offload import OffloadStore

__all__ = ["FSDP2Strategy"]


class FSDP2Strategy(DCPStrategy):
    """DCP save/load of FSDP2 modules, with zero-copy saves from the offload store.

    * Checkpoint collectives run on a gloo group of their own, created once: a
      thread-mode asynchronous save on the group FSDP uses deadlocks against FSDP's
      collectives.
    * ``offload_states``/``load_states`` move the local shards into and out of the
      :class:`~roll_ckpt_fsdp2.offload.OffloadStore` (``offload_backend``).
    * A save while the state is offloaded writes from the store: ``local`` slots are
      handed to DCP as exact-size aliases of the flat buffers (zero-copy), ``local_dedup``
      slots are rebuilt and then staged like any other tensor (regular).
    """

    name = "fsdp2"

    def __init__(self, config: Any, plugins: Any) -> None:
        super().__init__(config, plugins)
        self._group = None
        if self._dist is not None:
            self._group = self._dist.new_group(backend="gloo")
        self.store = OffloadStore(getattr(config, "offload_backend", "local"))
        self._aliases: set[int] = set()

    @property
    def process_group(self) -> Any:
        return self._group

    # ------------------------------------------------------------ offload cycle

    def offload_states(self, state: Mapping[str, Any], *, optimizer: bool = False) -> int:
        """Move the model's local shards (and the optimizer's, if asked) into the store.

        Waits for a checkpoint still writing from the store. Returns the bytes moved.
        """
        return self.store.offload(state, optimizer=optimizer)

    def load_states(self, state: Mapping[str, Any] | None = None) -> int:
        """Bring the offloaded shards back into the live tensors. Returns the bytes moved."""
        return self.store.load()

    # ------------------------------------------------------------ saving

    def state_dict(self, state: Mapping[str, Any]) -> dict[str, Any]:
        sd = super().state_dict(state)
        if not self.store.offloaded:
            return sd
        # The live tensors of offloaded shards hold no memory: write from the store.
        self._aliases = set()
        return {key: self._substitute(sub, key) if isinstance(sub, dict) else sub for key, sub in sd.items()}

    def _substitute(self, node: dict[str, Any], prefix: str) -> dict[str, Any]:
        """A copy of ``node`` with the store's tensors in place of the offloaded ones.

        Never ``node`` itself: ``get_optimizer_state_dict`` returns the optimizer's own
        per-parameter state dicts, and an alias put there would become the optimizer's
        state (training would then update the store's buffer).
        """
        out: dict[str, Any] = {}
        for k, v in node.items():
            name = f"{prefix}.{k}"
            if isinstance(v, dict):
                out[k] = self._substitute(v, name)
                continue
            out[k] = v
            slot = self.store.lookup(name)
            if slot is None or not isinstance(v, torch.Tensor):
                continue
            if slot.segments == 1:
                out[k] = self.store.zero_copy(slot)
                self._aliases.add(id(out[k]))
            else:
                from torch.distributed.tensor import DTensor

                t = slot.dtensor
                local = self.store.rebuild(slot).view(slot.local_shape)
                out[k] = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                            shape=t.shape, stride=t.stride())
        return out

    def stage(self, sd: dict[str, Any], save: Any) -> dict[str, Any]:
        if self._aliases:
            # The write reads the store's buffers: keep them unmodified until it is done.
            self.store.hold()
            save.on_finished(self.store.release)
        return super().stage(sd, save)

    def is_zero_copy(self, tensor: Any) -> bool:
        return id(tensor) in self._aliases

    def write(self, sd: dict[str, Any], storage: Any, dcp_path: str, on_bytes: Any = None) -> Any:
        try:
            return super().write(sd, storage, dcp_path, on_bytes)
        finally:
            self._aliases = set()

    def load(self, state: Any, storage: Any, dcp_path: str, on_bytes: Any = None, **kwargs: Any) -> None:
        self.store.load()  # loading writes into the live tensors: they must hold memory
        super().load(state, storage, dcp_path, on_bytes, **kwargs)
