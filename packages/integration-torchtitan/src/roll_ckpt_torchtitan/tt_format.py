"""torchtitan's own checkpoints, as its default ``CheckpointManager`` writes them: recognized,
checked for completeness, described, resumed read-only.

Read from torchtitan 0.3.0 (:data:`TORCHTITAN_VERSION`; ``components/checkpointer/dcp.py``)::

    <dump_folder>/<checkpoint.folder>/step-<N>/         no run folders
        .metadata                                        DCP's, written last (.metadata.tmp, renamed)
        __<rank>_0.distcp                                one data file per rank, fsynced
      model keys at the top level (ModelWrapper's flat dict: ``tok_embeddings.weight``,
      ``layers.0.attention.qkv_linear.wq.weight``...), ``optimizer.state.<fqn>.<name>``,
      ``optimizer.param_groups.<fqn>.<name>``, ``lr_scheduler.last_epoch``,
      ``dataloader.dp_rank_<r>`` (a pickle), ``dataloader.world_size``,
      ``train_state.step``, ``train_state.ntokens_seen``
    step-<N>/ of a last step saved with ``last_save_model_only``: the model's keys alone (in
      ``export_dtype``); with ``last_save_in_hf``: Hugging Face safetensors
      (``model.safetensors[.index.json]``) instead of DCP
    step-0/: a seed checkpoint (``--checkpoint.create_seed_checkpoint``), the model alone;
      torchtitan loads step 0 as the model only

torchtitan takes a ``step-<N>`` folder holding ``.metadata`` as whole, and nothing marks a
finished save beyond that (a re-save of a step overwrites its files in place under the old
``.metadata``). :func:`recognize` checks what can be checked: ``.metadata`` present and
readable by roll-ckpt's restricted unpickler, every data file it names long enough for the
bytes it names there. No checksums: torchtitan writes none.

A model-only folder of a step other than 0 (the final save of a finished run) is whole but
not a training state: ``latest`` passes over it, naming it, and resumes from the newest full
checkpoint (torchtitan's own manager stops there on the missing keys). It loads as initial
weights (``--checkpoint.initial_load_path``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from roll_ckpt.plugin import CheckpointCorruptError, Storage, safetensors_problems

from .state_map import OWN_PREFIXES, model_only_keys

__all__ = ["TORCHTITAN_VERSION", "FOLDER_PATTERN", "TorchtitanCheckpoint", "recognize", "step_of"]

TORCHTITAN_VERSION = "0.3.0"
"""The torchtitan release this layout, and the manager contract of :mod:`roll_ckpt_torchtitan.manager`, were read from."""
FOLDER_PATTERN = r"^step-(\d+)$"
_HF_INDEX = "model.safetensors.index.json"
_OURS = ("manifest.json", "trainer_state.json", "dcp")
"""What a roll-ckpt checkpoint (committed or in progress, in place on an object store) holds; torchtitan's never."""


