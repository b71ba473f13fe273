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

__all__ = ['dedup_plans', 'merge_planner_data', 'chunk_errors', 'SMALL_REPLICATED']


SMALL_REPLICATED = 64 << 10
"""A value every process holds alike up to this size (AdamW's ``step``, the optimizer's
param groups) is written by the lowest process that holds it."""


def dedup_plans(plans: list[Any]) -> list[Any]:
    """Each value several processes hold, written by one of them (DCP's dedup otherwise).

    DCP gives each such value to the process with the least planned so far, which spreads
    the small ones (a step counter per parameter) over every process's file: each process
    then opens every other's file on resume, N² opens for the job. Here the small ones go to
    the lowest process holding them (one extra file per process), the large ones (the
    replicated weights of a plain or DDP module) are spread by size as DCP does."""
    import dataclasses

    holders: dict[Any, list[int]] = {}
    items: dict[Any, Any] = {}
    for r, plan in enumerate(plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(r)
            items[item.index] = item
    planned = [0] * len(plans)
    keep: dict[Any, int] = {}
    for index, ranks in holders.items():
        size = items[index].tensor_storage_size() or 1
        chosen = ranks[0] if len(ranks) == 1 or size <= SMALL_REPLICATED else min(ranks, key=lambda r: planned[r])
        planned[chosen] += size
        keep[index] = chosen
    return [dataclasses.replace(plan, items=[i for i in plan.items if keep[i.index] == r])
            for r, plan in enumerate(plans)]


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
