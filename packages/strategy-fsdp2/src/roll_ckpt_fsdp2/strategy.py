"""The FSDP2 strategy: DCP on FSDP2 state with checkpoint collectives on their own group."""

from __future__ import annotations

from typing import Any

from roll_ckpt.strategy import DCPStrategy

__all__ = ["FSDP2Strategy"]


class FSDP2Strategy(DCPStrategy):
    """DCP save/load of FSDP2 modules on a dedicated gloo group.

    A thread-mode asynchronous save on the group FSDP uses deadlocks against FSDP's own
    collectives, so checkpointing gets its own group, created once.
    """

    name = "fsdp2"

    def __init__(self, config: Any, plugins: Any) -> None:
        super().__init__(config, plugins)
        self._group = None
        if self._dist is not None:
            self._group = self._dist.new_group(backend="gloo")

    @property
    def process_group(self) -> Any:
        return self._group
