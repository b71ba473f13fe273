"""Export the module saved under one state key as a Hugging Face folder.

::

    DIR/model-00001-of-00003.safetensors ...   shards (or DIR/model.safetensors when one is enough)
    DIR/model.safetensors.index.json           {"metadata": {"total_size": N}, "weight_map": {name: file}}
    DIR/config.json, generation_config.json,   copied from ``hf_config`` when given
        tokenizer files

With the model's ``config.json`` (``hf_config``, or the checkpoint's own ``config.json``)
the folder is what ``save_pretrained`` writes for that model (:mod:`roll_ckpt.format.hub_layout`,
by transformers' own rules): the hub's names (an MoE layer's fused experts written one
tensor per expert), tied weights once, the same shards, ``total_parameters`` in the index.
Without it the names are the module's own (the DCP keys under the state key, without it),
tied weights under every name the state dict has.

Memory stays bounded by one shard: the shards are planned from DCP's metadata alone
(every tensor's shape and dtype is known without reading it), then each shard's tensors
are read -- a DCP load of just those keys, each reassembled into a full tensor from the
shards of however many ranks saved it -- converted, written and released before the
next shard is read. Everything is written into a temporary sibling folder that is
renamed into place at the end: a failed export leaves nothing that looks complete.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import RollCkptError, StorageError, StorageFullError, disk_full
from ..format.layout import DCP_DIR
from ..format.hf_files import INDEX_NAME, SINGLE_NAME, index_bytes, layout_of, write_shards
from ..runtime.units import human_bytes, parse_size

__all__ = ["HFExportReport", "export_hf", "plan_shards", "module_keys", "DTYPES", "INDEX_NAME", "SINGLE_NAME"]

DTYPES = ("bfloat16", "float16", "float32")
_CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "spiece.model",
                 "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json")
# What a folder replaced by overwrite=True may hold: a Hugging Face folder, nothing else.
_REPLACEABLE_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".tiktoken")


@dataclass(frozen=True)
class HFExportReport:
    """What :func:`export_hf` wrote."""

    checkpoint: str
    out: str
    step: int
    key: str
    tensors: int
    bytes: int
    """``metadata.total_size``: the bytes of every tensor written."""
    shards: list[str]
    component: str | None = None
    dtype: str = ""
    copied: list[str] = field(default_factory=list)
    """Files copied from ``hf_config``."""
    skipped: list[str] = field(default_factory=list)
    """Non-tensor entries of the module left out (safetensors holds tensors only)."""


def module_keys(md: Any, key: str, path: str) -> tuple[dict[str, str], list[str]]:
    """The tensors of the module saved under the state key ``key``: ``{name: DCP key}``
    (``name`` without the prefix), and the module's non-tensor entries (left out).

    A module's state dict is flat, so its DCP paths are ``(key, name)``; an optimizer's
    are deeper (``(key, "state", name, "exp_avg")``) and are refused, as is a key the
    checkpoint does not hold.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    planner_data = md.planner_data or {}
    tensors: dict[str, str] = {}
    skipped: list[str] = []
    deeper: list[str] = []
    for fqn, entry in md.state_dict_metadata.items():
        where = tuple(str(p) for p in planner_data.get(fqn, fqn.split(".", 1)))
        if where[0] != key:
            continue
        if len(where) != 2:
            deeper.append(fqn)
        elif isinstance(entry, TensorStorageMetadata):
            tensors[where[1]] = fqn
        else:
            skipped.append(where[1])
    if deeper:
        raise RollCkptError(f"{path}: state key '{key}' holds nested values ({deeper[0]}, ...), not a module's "
                            "parameters (an optimizer's state?); pass --key with the state key of the module")
    if not tensors:
        top = sorted({str(p[0]) for p in planner_data.values() if p} or
                     {k.split(".", 1)[0] for k in md.state_dict_metadata})
        raise RollCkptError(f"{path} holds no module under the state key '{key}'; its state keys are "
                            f"{', '.join(top)}: pass --key NAME (the key the module had in the saved state)")
    return tensors, sorted(skipped)


