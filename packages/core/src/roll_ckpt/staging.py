"""Regular staging: copies into CPU buffers that are reused from one save to the next.

This is core's fallback for ``roll_ckpt_stage``; plugins take tensors they can stage
without a copy (FSDP2's offload store) before it runs.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["StagingPool"]


class StagingPool:
    """One CPU buffer per tensor name, reused while shape and dtype stay the same.

    The manager never starts a save before the previous write has finished, so a
    buffer is never overwritten while it is still being written.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def _buffer_for(self, name: str, like: torch.Tensor) -> torch.Tensor:
        with self._lock:
            buf = self._buffers.get(name)
            if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
                pin = like.device.type == "cuda" and torch.cuda.is_available()
                buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
                self._buffers[name] = buf
            return buf

    def copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU copy of ``tensor`` (a plain tensor) in the buffer kept for ``name``."""
        buf = self._buffer_for(name, tensor)
        buf.copy_(tensor.detach(), non_blocking=buf.is_pinned())
        return buf

    def stage(self, name: str, tensor: Any) -> tuple[Any, int]:
        """Copy a tensor or DTensor; returns what DCP should write and the bytes copied."""
        local = getattr(tensor, "_local_tensor", None)
        if local is not None:  # a DTensor: copy its local shard, keep mesh and placements
            from torch.distributed.tensor import DTensor

            staged = self.copy(name, local)
            out = DTensor.from_local(staged, tensor.device_mesh, tensor.placements,
                                     run_check=False, shape=tensor.shape, stride=tensor.stride())
            return out, staged.numel() * staged.element_size()
        staged = self.copy(name, tensor)
        return staged, staged.numel() * staged.element_size()

    def synchronize(self) -> None:
        """Wait for non-blocking device-to-host copies into pinned buffers."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()
