"""roll-ckpt's one exporter: full tensors read out of a checkpoint (:func:`read_full_tensors`,
through the DCP I/O, never the resume path) and written as a Hugging Face folder
(:func:`export_hf`), as one safetensors file (:func:`export_safetensors`), or as the folder
every checkpoint carries (:class:`HFPart`, written by the save's commit).

**A Hugging Face folder.** Export the module saved under one state key as a Hugging Face folder.

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

**One safetensors file.** Export a checkpoint as one safetensors file of full (unsharded) tensors.

A DCP checkpoint is split by rank and read through ``torch.distributed``; a safetensors
file opens anywhere (inference servers, the Hugging Face stack) and holds no pickle.
The export runs in one process without a process group: DCP reassembles every shard
into a full tensor from the checkpoint's metadata alone, so a checkpoint written by 64
FSDP2 ranks exports on a laptop (memory permitting: every exported tensor is held at
once).

The checkpoint is verified against its manifest first; ``.metadata`` is only ever
unpickled by :func:`roll_ckpt.dcp.checked.safe_load_metadata`, and non-tensor entries
(learning rates, RNG states kept as objects, ...) are never read at all.

A step made of components is exported one part at a time: give the part's folder
(``checkpoint-<step>/<component>``; ``roll-ckpt export --component`` finds it and checks it
against the step's manifest). A part saved by the ``json`` strategy holds no tensors.

**The folder inside every checkpoint.** The model as a Hugging Face folder inside every checkpoint (``checkpoint_config.hf_weights``,
``save_only_model``), written off the training loop.

::

    checkpoint-<step>/
        dcp/ ...                              the training state, as always
        config.json, generation_config.json   from the model's config (or hf_weights.config_dir)
        model-00001-of-0000N.safetensors ...  the weights, exactly as save_pretrained writes them
        model.safetensors.index.json
        tokenizer files                       those the job hands over (manager.hf_files) or config_dir's
        trainer_state.json, manifest.json

This is the folder ROLL's FSDP2 strategy writes beside ``dcp/`` (``save_pretrained`` into the
checkpoint folder), so vLLM, SGLang and ``from_pretrained`` open ``checkpoint-<step>/``
directly. ROLL gathers the full model on rank 0 and calls ``save_pretrained`` inside the
save; here nothing of it happens in ``save``: once ``dcp/`` is written (in the writer thread
of an asynchronous save), the coordinator reads the shards every rank just wrote, one HF
shard's tensors at a time (:mod:`roll_ckpt.format.hf_files`, in the hub's layout of
:mod:`roll_ckpt.format.hub_layout`), writes the HF files into the checkpoint being committed and
lists them in its manifest; the commit then publishes both at once. No collective, no
gather, no full copy of the model on any rank.

A process whose state holds no ``state[key]`` (a driver component saving ``DriverState``)
writes none.

**A failed HF part** (a model transformers cannot convert, a config that cannot be written,
an error while writing): the training state is what a resume needs, so the checkpoint is
still committed, without the HF files (those written are removed), and its manifest says
so: ``extra.hf = {"status": "failed", "error": ...}``, with a warning in the log;
``roll-ckpt ls`` shows ``hf: failed`` and ``roll-ckpt verify`` names it. A full disk is not
an HF failure: it fails the save as any write does. Otherwise ``extra.hf`` is
``{"status": "written", "files": N, "architecture": ...}``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..errors import RollCkptError, StorageError, StorageFullError, disk_full
from ..format.layout import DCP_DIR
from ..format.hf_files import INDEX_NAME, SINGLE_NAME, index_bytes, layout_of, write_shards
from ..runtime.units import human_bytes, parse_size
from ..format.manifest import Manifest, FileEntry
from ..contracts import Storage
from ..config.hf_weights import HFWeightsConfig

__all__ = ['HFExportReport', 'export_hf', 'plan_shards', 'module_keys', 'DTYPES', 'INDEX_NAME', 'SINGLE_NAME', 'ExportReport', 'select_tensor_keys', 'load_full_tensors', 'export_safetensors', 'require_tensors', 'read_full_tensors', 'HFPart', 'CONFIG_FILES', 'hf_status']


# ---- a Hugging Face folder from a checkpoint ------------------------------

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
    from ..tiers.run import open_storage
    from ..plugins import get_plugins
    from ..format.manifest import read_manifest, verify

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


# ---- one safetensors file of full tensors ---------------------------------

@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_safetensors` wrote."""

    checkpoint: str
    out: str
    step: int
    tensors: int
    bytes: int
    skipped: list[str] = field(default_factory=list)
    """Non-tensor entries left out (safetensors holds tensors only)."""


