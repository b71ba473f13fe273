"""Look inside a checkpoint: manifest, trainer state and every DCP key (``roll-ckpt inspect``).

The command line's own (and :func:`roll_ckpt.plugin.verify_checkpoint`'s): no save or resume
calls it, so it lives outside the save/load core.

The checkpoint is verified first (sizes and checksums), because DCP's ``.metadata`` is
a pickle: it is read only once it matches the manifest, and then only through
:func:`roll_ckpt.dcp.checked.safe_load_metadata`, which admits DCP's own classes. No tensor
data is read.

A step made of components (see :mod:`roll_ckpt.format.components`) is described part by part
(name, world size, strategy, files, bytes), each part's own manifest checked against the
step's; a part saved by the ``json`` strategy (:class:`~roll_ckpt.DriverState`) shows the
values of ``state/state.json``, read as JSON. For a step folder that is not committed,
:func:`roll_ckpt.format.layout.parts_status` says which parts are committed and which are missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CheckpointCorruptError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..contracts import Storage
from ..format.layout import DCP_DIR, TRAINER_STATE
from ..runtime.units import human_bytes

__all__ = ["KeyInfo", "PartInfo", "Inspection", "inspect_checkpoint", "format_inspection",
           "parts_of", "part_faults", "read_driver_state", "verify_checkpoint"]

DRIVER_STATE = "state/state.json"


@dataclass(frozen=True)
class KeyInfo:
    """One entry of DCP's metadata."""

    key: str
    kind: str
    """``tensor`` or ``bytes`` (a pickled non-tensor value)."""
    shape: tuple[int, ...] = ()
    dtype: str = ""
    chunks: int = 0
    """Shards the tensor is stored in (one per rank that held a piece)."""

    @property
    def nbytes(self) -> int:
        if self.kind != "tensor":
            return 0
        import torch

        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class PartInfo:
    """One component's part of a step, as the step's manifest records it."""

    name: str
    world_size: int | None
    strategy: str | None
    created: str
    files: int
    """Files of the part, its own manifest included."""
    bytes: int


@dataclass
class Inspection:
    path: str
    manifest: Manifest
    files: int
    bytes: int
    trainer_state: dict[str, Any]
    keys: list[KeyInfo] = field(default_factory=list)
    parts: list[PartInfo] = field(default_factory=list)
    """The components of a step made of several (empty otherwise)."""
    driver_state: dict[str, Any] | None = None
    """The ``state`` object of ``state/state.json`` for a part saved by the ``json``
    strategy: ``{key: {"values": {...}, "rng": {...}}}``; ``None`` otherwise."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- components

def parts_of(manifest: Manifest) -> list[PartInfo]:
    """The parts a step's manifest lists, with their files and bytes (empty without components)."""
    out = []
    for name, info in sorted(manifest.parts.items()):
        info = info if isinstance(info, dict) else {}
        entries = [e for rel, e in manifest.files.items() if rel.startswith(f"{name}/")]
        ws = info.get("world_size")
        out.append(PartInfo(name, ws if isinstance(ws, int) else None, info.get("strategy"),
                            str(info.get("created") or ""), len(entries), sum(e.size for e in entries)))
    return out


def part_faults(storage: Storage, path: str, manifest: Manifest) -> list[tuple[str, str]]:
    """What is wrong with the parts of the committed step at ``path`` (empty when sound).

    Each part's own ``manifest.json`` must parse, name its component and the step, and list
    exactly the files the step's manifest lists for that part. Files of the step that
    belong to no listed component are faults too. The step's checksums are not read
    again here: :func:`roll_ckpt.format.manifest.verify` does that.
    """
    parts = manifest.parts
    if not parts:
        return []
    from ..format.components import STEP_FILES_KEY, STEP_ROOT_KEY

    faults: list[tuple[str, str]] = []
    own = set(manifest.extra.get(STEP_FILES_KEY) or ())  # the step's own files (verl's data.pt)
    root_files = {rel for rel in manifest.files if "/" not in rel} - own  # published by a part (step_root)
    strays = sorted({rel.split("/", 1)[0] for rel in manifest.files if "/" in rel} - set(parts))
    for top in strays:
        faults.append((f"{top}/", "listed in the step's manifest, but the step has no component of that name "
                                  f"(its components: {', '.join(sorted(parts))})"))
    for name in sorted(parts):
        rel = f"{name}/{MANIFEST_NAME}"
        try:
            with storage.open_read(storage.join(path, name, MANIFEST_NAME)) as f:
                data = f.read()
        except FileNotFoundError:
            faults.append((rel, "missing (the part's own manifest)"))
            continue
        except OSError as exc:
            from ..format.manifest import unsafe_read_fault

            faults.append((rel, unsafe_read_fault(exc)))
            continue
        try:
            part, problems = Manifest.from_bytes(data)
        except ValueError as exc:
            faults.append((rel, f"the part's manifest is unreadable: {exc}"))
            continue
        faults.extend((rel, p) for p in problems)
        if part.component != name or part.step != manifest.step:
            faults.append((rel, f"names component {part.component!r} at step {part.step}, but it is the part "
                                f"'{name}' of step {manifest.step} (moved or copied from elsewhere)"))
            continue
        mine = {r[len(name) + 1:]: e for r, e in manifest.files.items() if r.startswith(f"{name}/") and r != rel}
        if mine != part.files:
            differ = sorted(set(mine) ^ set(part.files)) or sorted(k for k in mine if mine[k] != part.files[k])
            faults.append((rel, "lists other files than the step's manifest does for this part "
                                f"({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''})"))
        for published in part.extra.get(STEP_ROOT_KEY) or ():
            if manifest.files.get(published) != part.files.get(published):
                faults.append((published, f"the part '{name}' publishes it at the step's root, but the step's "
                                          "manifest lists it differently or not at all"))
            root_files.discard(published)
    faults.extend((rel, "listed at the step's root, but no part publishes it") for rel in sorted(root_files))
    return faults


