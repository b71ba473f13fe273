"""Exact-size aliases: the same memory as a view, without the view's oversized storage.

A shard that views a flat buffer has ``storage_offset() != 0`` and shares the whole
buffer's storage. DCP's writer clones such tensors, and its stagers copy the whole
buffer or crash on them. A tensor built from the view's NumPy array has offset 0 and a
storage of exactly its own bytes, yet the same memory — DCP then writes it as it is.
"""

from __future__ import annotations

import torch

__all__ = ["exact_alias"]

# dtypes NumPy has no type for travel as a same-width integer type.
_CARRIER = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
    torch.bool: torch.uint8,
}


def exact_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``t``'s memory whose storage is exactly ``t``'s bytes (CPU, contiguous)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("exact_alias needs a contiguous CPU tensor")
    carrier = _CARRIER.get(t.dtype)
    src = t.detach().view(carrier) if carrier is not None else t.detach()
    out = torch.from_numpy(src.numpy())
    if carrier is not None:
        out = out.view(t.dtype)
    if out.data_ptr() != t.data_ptr() or out.untyped_storage().nbytes() != t.numel() * t.element_size():
        raise AssertionError("alias does not cover exactly the tensor's memory")
    return out
