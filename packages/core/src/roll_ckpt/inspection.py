"""Look inside a checkpoint: manifest, trainer state and every DCP key.

The checkpoint is verified first (sizes and checksums), because DCP's ``.metadata`` is
a pickle: it is read only once it matches the manifest, and then only through
:func:`roll_ckpt.dcp_io.safe_load_metadata`, which admits DCP's own classes. No tensor
data is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import CheckpointCorruptError
from .manifest import Manifest
from .storage import Storage

__all__ = ["KeyInfo", "Inspection", "inspect_checkpoint", "format_inspection", "human_bytes"]

DCP_DIR = "dcp"
TRAINER_STATE = "trainer_state.json"


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


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


@dataclass
class Inspection:
    path: str
    manifest: Manifest
    files: int
    bytes: int
    trainer_state: dict[str, Any]
    keys: list[KeyInfo] = field(default_factory=list)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def inspect_checkpoint(storage: Storage, path: str, *,
                       on_bytes: Callable[[int], None] | None = None) -> Inspection:
    """Verify the checkpoint at ``path``, then describe it (no tensor data is read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp_io import METADATA_NAME, safe_load_metadata
    from .verify import verify

    report = verify(storage, path, on_bytes=on_bytes)
    trainer_state: dict[str, Any] = {}
    if TRAINER_STATE in report.manifest.files:
        with storage.open_read(storage.join(path, TRAINER_STATE)) as f:
            raw = f.read()
        try:
            trainer_state = json.loads(raw.decode("utf-8"))
        except ValueError as exc:
            raise CheckpointCorruptError(path, [(TRAINER_STATE, f"not valid JSON ({exc})")]) from None
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
    return Inspection(path, report.manifest, report.files, report.bytes, trainer_state, keys)


def format_inspection(ins: Inspection) -> str:
    """The human-readable report ``roll-ckpt inspect`` prints."""
    m = ins.manifest
    lines = [
        f"checkpoint   {ins.path}",
        f"step         {m.step}",
        f"created      {m.created or '-'}",
        f"world size   {m.world_size}",
    ]
    if m.extra.get("strategy"):
        lines.append(f"strategy     {m.extra['strategy']}")
    if m.component:
        lines.append(f"component    {m.component}")
    lines.append(f"files        {ins.files} ({human_bytes(ins.bytes)}), sizes and checksums match the manifest")
    if m.plugins:
        lines.append("written by   " + ", ".join(f"{k} {v}" for k, v in sorted(m.plugins.items())))
    lines.append("")
    lines.append(TRAINER_STATE)
    body = json.dumps(ins.trainer_state, indent=2, sort_keys=True) if ins.trainer_state else "(none)"
    lines.extend("  " + ln for ln in body.splitlines())
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