def read_driver_state(storage: Storage, path: str) -> dict[str, Any]:
    """The ``state`` object of the part at ``path``'s ``state/state.json`` (JSON, never pickle).

    Call it on a verified part: a file that is not a driver state is reported as damage.
    """
    from ..format.driver_state import STATE_FORMAT

    try:
        with storage.open_read(storage.join(path, *DRIVER_STATE.split("/"))) as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointCorruptError(path, [(DRIVER_STATE, "missing")]) from None
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointCorruptError(path, [(DRIVER_STATE, f"not valid JSON ({exc})")]) from None
    state = body.get("state") if isinstance(body, dict) and body.get("format") == STATE_FORMAT else None
    if not isinstance(state, dict):
        raise CheckpointCorruptError(path, [(DRIVER_STATE, "not a roll-ckpt driver state")])
    return state


def inspect_checkpoint(storage: Storage, path: str, *,
                       on_bytes: Callable[[int], None] | None = None) -> Inspection:
    """Verify the checkpoint at ``path``, then describe it (no tensor data is read).

    ``path`` may be a whole checkpoint, a step made of components (its parts are listed and
    their manifests checked), or one component's part (DCP keys, or the values of a
    ``json`` part's ``state/state.json``).
    """
    from ..format.manifest import verify

    report = verify(storage, path, on_bytes=on_bytes)
    if report.manifest.parts:
        faults = part_faults(storage, path, report.manifest)
        if faults:
            raise CheckpointCorruptError(path, faults)
        return Inspection(path, report.manifest, report.files, report.bytes, {}, parts=parts_of(report.manifest))
    trainer_state: dict[str, Any] = {}
    if TRAINER_STATE in report.manifest.files:
        with storage.open_read(storage.join(path, TRAINER_STATE)) as f:
            raw = f.read()
        try:
            trainer_state = json.loads(raw.decode("utf-8"))
        except ValueError as exc:
            raise CheckpointCorruptError(path, [(TRAINER_STATE, f"not valid JSON ({exc})")]) from None
    ins = Inspection(path, report.manifest, report.files, report.bytes, trainer_state)
    if DRIVER_STATE in report.manifest.files:
        ins.driver_state = read_driver_state(storage, path)
    if any(name.startswith(f"{DCP_DIR}/") for name in report.manifest.files):
        ins.keys = _dcp_keys(storage, path)
    return ins


def _dcp_keys(storage: Storage, path: str) -> list[KeyInfo]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..dcp.checked import METADATA_NAME, safe_load_metadata

    md_path = storage.join(path, DCP_DIR, METADATA_NAME)
    with storage.open_read(md_path) as f:
        md = safe_load_metadata(f.read(), md_path)
    keys = []
    for key in sorted(md.state_dict_metadata):
        entry = md.state_dict_metadata[key]
        if isinstance(entry, TensorStorageMetadata):
            keys.append(KeyInfo(key, "tensor", tuple(entry.size), _dtype_name(entry.properties.dtype),
                                len(entry.chunks)))
        else:
            keys.append(KeyInfo(key, "bytes"))
    return keys


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(value, sort_keys=True, allow_nan=True)
    return text if len(text) <= width else text[: width - 3] + "..."


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return f"list[{len(value)}]"
    if isinstance(value, dict):
        return f"dict[{len(value)}]"
    return {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}.get(type(value), type(value).__name__)


