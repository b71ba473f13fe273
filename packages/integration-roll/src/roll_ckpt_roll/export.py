"""``roll-ckpt export PATH --format roll --out DIR``: a roll-ckpt checkpoint as ROLL lays one
out (:mod:`roll_ckpt_roll.roll_format`), for ROLL's own ``load_checkpoint`` and rollout engines.

Each part with a DCP folder is written with ``dcp.save`` in ROLL's key schema: the model's
parameters at top level, the optimizer as torch's state dict (state by parameter position,
the positions in the saved param group's order), the scheduler's state dict, ``rng_state``
(rank 0's RNG: ROLL keeps one). The actor -- ``actor_train``, or the part that published its
Hugging Face files at the step, or the only one -- goes to the step folder, every other part
to a sub-folder of its name; each part's Hugging Face files beside its ``dcp/``. The
driver's :class:`~roll_ckpt.DriverState` becomes ``pipeline/worker_state_pipeline.json``.
Tensors are read whole (resharded to one process): the export needs the largest part's size
in memory. The checkpoint is verified before anything of it is read; ``DIR`` is written into
a temporary sibling and renamed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any, Callable

from roll_ckpt.plugin import (CheckpointNotFoundError, RollCkptError, Storage, dcp_placeholders, load_dcp,
                              read_dcp_metadata, write_dcp)

from .roll_format import PIPELINE, ROOT_PART, WORKER_STATE
from .state_map import WORKER_STATE_KEYS

__all__ = ["export_roll"]

_SKIP = ("manifest.json", "trainer_state.json")


def _read_json(storage: Storage, path: str) -> Any:
    with storage.open_read(path) as f:
        return json.loads(f.read().decode("utf-8"))


def _parts(storage: Storage, path: str, manifest: dict[str, Any], component: str | None) -> dict[str, tuple[str, str]]:
    """Component -> (its folder in the checkpoint, its folder in ROLL's layout: "" = the step)."""
    parts = (manifest.get("extra") or {}).get("components") or {}
    if not parts:  # a checkpoint of one job, no components: the actor's part
        return {component or ROOT_PART: (path, "")}
    dcp_parts = [n for n, p in parts.items() if p.get("strategy") != "json"]
    published = [n for n in dcp_parts
                 if (_read_json(storage, storage.join(path, n, "manifest.json")).get("extra") or {}).get("step_root")]
    root = ROOT_PART if ROOT_PART in dcp_parts else (published[0] if published else
                                                   (dcp_parts[0] if len(dcp_parts) == 1 else None))
    out = {n: (storage.join(path, n), "" if n == root else n) for n in parts}
    if component is not None:
        if component not in out:
            raise CheckpointNotFoundError(f"{path} has no part for component '{component}' (it holds "
                                          f"{', '.join(sorted(out))})")
        out = {component: out[component]}
    return out


def _roll_state_dict(storage: Storage, dcp: str, where: str) -> dict[str, Any]:
    """A roll-ckpt DCP folder read whole and put in ROLL's key schema."""
    import numpy as np
    import torch

    md = read_dcp_metadata(storage, dcp)
    full = dcp_placeholders(md, ())
    load_dcp(full, storage, dcp)
    modules = [k for k, v in full.items() if k != "per_rank" and isinstance(v, dict) and
               not ({"state", "param_groups"} <= set(v))]
    optimizers = [k for k, v in full.items() if isinstance(v, dict) and {"state", "param_groups"} <= set(v)]
    if len(modules) != 1 or len(optimizers) > 1:
        raise RollCkptError(f"{where} holds {len(modules)} module(s) and {len(optimizers)} optimizer(s); ROLL's "
                            "layout has one of each per worker")
    out: dict[str, Any] = dict(full[modules[0]])
    if optimizers:
        osd = full[optimizers[0]]
        position, groups = 0, []
        for group in osd["param_groups"]:
            names = list(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(position, position + len(names)))})
            for i, name in enumerate(names):
                if name in osd["state"]:
                    out.setdefault("optimizer", {"state": {}, "param_groups": groups})["state"][position + i] = \
                        osd["state"][name]
            position += len(names)
        out.setdefault("optimizer", {"state": {}, "param_groups": groups})
    mine = (full.get("per_rank") or {}).get("0") or {}
    scheduler = mine.get("scheduler")
    if isinstance(scheduler, tuple) and len(scheduler) == 1:  # a per-process value, boxed
        out["scheduler"] = scheduler[0]
    rng = mine.get("__rng__")
    if rng is not None:
        py, npv = rng["python"].tolist(), rng["numpy"].tolist()
        out["rng_state"] = {
            "cpu": rng["torch"].to(torch.uint8),
            "device": rng["cuda"][0].to(torch.uint8) if rng.get("cuda") is not None else None,
            "numpy": ("MT19937", np.array(npv[:624], dtype=np.uint32), npv[624], npv[625],
                      float(rng["numpy_gauss"][0])),
            "random": (py[0], tuple(py[1:-1]), float(rng["python_gauss"][0]) if py[-1] else None),
        }
    return out


