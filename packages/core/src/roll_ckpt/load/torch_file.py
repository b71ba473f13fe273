"""Another framework's ``torch.save`` files, read safely: what a format plugin reads verl's
per-rank ``model_world_size_W_rank_r.pt`` files (and the like) with.

Only ``torch.load(weights_only=True)``: tensors, DTensors (their mesh and placements),
containers and numbers, plain NumPy arrays when asked (``numpy.random.get_state()``'s, as
verl pickles it); nothing that runs code. A file the backend hands out as a local file is
memory-mapped, so a reader that takes a few rows of a large tensor reads those pages only.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import stat
import zipfile
from typing import Any

from ..contracts import Storage
from ..errors import CheckpointCorruptError, UnsafeCheckpointError

__all__ = ["torch_load", "torch_file_problem"]


@contextlib.contextmanager
def _quiet_device_mesh() -> Any:
    """A DTensor's ``DeviceMesh`` unpickled before (or without) the process groups of the job that
    saved it logs a warning about ``torch.compile`` lookups: expected here, where the mesh is
    read for its shape and ranks only."""
    logger = logging.getLogger("torch.distributed.device_mesh")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _local_file(f: Any, path: str) -> str | None:
    """``path`` when the reader ``f`` is that very file on a local disk (same device and inode,
    not a link): it can be memory-mapped by name."""
    try:
        mine = os.fstat(f.fileno())
        there = os.lstat(path)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None
    same = (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)
    return path if same and stat.S_ISREG(there.st_mode) else None


def torch_load(storage: Storage, path: str, *, numpy: bool = False, mmap: bool = True) -> Any:
    """The object ``torch.save`` wrote to ``path`` (a file of ``storage``), on the CPU, loaded
    with ``weights_only=True`` (``numpy``: plain NumPy arrays admitted too). With ``mmap`` and a
    backend that hands out local files, the tensors are memory-mapped rather than read.

    Raises :class:`~roll_ckpt.errors.UnsafeCheckpointError` when the file holds anything
    else (a pickled class, a function), naming the file and what it asked for, and
    :class:`~roll_ckpt.errors.CheckpointCorruptError` when it is not a whole ``torch.save``
    file (cut short).
    """
    import torch

    from ..runtime.torch_compat import numpy_arrays_admitted

    if torch.distributed.is_available():
        import torch.distributed.tensor  # noqa: F401  (DTensor, DeviceMesh, placements: admitted once imported)
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    folder = path.rsplit("/", 1)[0] or path
    admitted = numpy_arrays_admitted() if numpy else contextlib.nullcontext()
    with storage.open_read(path) as f:  # (errors opening it are the storage's own: a missing file, a link)
        local = _local_file(f, path) if mmap else None
        try:
            with admitted, _quiet_device_mesh():
                if local is not None:
                    return torch.load(local, map_location="cpu", weights_only=True, mmap=True)
                return torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            why = str(exc).splitlines()
            shown = next((ln.strip() for ln in why if "GLOBAL" in ln or "Unsupported" in ln), why[0] if why else "")
            raise UnsafeCheckpointError(folder, [(
                name, f"holds more than tensors and plain values ({shown}); roll-ckpt never unpickles code: load it "
                      "with the framework that wrote it")]) from None
        except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as exc:
            raise CheckpointCorruptError(folder, [(
                name, f"is not a whole torch.save file ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")]) \
                from None


def torch_file_problem(storage: Storage, path: str, size: int | None = None) -> str | None:
    """Why the file at ``path`` is not a whole ``torch.save`` file (``None`` when it is one): its
    zip directory at the end is missing (the write stopped), or names bytes past its end. Reads
    the directory only, never the data."""
    try:
        with storage.open_read(path) as f:
            with zipfile.ZipFile(f) as z:
                infos = z.infolist()
            end = size if size is not None else f.seek(0, os.SEEK_END)
    except FileNotFoundError:
        return "is missing"
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        return f"is not a whole torch.save file (cut short?): {exc}"
    if not infos:
        return "is an empty archive, not a torch.save file"
    past = [i.filename for i in infos if i.header_offset + i.compress_size > end]
    if past:
        return f"names {len(past)} record(s) past its end (cut short?)"
    return None