def _format_parts(ins: Inspection) -> list[str]:
    rows = [["NAME", "WORLD SIZE", "STRATEGY", "FILES", "SIZE", "CREATED"]]
    for p in ins.parts:
        rows.append([p.name, "-" if p.world_size is None else str(p.world_size), p.strategy or "-",
                     str(p.files), human_bytes(p.bytes), p.created or "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {1, 3, 4}
    lines = [f"components: {len(ins.parts)} parts, each part's manifest matches the step's"]
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  " + "  ".join(cells).rstrip())
    lines.append("")
    lines.append(f"one part in detail: roll-ckpt inspect {ins.path} --component NAME")
    return lines


def _format_driver(state: dict[str, Any]) -> list[str]:
    lines = [f"driver state ({DRIVER_STATE}, JSON): {len(state)} key(s)"]
    for key in sorted(state):
        entry = state[key] if isinstance(state[key], dict) else {}
        values = entry.get("values") if isinstance(entry.get("values"), dict) else {}
        rng = entry.get("rng") if isinstance(entry.get("rng"), dict) else None
        rng_text = f", RNG state ({', '.join(sorted(rng))})" if rng else ""
        lines.append(f"  {key}: {len(values)} values{rng_text}")
        width = max((len(k) for k in values), default=0)
        kwidth = max((len(_kind(v)) for v in values.values()), default=0)
        for name in sorted(values):
            v = values[name]
            lines.append(f"    {name:<{width}}  {_kind(v):<{kwidth}}  {_short(v)}")
    return lines


def format_inspection(ins: Inspection) -> str:
    """The human-readable report ``roll-ckpt inspect`` prints."""
    m = ins.manifest
    lines = [
        f"checkpoint   {ins.path}",
        f"step         {m.step}",
        f"created      {m.created or '-'}",
    ]
    if not ins.parts:  # a step made of parts has one world size per part, listed below
        lines.append(f"world size   {m.world_size}")
    if m.extra.get("strategy"):
        lines.append(f"strategy     {m.extra['strategy']}")
    if m.component:
        lines.append(f"component    {m.component}")
    hf = m.extra.get("hf") if isinstance(m.extra.get("hf"), dict) else {}
    if hf:  # the Hugging Face files the checkpoint carries (hf_weights)
        what = f"{hf.get('files')} files, {hf.get('architecture') or 'the module'}" if hf.get("status") == "written" \
            else f"not written: {hf.get('error')}"
        lines.append(f"hf files     {hf.get('status')} ({what})" + (" -- model only (save_only_model)"
                                                                    if m.extra.get("save_only_model") else ""))
    lines.append(f"files        {ins.files} ({human_bytes(ins.bytes)}), sizes and checksums match the manifest")
    if m.plugins:
        lines.append("written by   " + ", ".join(f"{k} {v}" for k, v in sorted(m.plugins.items())))
    lines.append("")
    if ins.parts:
        return "\n".join(lines + _format_parts(ins))
    lines.append(TRAINER_STATE)
    body = json.dumps(ins.trainer_state, indent=2, sort_keys=True) if ins.trainer_state else "(none)"
    lines.extend("  " + ln for ln in body.splitlines())
    lines.append("")
    if ins.driver_state is not None:
        lines.extend(_format_driver(ins.driver_state))
        if not ins.keys:
            return "\n".join(lines)
        lines.append("")
    tensors = [k for k in ins.keys if k.kind == "tensor"]
    total = sum(k.nbytes for k in tensors)
    lines.append(f"DCP keys: {len(tensors)} tensors ({human_bytes(total)}), "
                 f"{len(ins.keys) - len(tensors)} other values")
    width = max((len(k.key) for k in ins.keys), default=0)
    for k in ins.keys:
        if k.kind == "tensor":
            shape = "[" + ", ".join(str(d) for d in k.shape) + "]"
            shards = f"  {k.chunks} shards" if k.chunks > 1 else ""
            lines.append(f"  {k.key:<{width}}  {shape:<16} {k.dtype}{shards}")
        else:
            lines.append(f"  {k.key:<{width}}  bytes")
    return "\n".join(lines)


def verify_checkpoint(storage: Storage, path: str) -> dict:
    """Check every file of the committed checkpoint at ``path`` (sizes, checksums; a step's
    parts against the step's manifest) and return its manifest as JSON values; raises
    :class:`CheckpointCorruptError` naming every fault. What a plugin calls before it reads a
    checkpoint's files itself (``roll-ckpt export --format NAME``)."""
    from ..format.manifest import verify

    manifest = verify(storage, path).manifest
    faults = part_faults(storage, path, manifest)
    if faults:
        raise CheckpointCorruptError(path, faults)
    return manifest.as_dict()
