"""Staging: the one place where a save decides how each tensor is captured.

A save's state dict holds live tensors the training loop will change as soon as ``save``
returns. :func:`stage_state_dict` asks the staging policies (:class:`StagingPolicy`
objects that plugins register through ``roll_ckpt_staging_policies``), in order, which
one claims each tensor; the first claim wins and core's :class:`RegularCopy` takes the
rest. Each policy then stages its tensors in one call and is released once the write has
finished. Non-tensor values are copied when mutable (DCP pickles them during the write).

A synchronous save goes through the same policies (``save.is_async`` false): a policy
then only hands the write what it reads (the live tensor, a store's alias, a rebuilt
shard), copying nothing, and nothing is counted in ``SaveStats.policies``.
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from typing import Any, Mapping, Sequence

from .contracts import SaveContext, StagingPolicy

__all__ = ["stage_state_dict", "RegularCopy", "StagingPool"]


def stage_state_dict(sd: Mapping[str, Any], save: SaveContext, policies: Sequence[StagingPolicy]) -> dict[str, Any]:
    """What the write of ``sd`` reads: each tensor captured by the first policy claiming it
    (``policies`` in order, a :class:`RegularCopy` last); adds the time to ``save.blocked_s``.

    Each policy that staged something is released once the write has finished or failed
    (``save.run_finished_callbacks``)."""
    t0 = time.perf_counter()
    claimed: dict[int, list[tuple[str, Any]]] = {}
    torch = sys.modules.get("torch")  # a process that never imported torch holds no tensors (a driver)
    tensor_type: Any = torch.Tensor if torch is not None else ()

    def walk(node: Any, prefix: str) -> Any:
        if isinstance(node, tensor_type):
            for i, policy in enumerate(policies):
                if policy.claims(prefix, node, save):
                    break
            claimed.setdefault(i, []).append((prefix, node))
            return node  # replaced below by what the policy stages
        if isinstance(node, Mapping):
            return {k: walk(v, f"{prefix}.{k}" if prefix else str(k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            out = [walk(v, f"{prefix}.{i}") for i, v in enumerate(node)]
            return out if isinstance(node, list) else tuple(out)
        return _freeze(node)

    staged = walk(sd, "")
    replacements: dict[int, Any] = {}
    for i, items in sorted(claimed.items()):
        policy = policies[i]
        results = policy.stage(items, save)
        save.on_finished(lambda p=policy: p.release(save))
        for (_, tensor), result in zip(items, results):
            replacements[id(tensor)] = result
    staged = _replace(staged, replacements, tensor_type)
    save.blocked_s += time.perf_counter() - t0
    return staged


def _replace(node: Any, replacements: dict[int, Any], tensor_type: Any) -> Any:
    if isinstance(node, tensor_type):
        return replacements.get(id(node), node)
    if isinstance(node, dict):
        return {k: _replace(v, replacements, tensor_type) for k, v in node.items()}
    if isinstance(node, list):
        return [_replace(v, replacements, tensor_type) for v in node]
    if isinstance(node, tuple):
        return tuple(_replace(v, replacements, tensor_type) for v in node)
    return node


def _freeze(value: Any) -> Any:
    """Non-tensor leaves are pickled by DCP when written: copy mutable ones now."""
    return copy.deepcopy(value) if isinstance(value, (dict, list, set, bytearray)) else value


class StagingPool:
    """One CPU buffer per tensor name, reused while shape and dtype stay the same.

    The manager never starts a save before the previous write has finished, so a
    buffer is never overwritten while it is still being written.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _buffer_for(self, name: str, like: Any) -> Any:
        import torch

        with self._lock:
            buf = self._buffers.get(name)
            if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
                pin = like.device.type == "cuda" and torch.cuda.is_available()
                buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
                self._buffers[name] = buf
            return buf

    def copy(self, name: str, tensor: Any) -> Any:
        """A CPU copy of ``tensor`` (a plain tensor) in the buffer kept for ``name``."""
        buf = self._buffer_for(name, tensor)
        buf.copy_(tensor.detach(), non_blocking=buf.is_pinned())
        return buf

    def synchronize(self) -> None:
        """Wait for non-blocking device-to-host copies into pinned buffers."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()


class RegularCopy:
    """Core's fallback: copy into CPU buffers reused across saves (pinned on GPU machines).

    Claims every tensor; a DTensor's local shard is copied and wrapped again with the
    same mesh, placements, global shape and stride.
    """

    name = "regular"
    description = "copy into CPU staging buffers reused across saves (pinned on GPU machines)"

    def claims(self, name: str, tensor: Any, save: SaveContext) -> bool:
        return True

    def _pool(self, save: SaveContext) -> StagingPool:
        pool = save.reuse.get(self.name)
        if pool is None:
            pool = save.reuse[self.name] = StagingPool()
        return pool

    def stage(self, items: Sequence[tuple[str, Any]], save: SaveContext) -> list[Any]:
        if not save.is_async:
            return [tensor for _, tensor in items]
        from .torch_compat import local_tensor, rewrap_dtensor

        pool = self._pool(save)
        out = []
        for name, tensor in items:
            local = local_tensor(tensor)
            staged = pool.copy(name, local)
            out.append(staged if local is tensor else rewrap_dtensor(tensor, staged))
            save.note_staged(name, self.name, staged.numel() * staged.element_size())
        pool.synchronize()
        return out

    def release(self, save: SaveContext) -> None:
        """The buffers stay for the next save (the manager runs one save at a time)."""
