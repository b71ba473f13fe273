"""A ROLL checkpoint's parts loaded into a live training state (read-only on the checkpoint).

ROLL saves ``{**model.state_dict(), "optimizer": optimizer, "scheduler": scheduler,
"rng_state": {...}}`` with DCP: the optimizer as torch's own state dict, its state keyed by
each parameter's position in the optimizer's param groups (``optimizer.state.3.exp_avg``).
The live optimizer here is mapped position by position to its parameters' names, so every
state tensor (``exp_avg``, ``exp_avg_sq``, ``step``) lands on its parameter -- resharded to
this job's world size as DCP reshards -- and is handed over with torch's
``set_optimizer_state_dict``. (ROLL's own ``load_checkpoint`` restores none of them: it loads
into a freshly built optimizer's state dict, which has no state entries yet.) The positions
must be the same parameters as when ROLL saved: ROLL's ``FSDP2TrainStrategy.initialize``
builds ``AdamW`` over the model's trainable parameters in ``model.parameters()`` order; each
position's shape is checked against the saved one before anything is loaded.

The scheduler's state dict and the RNG (torch's CPU generator, NumPy's, Python's, the
device's when there is one) come back as ROLL saved them: one copy for all ranks (DCP keeps
one of values every rank saves under the same key). The driver's part is its
``WorkerState`` JSON, handed to a :class:`roll_ckpt.DriverState` as ``step``,
``log_history`` and ``kv``.
"""

from __future__ import annotations

import json
import logging
import random
import warnings
from typing import Any, MutableMapping

from roll_ckpt import DriverState
from roll_ckpt.plugin import RollCkptError, dcp_placeholders, load_dcp, read_dcp_metadata

__all__ = ["load_driver_part", "load_worker_part", "describe_driver_part", "describe_worker_part",
           "WORKER_STATE_KEYS"]

log = logging.getLogger("roll_ckpt")

WORKER_STATE_KEYS = ("step", "log_history", "kv")
"""ROLL's ``WorkerState`` fields (``roll/utils/worker_state.py``)."""
_OWN = ("optimizer.", "scheduler.", "rng_state.")


# --------------------------------------------------------------------------- the driver


def load_driver_part(storage: Any, worker_state: str, state: MutableMapping[str, Any], where: str) -> int:
    """ROLL's ``WorkerState`` JSON at ``worker_state`` into the one DriverState of ``state``; its step."""
    drivers = [v for v in state.values() if isinstance(v, DriverState)]
    if len(drivers) != 1 or len(state) != 1:
        raise RollCkptError(f"the pipeline part of {where} is ROLL's driver state (WorkerState: step, log_history, "
                            "kv): resume it into a state holding one DriverState, e.g. {'driver': DriverState()}")
    with storage.open_read(worker_state) as f:
        body = json.loads(f.read().decode("utf-8"))
    driver = drivers[0]
    driver.clear()
    driver.update({k: body.get(k, default) for k, default in zip(WORKER_STATE_KEYS, (-1, [], {}))})
    extra = sorted(set(body) - set(WORKER_STATE_KEYS))
    if extra:
        driver.update({k: body[k] for k in extra})
    return int(body["step"])


# --------------------------------------------------------------------------- a worker's DCP folder


def _one(state: MutableMapping[str, Any], kind: type, what: str, where: str) -> list[tuple[str, Any]]:
    found = [(k, v) for k, v in state.items() if isinstance(v, kind)]
    if len(found) > 1:
        raise RollCkptError(f"{where} holds one {what} (ROLL saves one per worker); the state has "
                            f"{len(found)}: {', '.join(k for k, _ in found)}")
    return found


def _names(model: Any) -> dict[int, str]:
    """Each parameter's name as torch's state-dict helpers write it (compile/activation-checkpoint
    wrappers left out)."""
    out = {}
    for name, p in model.named_parameters():
        out[id(p)] = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
    return out


