"""Steps made of several components (actor, critic, driver...), committed as one.

::

    checkpoint-<step>/
        actor_train/     manifest.json, trainer_state.json, dcp/...   one part per component,
        critic/          manifest.json, trainer_state.json, dcp/...   each written by its own
        pipeline/        manifest.json, trainer_state.json, state/... processes and group
        manifest.json    the step's manifest: written last, create-only

A part commits the way a whole checkpoint does (rename of a fsynced temporary sibling on
POSIX disks, its manifest last on object stores), inside the step folder. Right after,
its manager looks at the step folder: once every expected part has its manifest, it
writes the step's manifest -- every file of every part, under the part's name, the
parts' own manifests included -- with create-only semantics. Several parts may find the
step complete at the same moment; the storage lets exactly one create succeed, and that
process runs retention and replication for the step. No service, no collective across
components: the part that commits last always sees the others (each looks after its own
commit), so a complete step is always committed.

The step's manifest is a function of the parts' manifests only (``created`` is the
newest part's), so two writers would write the same bytes: a store that cannot refuse a
second create still ends up with one consistent manifest.

**Which parts a step needs** is ``checkpoint_config.components`` of the manager that
commits the part, together with the list each committed part's manager had (its manifest's
``extra.expects``): a driver that knows every component can name them all while each worker
names only itself and the driver, and the step still waits for every part.

**Files at the step's root.** A part may ask for some of its files to be published at the
step's folder too (its manifest's ``extra.step_root``: the Hugging Face files of the actor,
which ROLL keeps at ``checkpoint-<step>/`` for rollout engines). The process that commits
the step makes each one there from the part's own (a hard link on disks, a server-side
copy on object stores) before it writes the step's manifest, which lists them with the
part's size and checksum.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterable

from ..contracts import Storage
from .commit import take_over_file
from .manifest import COMPONENTS_KEY, hash_bytes, hash_stream, MANIFEST_NAME, FileEntry, Manifest
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError, RollCkptError
from .layout import committed_parts, parent, scan

log = logging.getLogger("roll_ckpt")

__all__ = ["ComponentSteps", "COMPONENTS_KEY", "EXPECTS_KEY", "STEP_FILES_KEY", "STEP_ROOT_KEY", "step_manifest", "try_complete", "complete_pending",
           "expected_parts", "open_part", "check_component", "check_part_free", "read_resume_record"]


EXPECTS_KEY = "expects"
"""``manifest.extra[EXPECTS_KEY]`` of a part: the components its manager's config lists."""

STEP_FILES_KEY = "step_files"
"""``manifest.extra[STEP_FILES_KEY]`` of a step: files at its root that no part holds, written
there by the program whose step it is (verl's trainer's ``data.pt``), covered by the step's manifest."""

STEP_ROOT_KEY = "step_root"
"""``manifest.extra[STEP_ROOT_KEY]`` of a part: its files published at the step's folder too."""


def _parts(step: int, parts: dict[str, bytes], step_path: str) -> dict[str, Manifest]:
    out = {}
    for name in sorted(parts):
        try:
            part, _ = Manifest.from_bytes(parts[name])
        except ValueError as exc:
            raise CheckpointCorruptError(step_path, [(f"{name}/{MANIFEST_NAME}", str(exc))]) from None
        if part.step != step or part.component != name:
            raise CheckpointCorruptError(step_path, [(
                f"{name}/{MANIFEST_NAME}",
                f"belongs to component {part.component!r} at step {part.step}, not {name!r} at step {step}")])
        out[name] = part
    return out


def _root_files(manifests: dict[str, Manifest], step_path: str) -> dict[str, tuple[str, FileEntry]]:
    """``name -> (component, entry)`` of the files the parts publish at the step's root."""
    out: dict[str, tuple[str, FileEntry]] = {}
    for name, part in manifests.items():
        for rel in part.extra.get(STEP_ROOT_KEY) or ():
            entry = part.files.get(rel)
            if entry is None or "/" in rel or rel == MANIFEST_NAME or rel in manifests:
                raise CheckpointCorruptError(step_path, [(f"{name}/{MANIFEST_NAME}", f"publishes {rel!r} at the "
                                                          "step's root, which is not one of its top-level files")])
            if rel in out:
                raise CheckpointCorruptError(step_path, [(f"{name}/{MANIFEST_NAME}", f"publishes {rel!r} at the "
                                                          f"step's root, as the part of {out[rel][0]} does")])
            out[rel] = (name, entry)
    return out


def step_manifest(step: int, parts: dict[str, bytes], step_path: str = "") -> Manifest:
    """The step's manifest over ``parts`` (each part's manifest bytes, by component)."""
    return _step_manifest(step, parts, _parts(step, parts, step_path), step_path)


