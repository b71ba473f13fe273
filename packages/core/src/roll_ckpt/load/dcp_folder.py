"""Another framework's DCP folder (no manifest), read safely, and written plainly: what format
plugins read checkpoints with, and write exports to a framework's own layout with.

``.metadata`` only through the restricted unpickler; byte values only with
``torch.load(weights_only=True)`` (plain NumPy arrays admitted on request); tensors read into
the caller's targets, resharded as DCP reshards, by each process alone.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ..contracts import Storage
from ..dcp.checked import METADATA_NAME, safe_load_metadata
from ..runtime.collector import CollectorPause
from ..runtime.torch_compat import dcp_save, numpy_arrays_admitted
from ..dcp.reader import SafeReader, read_dcp

__all__ = ["read_dcp_metadata", "dcp_folder_problems", "load_dcp", "write_dcp"]


def read_dcp_metadata(storage: Storage, dcp_path: str) -> Metadata:
    """The ``.metadata`` of the DCP folder at ``dcp_path``, unpickled by the restricted
    unpickler (DCP's metadata classes only: :mod:`roll_ckpt.dcp.checked`)."""
    path = storage.join(dcp_path, METADATA_NAME)
    with storage.open_read(path) as f:
        return safe_load_metadata(f.read(), path)


def dcp_folder_problems(storage: Storage, dcp_path: str, sizes: dict[str, int], *,
                        cut_short_hint: str = "") -> tuple[list[str], Metadata | None]:
    """What keeps another framework's DCP folder from being loaded -- its ``.metadata`` refused or
    unreadable, a data file it names missing or shorter than the bytes it names there -- and the
    metadata (``None`` when unreadable). ``sizes``: the folder's files and sizes, as listed, with
    ``.metadata`` among them (a folder without one is the caller's to word: it knows what never
    finished). ``cut_short_hint`` ends each cut-short problem. Names relative to ``dcp_path``."""
    from ..errors import CheckpointCorruptError, UnsafeCheckpointError
    from ..runtime.units import human_bytes

    try:
        md = read_dcp_metadata(storage, dcp_path)
    except (UnsafeCheckpointError, CheckpointCorruptError) as exc:
        return [f"{METADATA_NAME} cannot be read safely: {exc}"], None
    except Exception as exc:  # a torn pickle: EOFError, UnpicklingError...
        return [f"{METADATA_NAME} is unreadable ({type(exc).__name__}: {exc}): cut short?"], None
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    out = []
    for name, end in sorted(needed.items()):
        have = sizes.get(name)
        if have is None:
            out.append(f"{name} is missing ({METADATA_NAME} names it)")
        elif have < end:
            out.append(f"{name} is cut short: {human_bytes(have)} of at least {human_bytes(end)}{cut_short_hint}")
    return out, md


def load_dcp(target: dict[str, Any], storage: Storage, dcp_path: str, *, numpy: bool = False) -> None:
    """Read this process's share of the DCP folder at ``dcp_path`` into ``target`` (tensors,
    DTensors -- resharded as DCP does --, and placeholders for byte values, which are read
    with ``torch.load(weights_only=True)``), in place, without any collective.

    For folders with no manifest (another framework's checkpoint, read as it is): nothing
    is checked against checksums, but nothing is unpickled beyond DCP's metadata classes
    and tensors (``numpy``: and plain NumPy arrays, as in ``numpy.random.get_state()``).
    Keys of ``target`` missing from the folder raise, naming them.
    """
    reader = SafeReader(storage, dcp_path)
    try:
        with numpy_arrays_admitted() if numpy else contextlib.nullcontext(), CollectorPause(True):
            read_dcp(target, reader, reader.read_metadata())
    finally:
        reader.release()


def write_dcp(state_dict: dict[str, Any], path: str) -> None:
    """``state_dict`` (tensors, values, ``Stateful`` objects) written by this process alone as a
    plain DCP folder at the local ``path``, as ``dcp.save`` writes one (on every torch of the
    supported range: torch 2.6's ``dcp.save`` has no ``no_dist``)."""
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # no_dist: on purpose
        dcp_save(state_dict, storage_writer=FileSystemWriter(path), planner=None, process_group=None, no_dist=True)
