"""The pieces of a load coordinated by the job, not by DCP's global plan: ``.metadata`` read
once, every file checked once, each process planning its own reads (the sequence is
``DCPStrategy.load``'s).

DCP's load has every process read and unpickle ``.metadata`` (at 1,024 processes, 165 GB
read from storage for a 161 MB file) and gathers and scatters load plans through the
coordinator, which roll-ckpt used only to tell every process which files were checked.
Instead:

1. the coordinator reads ``.metadata`` once, checks it against the manifest and
   broadcasts its bytes; every process unpickles them (restricted unpickler, collector
   held off): :func:`job_metadata`;
2. each data file is checked by one process, the one of its writer's rank modulo the
   world size (at the same world size: the process that wrote it, which reads it next),
   and the job agrees that every check passed (one all-reduce: ``strategy.agree``)
   before any process reads a byte it did not check itself;
3. each process plans and reads its own part (DCP with ``no_dist``: resharding needs only
   the metadata), and the job agrees again that every process loaded.

An error on one process is raised on every process (the same type and message).
:func:`read_dcp` is the read itself, for the job's folders and for a folder one process wrote.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from ..runtime.collector import CollectorPause
from ..runtime.distributed import decide
from ..runtime.torch_compat import dcp_load
from ..format.digest import hash_bytes
from ..errors import CheckpointCorruptError, carried_roll_error
from ..format.layout import writer_rank
from ..format.unpickle import METADATA_NAME, SafeLoadPlanner, safe_load_metadata
from ..format.verify import content_fault

__all__ = ["read_dcp", "job_metadata", "assigned_files", "writer_rank"]  # writer_rank: format.layout's, used here


def assigned_files(files: Mapping[str, Any], rank: int, world_size: int) -> list[str]:
    """The data files process ``rank`` checks for the job."""
    return sorted(n for n in files if (w := writer_rank(n)) is not None and w % world_size == rank)


def job_metadata(strategy: Any, storage: Any, dcp_path: str, files: Mapping[str, Any] | None,
                 checkpoint: str, pause_gc: bool = True) -> tuple[Any, bytes]:
    """``.metadata`` of ``dcp_path``, read and checked by the coordinator alone, unpickled
    by every process; returns it with its bytes."""
    path = storage.join(dcp_path, METADATA_NAME)

    def read() -> bytes:
        with storage.open_read(path) as f:
            data = f.read()
        if files is not None:
            if (fault := content_fault(files.get(METADATA_NAME), *hash_bytes(data))) is not None:
                raise CheckpointCorruptError(checkpoint, [(f"dcp/{METADATA_NAME}", fault)])
        return data

    data = decide(strategy, read, where=f"cannot read {path}", phase="resume: reading .metadata")
    with CollectorPause(pause_gc):
        return safe_load_metadata(data, path), data


def read_dcp(target: dict[str, Any], reader: Any, dcp_path: str, **group: Any) -> None:
    """``dcp_path`` read into ``target`` through ``reader`` (a :class:`~roll_ckpt.load.reader.SafeReader`)
    and a :class:`~roll_ckpt.format.unpickle.SafeLoadPlanner`; ``group``: DCP's ``process_group``
    and ``no_dist``. An error of roll-ckpt's that DCP wrapped is raised as itself."""
    reader.reset(dcp_path)
    planner = SafeLoadPlanner()
    planner.reader = reader
    reader.planner = planner
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp_load(target, storage_reader=reader, planner=planner, **group)
        except BaseException as exc:  # DCP wraps every rank's error in a CheckpointException
            found = carried_roll_error(exc)
            if found is None:
                raise
            raise found from None
        finally:  # no cycle: the metadata and plans they hold go with the load, not at a collection
            planner.reader = reader.planner = None
