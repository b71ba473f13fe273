"""``roll-ckpt export PATH --format torchtitan --out DIR``: a checkpoint roll-ckpt-torchtitan
saved, as torchtitan's own manager lays a step out (:mod:`roll_ckpt_torchtitan.tt_format`), for
torchtitan's ``CheckpointManager`` (``--checkpoint.folder`` holding ``DIR`` as ``step-<N>``),
``--checkpoint.initial_load_path DIR`` and its conversion scripts.

The model's entries go to the top level, ``optimizer``, ``lr_scheduler``, ``train_state`` (and
any other state torchtitan was handed) under their key, each process's dataloader state to
``dataloader.dp_rank_<r>`` with ``dataloader.world_size``. The RNG states roll-ckpt keeps per
process are left out (torchtitan keeps none). Tensors are read whole (resharded to one
process) and written by one: the export needs the checkpoint's size in memory, and
torchtitan's loader reshards them to its job. The checkpoint is verified before anything of
it is read; ``DIR`` is written into a temporary sibling and renamed at the end.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any, Callable

from roll_ckpt.plugin import RollCkptError, Storage, dcp_placeholders, load_dcp, read_dcp_metadata

__all__ = ["export_torchtitan"]


def _unbox(value: Any) -> Any:
    return value[0] if isinstance(value, tuple) and len(value) == 1 else value


def torchtitan_state_dict(storage: Storage, dcp: str, where: str) -> dict[str, Any]:
    """A roll-ckpt-torchtitan DCP folder read whole, in torchtitan's flattened key schema."""
    md = read_dcp_metadata(storage, dcp)
    full = dcp_placeholders(md, ())
    load_dcp(full, storage, dcp)
    if not isinstance(full.get("model"), dict) or "train_state" not in full:
        raise RollCkptError(f"{where} was not saved by roll-ckpt-torchtitan (it holds {', '.join(sorted(full))}; "
                            "torchtitan's manager saves model, optimizer, lr_scheduler, dataloader and train_state)")
    out: dict[str, Any] = dict(full["model"])
    for key, value in full.items():
        if key not in ("model", "per_rank"):
            out[key] = value
    loader: dict[str, Any] = {}
    for rank in sorted((full.get("per_rank") or {}), key=int):
        value = _unbox(full["per_rank"][rank].get("dataloader"))
        if isinstance(value, dict):
            loader.update(value)
    if loader:
        out["dataloader"] = loader
    return out


def export_torchtitan(storage: Storage, path: str, out: str, *, component: str | None = None,
                      overwrite: bool = False, notes: Callable[[str], None] = print) -> str:
    """Write the committed checkpoint at ``path`` in torchtitan's layout at ``out``; one line saying what."""
    from roll_ckpt.plugin import verify_checkpoint, write_dcp

    if component is not None:
        raise RollCkptError("a torchtitan checkpoint has no components; export it without --component")
    if os.path.exists(out) and not overwrite:
        raise RollCkptError(f"{out} exists; pass --force to replace it")
    manifest = verify_checkpoint(storage, path)  # every file checked before anything is read
    step = int(manifest["step"])
    sd = torchtitan_state_dict(storage, storage.join(path, "dcp"), path)
    tmp = f"{out.rstrip('/')}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write_dcp(sd, tmp)  # this process alone, on every torch of the range
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.basename(out.rstrip("/")) != f"step-{step}":
        notes(f"note: torchtitan finds a step by its folder's name: put it in --checkpoint.folder as step-{step}")
    ranks = sum(1 for k in sd.get("dataloader", {}) if k.startswith("dp_rank_"))
    return (f"exported step {step} in torchtitan's layout to {out} ({len(sd)} top-level entries; the dataloader "
            f"of {ranks} rank(s); the per-process RNG states left out: torchtitan keeps none)")
