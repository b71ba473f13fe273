"""verl's own checkpoints, as verl 0.9's FSDP checkpoint manager writes them: recognized, checked
for completeness, described, resumed (read-only; :mod:`roll_ckpt_verl.migrate` loads them).

Read from verl 0.9.1 (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``: ``save_checkpoint``;
``checkpoint_handler.py``; ``trainer/ppo/ray_trainer.py``: ``_save_checkpoint``)::

    <trainer.default_local_dir>/
        latest_checkpointed_iteration.txt         the step verl resumes from (resume_mode: auto)
        global_step_<N>/                          SFT (CheckpointHandler): the step folder is the part
            model_world_size_<W>_rank_<r>.pt      each rank's torch.save of model.state_dict(): DTensor shards
            optim_world_size_<W>_rank_<r>.pt      each rank's optimizer.state_dict() (state by position)
            extra_state_world_size_<W>_rank_<r>.pt  {"lr_scheduler": ..., "rng": {cpu, numpy, random[, cuda]}}
            fsdp_config.json                      {"FSDP_version": 2, "world_size": W}: rank 0, after its files
            huggingface/                          config, tokenizer (+ the weights with hf_model)
            data_<dp>.pt                          the handler's dataloader state, per data-parallel rank
        global_step_<N>/actor/, critic/           PPO (the trainer): one part per role, each as above
        global_step_<N>/data.pt                   the trainer's dataloader state, written after every role's

Nothing marks a finished save: :func:`recognize` checks what can be checked without reading
tensor data -- ``fsdp_config.json``, every rank's file of each kind present, each a whole
``torch.save`` archive (its zip directory, written last, is there). No checksums: verl writes none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from roll_ckpt.plugin import RollCkptError, Storage, human_bytes, torch_file_problem

from .layout import DATA, FOLDER_PATTERN, FSDP_CONFIG, HF_DIR, KINDS, rank_file

__all__ = ["VerlCheckpoint", "recognize"]

_RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
_DATA_FILE = re.compile(r"^data(_\d+)?\.pt$")
_OURS = ("manifest.json", "trainer_state.json")


@dataclass
class VerlCheckpoint:
    """A ``global_step_<N>`` folder verl wrote (a :class:`roll_ckpt.plugin.ForeignCheckpoint`)."""

    storage: Storage
    path: str
    step: int
    parts: dict[str, str]
    """Role -> its folder (``actor``, ``critic``: the PPO trainer's); ``""`` -> the step folder
    itself, for the SFT handler's checkpoints (one part, no roles)."""
    world_sizes: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    format: str = "verl"
    title: str = "verl checkpoint"

    def components(self) -> list[str]:
        return sorted(k for k in self.parts if k)

    def files(self) -> dict[str, int]:
        return _tree(self.storage, self.path)

    def describe(self) -> list[str]:
        from .migrate import describe_part

        lines = []
        for name in sorted(self.parts):
            folder = self.parts[name]
            lines.append(f"part {name or '(the step folder: a CheckpointHandler save)'}" +
                         (f" ({name}/):" if name else ":"))
            lines.extend(f"  {line}" for line in describe_part(self.storage, folder, self.world_sizes.get(name)))
        root = {e.name: e.size for e in self.storage.list(self.path) if not e.is_dir}
        data = sorted(n for n in root if _DATA_FILE.match(n))
        lines.append(f"dataloader state: {', '.join(f'{n} ({human_bytes(root[n])})' for n in data) or 'none'} "
                     "(loaded by verl's trainer or handler, not by the checkpoint manager)")
        return lines

    def resume(self, state: Any, strategy: Any, component: str | None) -> dict[str, Any]:
        """Load ``component``'s part (``None``: the SFT handler's step folder) into ``state``
        on this process, resharded to its world size."""
        from roll_ckpt.plugin import CheckpointNotFoundError

        from .migrate import load_part

        key = component or ""
        folder = self.parts.get(key)
        if folder is None:
            held = ", ".join(self.components())
            if component is None and held:
                raise CheckpointNotFoundError(
                    f"{self.path} is a step of verl's PPO trainer with one part per role ({held}): resume a role's "
                    f"part, {self.path}/{self.components()[0]}, with that role's manager")
            raise CheckpointNotFoundError(f"{self.path} (a verl checkpoint) has no part for '{component}': it holds "
                                          f"{held or 'one part, the step folder itself (a CheckpointHandler save)'}")
        where = f"{folder} (verl)"
        world = self.world_sizes.get(key)
        if world is None:
            raise RollCkptError(f"{where}: {FSDP_CONFIG} names no world size")
        read = load_part(self.storage, folder, world, state, where, rank=int(strategy.rank),
                         world_size=int(strategy.world_size))
        return {"step": self.step, "format": "verl", "component": component, "world_size_saved": world, **read}


def _tree(storage: Storage, root: str, prefix: str = "") -> dict[str, int]:
    out: dict[str, int] = {}
    for e in storage.list(root):
        if e.is_dir:
            out.update(_tree(storage, e.path, f"{prefix}{e.name}/"))
        else:
            out[f"{prefix}{e.name}"] = e.size
    return out


def _verl_files(names: Any) -> bool:
    return FSDP_CONFIG in names or any(_RANK_FILE.match(n) for n in names)


def _ours(names: Any) -> bool:
    """roll-ckpt's folder (committed or not: its manifest, trainer state, markers, temporary
    folders -- dot names, which verl never writes)."""
    return any(n in _OURS or n.startswith(".") for n in names)


def recognize(storage: Storage, path: str) -> VerlCheckpoint | None:
    """The verl checkpoint at ``path`` (whole or not: see its ``problems``), or ``None``."""
    entries = {e.name: e for e in storage.list(path)}
    if _ours(entries):
        return None
    parts: dict[str, str] = {}
    if _verl_files(entries):
        parts[""] = path
    for name, e in entries.items():
        if not e.is_dir or name == HF_DIR:
            continue
        inner = [c.name for c in storage.list(e.path)]
        if _ours(inner):
            return None  # a part roll-ckpt wrote: the step is roll-ckpt's
        if _verl_files(inner):
            parts[name] = e.path
    if not parts:
        return None
    m = re.match(FOLDER_PATTERN, path.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1])
    found = VerlCheckpoint(storage, path, int(m.group(1)) if m else -1, parts)
    if not m:
        found.problems.append("its step is unknown: verl takes it from the folder's name, global_step_<N>; "
                              "rename the folder")
    if "" in parts and len(parts) > 1:
        found.problems.append(f"holds a part at the step folder and in {', '.join(found.components())}/: not a "
                              "layout verl writes")
    for name, folder in sorted(parts.items()):
        rel = f"{name}/" if name else ""
        world, problems = _part_problems(storage, folder, rel)
        found.problems.extend(problems)
        if world is not None:
            found.world_sizes[name] = world
    for name, e in sorted(entries.items()):
        if not e.is_dir and _DATA_FILE.match(name):
            problem = torch_file_problem(storage, e.path, e.size)
            if problem:
                found.problems.append(f"{name} {problem}")
    return found


