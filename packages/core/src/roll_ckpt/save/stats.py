"""What one save cost (:class:`SaveStats`, ``manager.stats.last``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..contracts import NetworkCounts

__all__ = ["SaveStats"]


@dataclass(frozen=True)
class SaveStats:
    """What one save cost; ``manager.stats.last`` holds the latest."""

    step: int
    path: str
    is_async: bool
    blocked_s: float
    """Seconds the training loop waited inside ``save``."""
    total_s: float
    """Seconds from the call until the checkpoint was committed."""
    bytes: int
    bytes_copied: int
    """Bytes copied while staging (0 when every tensor was staged without a copy)."""
    bytes_allocated: int = 0
    """Staging memory allocated inside the call (its page faults in the blocked time): the first
    save, or a save nobody announced (:meth:`~roll_ckpt.CheckpointManager.prepare_save`) while
    the buffers' memory was freed between saves; 0 when they were ready."""
    policies: Mapping[str, int] = field(default_factory=dict)
    """How many tensors each staging policy took (``regular``, ``zero_copy``...)."""
    network: NetworkCounts | None = None
    """Network faults this process met while writing and committing (``None``: not a networked store)."""
    bytes_taken_over: int = 0
    """Of :attr:`bytes`, those taken over unchanged from the newest committed checkpoint
    (incremental saves, :mod:`roll_ckpt.save.incremental`): linked or copied by the storage,
    not written. Like :attr:`bytes`, counted on the coordinator for every process."""

    @property
    def bytes_written(self) -> int:
        return self.bytes - self.bytes_taken_over