def _copy_files(storage: Storage, folder: str, out: str) -> int:
    """The part's Hugging Face and tokenizer files (everything but its DCP folder and roll-ckpt's own)."""
    n = 0
    for e in storage.list(folder):
        if e.is_dir or e.name in _SKIP or e.name.startswith("."):
            continue
        with storage.open_read(e.path) as f, open(os.path.join(out, e.name), "wb") as w:
            shutil.copyfileobj(f, w, 8 << 20)
        n += 1
    return n


def export_roll(storage: Storage, path: str, out: str, *, component: str | None = None, overwrite: bool = False,
                notes: Callable[[str], None] = print) -> str:
    """Write the committed checkpoint at ``path`` in ROLL's layout at ``out``; one line saying what."""
    from roll_ckpt.plugin import verify_checkpoint

    if os.path.exists(out) and not overwrite:
        raise RollCkptError(f"{out} exists; pass --force to replace it")
    manifest = verify_checkpoint(storage, path)  # every file checked before anything is read
    step = int(manifest["step"])
    tmp = f"{out.rstrip('/')}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    written = []
    try:
        for name, (folder, place) in _parts(storage, path, manifest, component).items():
            target = os.path.join(tmp, place)
            os.makedirs(target, exist_ok=True)
            if storage.exists(storage.join(folder, "state", "state.json")):  # the driver's DriverState
                body = _read_json(storage, storage.join(folder, "state", "state.json"))["state"]
                values = next(iter(body.values()))["values"] if len(body) == 1 else {}
                lacking = [k for k in WORKER_STATE_KEYS if k not in values]
                if lacking:
                    notes(f"note: the driver state of {name} has no {', '.join(lacking)} (ROLL's WorkerState "
                          "fields); written with ROLL's defaults")
                state = {k: values.get(k, d) for k, d in zip(WORKER_STATE_KEYS, (-1, [], {}))}
                os.makedirs(os.path.join(tmp, PIPELINE), exist_ok=True)
                with open(os.path.join(tmp, PIPELINE, WORKER_STATE), "w", encoding="utf-8") as f:
                    f.write(json.dumps(state, indent=2, sort_keys=True) + "\n")
                written.append(f"{name} -> {PIPELINE}/{WORKER_STATE}")
                continue
            sd = _roll_state_dict(storage, storage.join(folder, "dcp"), f"{path} ({name})")
            write_dcp(sd, os.path.join(target, "dcp"))
            files = _copy_files(storage, folder, target)
            written.append(f"{name} -> {place or '.'}/dcp" + (f" + {files} files" if files else ""))
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return f"exported step {step} in ROLL's layout to {out} ({'; '.join(written)})"
