"""What a resume loads into: the top-level keys a checkpoint holds, and the structure it
saved under a prefix, rebuilt with empty tensors (from ``.metadata`` alone)."""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.torch_compat import set_element

__all__ = ["top_keys", "placeholders"]


def top_keys(md: Any, per_rank: str) -> tuple[set[str], set[str]]:
    """The top-level keys of a checkpoint, and the ranks that saved per-process values under
    ``per_rank`` (one pass)."""
    top: set[str] = set()
    ranks: set[str] = set()
    for path in md.planner_data.values():
        if path:
            top.add(path[0])
            if len(path) > 1 and path[0] == per_rank:
                ranks.add(path[1])
    return top, ranks


def placeholders(md: Any, prefix: tuple[str, ...]) -> dict[str, Any]:
    """Rebuild the nested structure saved under ``prefix`` with empty tensors to load into."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root: dict[str, Any] = {}
    n = len(prefix)
    for fqn, path in md.planner_data.items():
        if tuple(str(p) for p in path[:n]) != prefix:
            continue
        entry = md.state_dict_metadata[fqn]
        if isinstance(entry, TensorStorageMetadata):
            value: Any = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            value = None
        set_element(root, tuple(path[n:]), value)
    return root
