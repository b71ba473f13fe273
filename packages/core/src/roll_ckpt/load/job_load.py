"""A load coordinated by the job, not by DCP's global plan: ``.metadata`` read once, every
file checked once, each process planning its own reads.

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
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

from ..runtime.collector import CollectorPause
from ..runtime.distributed import decide
from ..format.digest import hash_bytes
from ..errors import CheckpointCorruptError
from ..format.layout import basename, parent, parse_step, writer_rank
from ..format.unpickle import METADATA_NAME, safe_load_metadata
from ..format.verify import content_fault

__all__ = ["load_job", "job_metadata", "assigned_files", "writer_rank"]  # writer_rank: format.layout's, used here


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


def load_job(strategy: Any, state: MutableMapping[str, Any], reader: Any, storage: Any, dcp_path: str,
             files: Mapping[str, Any] | None, checkpoint: str) -> None:
    """Load a checkpoint of the job into ``state`` (``DCPStrategy.load``): ``.metadata`` read
    once, each file checked by one process before any process reads it, each process
    planning its own reads; an error anywhere is raised everywhere. Then the next save
    starts from the checkpoint's layout (:meth:`FixedLayouts.adopt`)."""
    with strategy.bounded("resume: loading", parse_step(basename(parent(dcp_path)))):
        _load_job(strategy, state, reader, storage, dcp_path, files, checkpoint)


def _load_job(strategy: Any, state: MutableMapping[str, Any], reader: Any, storage: Any, dcp_path: str,
              files: Mapping[str, Any] | None, checkpoint: str) -> None:
    step = parse_step(basename(parent(dcp_path)))
    md, md_bytes = job_metadata(strategy, storage, dcp_path, files, checkpoint,
                                strategy.config.checkpoint_config.pause_gc)
    reader.use_metadata(md)
    error: BaseException | None = None
    try:
        mine = assigned_files(files, strategy.rank, strategy.world_size) if files else []
        if mine:
            reader.start_checks(mine)  # the disk works while the target is built
        target, src = strategy.load_targets(state, md, dcp_path)
        if files:
            reader.check_files(mine)
            reader.job_checked = True
    except Exception as exc:
        error = exc
    strategy.agree(error, "resume: checking the files", step)  # every check passed before any process reads
    try:
        strategy.read_into(target, reader, dcp_path, True)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        error = exc
    strategy.agree(error, "resume: loading", step)
    try:
        strategy.hand_over(state, target, src)
    except Exception as exc:  # e.g. a stateful object refusing its value: before the collective below
        error = exc
    strategy.agree(error, "resume: handing the values over", step)
    if files is not None and METADATA_NAME in files:
        strategy.adopt_layout(md_bytes, files[METADATA_NAME].checksum)

