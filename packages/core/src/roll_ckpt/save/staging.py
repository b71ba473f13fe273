"""Staging: the one place where a save decides how each tensor is captured.

A save's state dict holds live tensors the training loop will change as soon as ``save``
returns. :func:`stage_state_dict` asks the staging policies (:class:`StagingPolicy`
objects that plugins register through ``roll_ckpt_staging_policies``), in order, which
one claims each tensor; the first claim wins and core's
:class:`~roll_ckpt.save.regular_copy.RegularCopy` takes the rest. Each policy then stages its
tensors in one call and is released once the write has finished. Non-tensor values are
copied when mutable (DCP pickles them during the write).

A synchronous save goes through the same policies (``save.is_async`` false): a policy
then only hands the write what it reads (the live tensor, a store's alias, a rebuilt
shard), copying nothing, and nothing is counted in ``SaveStats.policies``.

The walk is one pass over the state dict: each tensor's place in the staged copy is
remembered and filled once its policy has staged it, so a state of thousands of tensors
costs a few microseconds per tensor.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from typing import Any, Callable, Sequence

from ..contracts import SaveContext, StagingPolicy

__all__ = ["stage_state_dict"]


def stage_state_dict(sd: Mapping[str, Any], save: SaveContext, policies: Sequence[StagingPolicy]) -> dict[str, Any]:
    """What the write of ``sd`` reads: each tensor captured by the first policy claiming it
    (``policies`` in order, a ``RegularCopy`` last). The time it takes counts in the
    caller's blocked time, which the save pipeline measures around the whole call.

    Each policy that staged something is released once the write has finished or failed
    (``save.run_finished_callbacks``)."""
    torch = sys.modules.get("torch")  # a process that never imported torch holds no tensors (a driver)
    tensor_type: Any = torch.Tensor if torch is not None else ()
    claimed: list[list[tuple[str, Any]]] = [[] for _ in policies]
    places: list[list[tuple[Any, Any]]] = [[] for _ in policies]

    def visit(value: Any, name: str, container: Any, key: Any) -> Any:
        if type(value) is dict:  # the common container first: isinstance(.., Mapping) is slow
            out: dict[Any, Any] = {}
            for k, v in value.items():
                out[k] = visit(v, f"{name}.{k}" if name else str(k), out, k)
            return out
        if isinstance(value, tensor_type):
            for i, policy in enumerate(policies):
                if policy.claims(name, value, save):
                    claimed[i].append((name, value))
                    places[i].append((container, key))
                    return None  # filled below, once the policy has staged it
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                out[k] = visit(v, f"{name}.{k}" if name else str(k), out, k)
            return out
        if isinstance(value, list):
            items: list[Any] = [None] * len(value)
            for i, v in enumerate(value):
                items[i] = visit(v, f"{name}.{i}", items, i)
            return items
        if isinstance(value, tuple):  # one value to DCP, pickled whole: its tensors too
            return _copy_value(value, tensor_type, save.is_async)
        return _freeze(value)

    staged = visit(sd, "", None, None)
    for i, policy in enumerate(policies):
        if not claimed[i]:
            continue
        results = policy.stage(claimed[i], save)
        save.on_finished(_releaser(policy, save))
        for (container, key), result in zip(places[i], results):
            container[key] = result
    claimed.clear()  # visit() refers to itself: its cycle must not keep the tensors alive
    places.clear()
    return staged


def _releaser(policy: StagingPolicy, save: SaveContext) -> Callable[[], None]:
    return lambda: policy.release(save)


def _freeze(value: Any) -> Any:
    """Non-tensor leaves are pickled by DCP when written: copy mutable ones now."""
    return copy.deepcopy(value) if isinstance(value, (set, bytearray)) else value


def _copy_value(value: Any, tensor_type: Any, clone: bool) -> Any:
    """A value DCP pickles whole (a tuple), its containers rebuilt and, for an asynchronous
    save, its tensors cloned: each then has a storage of its own size, which is what
    ``torch.save`` writes (a view into a larger buffer would drag the whole buffer along).
    Other objects are kept as they are: copying them could run their code."""
    if isinstance(value, tensor_type):
        return value.detach().clone() if clone else value
    if isinstance(value, Mapping):
        return {k: _copy_value(v, tensor_type, clone) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_copy_value(v, tensor_type, clone) for v in value]
        return out if isinstance(value, list) else tuple(out)
    return _freeze(value)
