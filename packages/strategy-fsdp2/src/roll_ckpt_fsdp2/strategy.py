"""The FSDP2 strategy: DCP on FSDP2 state, its own process group, the offload store."""

from __future__ import annotations

from typing import Any, Mapping

from roll_ckpt.plugin import DCPStrategy

from .offload import OffloadStore

__all__ = ["FSDP2Strategy"]


class FSDP2Strategy(DCPStrategy):
    """DCP save/load of FSDP2 modules, with zero-copy saves from the offload store.

    * Checkpoint collectives run on a gloo group of their own, created once: a
      thread-mode asynchronous save on the group FSDP uses deadlocks against FSDP's
      collectives.
    * ``offload_states``/``load_states`` move the local shards into and out of the
      :class:`~roll_ckpt_fsdp2.offload.OffloadStore` (``offload_backend``).
    * A save while the state is offloaded writes from the store: the plugin's staging
      policies (:mod:`roll_ckpt_fsdp2.policies`) find each offloaded tensor in it by name.
    """

    name = "fsdp2"

    def __init__(self, config: Any, plugins: Any = None) -> None:
        super().__init__(config, plugins)  # (its gloo group, bounded by checkpoint_config.collective_timeout_s)
        if self.dist is not None and self.process_group is None:  # one rank of its own
            self.process_group = self.dist.new_group(backend="gloo")
        self.store = OffloadStore(config.options.get("offload_backend", "local"), self.collective_timeout_s)

    # ------------------------------------------------------------ offload cycle

    def offload_states(self, state: Mapping[str, Any], *, optimizer: bool = False) -> int:
        """Move the model's local shards (and the optimizer's, if asked) into the store.

        Waits for a checkpoint still writing from the store. Returns the bytes moved.
        """
        return self.store.offload(state, optimizer=optimizer)

    def load_states(self, state: Mapping[str, Any] | None = None) -> int:
        """Bring the offloaded shards back into the live tensors. Returns the bytes moved."""
        return self.store.load()

    # ------------------------------------------------------------ loading

    def load_targets(self, state: Mapping[str, Any], md: Any, dcp_path: str) -> tuple[dict[str, Any], str]:
        self.store.load()  # the targets are the live tensors, which the load writes into: they must hold memory
        return super().load_targets(state, md, dcp_path)