def plan_shards(sizes: Mapping[str, tuple[tuple[int, ...], Any]], max_shard_size: int) -> Any:
    """Hugging Face's own split (``huggingface_hub.split_torch_state_dict_into_shards``) of
    tensors known only by ``(shape, dtype)``: meta tensors carry the sizes, nothing is
    allocated. Returns its ``StateDictSplit`` (file names, which tensors go in each)."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in sizes.items()}
    return split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                              max_shard_size=max_shard_size)


def _check_out(out: str, overwrite: bool) -> None:
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise RollCkptError(f"--out {out} already exists; pass --overwrite to replace it, or choose another folder")
    if not os.path.isdir(out) or os.path.islink(out):
        raise RollCkptError(f"--out {out} exists and is not a folder; remove it or choose another --out")
    foreign = [e.name for e in os.scandir(out)
               if not e.is_file(follow_symlinks=False) or not e.name.endswith(_REPLACEABLE_SUFFIXES)]
    if foreign:
        raise RollCkptError(f"--out {out} holds {sorted(foreign)[0]!r}, which is not part of a Hugging Face "
                            "folder; --overwrite replaces only such folders: remove it yourself or choose "
                            "another --out")


def _config_files(hf_config: str | os.PathLike[str] | None) -> list[str]:
    if hf_config is None:
        return []
    src = os.fspath(hf_config)
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise RollCkptError(f"--hf-config {src}: no config.json there; give the folder of the model's "
                            "Hugging Face config (config.json, tokenizer files)")
    return [os.path.join(src, n) for n in sorted(os.listdir(src))
            if (n in _CONFIG_FILES or n.endswith(".tiktoken")) and os.path.isfile(os.path.join(src, n))]


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_configs(files: list[str], tmp: str, dtype: Any) -> list[str]:
    """Copy ``files`` into ``tmp``; ``config.json`` as ``save_pretrained`` writes it
    (:func:`~roll_ckpt.runtime.transformers_compat.as_saved`) and, with ``dtype`` (``--dtype``),
    saying it."""
    from ..runtime.transformers_compat import as_saved

    copied = []
    for src in files:
        name = os.path.basename(src)
        dst = os.path.join(tmp, name)
        config = None
        if name == "config.json":
            with open(src, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except ValueError as exc:
                    raise RollCkptError(f"--hf-config {src} is not valid JSON: {exc}") from None
        if config is not None and (dtype is not None or as_saved(config) is not config):
            config = as_saved(config)
            if dtype is not None:
                written = str(dtype).removeprefix("torch.")
                for k in [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]:
                    config[k] = written  # from_pretrained(dtype="auto") and vLLM read it
            with open(dst, "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2, sort_keys=True)
                f.write("\n")
        else:
            shutil.copyfile(src, dst)
        _fsync(dst)
        copied.append(name)
    return copied


def _write_shard(tensors: dict[str, Any], dst: str) -> None:
    from safetensors.torch import save_file

    try:
        save_file(tensors, dst, metadata={"format": "pt"})  # the metadata transformers checks for
    except OSError:
        raise
    except Exception as exc:  # safetensors' own error, which also carries the I/O errors of its writer
        if disk_full(exc):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst) from None
        raise RollCkptError(f"cannot write {os.path.basename(dst)} as safetensors: {exc}") from None
    _fsync(dst)


def _write_file(data: bytes, dst: str) -> None:
    with open(dst, "wb") as f:
        f.write(data)
    _fsync(dst)


def _put_in_place(tmp: str, out: str) -> None:
    """Rename the finished folder ``tmp`` to ``out`` (replacing an old one), durably.

    With an old folder, there is a moment between the two renames when ``out`` is
    missing; a crash then leaves the old folder as ``<out>.old-*`` and the new one as
    ``<out>.tmp-*``, neither under the name ``out``."""
    parent = os.path.dirname(os.path.abspath(out))
    _fsync(tmp)
    old = None
    if os.path.lexists(out):
        old = f"{out}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    os.rename(tmp, out)
    _fsync(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_hf(path: str, out: str | os.PathLike[str], *, component: str | None = None, key: str = "model",
              dtype: str | None = None, max_shard_size: str | int = "5GB",
              hf_config: str | os.PathLike[str] | None = None, overwrite: bool = False,
              type: str = "file_system", storage_options: Mapping[str, Any] | None = None,
              quiet: bool = False, notes: Callable[[str], None] | None = None) -> HFExportReport:
    """Write the module saved under ``key`` in the checkpoint at ``path`` as a Hugging Face folder ``out``.

    ``path`` is a ``checkpoint-<step>`` folder (local path or fsspec URL; ``type`` and
    ``storage_options`` as in ``checkpoint_config``), or a step made of components with
    ``component`` naming the part. The checkpoint is verified against its manifest
    first. ``dtype`` (``bfloat16``, ``float16``, ``float32``) converts floating tensors;
    by default they keep the dtype they were saved in. ``max_shard_size`` (``"5GB"``,
    ``"500MB"``, bytes) bounds each file and the memory the export holds. ``hf_config``
    names a folder whose ``config.json``, ``generation_config.json`` and tokenizer files
    are copied. An existing ``out`` is refused unless ``overwrite``. ``notes`` receives
    remarks for the user (e.g. a part of a step that is not committed).
    """
    from ..runtime.progress import progress

    out = os.fspath(out)
    if "://" in out:
        raise RollCkptError(f"--out {out}: the Hugging Face export writes a local folder; copy it to the store "
                            "afterwards")
    out = os.path.normpath(out)  # "DIR/" and "DIR" name one folder, whose sibling is the temporary one
    if dtype is not None and dtype not in DTYPES:
        raise RollCkptError(f"--dtype {dtype}: not a dtype the export writes; choose one of {', '.join(DTYPES)}")
    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as exc:
        raise RollCkptError(f"--max-shard-size: {exc}") from None
    _check_out(out, overwrite)
    configs = _config_files(hf_config)

    from ..format.targets import resolve  # a step made of components: its part, checked against the step
    from ..dcp.reader import SafeReader
    from ..load.export import read_full_tensors, require_tensors
    from ..tiers.run import open_storage
    from ..plugins import get_plugins
    from ..format.verify import read_manifest, verify

    storage = open_storage(get_plugins(), type, path, dict(storage_options or {}))
    target, note = resolve(storage, storage.root, component)
    if note and notes is not None:
        notes(note)
    manifest = read_manifest(storage, target)
    require_tensors(manifest, target)
    with progress("verify", sum(e.size for e in manifest.files.values()), enabled=not quiet) as on_bytes:
        manifest = verify(storage, target, on_bytes=on_bytes).manifest
    dcp_dir = storage.join(target, DCP_DIR)
    md = SafeReader(storage, dcp_dir, checkpoint=target).read_metadata()
    names, skipped = module_keys(md, key, target)

    import torch

    out_dtype = getattr(torch, dtype) if dtype else None
    sizes = {name: (tuple(md.state_dict_metadata[fqn].size), md.state_dict_metadata[fqn].properties.dtype)
             for name, fqn in names.items()}
    layout = layout_of(_model_config(configs, storage, target), sizes, shard_bytes, out_dtype)
    plan = layout.plan
    saved = {md.state_dict_metadata[k].properties.dtype for k in names.values()}
    saved = {d for d in saved if d.is_floating_point}
    written = out_dtype or (saved.pop() if len(saved) == 1 else None)  # for the report
    read_total = sum(info.length for idx, info in md.storage_data.items() if idx.fqn in set(names.values()))
    tmp = f"{out}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(tmp)
        with progress("export", read_total, enabled=not quiet) as on_bytes:
            reader = SafeReader(storage, dcp_dir, on_bytes, checkpoint=target)

            def read(module_keys: list[str]) -> dict[str, Any]:
                full = read_full_tensors(reader, md, [names[n] for n in module_keys], target)
                return {n: full.pop(names[n]) for n in module_keys}

            write_shards(layout, read, lambda filename, tensors: _write_shard(tensors, os.path.join(tmp, filename)),
                         out_dtype)
        index = index_bytes(layout)
        if index is not None:
            _write_file(index, os.path.join(tmp, INDEX_NAME))
        copied = _copy_configs(configs, tmp, out_dtype)  # config.json says what --dtype wrote
        _put_in_place(tmp, out)
    except OSError as exc:
        if disk_full(exc):
            raise StorageFullError(f"no space left on the device of {out} while exporting "
                                   f"{human_bytes(plan.metadata['total_size'])}; nothing was left there: free "
                                   "space or choose another --out") from None
        raise StorageError(f"cannot export to {out}: {exc.strerror or exc}; nothing was left there") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the export succeeded
    return HFExportReport(checkpoint=target, out=out, step=manifest.step, key=key, tensors=len(layout.hub),
                          bytes=plan.metadata["total_size"], shards=list(plan.filename_to_tensors),
                          component=manifest.component, dtype=str(written or "").removeprefix("torch."),
                          copied=copied, skipped=skipped)


def _model_config(configs: list[str], storage: Any, target: str) -> Any:
    """The transformers config the hub's layout is taken from: ``--hf-config``'s
    ``config.json``, else the checkpoint's own ``config.json``; ``None`` (names kept as
    saved) when there is neither, or transformers is not installed."""
    import tempfile

    src = next((f for f in configs if os.path.basename(f) == "config.json"), None)
    own = storage.join(target, "config.json")  # the checkpoint's own Hugging Face files (hf_weights)
    if src is None and not storage.exists(own):
        return None  # transformers is not imported: it costs ~45 MiB of RSS for nothing here
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    if src is not None:
        return AutoConfig.from_pretrained(os.path.dirname(src))
    with tempfile.TemporaryDirectory() as tmp, storage.open_read(own) as f:
        with open(os.path.join(tmp, "config.json"), "wb") as out:
            out.write(f.read())
        return AutoConfig.from_pretrained(tmp)