def load_worker_part(storage: Any, dcp: str, state: MutableMapping[str, Any], where: str) -> int:
    """ROLL's DCP folder ``dcp`` into ``state`` (the module doc); the number of files it read from."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    md = read_dcp_metadata(storage, dcp)
    saved = md.state_dict_metadata
    modules = _one(state, torch.nn.Module, "model", where)
    if not modules:
        raise RollCkptError(f"{where} holds a model (ROLL's worker state); the state has none: resume it into "
                            "{'model': model, 'optimizer': optimizer, 'scheduler': scheduler}")
    _, model = modules[0]
    msd = get_model_state_dict(model)
    missing = [k for k in msd if k not in saved]
    if missing:
        have = [k for k in saved if not k.startswith(_OWN)]
        raise RollCkptError(f"{where} has no {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                            f"({len(missing)} of the model's {len(msd)} tensors); it holds {len(have)} model tensors, "
                            f"e.g. {', '.join(have[:3])}: resume it into the model ROLL trained")
    unexpected = [k for k in saved if not k.startswith(_OWN) and k not in msd]
    if unexpected:
        raise RollCkptError(f"{where} holds model tensors this model does not have: {', '.join(unexpected[:5])}")
    for k, t in msd.items():
        if tuple(saved[k].size) != tuple(t.shape):
            raise RollCkptError(f"{where}: {k} was saved with shape {list(saved[k].size)}, the model's is "
                                f"{list(t.shape)}")
    target: dict[str, Any] = dict(msd)
    optimizer = _one(state, torch.optim.Optimizer, "optimizer", where)
    osd = groups = None
    if optimizer and any(k.startswith("optimizer.state.") for k in saved):
        opt = optimizer[0][1]
        osd = get_optimizer_state_dict(model, opt)  # keyed by name; the state is made if the optimizer has none
        order = _positions(storage, dcp, md, model, opt, where)
        for i, name in enumerate(order):
            for field, t in osd["state"].get(name, {}).items():
                key = f"optimizer.state.{i}.{field}"
                if key in saved:
                    if not isinstance(saved[key], TensorStorageMetadata):
                        target[key] = None  # a value, not a tensor: loaded below into the state dict
                    else:
                        target[key] = t  # loaded in place, resharded
        groups = [{hp: None for hp in g if hp != "params" and f"optimizer.param_groups.{i}.{hp}" in saved}
                  for i, g in enumerate(osd["param_groups"])]
        for i, g in enumerate(groups):
            for hp in g:
                target[f"optimizer.param_groups.{i}.{hp}"] = None
    elif optimizer:
        warnings.warn(f"roll-ckpt: {where} holds no optimizer state (saved before the first optimizer step, or "
                      "without an optimizer); the optimizer starts fresh", stacklevel=4)
    scheduler = _scheduler(state)
    if scheduler is not None:
        target["scheduler"] = dcp_placeholders(md, ("scheduler",))
    target["rng_state"] = dcp_placeholders(md, ("rng_state",))
    load_dcp(target, storage, dcp, numpy=True)
    set_model_state_dict(model, {k: target[k] for k in msd})
    if osd is not None:
        for i, name in enumerate(order):
            for field in list(osd["state"].get(name, {})):
                value = target.get(f"optimizer.state.{i}.{field}")
                if value is not None and not isinstance(value, torch.Tensor):
                    osd["state"][name][field] = value
        for i, g in enumerate(groups or []):
            for hp in g:
                osd["param_groups"][i][hp] = target[f"optimizer.param_groups.{i}.{hp}"]
        set_optimizer_state_dict(model, optimizer[0][1], osd)
    if scheduler is not None:
        scheduler.load_state_dict({**scheduler.state_dict(), **target["scheduler"]})
    _restore_rng(target["rng_state"], where)
    others = [k for k, v in state.items() if not isinstance(v, (torch.nn.Module, torch.optim.Optimizer))
              and v is not scheduler]
    if others:
        warnings.warn(f"roll-ckpt: {where} holds no value for state {', '.join(map(repr, others))} (ROLL saves the "
                      "model, optimizer, scheduler and RNG): they keep their current values", stacklevel=4)
    return len({str(getattr(i, "relative_path", "")) for i in (md.storage_data or {}).values()})


def _positions(storage: Any, dcp: str, md: Any, model: Any, opt: Any, where: str) -> list[str]:
    """The names of the optimizer's parameters in ROLL's order, checked against what was saved:
    the same param groups, each position's state the shape of its parameter."""
    saved = md.state_dict_metadata
    names = _names(model)
    live = [[p for p in g["params"]] for g in opt.param_groups]
    keys = {f"optimizer.param_groups.{i}.params": None for i in range(len(live))
            if f"optimizer.param_groups.{i}.params" in saved}
    load_dcp(keys, storage, dcp)
    saved_groups = sum(1 for k in saved if k.startswith("optimizer.param_groups.") and k.endswith(".params"))
    if saved_groups != len(live):
        raise RollCkptError(f"{where}: ROLL's optimizer had {saved_groups} param group(s), this one has "
                            f"{len(live)}: build it as ROLL does (AdamW over the trainable parameters)")
    order: list[str] = []
    for i, group in enumerate(live):
        indices = keys[f"optimizer.param_groups.{i}.params"]
        if list(indices) != list(range(len(order), len(order) + len(group))):
            raise RollCkptError(f"{where}: ROLL's param group {i} holds {len(indices)} parameters "
                                f"(positions {indices[:3]}...), this optimizer's {len(group)}")
        for p in group:
            name = names.get(id(p))
            if name is None:
                raise RollCkptError(f"{where}: the optimizer updates a parameter the model does not hold")
            entry = saved.get(f"optimizer.state.{len(order)}.exp_avg")
            if entry is not None and tuple(entry.size) != tuple(p.shape):
                raise RollCkptError(
                    f"{where}: the optimizer's parameter {len(order)} is {name} with shape {list(p.shape)}, but ROLL "
                    f"saved a state of shape {list(entry.size)} at that position: build the optimizer over the "
                    "trainable parameters in model.parameters() order, as ROLL's FSDP2TrainStrategy does")
            order.append(name)
    return order


