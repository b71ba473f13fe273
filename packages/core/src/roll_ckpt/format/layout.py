"""Where checkpoints live and how they are found and ordered.

::

    <output_dir>/<YYYYmmdd-HHMMSS>/checkpoint-<step>/   (timestamp_subdir: true)
    <output_dir>/checkpoint-<step>/                     (timestamp_subdir: false)

Checkpoints are ordered by run (the run folder's timestamp; checkpoints directly under
``output_dir`` count as the oldest run) and then by step as a number, never by name: a
run that resumed from an earlier step and went on is newer than the run it came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from ..contracts import Storage
from .manifest import MANIFEST_NAME

__all__ = ["CheckpointRef", "NAME_FORMATS", "scan", "committed", "latest", "checkpoint_name", "run_name",
           "new_run_name", "run_key", "parse_step", "parent", "basename", "RUN_RE", "DCP_DIR", "TRAINER_STATE", "writer_rank"]

RUN_RE = re.compile(r"^(\d{8}-\d{6})(?:-(\d+))?$")
NAME_FORMATS = ("checkpoint-{step}", "global_step_{step}", "step-{step}")
"""How a checkpoint folder may be named (``checkpoint_config.name_format``): roll-ckpt's own,
verl's (``global_step_N``), torchtitan's (``step-N``). Each is a prefix and the step."""
CKPT_RE = re.compile(r"^(?:checkpoint-|global_step_|step-)(\d+)$")
TMP_PREFIX = ".tmp-"
DCP_DIR = "dcp"
"""A checkpoint's DCP folder (the ``dcp`` and ``fsdp2`` strategies write there)."""
TRAINER_STATE = "trainer_state.json"
"""Step, time, world size, strategy, user values: written beside every checkpoint's data."""
RUN_RECORD = ".run.json"
"""Written create-only when a run claims its folder: who owns it (host, pid)."""
RESUME_RECORD = ".resume.json"
"""With components: where the launch writing this run folder resumed from (create-only,
by its first component to resume; the others resume from the same place)."""


def parent(path: str) -> str:
    """The folder holding ``path`` (paths of every backend use ``/``)."""
    p = path.rstrip("/\\")
    return p[: len(p) - len(basename(p))].rstrip("/\\") or ("/" if p.startswith("/") else "")


def basename(path: str) -> str:
    """The last part of ``path``."""
    return path.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]


def checkpoint_name(step: int, name_format: str = NAME_FORMATS[0]) -> str:
    """The folder of step ``step`` (``checkpoint-<step>``, or another of :data:`NAME_FORMATS`)."""
    return name_format.format(step=step)


def run_name(now: datetime, attempt: int = 0) -> str:
    base = now.strftime("%Y%m%d-%H%M%S")
    return base if attempt == 0 else f"{base}-{attempt}"


def new_run_name() -> str:
    """A run folder name for a job starting now (``YYYYmmdd-HHMMSS-<ms>``, local time; the
    milliseconds so that a launch restarted within the second of the one it replaces gets a
    newer name, not the same one).

    Multi-component jobs pick it once per launch, in the driver, and give it to every
    component as ``checkpoint_config.run_name``.
    """
    now = datetime.now()
    return run_name(now, now.microsecond // 1000)


def parse_step(name: str) -> int | None:
    m = CKPT_RE.match(name)
    return int(m.group(1)) if m else None


def run_key(name: str) -> tuple[datetime, int]:
    """How run folders are ordered: by their timestamp, then the milliseconds or attempt
    after it; a name that is not a run folder's (``output_dir`` itself) comes first."""
    m = RUN_RE.match(name)
    if not m:
        return (datetime.min, 0)
    return (datetime.strptime(m.group(1), "%Y%m%d-%H%M%S"), int(m.group(2) or 0))


@dataclass(frozen=True)
class CheckpointRef:
    path: str
    step: int
    run: str
    """The run folder's name; empty for checkpoints directly under output_dir."""
    committed: bool
    mtime: float | None = None

    @property
    def order(self) -> tuple[tuple[datetime, int], int]:
        return (run_key(self.run), self.step)


def _checkpoints_in(storage: Storage, folder: str, run: str) -> list[CheckpointRef]:
    refs = []
    for e in storage.list(folder):
        step = parse_step(e.name)
        if step is None or not e.is_dir:
            continue
        ok = storage.exists(storage.join(e.path, MANIFEST_NAME))
        refs.append(CheckpointRef(e.path, step, run, ok, e.mtime))
    return refs


def run_folders(storage: Storage, output_dir: str) -> list[tuple[str, str]]:
    return [(e.name, e.path) for e in storage.list(output_dir) if e.is_dir and RUN_RE.match(e.name)]


def scan(storage: Storage, output_dir: str) -> list[CheckpointRef]:
    """Every checkpoint folder under ``output_dir`` (committed or not), oldest first.

    ``output_dir`` may itself be a run folder: then its own checkpoints are listed.
    """
    refs = _checkpoints_in(storage, output_dir, "")
    for name, path in run_folders(storage, output_dir):
        refs.extend(_checkpoints_in(storage, path, name))
    refs.sort(key=lambda r: r.order)
    return refs


def committed(storage: Storage, output_dir: str) -> list[CheckpointRef]:
    return [r for r in scan(storage, output_dir) if r.committed]


def latest(storage: Storage, output_dir: str) -> CheckpointRef | None:
    refs = committed(storage, output_dir)
    return refs[-1] if refs else None


def writer_rank(name: str) -> int | None:
    """The rank that wrote ``__<rank>_<n>.distcp``; ``None`` for any other file."""
    if not (name.startswith("__") and name.endswith(".distcp")):
        return None
    head = name[2:].split("_", 1)[0]
    return int(head) if head.isdigit() else None