def step_of(path: str) -> int | None:
    m = re.match(FOLDER_PATTERN, path.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


@dataclass
class TorchtitanCheckpoint:
    """A ``step-<N>`` folder torchtitan wrote (a :class:`roll_ckpt.plugin.ForeignCheckpoint`)."""

    storage: Storage
    path: str
    step: int
    kind: str = "full"
    """``full`` (a training state), ``model`` (model-only DCP), ``hf`` (model-only safetensors)."""
    problems: list[str] = field(default_factory=list)
    not_resumable: str = ""
    """Why this whole folder is not a resume point (a model-only last step); empty when it is."""
    format: str = "torchtitan"
    title: str = "torchtitan checkpoint"
    keys: list[str] = field(default_factory=list)

    @property
    def model_only(self) -> bool:
        return self.kind != "full"

    def components(self) -> list[str]:
        return []

    def files(self) -> dict[str, int]:
        return {e.name: e.size for e in self.storage.list(self.path) if not e.is_dir}

    def describe(self) -> list[str]:
        if self.kind == "hf":
            return [f"model only, as Hugging Face safetensors: {', '.join(sorted(self.files()))}"]
        from roll_ckpt.plugin import read_dcp_metadata
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = read_dcp_metadata(self.storage, self.path)
        entries = md.state_dict_metadata
        model = {k: v for k, v in entries.items() if not k.startswith(OWN_PREFIXES)}
        numel = sum(int(v.size.numel()) for v in model.values() if isinstance(v, TensorStorageMetadata))
        dtypes = sorted({str(v.properties.dtype).replace("torch.", "") for v in model.values()
                         if isinstance(v, TensorStorageMetadata)})
        out = [f"model: {len(model)} entries, {numel:,} elements ({', '.join(dtypes)}), e.g. " +
               ", ".join(f"{k} {list(v.size)}" for k, v in list(model.items())[:3])]
        if self.kind == "model":
            out.append("model only (torchtitan's last_save_model_only, or a seed checkpoint at step 0)")
            return out
        state = [k for k in entries if k.startswith("optimizer.state.")]
        params = {k[len("optimizer.state."):].rsplit(".", 1)[0] for k in state}
        ranks = sorted(k[len("dataloader."):] for k in entries if k.startswith("dataloader.dp_rank_"))
        out.append(f"optimizer: {len(state)} state entries for {len(params)} parameters (by name)")
        small = {k: None for k in entries if k.startswith(("train_state.", "lr_scheduler.", "dataloader.world_size"))}
        try:
            from roll_ckpt.plugin import load_dcp

            load_dcp(small, self.storage, self.path)
        except Exception as exc:  # shown, not raised: inspect describes what it can
            small = {k: f"unreadable ({type(exc).__name__})" for k in small}
        out.append("train_state: " + ", ".join(f"{k[len('train_state.'):]} {v}" for k, v in sorted(small.items())
                                               if k.startswith("train_state.")))
        out.append(f"lr_scheduler: last_epoch {small.get('lr_scheduler.last_epoch')}")
        out.append(f"dataloader: {', '.join(ranks) or 'none'} (world_size {small.get('dataloader.world_size')}; "
                   "each a pickle, vetted before torchtitan's loader unpickles it)")
        return out

    def resume(self, state: Any, strategy: Any, component: str | None) -> dict[str, Any]:
        """Load it into ``state`` (the state :func:`roll_ckpt_torchtitan.state_map.roll_state`
        builds) on this process; a model-only folder (a seed at step 0) loads the model alone."""
        from .state_map import MODEL, load_torchtitan_folder

        if self.kind == "hf":
            raise CheckpointCorruptError(self.path, [(_HF_INDEX, "the model as Hugging Face safetensors: load it "
                                                      "with --checkpoint.initial_load_in_hf")])
        into = {MODEL: state[MODEL]} if self.model_only and MODEL in state else state
        load_torchtitan_folder(self.storage, self.path, into)
        out: dict[str, Any] = {"step": self.step, "format": "torchtitan", "model_only": self.model_only}
        train_state = state.get("train_state") if not self.model_only else None
        if train_state is not None:
            out["step"] = int(train_state.state_dict().get("step", self.step))
        return out


def recognize(storage: Storage, path: str) -> TorchtitanCheckpoint | None:
    """The torchtitan checkpoint at ``path`` (whole or not: see its ``problems``), or ``None``."""
    entries = {e.name: e for e in storage.list(path)}
    if any(name in entries for name in _OURS):
        return None  # roll-ckpt's (a save in progress writes dcp/ and trainer_state.json there)
    sizes = {name: e.size for name, e in entries.items() if not e.is_dir}
    distcp = [n for n in sizes if n.endswith(".distcp")]
    hf = [n for n in sizes if n.endswith(".safetensors")] + ([_HF_INDEX] if _HF_INDEX in sizes else [])
    if ".metadata" not in sizes and ".metadata.tmp" not in sizes and not distcp and not hf:
        return None
    step = step_of(path)
    found = TorchtitanCheckpoint(storage, path, -1 if step is None else step)
    if step is None:
        found.problems.append("its step is unknown: the folder is not named step-<N>; rename it step-<N>")
    if hf and not distcp and ".metadata" not in sizes:
        found.kind = "hf"
        found.problems.extend(safetensors_problems(storage, path, sizes))
        found.not_resumable = ("holds the model only, as Hugging Face safetensors (torchtitan's last_save_in_hf): "
                               "not a training state; load it with --checkpoint.initial_load_in_hf")
        return found
    problems, md = _dcp_problems(storage, path, sizes)
    found.problems.extend(problems)
    if md is not None:
        found.keys = list(md.state_dict_metadata)
        if model_only_keys(found.keys):
            found.kind = "model"
            if found.step != 0:
                found.not_resumable = (
                    "holds the model only (torchtitan's last_save_model_only: the last step of a finished run), not "
                    f"a training state; load it as initial weights with --checkpoint.initial_load_path {path}")
    return found


def _dcp_problems(storage: Storage, path: str, sizes: dict[str, int]) -> tuple[list[str], Any]:
    """What keeps the DCP folder from being loaded -- ``.metadata`` missing or refused, a data
    file it names missing or shorter than the bytes it names there -- and the metadata."""
    from roll_ckpt.plugin import dcp_folder_problems

    if ".metadata" not in sizes:
        return [".metadata is missing: torchtitan never finished writing this step (a save cut short)"], None
    return dcp_folder_problems(storage, path, sizes, cut_short_hint=" (a re-save of this step that never finished, "
                                                                   "under the old .metadata)")