def _scheduler(state: MutableMapping[str, Any]) -> Any:
    import torch

    if "scheduler" in state:
        return state["scheduler"]
    found = [v for v in state.values() if not isinstance(v, (torch.nn.Module, torch.optim.Optimizer))
             and callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))]
    return found[0] if len(found) == 1 else None


def _restore_rng(rng: dict[str, Any], where: str) -> None:
    import numpy as np
    import torch

    if isinstance(rng.get("cpu"), torch.Tensor):
        torch.set_rng_state(rng["cpu"].to(torch.uint8))
    if rng.get("numpy") is not None:
        np.random.set_state(tuple(rng["numpy"]))
    if rng.get("random") is not None:
        version, internal, gauss = rng["random"]
        random.setstate((version, tuple(internal), gauss))
    device = rng.get("device")
    if isinstance(device, torch.Tensor) and torch.cuda.is_available():
        torch.cuda.set_rng_state(device.to(torch.uint8).cpu())
    elif device is not None and not torch.cuda.is_available():
        log.info("roll-ckpt: %s holds a device RNG state; this process has no GPU, so it is not restored", where)


# --------------------------------------------------------------------------- inspect


def describe_driver_part(storage: Any, worker_state: str) -> list[str]:
    """What ``roll-ckpt inspect`` shows of ROLL's ``WorkerState`` JSON."""
    name = worker_state.rsplit("/", 1)[-1]
    try:
        with storage.open_read(worker_state) as f:
            body = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        return [f"{name}: unreadable ({exc})"]
    kv = body.get("kv") or {}
    return [f"{name}: step {body.get('step')}, {len(body.get('log_history') or [])} logged steps, "
            f"kv: {', '.join(sorted(kv)) or 'none'}"]


def describe_worker_part(storage: Any, folder: str) -> list[str]:
    """What ``roll-ckpt inspect`` shows of one worker's part of a ROLL checkpoint (no tensor data read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = read_dcp_metadata(storage, storage.join(folder, "dcp"))
    except Exception as exc:
        return [f"dcp/.metadata: unreadable ({type(exc).__name__}: {exc})"]
    entries = md.state_dict_metadata
    model = {k: v for k, v in entries.items() if not k.startswith(_OWN)}
    state = [k for k in entries if k.startswith("optimizer.state.")]
    positions = {k.split(".")[2] for k in state}
    sched = sorted(k[len("scheduler."):] for k in entries if k.startswith("scheduler."))
    numel = sum(int(v.size.numel()) for v in model.values() if isinstance(v, TensorStorageMetadata))
    out = [f"model: {len(model)} tensors, {numel:,} elements, e.g. " +
           ", ".join(f"{k} {list(v.size)}" for k, v in list(model.items())[:3]),
           f"optimizer: {len(state)} state tensors for {len(positions)} parameters (by position), "
           f"{sum(1 for k in entries if k.startswith('optimizer.param_groups.') and k.endswith('.params'))} "
           "param group(s)",
           f"scheduler: {', '.join(sched) or 'none'}",
           f"rng_state: {', '.join(sorted(k[len('rng_state.'):] for k in entries if k.startswith('rng_state.')))}"]
    hf = sorted(e.name for e in storage.list(folder) if not e.is_dir)
    if hf:
        out.append(f"Hugging Face files: {', '.join(hf)}")
    return out
