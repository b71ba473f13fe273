"""Hugging Face folders as initial weights (``checkpoint_config.initial_load``).

A fresh start (no checkpoint to resume from) loads a Hugging Face folder --
``model.safetensors``, or shards listed by ``model.safetensors.index.json`` -- into the
module ``state[key]``, plain or FSDP2, on any number of processes:

1. the coordinator reads the folder's index and every file's header (no tensor data)
   and checks them against each other and against the module, with the checks of a
   resume: missing and unexpected names, shapes. Its verdict (the layout, or the
   error) reaches every process, so all of them raise the same error or none does;
2. each process reads, through ``safe_open(...).get_slice``, only the slice of each
   tensor its own shard holds (for a DTensor: the offsets its placements give) and
   copies it into the live tensor, converting the dtype to the module's. Nothing but one
   slice at a time is allocated; no collective is needed.

A transformers model's tensors may be in the hub's layout (:mod:`roll_ckpt.format.hub_layout`): an
MoE layer's experts one tensor each, as ``save_pretrained`` and published checkpoints have
them, where the module holds them fused. Such a module tensor is assembled by transformers'
own conversion rules from the hub tensors holding part of this process's slice (the fused
tensor is built whole, one at a time, then sliced: memory of one fused tensor, plus its
index); a folder in the module's own layout is read as it is.

Tied weights (``lm_head.weight`` and the input embeddings) are one tensor under several
names: a folder holding any of the names loads it (``save_pretrained`` writes one; ``roll-ckpt
export`` writes all, equal). A folder holding several that differ was saved from an untied
model and is refused.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import CheckpointCorruptError, CheckpointNotFoundError, RollCkptError
from ..format.hf_files import INDEX_NAME, SINGLE_NAME

__all__ = ["HFFolder", "HFLoadReport", "read_hf_folder", "check_against", "check_tied", "load_hf", "load_initial",
           "module_layout", "present"]

log = logging.getLogger("roll_ckpt")

_SHOWN = 5  # names listed in one error line


@dataclass(frozen=True)
class HFFolder:
    """What a Hugging Face folder holds, from its index and its files' headers."""

    path: str
    files: dict[str, str]
    """Tensor name -> the file holding it (a name inside ``path``)."""
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    """safetensors' dtype names (``F32``, ``BF16``...)."""


@dataclass(frozen=True)
class HFLoadReport:
    path: str
    key: str
    tensors: int
    """Distinct tensors loaded (tied names count once)."""
    bytes_read: int
    """Bytes this process read: its slices only."""
    converted: dict[str, str] = field(default_factory=dict)
    """Names whose dtype was converted, with ``"<file dtype> -> <module dtype>"``."""


def _listed(names: list[str]) -> str:
    more = f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _header(path: str, name: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    except FileNotFoundError:
        raise
    except Exception as exc:  # safetensors' own error: a truncated file, a damaged header
        raise CheckpointCorruptError(path, [(name, f"is not a readable safetensors file ({exc})")]) from None
    return shapes, dtypes


def read_hf_folder(path: str) -> HFFolder:
    """Read the layout of the Hugging Face folder ``path`` and check its index against its files.

    A single ``model.safetensors`` is taken as it is (Hugging Face prefers it too);
    otherwise every shard the index names must exist and hold exactly the names the
    index maps to it.
    """
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"initial_load.path {path}: no such folder")
    if os.path.isfile(os.path.join(path, SINGLE_NAME)):
        shapes, dtypes = _header(path, SINGLE_NAME)
        return HFFolder(path, dict.fromkeys(shapes, SINGLE_NAME), shapes, dtypes)
    index_path = os.path.join(path, INDEX_NAME)
    if not os.path.isfile(index_path):
        pickled = [n for n in sorted(os.listdir(path)) if n.endswith((".bin", ".pt", ".pth"))]
        why = (f"it holds only pickled weights ({pickled[0]}), which roll-ckpt does not unpickle: save them as "
               "safetensors (save_pretrained(..., safe_serialization=True))") if pickled else \
            "it is not a Hugging Face model folder"
        raise CheckpointNotFoundError(f"{path} has neither {SINGLE_NAME} nor {INDEX_NAME}: {why}")
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise ValueError("weight_map is not a mapping of names to file names")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(path, [(INDEX_NAME, f"is not a valid index ({exc})")]) from None
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    bad = [f for f in by_file if os.path.basename(f) != f or f in (".", "..")]
    if bad:
        raise CheckpointCorruptError(path, [(INDEX_NAME, f"names a file outside the folder: {bad[0]!r}")])
    missing = sorted(f for f in by_file if not os.path.isfile(os.path.join(path, f)))
    if missing:
        raise CheckpointCorruptError(path, [(INDEX_NAME, f"names {len(missing)} shard(s) the folder does not "
                                                         f"have: {_listed(missing)}")])
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    faults = []
    for file, names in sorted(by_file.items()):
        got_shapes, got_dtypes = _header(path, file)
        absent = sorted(set(names) - set(got_shapes))
        if absent:
            faults.append((file, f"lacks {_listed(absent)}, which the index maps to it"))
        unlisted = sorted(set(got_shapes) - set(names))
        if unlisted:
            faults.append((file, f"holds {_listed(unlisted)}, which the index does not map to it"))
        shapes.update({k: v for k, v in got_shapes.items() if k in weight_map})
        dtypes.update({k: v for k, v in got_dtypes.items() if k in weight_map})
    if faults:
        raise CheckpointCorruptError(path, faults)
    return HFFolder(path, dict(weight_map), shapes, dtypes)