def _step_manifest(step: int, parts: dict[str, bytes], manifests: dict[str, Manifest], step_path: str,
                   own: dict[str, FileEntry] | None = None) -> Manifest:
    files: dict[str, FileEntry] = {}
    summary: dict[str, dict] = {}
    created = ""
    for name, part in manifests.items():
        for rel, entry in part.files.items():
            files[f"{name}/{rel}"] = entry
        size, digest = hash_bytes(parts[name])
        files[f"{name}/{MANIFEST_NAME}"] = FileEntry(size, digest)
        summary[name] = {"world_size": part.world_size, "strategy": part.extra.get("strategy"),
                         "created": part.created}
        created = max(created, part.created)
    for rel, (_, entry) in _root_files(manifests, step_path).items():
        files[rel] = entry
    extra: dict[str, Any] = {COMPONENTS_KEY: summary}
    if own:
        files.update(own)
        extra[STEP_FILES_KEY] = sorted(own)
    return Manifest(step=step, files=files, created=created, world_size=1, component=None, extra=extra)


def expected_parts(manifests: dict[str, Manifest], configured: Iterable[str]) -> set[str]:
    """The parts a step needs: ``configured`` and every list a committed part's manager had."""
    out = set(configured)
    for part in manifests.values():
        out.update(part.extra.get(EXPECTS_KEY) or ())
    return out


def _publish_root_files(storage: Storage, step_path: str, manifests: dict[str, Manifest]) -> None:
    """Make the files the parts publish at the step's root there, each from its part's copy."""
    here = {e.name: e.size for e in storage.list(step_path) if not e.is_dir}
    made = False
    for rel, (name, entry) in _root_files(manifests, step_path).items():
        if here.get(rel) == entry.size:
            continue  # made by another process committing the step at the same moment
        dst = storage.join(step_path, rel)
        storage.remove(dst)
        try:
            take_over_file(storage, storage.join(step_path, name, rel), dst)
        except FileExistsError:
            pass
        made = True
    if made:
        storage.sync_dir(step_path)


def try_complete(storage: Storage, step_path: str, step: int, expected: Iterable[str],
                 files: Iterable[str] = ()) -> Manifest | None:
    """Commit the step when every expected part is committed; its manifest if this call did.

    ``expected``: the parts this manager's config lists; those the committed parts' managers
    listed are needed too. ``files``: files at the step's root that belong to the step itself
    (written there by the program whose step it is), hashed now and covered. ``None`` when a
    part is still missing, or when another process committed the step first (the storage
    refused our create).
    """
    if storage.exists(storage.join(step_path, MANIFEST_NAME)):
        return None
    parts = committed_parts(storage, step_path)
    manifests = _parts(step, parts, step_path)
    if not expected_parts(manifests, expected) <= set(parts):
        return None
    own = {}
    for name in files:
        if "/" in name or name == MANIFEST_NAME or name in parts:
            raise RollCkptError(f"{name!r} is not a file of the step's own at {step_path}")
        with storage.open_read(storage.join(step_path, name)) as f:
            own[name] = FileEntry(*hash_stream(f)[:2])
    manifest = _step_manifest(step, parts, manifests, step_path, own)
    _publish_root_files(storage, step_path, manifests)
    try:
        storage.write_create(storage.join(step_path, MANIFEST_NAME), manifest.to_bytes())
    except FileExistsError:
        return None
    return manifest


class ComponentSteps:
    """A component's commits made steps: the commit hook that turns "this part is committed"
    into "the step is committed" once every part is (the saver runs the checkpoint's commit
    hooks, retention and replication, only then).

    ``component``: the part this manager saves; ``cc``: its ``checkpoint_config``
    (``components``, ``commit_steps``); ``announce(path, manifest)``: ``roll_ckpt_on_commit``
    for a step committed here.
    """

    def __init__(self, component: str, cc: Any, announce: Any) -> None:
        self.component = component
        self.expected = tuple(cc.components or ())
        self.commit_steps = bool(cc.commit_steps)
        self.announce = announce

    def manifest_part(self, storage: Storage, write_path: str, save: Any, state: Any) -> tuple[dict, dict]:
        """The part's manifest names every part this manager knows of: the step waits for them all."""
        return {}, {EXPECTS_KEY: list(self.expected)}

    def after_part(self, storage: Storage, part_path: str, step: int) -> str | None:
        """The part at ``part_path`` is committed: the step's folder when that committed the step
        here, else ``None`` (a part still missing, another process's create won, or something
        else commits the steps: ``commit_steps: false``)."""
        if not self.commit_steps:
            return None  # another commits the step: it knows which parts it has
        step_path = parent(part_path)
        return step_path if self.commit(storage, step_path, step, self.expected) else None

    def commit(self, storage: Storage, step_path: str, step: int, parts: Iterable[str], files: Iterable[str] = ()) -> bool:
        """Commit the step at ``step_path`` when ``parts`` are all committed (``files``: its own
        files at its root); True when this call did. A failure is logged, not raised: the parts
        are committed, and the next resume commits the step once every part is there."""
        try:
            manifest = try_complete(storage, step_path, step, parts, files=files)
        except Exception as exc:
            log.warning("roll-ckpt: the part of %s is committed, but committing step %d failed (%s: %s); the "
                        "next resume commits the step once every part is there", self.component, step,
                        type(exc).__name__, exc)
            return False
        if manifest is None:
            return False
        self.announce(step_path, manifest)
        log.info("roll-ckpt: step %d committed (every component's part is in %s)", step, step_path)
        return True


