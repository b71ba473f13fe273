"""A verl checkpoint's part loaded into a live training state, at any world size, bit for bit.

verl's FSDP manager saves each rank's ``model.state_dict()`` (FSDP2: DTensor shards),
``optimizer.state_dict()`` (state by the parameter's position, moments as DTensor shards) and
``{"lr_scheduler", "rng"}`` with ``torch.save``. Here every file is read with
``torch.load(weights_only=True)``, memory-mapped (:func:`roll_ckpt.plugin.torch_load`), and
each live tensor's shard on this process is assembled from the saved shards that overlap it:
where each saved shard lies follows from its own mesh, rank and placements (``Shard(d)``,
``Replicate``; the chunks of ``torch.chunk``, as DTensor splits), where the live one lies from
the live DTensor (:func:`roll_ckpt.plugin.local_chunk`). Only the overlapping rows are read;
nothing is gathered, no collective runs, and at the world size verl saved at, each rank's
shard is its own file's, byte for byte.

The model is then loaded with its own ``load_state_dict`` and the optimizer with its own
``load_state_dict`` (positions kept: verl builds the optimizer over ``module.parameters()``;
each position's saved shape is checked against the live parameter's first), as verl's own
manager loads them. The scheduler and the RNG (torch's CPU generator, NumPy's, Python's, the
device's when there is one) come from this rank's ``extra_state`` file -- rank 0's for a
rank the saving job did not have, as roll-ckpt's per-rank values do.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any, MutableMapping

from roll_ckpt.plugin import RollCkptError, Storage, human_bytes, local_chunk, rewrap_dtensor, torch_load

from .layout import FSDP_CONFIG, HF_DIR, KINDS, rank_file

__all__ = ["load_part", "describe_part"]

log = logging.getLogger("roll_ckpt")

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, sizes)`` of a piece of a tensor, per dimension."""