def _part_problems(storage: Storage, folder: str, rel: str) -> tuple[int | None, list[str]]:
    """The world size a part was saved at, and what keeps it from being resumed."""
    sizes = {e.name: e.size for e in storage.list(folder) if not e.is_dir}
    try:
        with storage.open_read(storage.join(folder, FSDP_CONFIG)) as f:
            body = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None, [f"{rel}{FSDP_CONFIG} is missing: verl writes it after every rank's files, so this save never "
                      "finished"]
    except (OSError, ValueError) as exc:
        return None, [f"{rel}{FSDP_CONFIG} is unreadable ({exc}): cut short?"]
    world = body.get("world_size") if isinstance(body, dict) else None
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        return None, [f"{rel}{FSDP_CONFIG} names no world size ({body!r})"]
    out = []
    if body.get("FSDP_version") != 2:
        out.append(f"{rel}: written by verl's FSDP{body.get('FSDP_version')} engine (strategy: fsdp), whose sharded "
                   "state dicts roll-ckpt does not read; it reads the FSDP2 engine's (strategy: fsdp2). Resume it "
                   "with verl's own manager (VERL_ENGINE_VENDOR unset)")
    kinds = {k for k in KINDS for n in sizes if n.startswith(f"{k}_world_size_{world}_rank_")}
    if "model" not in kinds:
        out.append(f"{rel}holds no model_world_size_{world}_rank_<r>.pt files (saved without 'model' in save_contents)")
    for kind in KINDS:
        if kind not in kinds:
            continue
        for r in range(world):
            name = rank_file(kind, world, r)
            if name not in sizes:
                out.append(f"{rel}{name} is missing ({FSDP_CONFIG} says {world} ranks saved)")
                continue
            problem = torch_file_problem(storage, storage.join(folder, name), sizes[name])
            if problem:
                out.append(f"{rel}{name} {problem}")
    return world, out
