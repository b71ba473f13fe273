"""Folders that look like checkpoints under ``output_dir``: roll-ckpt's, other frameworks'
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
not a committed roll-ckpt checkpoint: a resume from roll-ckpt's own checkpoints imports and
asks no format plugin.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from ..contracts import ForeignCheckpoint, FormatRecord, Storage
from .layout import CKPT_RE, DCP_DIR, RUN_RE, TRAINER_STATE, basename, parent, run_key
from .manifest import MANIFEST_NAME
from .commit import MARKER_PREFIX

__all__ = ["Found", "Formats", "FORMAT_EXTRAS", "recognize", "survey", "passed_over", "what_is", "not_committed", "LOOKS_LIKE"]

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
    from .components import parts_status

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
    runs = [(e.name, storage.list(e.path)) for e in top if e.is_dir and RUN_RE.match(e.name)]
    for run, entries in [("", top), *runs]:
        names = [e.name for e in entries]
        for e in entries:
            if not e.is_dir or (not run and RUN_RE.match(e.name)):  # (a run folder: its entries are)
                continue
            step = _step_of(e.name, formats)
            if step is not None:
                out.append(_judge(storage, e.path, step, run, formats, components, _marked(names, e.name)))
    out.sort(key=lambda f: f.order)
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