def _tied_groups(module: Any, names: list[str]) -> list[list[str]]:
    """``names`` (the module's state dict) grouped by the tensor they name: tied weights
    form one group, in the module's order (the input embeddings before ``lm_head``)."""
    ids: dict[str, int] = {}
    for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        ids.setdefault(n, id(t))
    groups: dict[Any, list[str]] = {}
    for n in names:
        groups.setdefault(ids.get(n, n), []).append(n)
    return list(groups.values())


def _hub_names(layout: Any, name: str) -> list[str]:
    """The names ``name`` (a module key) may have in a folder: its own, or the hub's it
    becomes by transformers' conversion rules (:mod:`roll_ckpt.format.hub_layout`)."""
    outs = layout.outputs.get(name) if layout is not None else None
    return outs if outs and outs != [name] else []


def present(folder: HFFolder, name: str, layout: Any = None) -> str | None:
    """How the folder holds module key ``name``: ``"own"`` (its own name), ``"hub"`` (every
    name the hub's layout gives it), or ``None``."""
    if name in folder.files:
        return "own"
    hub = _hub_names(layout, name)
    return "hub" if hub and all(h in folder.files for h in hub) else None


def check_against(folder: HFFolder, targets: Mapping[str, Any], groups: list[list[str]], key: str,
                  layout: Any = None, architecture: str | None = None) -> None:
    """Raise, naming the keys, when the folder and the module do not match (names, shapes).
    With ``layout`` (a transformers model's), a tensor may be in the hub's layout (an MoE
    layer's experts one tensor each, as ``save_pretrained`` writes them) or in the module's."""
    where = f"initial_load: {folder.path} does not fit state['{key}']"
    missing = [g[0] for g in groups if not any(present(folder, n, layout) for n in g)]
    known = set(targets) | {h for n in targets for h in _hub_names(layout, n)}
    unexpected = sorted(n for n in folder.files if n not in known)
    if missing or unexpected:
        parts = ([f"missing {len(missing)} key(s) (the module's, not in the folder): {_listed(missing)}"]
                 if missing else []) + \
                ([f"unexpected {len(unexpected)} key(s) (the folder's, not in the module): {_listed(unexpected)}"]
                 if unexpected else [])
        arch = architecture or (layout.architecture if layout is not None else None)
        arch = f" ({arch})" if arch else ""
        raise RollCkptError(f"{where}{arch}: {'; '.join(parts)}; load the folder saved from this model's architecture")
    wrong = [f"'{n}' is {list(folder.shapes[n])} in {folder.files[n]}, the module's is {list(targets[n].shape)}"
             for n in folder.files if n in targets and tuple(targets[n].shape) != folder.shapes[n]]
    if layout is not None:
        wrong += [f"'{h}' is {list(folder.shapes[h])} in {folder.files[h]}, the hub's layout of the module gives "
                  f"{list(layout.hub[h][0])}" for n in targets if n not in folder.files
                  for h in _hub_names(layout, n) if h in folder.shapes and folder.shapes[h] != tuple(layout.hub[h][0])]
    if wrong:
        more = f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise RollCkptError(f"{where}: shape mismatch: {'; '.join(wrong[:3])}{more}; load the folder saved from "
                            "a model of this configuration")


