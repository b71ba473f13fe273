"""ROLL's own checkpoints, as ROLL writes them: recognized, checked for completeness, described.

Checked against alibaba/ROLL at :data:`ROLL_COMMIT` (``roll/distributed/strategy/fsdp2_strategy.py``:
``save_checkpoint``, ``_save_checkpoint_with_dcp``, ``load_checkpoint``;
``roll/pipeline/base_worker.py`` and ``base_pipeline.py``: ``do_checkpoint``;
``roll/utils/worker_state.py``; ``roll/utils/upload_utils.py``)::

    <checkpoint_config.output_dir>/<YYYYmmdd-HHMMSS>/checkpoint-<N>/
        config.json, generation_config.json,        the actor's model: rank 0's save_pretrained of the
        model*.safetensors [+ index], tokenizer     full state dict, and its tokenizer (rollout engines
                                                    and from_pretrained open this folder)
        dcp/.metadata, __<rank>_0.distcp            the actor (actor_train): dcp.save of
                                                    {**model.state_dict(), "optimizer": optimizer,
                                                     "scheduler": scheduler, "rng_state": {...}}
        critic/config.json, model.safetensors, dcp/ the critic, the same way (every cluster ROLL saves
                                                    below the step, under its name)
        pipeline/worker_state_pipeline.json         the driver's WorkerState: step, log_history, kv
        pipeline/rng_state_pipeline.pth             the driver's RNG (a pickle ROLL never loads)

Each part is uploaded by ``shutil.copytree`` from a local staging folder, worker by worker: a
step folder can hold some parts whole and others cut short. Nothing marks a finished save,
so :func:`recognize` checks what can be checked without trusting anything: ``.metadata``
(through roll-ckpt's restricted unpickler) and every data file it names, long enough for
the bytes it names; each safetensors file against its own header and its index; the
driver's JSON. No checksums: ROLL writes none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from roll_ckpt.plugin import Storage, safetensors_problems

__all__ = ["ROLL_COMMIT", "ROOT_PART", "PIPELINE", "WORKER_STATE", "RollCheckpoint", "recognize"]

ROLL_COMMIT = "8eb27cc2dc34c4d1310b169d9b86d339004d811a"
"""The alibaba/ROLL commit this layout and the calls in :mod:`roll_ckpt_roll.patches` were read from."""

ROOT_PART = "actor_train"
"""The component whose part is the step folder itself in ROLL's layout (``ActorWorker`` saves there)."""
PIPELINE = "pipeline"
WORKER_STATE = "worker_state_pipeline.json"
_LEGACY = ("model_world_size_", "optim_world_size_", "extra_state_world_size_")
_MANIFEST = "manifest.json"
_TRAINER_STATE = "trainer_state.json"
_OURS_KEY = "per_rank."
"""roll-ckpt's DCP folders always hold per-process values under it; ROLL's never do."""


@dataclass
class RollCheckpoint:
    """A ``checkpoint-<N>`` folder ROLL wrote (a :class:`roll_ckpt.plugin.ForeignCheckpoint`)."""

    storage: Storage
    path: str
    step: int
    parts: dict[str, str]
    """Component name -> its folder: ``actor_train`` the step folder, ``critic`` its sub-folder,
    ``pipeline`` the driver's folder."""
    problems: list[str] = field(default_factory=list)
    format: str = "roll"
    title: str = "ROLL checkpoint"

    def components(self) -> list[str]:
        return sorted(self.parts)

    def files(self) -> dict[str, int]:
        return _tree(self.storage, self.path)

    def describe(self) -> list[str]:
        from .state_map import describe_driver_part, describe_worker_part

        lines = []
        for name in self.components():
            folder = self.parts[name]
            lines.append(f"part {name} ({'the step folder' if folder == self.path else name + '/'}):")
            found = describe_driver_part(self.storage, self.storage.join(folder, WORKER_STATE)) if name == PIPELINE \
                else describe_worker_part(self.storage, folder)
            lines.extend(f"  {line}" for line in found)
        return lines

    def resume(self, state: Any, strategy: Any, component: str | None) -> dict[str, Any]:
        """Load ``component``'s part (a job without components: ``actor_train``'s, the step folder)."""
        from roll_ckpt.plugin import CheckpointNotFoundError

        from .state_map import load_driver_part, load_worker_part

        component = component or ROOT_PART
        folder = self.parts.get(component)
        if folder is None:
            raise CheckpointNotFoundError(
                f"{self.path} (a ROLL checkpoint) has no part for component '{component}': it holds "
                f"{', '.join(self.components()) or 'none'} (ROLL keeps actor_train's at the step folder, other "
                "clusters' in sub-folders of their name, the driver's in pipeline/)")
        out: dict[str, Any] = {"step": self.step, "format": "roll", "component": component}
        where = f"{self.path} ({component})"
        if component == PIPELINE:
            out["worker_state_step"] = load_driver_part(self.storage, self.storage.join(folder, WORKER_STATE),
                                                        state, where)
        else:
            out["files_read"] = load_worker_part(self.storage, self.storage.join(folder, "dcp"), state, where)
        return out


def _tree(storage: Storage, root: str, prefix: str = "") -> dict[str, int]:
    out: dict[str, int] = {}
    for e in storage.list(root):
        if e.is_dir:
            out.update(_tree(storage, e.path, f"{prefix}{e.name}/"))
        else:
            out[f"{prefix}{e.name}"] = e.size
    return out


