"""Writing a module's tensors as Hugging Face safetensors shards, in the hub's layout
(:mod:`roll_ckpt.format.hub_layout`), one shard in memory at a time.

Shared by ``roll-ckpt export --format hf`` (:mod:`roll_ckpt.hf.export`, a local folder) and
the Hugging Face folder inside a checkpoint (:mod:`roll_ckpt.hf.export`, any backend):
the caller says how to read module tensors and where each shard goes.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Callable, Mapping

from .hub_layout import HubLayout, hub_layout, identity_layout, meta_model

__all__ = ["INDEX_NAME", "SINGLE_NAME", "layout_of", "write_shards", "index_bytes", "shard_bytes", "safetensors_problems"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def layout_of(model_or_config: Any, sizes: Mapping[str, tuple[tuple[int, ...], Any]], max_shard_size: int,
              out_dtype: Any = None) -> HubLayout:
    """The hub's layout of ``sizes`` (module key -> (shape, saved dtype)) for a transformers
    model or config; the identity layout for ``None``. ``out_dtype`` converts floating tensors."""
    if out_dtype is not None:
        sizes = {k: (shape, out_dtype if dtype.is_floating_point else dtype) for k, (shape, dtype) in sizes.items()}
    if model_or_config is None:
        return identity_layout(sizes, max_shard_size)
    return hub_layout(meta_model(model_or_config), sizes, max_shard_size)


def write_shards(layout: HubLayout, read: Callable[[list[str]], dict[str, Any]], put: Callable[[str, dict], None],
                 out_dtype: Any = None) -> None:
    """For each shard of ``layout.plan``: ``read(module keys)`` (full CPU tensors), converted
    to the hub's form (and to ``out_dtype``), handed to ``put(file name, {hub name: tensor})``."""
    for filename, names in layout.plan.filename_to_tensors.items():
        module = read(layout.sources(names))
        if out_dtype is not None:
            module = {k: t.to(out_dtype) if t.is_floating_point() else t for k, t in module.items()}
        hub = layout.to_hub(module)
        del module
        put(filename, {n: hub[n].contiguous() for n in names})
        del hub  # one shard in memory at a time


def index_bytes(layout: HubLayout) -> bytes | None:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it; ``None`` for one file."""
    plan = layout.plan
    if not plan.is_sharded:
        return None
    metadata: dict[str, Any] = dict(plan.metadata)
    if layout.total_parameters is not None:
        metadata["total_parameters"] = layout.total_parameters
    index = {"metadata": metadata, "weight_map": dict(plan.tensor_to_filename)}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def shard_bytes(tensors: dict[str, Any]) -> bytes:
    """One shard's safetensors bytes, with the metadata transformers checks for."""
    from safetensors.torch import save

    return save(tensors, metadata={"format": "pt"})


def safetensors_problems(storage: Any, folder: str, sizes: Mapping[str, int]) -> list[str]:
    """What makes the Hugging Face weights of ``folder`` incomplete (``sizes``: its files' names
    and sizes, as listed): a ``*.safetensors`` file without a readable header or shorter than its
    header says, and a shard that ``model.safetensors.index.json`` names but the folder lacks.
    Names relative to ``folder``; empty when every file is whole. Another framework's checkpoint
    (a format plugin's) is judged by it before it is called whole."""
    from ..runtime.units import human_bytes

    out = []
    for name, size in sorted(sizes.items()):
        if not name.endswith(".safetensors"):
            continue
        try:
            with storage.open_read(storage.join(folder, name)) as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                header = json.loads(f.read(n)) if 0 < n < (100 << 20) else None
        except (OSError, ValueError, struct.error):
            header = None
        if not isinstance(header, dict):
            out.append(f"{name} has no readable safetensors header (cut short?)")
            continue
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if size < 8 + n + end:
            out.append(f"{name} is cut short: {human_bytes(size)} of {human_bytes(8 + n + end)}")
    if INDEX_NAME in sizes:
        try:
            with storage.open_read(storage.join(folder, INDEX_NAME)) as f:
                shards = set(json.loads(f.read())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return out + [f"{INDEX_NAME} is unreadable ({exc})"]
        out.extend(f"{s} is missing ({INDEX_NAME} names it)" for s in sorted(shards - set(sizes)))
    return out