def check_tied(folder: HFFolder, groups: list[list[str]], key: str, chunk_bytes: int = 64 << 20) -> None:
    """Raise when the folder holds several names of one tied tensor with different values
    (a folder saved from an untied model): loading it would keep one and drop the other.
    Compared a block of rows at a time, so an embedding never needs two full copies."""
    import torch
    from safetensors import safe_open

    for names in groups:
        present = [n for n in names if n in folder.files]
        for other in present[1:]:
            first = present[0]
            shape = folder.shapes[first]
            with safe_open(os.path.join(folder.path, folder.files[first]), framework="pt") as a, \
                    safe_open(os.path.join(folder.path, folder.files[other]), framework="pt") as b:
                if not shape:  # one value
                    same = torch.equal(a.get_tensor(first), b.get_tensor(other))
                else:
                    rows = max(1, chunk_bytes // max(1, 4 * math.prod(shape[1:])))
                    same = all(torch.equal(a.get_slice(first)[i:i + rows], b.get_slice(other)[i:i + rows])
                               for i in range(0, shape[0], rows))
            if not same:
                raise RollCkptError(
                    f"initial_load: '{first}' and '{other}' are one tensor in state['{key}'] (tied weights) "
                    f"but differ in {folder.path}: it was saved from an untied model; load it into a model "
                    "configured without tie_word_embeddings")


def load_hf(module: Any, folder: HFFolder, key: str = "model",
            on_bytes: Callable[[int], None] | None = None, layout: Any = None) -> HFLoadReport:
    """Copy the tensors of ``folder`` into ``module`` in place, this process reading only its slices.

    The folder must have been checked against the module (:func:`check_against`). A tensor
    the folder holds in the hub's layout (``layout``) is assembled by transformers' rules
    from the hub tensors that hold part of this process's slice.
    """
    import contextlib

    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ..runtime.torch_compat import local_chunk, local_tensor

    targets = get_model_state_dict(module)  # the live tensors (this process's shards of DTensors)
    groups = _tied_groups(module, list(targets))
    read = 0
    converted: dict[str, str] = {}
    with torch.no_grad(), contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def opened(file: str) -> Any:
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(os.path.join(folder.path, file), framework="pt"))
            return handles[file]

        for group in groups:
            name = group[0]
            src = next((n for n in group if n in folder.files), None)  # a tied tensor: its first name
            target = targets[name]
            local = local_tensor(target)
            rows = None
            if local is not target:  # a DTensor: this process's shard only
                offsets, sizes = local_chunk(target)
                if 0 in sizes:
                    continue
                rows = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            if src is not None:
                f = opened(folder.files[src])
                data = f.get_slice(src)[rows] if rows is not None else f.get_tensor(src)
                dtype = folder.dtypes[src]
            else:
                hub = next(n for n in group if present(folder, n, layout) == "hub")
                data = layout.assemble(hub, lambda h: opened(folder.files[h]).get_tensor(h), rows)
                dtype = folder.dtypes[layout.outputs[hub][0]]
            if data.dtype != local.dtype:
                converted[name] = f"{dtype} -> {str(local.dtype).removeprefix('torch.')}"
            local.copy_(data.reshape(local.shape))
            nbytes = data.numel() * data.element_size()
            read += nbytes
            if on_bytes is not None:
                on_bytes(nbytes)
            del data
    return HFLoadReport(folder.path, key, len(groups), read, converted)


def module_layout(module: Any, targets: Mapping[str, Any]) -> Any:
    """The hub's layout of a transformers model's state dict (``None`` for other modules)."""
    from ..format.hub_layout import transformers_model

    if transformers_model(module) is None:
        return None
    from ..format.hf_files import layout_of

    sizes = {k: (tuple(t.shape), t.dtype) for k, t in targets.items()}
    return layout_of(module, sizes, 5 << 30)


def load_initial(state: Mapping[str, Any], initial: Any, strategy: Any,
                 progress: Callable[..., Any]) -> HFLoadReport:
    """``checkpoint_config.initial_load`` into ``state``: checked by the coordinator, read by every process."""
    import torch

    from ..runtime.distributed import decide

    key = initial.key
    module = state.get(key)
    if not isinstance(module, torch.nn.Module):
        held = ", ".join(repr(k) for k in state) or "nothing"
        what = "has no such key" if key not in state else f"holds a {type(module).__name__}, not a torch.nn.Module"
        raise RollCkptError(f"checkpoint_config.initial_load.key '{key}': the state {what} (it holds {held}); "
                            "set initial_load.key to the module's state key, or leave initial_load out of the "
                            "config of processes whose state holds no such module (a driver component)")
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ..format.hub_layout import architecture_name, transformers_model

    targets = get_model_state_dict(module)  # on every process: no rank calls into torch.distributed alone
    groups = _tied_groups(module, list(targets))

    def check() -> HFFolder:
        folder = read_hf_folder(initial.path)
        layout = module_layout(module, targets) if any(n not in folder.files for n in targets) else None
        check_against(folder, targets, groups, key, layout,
                      architecture_name(module) if transformers_model(module) is not None else None)
        check_tied(folder, groups, key)
        return folder

    folder = decide(strategy, check, where=f"cannot read the initial weights at {initial.path}")
    layout = module_layout(module, targets) if any(n not in folder.files for n in targets) else None
    with progress("initial load") as bar:
        report = load_hf(module, folder, key, on_bytes=bar, layout=layout)
    log.info("roll-ckpt: no checkpoint to resume from; loaded the initial weights of state['%s'] from %s "
             "(%d tensors%s)", key, initial.path, report.tensors,
             f", {len(report.converted)} converted to the module's dtype" if report.converted else "")
    return report
