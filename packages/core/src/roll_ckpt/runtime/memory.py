"""Views of CPU memory without copies, and without NumPy.

``Tensor.numpy()`` marks a tensor's storage non-resizable for good; the offload store
frees a live parameter's memory by resizing its storage to 0, which FSDP2's views of it
survive. These helpers reach the memory through ``ctypes`` instead, leaving the source
storage as it was.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["writable_view", "exact_alias"]


def writable_view(storage: Any, nbytes: int) -> memoryview:
    """The first ``nbytes`` of a CPU storage (or tensor) as a writable memoryview."""
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(storage.data_ptr())).cast("B")


def exact_alias(t: Any) -> Any:
    """A tensor over ``t``'s memory whose storage is exactly ``t``'s bytes (CPU, contiguous).

    A view into a larger storage -- a flat buffer's slot, an arena's slice, a padded FSDP
    shard -- would make ``torch.save`` write the whole storage; DCP's writer clones such
    tensors (one more copy of each). The alias needs no copy; ``t`` (which owns the memory)
    must outlive it.
    """
    import torch

    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("exact_alias needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    raw = torch.frombuffer(writable_view(t, nbytes), dtype=torch.uint8)
    out = raw.view(t.dtype).view(t.shape)
    if out.data_ptr() != t.data_ptr() or out.untyped_storage().nbytes() != nbytes:
        raise AssertionError("alias does not cover exactly the tensor's memory")
    return out
