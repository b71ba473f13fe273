"""Reading a checkpoint never runs its code.

DCP's ``.metadata`` is a pickle: :func:`safe_load_metadata` admits only DCP's metadata
classes. Every other value DCP reads goes through ``torch.load(weights_only=True)``
(:class:`SafeLoadPlanner`, :class:`SafeEmptyLoadPlanner`); a refusal names the item.
"""

from __future__ import annotations

import enum
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import UnsafeCheckpointError
from ..runtime.torch_compat import empty_state_dict_load_planner, local_load_plan, planner_set_value

__all__ = ["METADATA_NAME", "safe_load_metadata", "SafeLoadPlanner", "SafeEmptyLoadPlanner", "pickle_reason"]

METADATA_NAME = ".metadata"

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
              "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def _enum_member(cls: Any, name: Any) -> Any:
    """What ``getattr(cls, name)`` gives in a pickle, admitted for the members of an admitted enum only.

    CPython 3.11.0 to 3.11.4 (3.11.2 is Debian 12's system Python) pickle an enum member as
    ``getattr(EnumClass, "NAME")``; other releases as ``EnumClass(value)``. ``cls`` here was
    itself admitted by :meth:`_MetadataUnpickler.find_class`, so this adds no class.
    """
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not a "
                                 "member of a DCP metadata enum")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module in ("builtins", "__builtin__") and name == "getattr":
            return _enum_member
        if module == "pathlib._local" and name in ("PosixPath", "PurePosixPath"):
            # Python 3.13 moved pathlib's classes there; what DCP's FileSystemWriter records as the
            # checkpoint_id then names them so. Read as pathlib's own on every Python.
            import pathlib

            return getattr(pathlib, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def safe_load_metadata(data: bytes, where: str = METADATA_NAME) -> Metadata:
    """Unpickle DCP metadata, admitting only DCP's metadata classes."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise UnsafeCheckpointError(where, [(METADATA_NAME, f"refused to unpickle: {exc}")]) from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(where, [(METADATA_NAME, f"holds a {type(md).__name__}, not DCP Metadata")])
    return md


class _RefusedValue(pickle.UnpicklingError):
    """``torch.load(weights_only=True)`` refused a non-tensor value; names the item."""

    def __init__(self, message: str, read_item: Any) -> None:
        super().__init__(message)
        self.read_item = read_item


def pickle_reason(exc: BaseException) -> str:
    """The line of torch's (long) weights-only refusal that says what was refused."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if "GLOBAL" in ln or "global" in ln:
            return ln[:300].rstrip(".")
    return (lines[-1] if lines else type(exc).__name__)[:300].rstrip(".")


def _load_bytes_safely(value: io.BytesIO, read_item: Any = None) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _RefusedValue(pickle_reason(exc), read_item) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are read with ``weights_only=True``."""

    reader: Any = None

    def create_local_plan(self) -> Any:
        if self.allow_partial_load:
            return super().create_local_plan()
        return local_load_plan(self.state_dict, self.metadata)  # each DTensor's chunk made once per shape

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        planner_set_value(self, read_item.dest_index.fqn, _load_bytes_safely(value, read_item))


class SafeEmptyLoadPlanner(empty_state_dict_load_planner()):  # type: ignore[misc]
    """Rebuilds a full state dict from metadata (export, inspect), reading safely."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        planner_set_value(self, read_item.dest_index.fqn, _load_bytes_safely(value, read_item))