def _matches(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def select_tensor_keys(md: Any, only: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
    """The tensor keys of DCP metadata ``md`` (under the ``only`` prefixes), and the skipped non-tensor keys.

    Raises when a prefix selects nothing, naming the top-level keys the checkpoint has.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    only = [p.strip(".") for p in only or [] if p.strip(".")]
    tensors, skipped = [], []
    for key, entry in md.state_dict_metadata.items():
        if only and not _matches(key, only):
            continue
        (tensors if isinstance(entry, TensorStorageMetadata) else skipped).append(key)
    if only:
        top = sorted({k.split(".", 1)[0] for k in md.state_dict_metadata})
        for p in only:
            if not any(_matches(k, [p]) for k in tensors):
                raise RollCkptError(f"--only {p}: the checkpoint has no tensor under '{p}'; "
                                    f"its top-level keys are {', '.join(top)}")
    return sorted(tensors), sorted(skipped)


def require_tensors(manifest: Manifest, path: str) -> None:
    """Raise a :class:`RollCkptError` saying why the checkpoint at ``path`` has no tensors to
    export: a step made of components (export one of its parts), a ``json`` part (driver
    state), or no ``dcp/`` folder at all. Returns when it has a DCP folder."""
    if any(name.startswith(f"{DCP_DIR}/") for name in manifest.files):
        return
    from ..format.driver_state import STATE_FILE

    parts = manifest.parts
    if parts:
        names = sorted(parts)
        dcp = [n for n in names if not isinstance(parts[n], dict) or parts[n].get("strategy") != "json"]
        held = f"; tensors are in {', '.join(dcp)}" if dcp else "; none of them holds tensors"
        raise RollCkptError(f"{path} is step {manifest.step} made of components ({', '.join(names)}): export one "
                            f"part with --component NAME{held}")
    if f"state/{STATE_FILE}" in manifest.files:
        who = f"the part of component '{manifest.component}'" if manifest.component else "a checkpoint"
        raise RollCkptError(f"{path} holds no tensors to export: it is {who} saved as JSON from DriverState "
                            f"values (strategy json); its values are in {path.rstrip('/')}/state/{STATE_FILE} "
                            "(JSON, readable by any JSON parser), or run 'roll-ckpt inspect' on it")
    raise RollCkptError(f"{path}: its manifest lists no {DCP_DIR}/ file (strategy "
                        f"{manifest.extra.get('strategy')!r}), so there are no tensors to export; "
                        f"'roll-ckpt verify {path}' checks the folder against it")


def load_full_tensors(storage: Storage, path: str, *, only: Sequence[str] | None = None,
                      on_bytes: Callable[[int], None] | None = None,
                      verify_first: bool = True,
                      on_verify_bytes: Callable[[int], None] | None = None,
                      ) -> tuple[dict[str, Any], Manifest, list[str]]:
    """Every tensor of the checkpoint at ``path`` as a full CPU tensor, by dotted DCP key.

    Returns ``(tensors, manifest, skipped_non_tensor_keys)``. Runs without a process
    group, whatever world size wrote the checkpoint.
    """
    from ..dcp.reader import SafeReader
    from ..format.manifest import read_manifest, verify

    manifest = read_manifest(storage, path)
    require_tensors(manifest, path)  # before reading any data: a step of components, a json part
    if verify_first:
        manifest = verify(storage, path, on_bytes=on_verify_bytes).manifest
    reader = SafeReader(storage, storage.join(path, DCP_DIR), on_bytes, checkpoint=path)
    md = reader.read_metadata()
    keys, skipped = select_tensor_keys(md, only)
    out = read_full_tensors(reader, md, keys, path) if keys else {}
    return out, manifest, skipped


def read_full_tensors(reader: Any, md: Any, keys: Sequence[str], path: str) -> dict[str, Any]:
    """The tensors ``keys`` of the DCP folder ``reader`` reads, each a full CPU tensor
    reassembled from the shards of every saving rank, by dotted DCP key (``md``: its
    metadata). Only these keys are allocated and read; no process group is needed."""
    import warnings

    from ..errors import carried_roll_error
    from ..runtime.torch_compat import get_element, load_state_dict_no_dist
    from ..dcp.checked import SafeEmptyLoadPlanner

    sd: dict[str, Any] = {}
    reader.reset(reader.path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            load_state_dict_no_dist(sd, reader, SafeEmptyLoadPlanner(keys=set(keys)))
        except BaseException as exc:  # DCP wraps errors in a CheckpointException
            ours = carried_roll_error(exc)
            if ours is None:
                raise
            raise ours from None
    planner_data = md.planner_data or {}
    out: dict[str, Any] = {}
    for key in keys:
        value = get_element(sd, planner_data[key]) if key in planner_data else sd.get(key)
        if value is None:
            raise RollCkptError(f"{path}: the tensor '{key}' listed in the DCP metadata was not loaded")
        out[key] = value.detach().contiguous()
    return out


def export_safetensors(storage: Storage, path: str, out: str | os.PathLike[str], *,
                       only: Sequence[str] | None = None, strip_prefix: bool = False,
                       overwrite: bool = False, on_bytes: Callable[[int], None] | None = None,
                       on_verify_bytes: Callable[[int], None] | None = None,
                       verified: bool = False) -> ExportReport:
    """Verify the checkpoint at ``path`` and write its tensors to the local file ``out``.

    Keys are DCP's dotted names (``model.layers.0.weight``); ``only`` keeps the keys
    under the given top-level prefixes, and ``strip_prefix`` (with one prefix) removes
    it, so ``only=["model"], strip_prefix=True`` gives a file ``model.load_state_dict``
    accepts. The step and the source go into the file's metadata. The file is written
    beside its final name and renamed into place, so a failed export leaves nothing.
    ``verified=True`` skips the checksum pass for a caller that has just run
    :func:`roll_ckpt.format.manifest.verify` itself.
    """
    out = os.fspath(out)
    if "://" in out:
        raise RollCkptError(f"--out {out}: export writes a local file; copy it to the store afterwards")
    if os.path.isdir(out):
        raise RollCkptError(f"--out {out} is a folder; give a file name such as {os.path.join(out, 'model.safetensors')}")
    if os.path.exists(out) and not overwrite:
        raise RollCkptError(f"--out {out} already exists; remove it or pass --force to overwrite it")
    if strip_prefix and len(only or []) != 1:
        raise RollCkptError("--strip-prefix needs exactly one --only prefix")
    tensors, manifest, skipped = load_full_tensors(storage, path, only=only, on_bytes=on_bytes,
                                                   verify_first=not verified,
                                                   on_verify_bytes=on_verify_bytes)
    if not tensors:
        raise RollCkptError(f"{path} holds no tensor to export")
    if strip_prefix:
        cut = len(only[0].strip(".")) + 1  # type: ignore[index]
        tensors = {k[cut:]: v for k, v in tensors.items()}
    metadata = {"format": "pt", "step": str(manifest.step), "source": path,
                "exported_by": "roll-ckpt"}
    if manifest.component:
        metadata["component"] = manifest.component
    if only:
        metadata["only"] = ",".join(only)
    _write_safetensors(tensors, out, metadata)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return ExportReport(checkpoint=path, out=out, step=manifest.step, tensors=len(tensors),
                        bytes=nbytes, skipped=skipped)


def _write_safetensors(tensors: dict[str, Any], out: str, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise RollCkptError(f"--out {out}: cannot create the folder {parent}: {exc.strerror or exc}") from None
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except (ValueError, TypeError) as exc:  # safetensors refuses a dtype or layout
        raise RollCkptError(f"cannot write {out} as safetensors: {exc}") from None
    except OSError as exc:
        raise RollCkptError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---- the Hugging Face folder inside every checkpoint ----------------------

log = logging.getLogger("roll_ckpt")

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
                "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
                "processor_config.json")


class HFPart:
    """Writes the Hugging Face files of one checkpoint, on the coordinator."""

    def __init__(self, config: HFWeightsConfig, *, component: str | None = None, only_model: bool = False) -> None:
        self.config = config
        self.component, self.only_model = component, only_model  # (the manifest's step_root, save_only_model)
        self.extras: list[Any] = []
        """Objects with ``save_pretrained(dir)`` (tokenizer, processor) the job handed over."""
        self._extra_files: dict[str, bytes] | None = None
        self._layout: tuple[Any, Any] | None = None

    @staticmethod
    def of(cc: Any, strategy_config: Any, component: str | None = None) -> "HFPart | None":
        """A manager's (``hf_weights``, or ``save_only_model``'s defaults), or ``None``."""
        only_model = bool(strategy_config.save_only_model)
        if cc.hf_weights is None and not only_model:
            return None
        return HFPart(cc.hf_weights or HFWeightsConfig(), component=component, only_model=only_model)

    def forget_files(self) -> None:
        """The handed-over objects changed: make their files again at the next write."""
        self._extra_files = None

    # ------------------------------------------------------------------ in the writer thread

    def manifest_part(self, storage: Any, write_path: str, save: Any, state: Mapping[str, Any]) -> tuple[dict, dict]:
        """The commit's ``ManifestPart`` (:mod:`roll_ckpt.save.pipeline`): the HF files written into
        ``write_path`` from the strategy's files there (none without a module under the key in
        ``state``), and the manifest's ``extra`` keys (``hf``, ``save_only_model``, ``step_root``)."""
        from ..format.components import STEP_ROOT_KEY

        extra: dict[str, Any] = {"save_only_model": self.config.key} if self.only_model else {}
        module = state.get(self.config.key)
        if module is None:
            return {}, extra
        files, extra["hf"] = self.write(storage, write_path, module, storage.join(write_path, save.strategy.data_dir))
        if self.component and self.config.step_root and files:  # at checkpoint-<step>/ too
            extra[STEP_ROOT_KEY] = sorted(files)
        return files, extra

    def write(self, storage: Any, write_path: str, module: Any, dcp_dir: str) -> tuple[dict[str, FileEntry], dict]:
        """Write the HF files into ``write_path``; returns their manifest entries and
        ``extra.hf``. A failure leaves no HF file behind and is returned as
        ``{"status": "failed"}`` (a full disk is raised)."""
        from ..format.manifest import hash_bytes

        folder = storage.join(write_path, self.config.subdir) if self.config.subdir else write_path
        prefix = f"{self.config.subdir}/" if self.config.subdir else ""

        def put(name: str, data: bytes) -> FileEntry:
            with storage.open_write(storage.join(folder, name)) as f:
                f.write(data)
            return FileEntry(*hash_bytes(data))

        written: dict[str, FileEntry] = {}
        try:
            if self.config.subdir:
                storage.makedirs(folder)
            arch = self._write(storage, write_path, module, dcp_dir,
                               lambda n, d: written.__setitem__(prefix + n, put(n, d)))
            return written, {"status": "written", "files": len(written), "architecture": arch}
        except Exception as exc:
            for name in written:
                try:
                    storage.remove(storage.join(write_path, *name.split("/")))
                except OSError:
                    pass
            if disk_full(exc) or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
                raise
            message = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RollCkptError) else str(exc)
            log.warning("roll-ckpt: the Hugging Face folder of %s could not be written (%s); the checkpoint is "
                        "committed without it (its manifest says so) and resumes as any other", write_path, message)
            return {}, {"status": "failed", "error": message}

    def _write(self, storage: Any, write_path: str, module: Any, dcp_dir: str, put: Callable[[str, bytes], None]) -> Any:
        import torch

        from ..dcp.reader import SafeReader
        from ..format.hf_files import INDEX_NAME, index_bytes, layout_of, shard_bytes, write_shards
        from ..format.hub_layout import transformers_model
        from ..runtime.units import parse_size

        cfg = self.config
        reader = SafeReader(storage, dcp_dir, checkpoint=write_path)
        md = reader.read_metadata()
        names, _ = module_keys(md, cfg.key, write_path)
        sizes = {n: (tuple(md.state_dict_metadata[f].size), md.state_dict_metadata[f].properties.dtype)
                 for n, f in names.items()}
        out_dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
        model = transformers_model(module)
        signature = tuple(sorted((n, s, str(d)) for n, (s, d) in sizes.items()))
        if self._layout is None or self._layout[0] != signature:
            self._layout = (signature, layout_of(model, sizes, parse_size(cfg.max_shard_size), out_dtype))
        layout = self._layout[1]

        def read(keys: list[str]) -> dict[str, Any]:
            full = read_full_tensors(reader, md, [names[n] for n in keys], write_path)
            return {n: full.pop(names[n]) for n in keys}

        write_shards(layout, read, lambda filename, tensors: put(filename, shard_bytes(tensors)), out_dtype)
        index = index_bytes(layout)
        if index is not None:
            put(INDEX_NAME, index)
        for name, data in self._config_files(model, out_dtype).items():
            put(name, data)
        return layout.architecture

    def _config_files(self, model: Any, out_dtype: Any) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        if self.config.config_dir is not None:
            src = self.config.config_dir
            if not os.path.isfile(os.path.join(src, "config.json")):
                raise RollCkptError(f"checkpoint_config.hf_weights.config_dir {src}: no config.json there; give the "
                                    "folder of the model's Hugging Face config (config.json, tokenizer files)")
            for n in sorted(os.listdir(src)):
                if (n in CONFIG_FILES or n.endswith(".tiktoken")) and os.path.isfile(os.path.join(src, n)):
                    with open(os.path.join(src, n), "rb") as f:
                        files[n] = f.read()
        elif model is not None:
            from ..format.hub_layout import architecture_name
            from ..runtime.transformers_compat import saved_config

            config = saved_config(model, architecture_name(model))
            files["config.json"] = config.to_json_string(use_diff=True).encode()
            generation = getattr(model, "generation_config", None)
            if generation is not None and getattr(model, "can_generate", lambda: False)():
                files["generation_config.json"] = generation.to_json_string(use_diff=True).encode()
        else:
            raise RollCkptError(f"state['{self.config.key}'] is not a transformers model, so there is no config.json "
                                "to write beside its weights: set checkpoint_config.hf_weights.config_dir")
        if "config.json" in files:
            from ..runtime.transformers_compat import as_saved

            body = json.loads(files["config.json"])
            if out_dtype is not None or as_saved(body) is not body:  # else the bytes as they are
                body = as_saved(body)
                if out_dtype is not None:
                    for k in [k for k in ("dtype", "torch_dtype") if k in body] or ["dtype"]:
                        body[k] = str(out_dtype).removeprefix("torch.")
                files["config.json"] = (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
        files.update(self._handed_over())
        return files

    def _handed_over(self) -> dict[str, bytes]:
        """The files of the tokenizer/processor the job handed over, made once."""
        if self._extra_files is None:
            import tempfile

            self._extra_files = {}
            with tempfile.TemporaryDirectory() as tmp:
                for obj in self.extras:
                    obj.save_pretrained(tmp)
                for n in sorted(os.listdir(tmp)):
                    if os.path.isfile(os.path.join(tmp, n)) and n != "config.json":
                        with open(os.path.join(tmp, n), "rb") as f:
                            self._extra_files[n] = f.read()
        return self._extra_files


def hf_status(extra: Mapping[str, Any]) -> str:
    """``written``, ``failed`` or ``""`` (no HF part) for a manifest's ``extra``."""
    hf = extra.get("hf")
    return str(hf.get("status", "")) if isinstance(hf, Mapping) else ""
