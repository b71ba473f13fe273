"""Where checkpoints live, and what the folders under ``output_dir`` are: how checkpoints are
named, found and ordered, which folders are other frameworks' checkpoints or unusable, and
what a step whose parts are not all committed holds.

::

    <output_dir>/<YYYYmmdd-HHMMSS>/checkpoint-<step>/   (timestamp_subdir: true)
    <output_dir>/checkpoint-<step>/                     (timestamp_subdir: false)

Checkpoints are ordered by run (the run folder's timestamp; checkpoints directly under
``output_dir`` count as the oldest run) and then by step as a number, never by name: a
run that resumed from an earlier step and went on is newer than the run it came from.

**Folders that look like checkpoints** under ``output_dir``: roll-ckpt's, other frameworks'
(recognized by format plugins, :class:`~roll_ckpt.contracts.FormatRecord`), saves that never
committed, and folders nothing here can read.

``latest`` resumes from the newest *usable* one -- a committed roll-ckpt checkpoint, or
another framework's that is complete (and, with components, holds every component) -- and
names every newer folder it passed over, with the reason (:func:`survey`,
:func:`passed_over`): a resume never starts from step 0, nor from an older step, without
saying why. :func:`what_is` says the same of one folder, for an explicit path.

Nothing here reads tensor data or unpickles anything: a format's ``recognize`` looks at
names, sizes and small JSON files; what it finds wrong is in ``problems``.

The formats come as a function (``Plugins.formats``) that is called only for a folder that is
neither a committed roll-ckpt checkpoint nor a hidden one (temporary folders, markers): a
resume from an ``output_dir`` that holds only roll-ckpt's checkpoints asks no format plugin
(a ``logs/`` folder beside them does: its name might be another framework's checkpoint's).

**A step not committed, part by part** (:func:`parts_status`): which parts of a step made of
components (:mod:`roll_ckpt.format.components`) are committed, unfinished or missing.
"""

from __future__ import annotations

import logging
import re
from operator import attrgetter
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Iterable, Mapping

from ..contracts import ForeignCheckpoint, FormatRecord, Storage
from .manifest import MANIFEST_NAME, Manifest

__all__ = ["CheckpointRef", "NAME_FORMATS", "scan", "committed", "latest", "checkpoint_name", "run_name",
           "new_run_name", "run_key", "parse_step", "parent", "basename", "RUN_RE", "DCP_DIR", "TRAINER_STATE", "writer_rank", 'Found', 'Formats', 'FORMAT_EXTRAS', 'recognize', 'survey', 'passed_over', 'what_is', 'not_committed', 'LOOKS_LIKE', "PartsStatus", "parts_status", "expected_components", "committed_parts"]

RUN_RE = re.compile(r"^(\d{8}-\d{6})(?:-(\d+))?$")
NAME_FORMATS = ("checkpoint-{step}", "global_step_{step}", "step-{step}")
"""How a checkpoint folder may be named (``checkpoint_config.name_format``): roll-ckpt's own,
verl's (``global_step_N``), torchtitan's (``step-N``). Each is a prefix and the step."""
CKPT_RE = re.compile(r"^(?:checkpoint-|global_step_|step-)(\d+)$")
TMP_PREFIX = ".tmp-"
MARKER_PREFIX = ".inflight-"
"""How an owner marker's name starts: it lies beside the folder being written or removed
(:mod:`roll_ckpt.format.commit`)."""
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


# ---- folders that look like checkpoints ------------------------------------

log = logging.getLogger("roll_ckpt")

Formats = Callable[[], Mapping[str, FormatRecord]]
"""The installed formats, asked for only when a folder needs them (``Plugins.formats``)."""

LOOKS_LIKE = re.compile(r"^(?:checkpoint|global_step|step|iter)[-_]?(\d+)$")
"""Folder names training frameworks give checkpoints (``checkpoint-500``, ``global_step_500``,
``step-500``, ``iter_0000500``): such a folder that nothing can read is named when passed over."""

