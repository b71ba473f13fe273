"""The objects lifecycle hooks receive."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["SaveContext", "CommitInfo"]


@dataclass
class SaveContext:
    """One save in progress, shared by the manager, the strategy and the plugins."""

    step: int
    path: str
    """The committed path the checkpoint will have."""
    is_async: bool
    rank: int = 0
    world_size: int = 1
    staging: dict[str, str] = field(default_factory=dict)
    """Per tensor name, the policy that staged it (``zero_copy``, ``regular``...)."""
    bytes_copied: int = 0
    """Bytes copied while staging (0 for zero-copy tensors)."""
    blocked_s: float = 0.0
    """Seconds the caller was blocked by this save."""
    strategy: Any = None
    """The strategy doing the save (its ``pool`` holds the regular staging buffers)."""
    _finished: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def on_finished(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the write has finished (or failed): release staged memory."""
        with self._lock:
            self._finished.append(callback)

    def run_finished_callbacks(self) -> None:
        with self._lock:
            callbacks, self._finished = self._finished, []
        for cb in callbacks:
            cb()

    def note_staged(self, name: str, policy: str, nbytes_copied: int) -> None:
        self.staging[name] = policy
        self.bytes_copied += nbytes_copied


@dataclass(frozen=True)
class CommitInfo:
    """A committed checkpoint, as announced to ``roll_ckpt_on_commit``."""

    path: str
    step: int
    url: str
    manifest: dict[str, Any]
    component: str | None = None
    """The component whose part was committed; ``None`` for a whole checkpoint or step."""