def _name(kind: str, world: int, rank: int) -> str:
    return rank_file(kind, world, rank)


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """Where piece ``index`` of ``torch.chunk(t, parts)`` lies along a dimension of ``size``."""
    step = -(-size // parts) if size else 0
    start = min(index * step, size)
    return start, max(0, min(step, size - start))


def saved_box(value: Any, rank: int, where: str, key: str) -> Box:
    """Where the shard rank ``rank`` saved of ``value`` (a DTensor as the saving job had it, or a
    plain tensor: all of it) lies in the global tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = tuple(value.shape)
    if not isinstance(value, DTensor):
        return (0,) * len(shape), shape
    mesh = value.device_mesh.mesh
    at = (mesh == rank).nonzero()
    if at.numel() == 0:
        raise RollCkptError(f"{where}: {key} was saved on the mesh {mesh.tolist()}, which does not hold rank {rank} "
                            "whose file it is in")
    coord = at[0].tolist()
    offsets, sizes = [0] * len(shape), list(shape)
    for dim, placement in enumerate(value.placements):
        if type(placement) is Shard:
            d = placement.dim % len(shape)
            start, length = _chunk(sizes[d], int(mesh.shape[dim]), coord[dim])
            offsets[d] += start
            sizes[d] = length
        elif not isinstance(placement, Replicate):
            raise RollCkptError(f"{where}: {key} was saved with the placement {placement!r}, which roll-ckpt does "
                                "not reshard (verl's FSDP2 engine saves Shard(0) and Replicate)")
    local = tuple(value.to_local().shape)
    if local != tuple(sizes):
        raise RollCkptError(f"{where}: {key} of rank {rank} holds a shard of shape {list(local)}, not the "
                            f"{sizes} its placements {value.placements} give; it is not one verl wrote")
    return tuple(offsets), tuple(sizes)


def _assemble(live: Any, pieces: list[tuple[Box, Any]], where: str, key: str) -> Any:
    """This process's shard of ``live`` (a DTensor, or a plain tensor: all of it), from the saved
    ``pieces`` that overlap it, as a DTensor like ``live`` or a plain tensor."""
    import torch
    from torch.distributed.tensor import DTensor

    is_dt = isinstance(live, DTensor)
    offsets, sizes = local_chunk(live) if is_dt else ((0,) * live.dim(), tuple(live.shape))
    first = pieces[0][1]
    out = torch.empty(sizes, dtype=first.dtype)
    covered = 0
    seen: set[Box] = set()
    for (p_off, p_size), data in pieces:
        if (p_off, p_size) in seen:  # a replica of a piece already taken
            continue
        seen.add((p_off, p_size))
        lo = [max(a, b) for a, b in zip(offsets, p_off)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, p_off, p_size)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        dst = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))
        src = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, p_off))
        block = data[src]
        out[dst] = block
        covered += block.numel()
    if covered != out.numel():
        raise RollCkptError(f"{where}: the saved shards of {key} cover {covered} of the {out.numel()} elements this "
                            "process holds; a rank's file is not the one its folder's other files were saved with")
    return rewrap_dtensor(live, out) if is_dt else out


def _pieces(values: list[Any], where: str, key: str) -> list[tuple[Box, Any]]:
    from torch.distributed.tensor import DTensor

    return [(saved_box(v, r, where, key), v.to_local() if isinstance(v, DTensor) else v) for r, v in enumerate(values)]


def _one(state: MutableMapping[str, Any], kind: type, what: str, where: str) -> Any:
    found = [v for v in state.values() if isinstance(v, kind)]
    if len(found) > 1:
        raise RollCkptError(f"{where} holds one {what}; the state has {len(found)}: resume it into a state with one")
    return found[0] if found else None


def _scheduler(state: MutableMapping[str, Any]) -> Any:
    import torch

    if "scheduler" in state:
        return state["scheduler"]
    found = [v for v in state.values() if not isinstance(v, (torch.nn.Module, torch.optim.Optimizer))
             and callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))]
    return found[0] if len(found) == 1 else None


def _global_shape(value: Any) -> list[int]:
    return list(value.shape)


def _load_model(storage: Storage, folder: str, world: int, module: Any, where: str) -> int:
    saved = [torch_load(storage, storage.join(folder, _name("model", world, r))) for r in range(world)]
    live = module.state_dict()
    keys = set(saved[0])
    if keys and keys < set(live) and all("lora_" in k or ".adapter_" in k for k in keys):
        raise RollCkptError(f"{where} is a LoRA-only save (checkpoint.save_lora_only: true: {len(keys)} adapter "
                            "tensors, no base weights), which roll-ckpt does not resume; resume it with verl's own "
                            "manager (VERL_ENGINE_VENDOR unset)")
    missing = [k for k in live if k not in keys]
    extra = sorted(keys - set(live))
    if missing or extra:
        raise RollCkptError(f"{where}: its model does not match this one: "
                            + (f"it lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; " if missing else "")
                            + (f"it holds {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}, which this model "
                               "does not have" if extra else "") + "; resume it into the model verl trained")
    new = {}
    for k, t in live.items():
        values = [sd[k] for sd in saved]
        if _global_shape(values[0]) != _global_shape(t):
            raise RollCkptError(f"{where}: {k} was saved with shape {_global_shape(values[0])}, this model's is "
                                f"{_global_shape(t)}")
        new[k] = _assemble(t, _pieces(values, where, k), where, k)
    module.load_state_dict(new)
    return world


def _load_optimizer(storage: Storage, folder: str, world: int, optimizer: Any, rank: int, where: str) -> int:
    import torch

    saved = [torch_load(storage, storage.join(folder, _name("optim", world, r))) for r in range(world)]
    mine = saved[rank if rank < world else 0]
    groups = mine.get("param_groups") or []
    live_groups = optimizer.param_groups
    if len(groups) != len(live_groups) or any(len(g["params"]) != len(lg["params"])
                                              for g, lg in zip(groups, live_groups)):
        raise RollCkptError(
            f"{where}: verl's optimizer had {len(groups)} param group(s) of "
            f"{[len(g['params']) for g in groups]} parameters, this one has {len(live_groups)} of "
            f"{[len(g['params']) for g in live_groups]}: build it as verl does (over module.parameters())")
    params = [p for g in live_groups for p in g["params"]]
    positions = [i for g in groups for i in g["params"]]
    if positions != list(range(len(params))):
        raise RollCkptError(f"{where}: verl's param groups name positions {positions[:5]}..., not 0..{len(params) - 1}")
    state: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(params):
        entries = [sd["state"].get(i, sd["state"].get(str(i))) for sd in saved]
        if entries[0] is None:
            continue  # no state yet at this position (never stepped): as verl would leave it
        own = entries[rank if rank < world else 0]
        out: dict[str, Any] = {}
        for field, v0 in entries[0].items():
            if isinstance(v0, torch.Tensor) and v0.dim() > 0:
                if _global_shape(v0) != _global_shape(p):
                    raise RollCkptError(
                        f"{where}: the optimizer's state {field} at position {i} has shape {_global_shape(v0)}, but "
                        f"this optimizer's parameter {i} has shape {_global_shape(p)}: build it over the trainable "
                        "parameters in module.parameters() order, as verl's engine does")
                out[field] = _assemble(p, _pieces([e[field] for e in entries], where, f"optimizer state {i}.{field}"),
                                       where, f"optimizer state {i}.{field}")
            else:
                out[field] = own[field]
        state[i] = out
    optimizer.load_state_dict({"state": state, "param_groups": [dict(g) for g in groups]})
    return world


def _restore_rng(rng: dict[str, Any], where: str) -> None:
    import numpy as np
    import torch

    if isinstance(rng.get("cpu"), torch.Tensor):
        torch.set_rng_state(rng["cpu"].to(torch.uint8))
    if rng.get("numpy") is not None:
        np.random.set_state(rng["numpy"])
    if rng.get("random") is not None:
        random.setstate(rng["random"])
    for device in sorted(k for k in rng if k not in ("cpu", "numpy", "random")):
        module = getattr(torch, device, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            module.set_rng_state(rng[device].to(torch.uint8).cpu())
        else:
            log.info("roll-ckpt: %s holds a %s RNG state; this process has no such device, so it is not restored",
                     where, device)


def load_part(storage: Storage, folder: str, world: int, state: MutableMapping[str, Any], where: str, *,
              rank: int, world_size: int) -> dict[str, Any]:
    """verl's part at ``folder`` (saved by ``world`` ranks) into ``state`` on rank ``rank`` of
    ``world_size``: the model, the optimizer and the scheduler found in ``state`` (by type; the
    scheduler under ``scheduler``, or the one other stateful object), and the RNG. What is not in
    ``state`` is not loaded. Returns what it read."""
    import torch

    module = _one(state, torch.nn.Module, "model", where)
    optimizer = _one(state, torch.optim.Optimizer, "optimizer", where)
    scheduler = _scheduler(state)
    names = {e.name for e in storage.list(folder) if not e.is_dir}
    read: dict[str, Any] = {"files_read": 0}
    if module is not None:
        _load_model(storage, folder, world, module, where)
        read["files_read"] += world
    if optimizer is not None:
        if _name("optim", world, 0) not in names:
            raise RollCkptError(f"{where} holds no optimizer state (saved without 'optimizer' in save_contents); "
                                "leave 'optimizer' out of load_contents to resume it")
        _load_optimizer(storage, folder, world, optimizer, rank, where)
        read["files_read"] += world
    extra_name = _name("extra_state", world, rank if rank < world else 0)
    if extra_name in names:
        extra = torch_load(storage, storage.join(folder, extra_name), numpy=True)
        read["files_read"] += 1
        sched = extra.get("lr_scheduler")
        if scheduler is not None and sched is not None:
            scheduler.load_state_dict(sched)
        if isinstance(extra.get("rng"), dict):
            _restore_rng(extra["rng"], where)
    elif scheduler is not None:
        raise RollCkptError(f"{where} holds no extra_state files (saved without 'extra' in save_contents): no "
                            "scheduler to resume; leave 'extra' out of load_contents to resume it")
    if world != world_size:
        log.info("roll-ckpt: %s was saved by %d rank(s); resharded to this job's %d", where, world, world_size)
    return read


def describe_part(storage: Storage, folder: str, world: int | None) -> list[str]:
    """What ``roll-ckpt inspect`` shows of one part of a verl checkpoint (rank 0's files only,
    memory-mapped: shapes and values, no tensor data read)."""
    sizes = {e.name: e.size for e in storage.list(folder) if not e.is_dir}
    try:
        with storage.open_read(storage.join(folder, FSDP_CONFIG)) as f:
            fsdp = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        return [f"{FSDP_CONFIG}: unreadable ({exc})"]
    out = [f"{FSDP_CONFIG}: FSDP version {fsdp.get('FSDP_version')}, saved by {world} rank(s); " +
           ", ".join(f"{k}: {human_bytes(sum(s for n, s in sizes.items() if n.startswith(k + '_world_size_')))}"
                     for k in KINDS)]
    if world is None:
        return out
    try:
        model = torch_load(storage, storage.join(folder, _name("model", world, 0)))
        shown = list(model.items())[:3]
        out.append(f"model (rank 0's file): {len(model)} tensors, e.g. " +
                   ", ".join(f"{k} {list(v.shape)} {str(v.dtype).replace('torch.', '')}"
                             f"{' ' + str(tuple(v.placements)) if hasattr(v, 'placements') else ''}" for k, v in shown))
        if _name("optim", world, 0) in sizes:
            optim = torch_load(storage, storage.join(folder, _name("optim", world, 0)))
            fields = sorted({f for st in optim.get("state", {}).values() for f in st})
            groups = optim.get("param_groups") or [{}]
            out.append(f"optimizer: state for {len(optim.get('state', {}))} positions ({', '.join(fields)}), "
                       f"{len(groups)} param group(s), lr {groups[0].get('lr')}")
        if _name("extra_state", world, 0) in sizes:
            extra = torch_load(storage, storage.join(folder, _name("extra_state", world, 0)), numpy=True)
            sched = extra.get("lr_scheduler") or {}
            out.append(f"scheduler: last_epoch {sched.get('last_epoch')}, lr {sched.get('_last_lr')}; rng: "
                       f"{', '.join(sorted(extra.get('rng') or {}))}")
    except RollCkptError as exc:
        out.append(f"unreadable: {exc}")
    hf = sorted(e.name for e in storage.list(storage.join(folder, HF_DIR)) if not e.is_dir)
    if hf:
        out.append(f"{HF_DIR}/: {', '.join(hf)}")
    return out