FORMAT_EXTRAS = {"roll": 'pip install "roll-ckpt[roll]"', "torchtitan": 'pip install "roll-ckpt[torchtitan]"',
                 "verl": 'pip install "roll-ckpt[verl]"'}
"""The format plugins roll-ckpt ships, and what installs each (named when nothing reads a folder)."""


@dataclass(frozen=True)
class Found:
    """One folder under ``output_dir`` that looks like a checkpoint."""

    path: str
    step: int
    run: str
    """Its run folder's name; empty directly under ``output_dir``."""
    committed: bool
    """A committed roll-ckpt checkpoint (its ``manifest.json`` is there)."""
    foreign: ForeignCheckpoint | None = None
    reason: str = ""
    """Why it cannot be resumed from; empty when it can."""
    ours: bool = True
    """roll-ckpt's (committed or not); false for another framework's or an unknown folder."""

    @property
    def usable(self) -> bool:
        return not self.reason

    @property
    def order(self) -> tuple:
        return (run_key(self.run), self.step)

    @property
    def kind(self) -> str:
        """``roll-ckpt``, the format's name, or ``unknown``."""
        if self.foreign is not None:
            return self.foreign.format
        return "roll-ckpt" if self.ours else "unknown"


def recognize(storage: Storage, path: str, formats: Mapping[str, FormatRecord],
              any_name: bool = False) -> ForeignCheckpoint | None:
    """The checkpoint at ``path`` as the first format whose folder names match it recognizes it
    (``any_name``: whatever the folder's name, as for a path the user gave; the formats whose
    names match are asked first: two frameworks may write the same files, as ROLL's older
    layout and verl's do, in folders named their own way)."""
    name = basename(path)
    matching = [r for r in formats.values() if re.match(r.folder_pattern, name)]
    others = [r for r in formats.values() if r not in matching] if any_name else []
    for record in matching + others:
        try:
            found = record.recognize(storage, path)
        except Exception as exc:  # a plugin's bug must not stop a resume from roll-ckpt's own checkpoints
            log.warning("roll-ckpt: the %s format (%s) failed on %s: %s: %s", record.name,
                        record.distribution or "?", path, type(exc).__name__, exc)
            continue
        if found is not None:
            return found
    return None


def _step_of(name: str, formats: Formats) -> int | None:
    m = CKPT_RE.match(name)  # roll-ckpt's own name: no format asked
    if m:
        return int(m.group(1))
    if name.startswith("."):  # a temporary folder or a marker: nobody's checkpoint
        return None
    for pattern in [*(r.folder_pattern for r in formats().values()), LOOKS_LIKE.pattern]:
        m = re.match(pattern, name)
        if m:
            return int(m.group(1))
    return None


def _installed(formats: Mapping[str, FormatRecord]) -> str:
    names = ", ".join(sorted(formats)) or "none"
    hints = [f"{name}: {hint}" for name, hint in FORMAT_EXTRAS.items() if name not in formats]
    return f"installed formats: {names}" + (f"; {'; '.join(hints)}" if hints else "")


def not_committed(storage: Storage, path: str, formats: Formats) -> tuple[bool, str]:
    """Whether a folder without ``manifest.json`` that no format recognizes is roll-ckpt's, and
    why it cannot be resumed."""
    status = parts_status(storage, path)
    if status.any:
        if status.complete:
            return True, (f"a step whose parts are all committed ({', '.join(status.committed)}) but not the step "
                          "itself (the next resume of a component of its launch commits it)")
        return True, f"a step that never committed (parts: {status.describe()})"
    names = {e.name for e in storage.list(path)}
    if not names:
        return True, "an empty folder (a save that stopped before writing anything)"
    if names & {TRAINER_STATE, DCP_DIR, "state"} and CKPT_RE.match(basename(path)):
        return True, "a roll-ckpt save that never committed (no manifest.json)"
    return False, f"no manifest.json, and no installed format recognizes it ({_installed(formats())})"