def complete_pending(storage: Storage, root: str, expected: Iterable[str]) -> list[tuple[str, Manifest]]:
    """Commit the steps under ``root`` whose parts are all committed but whose own manifest
    is missing (the last part's process died between the two); returns ``(path, manifest)``.

    A step with a damaged part is left alone (``roll-ckpt verify`` names the file): it
    must not keep the other steps from being resumed.
    """
    expected = tuple(expected)
    done = []
    for ref in scan(storage, root):
        if ref.committed:
            continue
        try:
            manifest = try_complete(storage, ref.path, ref.step, expected)
        except CheckpointCorruptError as exc:
            log.warning("roll-ckpt: %s stays uncommitted: %s", ref.path, exc)
            continue
        if manifest is not None:
            done.append((ref.path, manifest))
    return done


def open_part(storage: Storage, step_path: str, step: Manifest, component: str) -> str:
    """The folder of ``component``'s part of a committed step, its manifest checked against the step's.

    Raises :class:`CheckpointNotFoundError` when the step has no such part and
    :class:`CheckpointCorruptError` when the part's manifest is not the one the step committed.
    """
    parts = step.parts
    if component not in parts:
        held = ", ".join(sorted(parts)) or "no components"
        raise CheckpointNotFoundError(
            f"{step_path} has no part for component '{component}' (it holds {held}); use a step that has "
            "it, or check the component's name against checkpoint_config.components")
    name = f"{component}/{MANIFEST_NAME}"
    path = storage.join(step_path, component)
    entry = step.files.get(name)
    try:
        with storage.open_read(storage.join(path, MANIFEST_NAME)) as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointCorruptError(step_path, [(name, "missing")]) from None
    size, digest = hash_bytes(data)
    if entry is None or (size, digest) != (entry.size, entry.checksum):
        raise CheckpointCorruptError(step_path, [(name, "is not the part's manifest the step committed "
                                                        "(checksum mismatch)")])
    return path


def check_component(component: str | None, cc: Any) -> str | None:
    """``component`` when ``checkpoint_config`` (``cc``) allows a manager for it, else a ConfigError."""
    names = cc.components or ()
    if component is None:
        if names:
            raise ConfigError("checkpoint_config.components", "lists the parts of each step, so every manager "
                              "saves one of them", list(names),
                              "CheckpointManager(config, component=<one of them>)")
        return None
    if not names:
        raise ConfigError("checkpoint_config.components", f"is not set, but a manager was created for "
                          f"component '{component}'", None,
                          f"the list of every component that saves a step, e.g. [{component}, ...]")
    if component not in names:
        raise ConfigError("checkpoint_config.components", f"does not list component '{component}'",
                          list(names), "one of the listed names")
    if not cc.run_name and cc.timestamp_subdir:
        raise ConfigError("checkpoint_config.run_name", "is needed with components: every component of one "
                          "launch must write the same run folder", None,
                          "a name the driver picks once per launch (roll_ckpt.new_run_name()) and gives to "
                          "every component, e.g. run_name: ${env:ROLL_CKPT_RUN_NAME}")
    return component


def check_part_free(storage: Storage, part_path: str, step: int, component: str) -> None:
    """Refuse to write the part at ``part_path`` when it, or its step, is committed already."""
    step_path = parent(part_path)
    if storage.exists(storage.join(step_path, MANIFEST_NAME)):
        raise RollCkptError(f"step {step} is already committed at {step_path}; a part cannot be added "
                            "to it. Save another step, or delete it with 'roll-ckpt prune'")
    if storage.exists(storage.join(part_path, MANIFEST_NAME)):
        raise RollCkptError(
            f"{part_path} is already committed: by an earlier launch that used the same "
            "checkpoint_config.run_name (each launch needs a new one, roll_ckpt.new_run_name(), picked "
            "once by the driver), or by a second manager for component "
            f"'{component}' in this launch")


def read_resume_record(storage: Storage, path: str) -> list[tuple[str, bool]] | None:
    """The resume candidates another component of this launch chose (``None``: none yet)."""
    try:
        with storage.open_read(path) as f:
            body = json.loads(f.read().decode())
        return [(str(p), bool(b)) for p, b in body["candidates"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RollCkptError(f"{path} is damaged ({exc}): it records where this launch's components resume "
                            "from; remove it and restart every component") from None
