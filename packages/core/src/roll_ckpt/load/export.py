"""Export a checkpoint as one safetensors file of full (unsharded) tensors.

A DCP checkpoint is split by rank and read through ``torch.distributed``; a safetensors
file opens anywhere (inference servers, the Hugging Face stack) and holds no pickle.
The export runs in one process without a process group: DCP reassembles every shard
into a full tensor from the checkpoint's metadata alone, so a checkpoint written by 64
FSDP2 ranks exports on a laptop (memory permitting: every exported tensor is held at
once).

The checkpoint is verified against its manifest first; ``.metadata`` is only ever
unpickled by :func:`roll_ckpt.format.unpickle.safe_load_metadata`, and non-tensor entries
(learning rates, RNG states kept as objects, ...) are never read at all.

A step made of components is exported one part at a time: give the part's folder
(``checkpoint-<step>/<component>``; ``roll-ckpt export --component`` finds it and checks it
against the step's manifest). A part saved by the ``json`` strategy holds no tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import RollCkptError
from ..format.layout import DCP_DIR
from ..format.manifest import Manifest
from ..contracts import Storage

__all__ = ["ExportReport", "select_tensor_keys", "load_full_tensors", "export_safetensors", "require_tensors",
           "read_full_tensors"]


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
    from ..format.components import components_of
    from ..format.driver_state import STATE_FILE

    parts = components_of(manifest)
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
    from ..format.verify import read_manifest, verify

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
    from ..format.unpickle import SafeEmptyLoadPlanner

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
    :func:`roll_ckpt.format.verify.verify` itself.
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