def _marked(names: Iterable[str], folder_name: str) -> bool:
    """An owner marker of a roll-ckpt save of ``folder_name`` is among ``names`` (its parent's
    entries): a save in progress, or one a crash left (object stores write in place)."""
    prefix = f"{MARKER_PREFIX}{folder_name}-"
    return any(n.startswith(prefix) for n in names)


def _judge(storage: Storage, path: str, step: int, run: str, formats: Formats,
           components: Iterable[str] | None, marked: bool = False, any_name: bool = False) -> Found:
    if CKPT_RE.match(basename(path)) and storage.exists(storage.join(path, MANIFEST_NAME)):
        return Found(path, step, run, True)
    if marked:
        return Found(path, step, run, False, None, "a roll-ckpt save in progress, or one a crash left (its owner "
                                                   "marker is beside it)")
    foreign = recognize(storage, path, formats(), any_name)
    if foreign is None:
        ours, reason = not_committed(storage, path, formats)
        return Found(path, step, run, False, None, reason, ours)
    if foreign.problems:
        return Found(path, step, run, False, foreign,
                     f"a {foreign.title} that was never finished: {'; '.join(foreign.problems)}", False)
    refusal = getattr(foreign, "not_resumable", "")
    if refusal:  # whole, but not a resume point (a model-only export)
        return Found(path, step, run, False, foreign, f"a {foreign.title} that {refusal}", False)
    lacking = sorted(set(components or ()) - set(foreign.components()))
    if lacking:
        return Found(path, step, run, False, foreign,
                     f"a {foreign.title} that holds {', '.join(foreign.components()) or 'no part'} but not "
                     f"{', '.join(lacking)} (checkpoint_config.components lists it)", False)
    return Found(path, step, run, False, foreign, "", False)


def survey(storage: Storage, root: str, formats: Formats,
           components: Iterable[str] | None = None) -> list[Found]:
    """Every folder under ``root`` (and its run folders) that looks like a checkpoint,
    oldest first, each judged usable or not (``components``: the parts a step must hold)."""
    components = tuple(components or ())
    out: list[Found] = []
    top = storage.list(root)
    runs = sorted((run_key(e.name), e.name, storage.list(e.path))
                  for e in top if e.is_dir and RUN_RE.match(e.name))
    for _, run, entries in [(None, "", top), *runs]:  # the folders directly under root: the oldest run
        markers = [e.name for e in entries if e.name.startswith(MARKER_PREFIX)]  # (usually none)
        found: list[Found] = []
        for e in entries:
            if not e.is_dir or (not run and RUN_RE.match(e.name)):  # (a run folder: its entries are)
                continue
            step = _step_of(e.name, formats)
            if step is not None:
                found.append(_judge(storage, e.path, step, run, formats, components, _marked(markers, e.name)))
        out += sorted(found, key=attrgetter("step"))
    return out


def passed_over(found: list[Found], chosen: Found | None) -> list[Found]:
    """The unusable folders newer than ``chosen`` (all of them when nothing is usable)."""
    return [f for f in found if not f.usable and (chosen is None or f.order > chosen.order)]


def what_is(storage: Storage, path: str, formats: Formats,
            components: Iterable[str] | None = None) -> Found:
    """``path`` judged as :func:`survey` judges a folder (its step from its name, or -1),
    every format asked whatever the folder's name (a path the user gave)."""
    step = _step_of(basename(path), formats)
    above = parent(path)
    marked = bool(above) and _marked([e.name for e in storage.list(above)], basename(path))
    return _judge(storage, path, -1 if step is None else step, "", formats, components, marked, any_name=True)


# ---- a step not committed, part by part -------------------------------------

def committed_parts(storage: Storage, step_path: str) -> dict[str, bytes]:
    """``component -> manifest bytes`` for every part committed in ``step_path``."""
    out: dict[str, bytes] = {}
    for e in storage.list(step_path):
        if not e.is_dir or e.name.startswith("."):
            continue
        try:
            with storage.open_read(storage.join(e.path, MANIFEST_NAME)) as f:
                out[e.name] = f.read()
        except FileNotFoundError:
            continue
    return out