def _step(storage: Storage, path: str, parts: dict[str, str]) -> int | None:
    """The step: from the folder's name (``checkpoint-<N>``), else from the driver's WorkerState."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    head, _, tail = name.rpartition("-")
    if head == "checkpoint" and tail.isdigit():
        return int(tail)
    if PIPELINE in parts:
        try:
            with storage.open_read(storage.join(parts[PIPELINE], WORKER_STATE)) as f:
                step = json.loads(f.read().decode("utf-8")).get("step")
            return step if isinstance(step, int) else None
        except (OSError, ValueError):
            return None
    return None


def recognize(storage: Storage, path: str) -> RollCheckpoint | None:
    """The ROLL checkpoint at ``path`` (whole or not: see its ``problems``), or ``None``."""
    entries = {e.name: e for e in storage.list(path)}
    if _ours(storage, entries):
        return None
    parts: dict[str, str] = {}
    if entries.get("dcp") is not None and entries["dcp"].is_dir:
        parts[ROOT_PART] = path
    for name, e in entries.items():
        if e.is_dir and name not in ("dcp", PIPELINE) and not name.startswith(".") and \
                storage.isdir(storage.join(e.path, "dcp")):
            parts[name] = e.path
    pipeline = entries.get(PIPELINE)
    if pipeline is not None and pipeline.is_dir:
        parts[PIPELINE] = pipeline.path
    hf_only = ROOT_PART not in parts and "config.json" in entries and any(n.endswith(".safetensors") for n in entries)
    legacy = sorted(n for n in entries if n.startswith(_LEGACY) and n.endswith(".pt"))
    if not parts and not hf_only and not legacy:
        return None
    step = _step(storage, path, parts)
    found = RollCheckpoint(storage, path, -1 if step is None else step, parts)
    if step is None:
        found.problems.append("its step is unknown: the folder is not named checkpoint-<N> and holds no "
                              f"{PIPELINE}/{WORKER_STATE}; rename it checkpoint-<N>")
    if legacy:
        found.problems.append(f"holds ROLL's older per-rank torch.save files ({legacy[0]}...): pickles that "
                              "roll-ckpt does not open; resume it with ROLL once, then save")
    if hf_only:
        found.problems.append("holds the actor's Hugging Face weights only (no dcp/: saved with save_only_model); "
                              f"load them with checkpoint_config.initial_load: {{path: {path}, format: hf}}")
    for name, folder in sorted(parts.items()):
        rel = "" if folder == path else f"{name}/"
        if name == PIPELINE:
            found.problems.extend(_pipeline_problems(storage, folder, rel))
            continue
        problems, md = _dcp_problems(storage, storage.join(folder, "dcp"), rel + "dcp/")
        if md is not None and any(k.startswith(_OURS_KEY) for k in md.state_dict_metadata):
            return None  # roll-ckpt's DCP keys: one of its saves that never committed
        found.problems.extend(problems)
        found.problems.extend(_safetensors_problems(storage, folder, rel))
    return found


def _ours(storage: Storage, entries: dict[str, Any]) -> bool:
    """roll-ckpt's folder (committed or not): its manifest or trainer state, its owner markers
    and temporary folders (dot names), in the folder or in a part's folder. ROLL writes none."""
    if _MANIFEST in entries or _TRAINER_STATE in entries or any(n.startswith(".") for n in entries):
        return True
    for e in entries.values():
        if e.is_dir and e.name != "dcp":
            inner = {c.name for c in storage.list(e.path)}
            if _MANIFEST in inner or _TRAINER_STATE in inner:
                return True
    return False


def _dcp_problems(storage: Storage, dcp: str, rel: str) -> tuple[list[str], Any]:
    """What keeps the DCP folder at ``dcp`` from being loaded, and its metadata (``None`` when unreadable)."""
    from roll_ckpt.plugin import dcp_folder_problems

    sizes = {e.name: e.size for e in storage.list(dcp) if not e.is_dir}
    if ".metadata" not in sizes:
        return [f"{rel}.metadata is missing: DCP never finished writing this part (or its upload was cut short)"], None
    problems, md = dcp_folder_problems(storage, dcp, sizes)
    return [f"{rel}{p}" for p in problems], md


def _safetensors_problems(storage: Storage, folder: str, rel: str) -> list[str]:
    """Each ``*.safetensors`` file whole by its own header; every shard its index names there."""
    sizes = {e.name: e.size for e in storage.list(folder) if not e.is_dir}
    return [f"{rel}{problem}" for problem in safetensors_problems(storage, folder, sizes)]


def _pipeline_problems(storage: Storage, folder: str, rel: str) -> list[str]:
    try:
        with storage.open_read(storage.join(folder, WORKER_STATE)) as f:
            body = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return [f"{rel}{WORKER_STATE} is missing: the driver never wrote its state for this step"]
    except (OSError, ValueError) as exc:
        return [f"{rel}{WORKER_STATE} is unreadable ({exc}): cut short?"]
    if not isinstance(body, dict) or not isinstance(body.get("step"), int):
        return [f"{rel}{WORKER_STATE} is not ROLL's WorkerState (no integer step)"]
    return []
