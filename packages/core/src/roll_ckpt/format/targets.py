"""The folder a command reads: a checkpoint, a step made of components, or one part of it.

A part is checked against its step's manifest; a step that is not committed is an error
naming its missing parts (one of its committed parts may still be named).
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from .layout import basename, parent

__all__ = ["resolve", "uncommitted_step", "not_committed", "part_in_step"]


def uncommitted_step(storage: Any, path: str) -> Any:
    """The :class:`~roll_ckpt.format.layout.PartsStatus` of ``path`` when it is the folder of a
    step made of components that is not committed; ``None`` otherwise."""
    from .layout import parse_step
    from .manifest import MANIFEST_NAME

    if parse_step(basename(path)) is None or not storage.isdir(path) \
            or storage.exists(storage.join(path, MANIFEST_NAME)):
        return None
    from .layout import parts_status

    status = parts_status(storage, path)
    return status if status.any else None


def not_committed(status: Any, component: str | None = None) -> str:
    """Why the step folder of ``status`` is not a checkpoint, and what to do."""
    path = status.path
    if status.complete:
        return (f"{path} is not a committed step: every part is committed ({', '.join(status.committed)}) but "
                "not the step itself (no manifest.json: the last part's process stopped before writing it); "
                "the next resume of any component commits it. One part alone: --component NAME")
    have = ", ".join(status.committed) or "none"
    if status.missing is None:
        lacking = "which other parts it needs is unknown (no step beside it is committed)"
    else:
        lacking = "missing: " + ", ".join(f"{n} (unfinished)" if n in status.unfinished else n for n in status.missing)
    asked = f"; --component {component}: that part is not committed" if component else ""
    hint = f"; check a committed part alone with --component {status.committed[0]}" if status.committed else ""
    return (f"{path} is not a committed step (parts committed: {have}; {lacking}){asked}: a save that never "
            f"finished or is still running, never resumed from; use an earlier step{hint}")


def resolve(storage: Any, path: str, component: str | None) -> tuple[str, str]:
    """The folder a command reads -- ``path``, or its ``component``'s part -- and a note
    for the user (empty when none).

    A part is checked against the step's manifest (:func:`roll_ckpt.format.components.open_part`).
    A step that is not committed is an error naming its missing parts, except that one of
    its committed parts may be named with ``component`` (with a note saying so).
    """
    from .components import open_part
    from .manifest import read_manifest

    status = uncommitted_step(storage, path)
    if status is not None:
        if component and component in status.committed:
            return storage.join(path, component), (
                f"note: step {status.step} is not committed ({status.describe()}); its part '{component}' is "
                "committed on its own and checked against its own manifest only")
        raise CheckpointNotFoundError(not_committed(status, component))
    manifest = read_manifest(storage, path)
    if manifest.component is not None and component in (None, manifest.component):
        faults, note = part_in_step(storage, path, manifest)  # the folder of one part, given directly
        if faults:
            raise CheckpointCorruptError(path, faults)
        return path, note
    if component is None:
        return path, ""
    parts = manifest.parts
    if parts:
        if component not in parts:
            raise CheckpointNotFoundError(f"{path} has no part for component '{component}' (its components: "
                                          f"{', '.join(sorted(parts))}); name one of them")
        return open_part(storage, path, manifest, component), ""
    if manifest.component is not None:
        raise CheckpointNotFoundError(
            f"{path} is the part of component '{manifest.component}', not of '{component}'; give the step "
            f"folder ({parent(path)}) with --component {component}, or this part without --component")
    raise CheckpointNotFoundError(f"{path} was saved without components, so it has no part '{component}'; "
                                  "drop --component")


def part_in_step(storage: Any, path: str, manifest: Any) -> tuple[list[tuple[str, str]], str]:
    """For the folder of one part: faults if the step it is in committed another manifest
    for it, and a note when that step is not committed."""
    from .components import open_part
    from .layout import parse_step
    from .manifest import MANIFEST_NAME
    from .manifest import read_manifest

    step_dir = parent(path)
    if manifest.component is None or not step_dir or parse_step(basename(step_dir)) is None:
        return [], ""
    status = uncommitted_step(storage, step_dir)
    if status is not None:
        return [], (f"note: its step {step_dir} is not committed yet ({status.describe()}); a step counts once "
                    "every part is committed")
    if not storage.exists(storage.join(step_dir, MANIFEST_NAME)):
        return [], ""
    try:
        step = read_manifest(storage, step_dir)
        open_part(storage, step_dir, step, manifest.component)
    except CheckpointNotFoundError:
        return [(MANIFEST_NAME, f"step {manifest.step}'s manifest ({step_dir}/{MANIFEST_NAME}) has no part "
                                f"'{manifest.component}': this folder is not part of that step")], ""
    except CheckpointCorruptError as exc:
        why = "; ".join(f"{name}: {fault}" for name, fault in exc.faults)
        return [(MANIFEST_NAME, f"is not the part's manifest its step committed ({step_dir}: {why})")], ""
    return [], ""
