"""The coordinator's global save plan, with DCP's two parts that grow faster than the job.

A full save (the first of a job, or one after a change of structure) runs DCP's global
plan: dedup of replicated values, the metadata, and a validation of every tensor's chunks.
Two of its steps cost more than linear time in the number of processes N in torch 2.13:

* the merge of every process's ``planner_data`` through a ``ChainMap``: each process's own
  keys (``per_rank.<r>.*``) are looked up through the maps before it (O(N²));
* the overlap check sweeps each tensor's chunks along its *largest* dimension; FSDP2 cuts
  the first, so when the second is larger every chunk is compared with every other (O(N²)
  per tensor).

:func:`merge_planner_data` and :func:`chunk_errors` give the same results in linear time
(the sweep runs along the dimension the chunks are cut along), checked against DCP's own
on random chunkings in the tests.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["merge_planner_data", "chunk_errors"]


def merge_planner_data(plans: list[Any]) -> dict[str, Any]:
    """``dict(ChainMap(*planner_data))``: the first plan that names a key wins."""
    merged: dict[str, Any] = {}
    for plan in reversed(plans):
        merged.update(plan.planner_data)
    return merged


def _overlap(a: Any, b: Any) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def chunk_errors(metadata: Any, whole: bool) -> list[str]:
    """What is wrong with the chunks of each tensor of ``metadata``: out of bounds,
    overlapping, or (``whole``: saved by several processes) not covering the tensor."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    errors: list[str] = []
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata) or len(value.size) == 0:
            continue
        size, chunks = value.size, value.chunks
        volume = 0
        for c in chunks:
            if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, size)):
                errors.append(f"key:{key} has out of bounds chunk: tensor-size:{size} chunk: {c}")
            volume += math.prod(c.sizes)
        if len(chunks) > 1:
            dims = range(len(size))
            d = max(dims, key=lambda k: len({c.offsets[k] for c in chunks}))  # the dimension cut
            order = sorted(chunks, key=lambda c: (c.offsets[d], *c.offsets))
            active: list[Any] = []  # chunks that reach past the current start along d
            for c in order:
                start = c.offsets[d]
                active = [o for o in active if o.offsets[d] + o.sizes[d] > start]
                for other in active:
                    if _overlap(c, other):
                        errors.append(f"key:{key} has overlapping chunks: {c} {other}")
                active.append(c)
        if whole and volume != math.prod(size):
            errors.append(f"key:{key} invalid fill tensor-volume: {math.prod(size)} chunks-volume: {volume}")
    return errors