@dataclass(frozen=True)
class PartsStatus:
    """What the folder of a step that is not committed holds, part by part."""

    path: str
    step: int | None
    committed: list[str]
    """Parts whose own manifest is there (committed on their own)."""
    unfinished: list[str]
    """Parts being written, or left by a crash (a temporary folder, an owner marker, or a
    folder without a manifest), and not committed."""
    missing: list[str] | None
    """The parts the step needs that are not committed; ``None`` when that is unknown (no
    committed step of the same run says which parts a step has)."""
    created: str = ""
    """The newest committed part's ``created``."""

    @property
    def any(self) -> bool:
        return bool(self.committed or self.unfinished)

    @property
    def complete(self) -> bool:
        """Every part is committed, only the step's own manifest is missing."""
        return self.missing == [] and bool(self.committed)

    def describe(self) -> str:
        """One short line, e.g. ``actor_train, critic; pipeline missing``."""
        head = ", ".join(self.committed) if self.committed else "no part committed"
        if self.missing is None:
            rest = [f"{n} unfinished" for n in self.unfinished if n not in self.committed]
            return "; ".join([head, ", ".join(rest + ["others unknown"])])
        if not self.missing:
            return f"{head}; step manifest missing"
        rest = [f"{n} unfinished" if n in self.unfinished else f"{n} missing" for n in self.missing]
        return f"{head}; {', '.join(rest)}"


def expected_components(storage: Storage, step_path: str) -> list[str] | None:
    """The components a step in ``step_path``'s folder is made of, as the newest committed
    step beside it records them (one launch writes one run folder, with one config);
    ``None`` when no step beside it is committed, or it has no components."""
    folder = parent(step_path) if "/" in step_path.rstrip("/") else ""
    if not folder:
        return None
    try:
        entries = storage.list(folder)
    except OSError:
        return None
    steps = sorted(((parse_step(e.name), e.path) for e in entries if e.is_dir and parse_step(e.name) is not None
                    and e.path.rstrip("/") != step_path.rstrip("/")), reverse=True)
    for _, path in steps:
        try:
            with storage.open_read(storage.join(path, MANIFEST_NAME)) as f:
                manifest, _ = Manifest.from_bytes(f.read())
        except (OSError, ValueError):
            continue
        parts = manifest.parts
        return sorted(parts) if parts else None
    return None


def parts_status(storage: Storage, step_path: str, expected: list[str] | None = None,
                 guess: bool = True) -> PartsStatus:
    """Which parts of the (uncommitted) step at ``step_path`` are committed, unfinished, missing.

    ``expected`` is the list of components a step needs; by default (``guess``) it is read
    from the newest committed step beside it (:func:`expected_components`).
    """
    parts = committed_parts(storage, step_path)
    committed = sorted(parts)
    created = ""
    for data in parts.values():
        try:
            created = max(created, Manifest.from_bytes(data)[0].created)
        except ValueError:
            pass
    if expected is None and guess:
        expected = expected_components(storage, step_path)
    unfinished: set[str] = set()
    for e in storage.list(step_path):
        name = e.name
        # Only a part's save leaves a temporary folder or an owner marker inside a step folder.
        if e.is_dir and name.startswith(TMP_PREFIX):
            unfinished.add(name[len(TMP_PREFIX):].rsplit("-", 1)[0])
        elif not e.is_dir and name.startswith(MARKER_PREFIX) and name.endswith(".json"):
            unfinished.add(name[len(MARKER_PREFIX):-len(".json")].rsplit("-", 1)[0])
        elif e.is_dir and expected is not None and name in expected:
            unfinished.add(name)  # written in place (object stores), its manifest not there yet
    unfinished -= set(committed)
    unfinished.discard("")
    missing = None if expected is None else sorted(set(expected) - set(committed))
    return PartsStatus(step_path, parse_step(basename(step_path)), committed, sorted(unfinished), missing, created)
