"""roll-ckpt verify and inspect: a checkpoint, a step of components or one part, against its manifest."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointNotFoundError, RollCkptError
from ._common import (basename, component_arg, foreign_at, foreign_verdict, formats, human_bytes, is_checkpoint_dir,
                      open_storage_arg, parent_dir, part_in_step, progress_bar, resolve, say, storage_args)


def _damaged(path: str, faults: list[tuple[str, str]]) -> tuple[bool, str]:
    say(f"DAMAGED  {path}")
    say(*(f"  {name}: {fault}" for name, fault in faults))
    return False, f"checkpoint {path} is damaged ({len(faults)} bad file(s), listed above); " \
                  "resume from an earlier checkpoint or a backup copy"


def _verify_one(storage: Any, path: str) -> tuple[bool, str]:
    """Verify one checkpoint: a whole one, a step made of components (every file, and each
    part's manifest), or one part (also against its step's manifest)."""
    from .inspection import part_faults
    from ..format.manifest import read_manifest, verify

    manifest = read_manifest(storage, path)
    total = sum(e.size for e in manifest.files.values())
    try:
        with progress_bar("verify", total) as progress:
            report = verify(storage, path, on_bytes=progress)
    except CheckpointCorruptError as exc:
        return _damaged(path, exc.faults)
    m = report.manifest
    faults = part_faults(storage, path, m)
    extra, note = part_in_step(storage, path, m)
    if faults or extra:
        return _damaged(path, faults + extra)
    parts = m.parts
    what = f"step {m.step}" + (f", component {m.component}" if m.component else "")
    tail = f"; {len(parts)} components ({', '.join(sorted(parts))}), each part's manifest matches the step's" \
        if parts else ""
    say(f"OK  {path}  {what}: {report.files} files, {human_bytes(report.bytes)}, "
         f"sizes and checksums match the manifest{tail}")
    if note:
        say(note)
    hf = m.extra.get("hf") if isinstance(m.extra.get("hf"), dict) else {}
    if hf.get("status") == "written":
        say(f"    with the Hugging Face files of {hf.get('architecture') or 'the model'} ({hf.get('files')} files, "
            "covered by the manifest)")
    elif hf.get("status") == "failed":
        say(f"    NOTE: its Hugging Face files could not be written ({hf.get('error')}); the training state is "
            "complete; `roll-ckpt export --format hf` writes them from it")
    return True, ""


def cmd_verify(args: argparse.Namespace) -> int:
    from ..format.layout import survey
    from ..format.layout import parse_step

    from ..format.manifest import MANIFEST_NAME
    from .ls_local import local_units

    storage = open_storage_arg(args, args.path)
    root = storage.root
    component = args.component
    foreign = foreign_at(storage, root)
    if foreign is not None:  # another framework's checkpoint: complete or not, no checksums
        ok, why = foreign_verdict(foreign)
        if not ok:
            raise RollCkptError(why)
        return 0
    units = None if storage.exists(storage.join(root, MANIFEST_NAME)) else local_units(storage, root)
    if units is not None:  # the fast recovery tier: every unit of a local.dir, a node or a step folder
        bad = []
        for unit in units:
            if not storage.exists(storage.join(unit, MANIFEST_NAME)):
                say(f"SKIP  {unit}  not committed (a local save that never finished)")
            elif not _verify_one(storage, unit)[0]:
                bad.append(unit)
        if bad:
            raise RollCkptError(f"{len(bad)} damaged local unit(s) under {args.path}: {', '.join(bad)}")
        return 0
    if is_checkpoint_dir(storage, root) or not storage.isdir(root):
        try:
            target, _ = resolve(storage, root, component)
        except CheckpointCorruptError as exc:  # the part's manifest is not the one the step committed
            _, why = _damaged(exc.checkpoint, exc.faults)
            raise RollCkptError(why) from None
        # (a committed part of a step that is not: _verify_one notes it, as for a part's folder)
        ok, why = _verify_one(storage, target)
        if not ok:
            raise RollCkptError(why)
        return 0
    parent = parent_dir(root)
    if parent and parse_step(basename(parent)) is not None:  # a part's folder without its manifest
        raise CheckpointNotFoundError(
            f"{args.path} is not committed (no manifest.json): it is the folder of the part of component "
            f"'{basename(root)}' of step {parse_step(basename(parent))}, from a save that never finished "
            "or is still running; use an earlier step")
    # A folder of checkpoints (output_dir or a run folder): verify every committed one.
    refs = survey(storage, root, formats)
    if not refs:
        raise CheckpointNotFoundError(f"{args.path} is neither a checkpoint nor a folder of checkpoints")
    bad = []
    checked = 0
    for ref in refs:
        if ref.foreign is not None:
            if not foreign_verdict(ref.foreign)[0]:
                bad.append(ref.path)
            continue
        if not ref.committed:
            say(f"SKIP  {ref.path}  not committed: {ref.reason}")
            continue
        target = ref.path
        if component:
            try:
                target, _ = resolve(storage, ref.path, component)
            except CheckpointCorruptError as exc:
                _damaged(exc.checkpoint, exc.faults)
                bad.append(ref.path)
                continue
            except CheckpointNotFoundError:
                say(f"SKIP  {ref.path}  has no part for component '{component}'")
                continue
        checked += 1
        ok, _ = _verify_one(storage, target)
        if not ok:
            bad.append(target)
    if bad:
        raise RollCkptError(f"{len(bad)} damaged checkpoint(s) under {args.path}: {', '.join(bad)}")
    if component and not checked:
        raise CheckpointNotFoundError(f"no committed step under {args.path} has a part for component "
                                      f"'{component}'; `roll-ckpt ls {args.path}` shows each step's components")
    return 0



def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspection import format_inspection, inspect_checkpoint
    from ..format.manifest import read_manifest

    storage = open_storage_arg(args, args.path)
    foreign = foreign_at(storage, storage.root)
    if foreign is not None:
        files = foreign.files()
        say(f"{foreign.path}", f"  {foreign.title}, step {foreign.step}: {len(files)} files, "
            f"{human_bytes(sum(files.values()))}; parts: {', '.join(foreign.components()) or 'none'}",
            "  written by another framework: no manifest, no checksums; roll-ckpt resumes it read-only",
            *(f"  NOT RESUMABLE: {p}" for p in foreign.problems),
            *([f"  NOT A RESUME POINT: it {foreign.not_resumable}"] if getattr(foreign, "not_resumable", "") else []),
            "", *foreign.describe())
        return 0
    target, note = resolve(storage, storage.root, args.component)
    manifest = read_manifest(storage, target)
    if any(name.startswith("dcp/") for name in manifest.files) and not manifest.extra.get("components"):
        from ..dcp import reader as dcp_read  # noqa: F401  (torch: imported before the progress bar starts its clock)
    total = sum(e.size for e in manifest.files.values())
    with progress_bar("verify", total) as progress:
        ins = inspect_checkpoint(storage, target, on_bytes=progress)
    if note:
        say(note, "")
    say(format_inspection(ins))
    return 0


def add_verify_parser(sub: Any) -> None:
    p = sub.add_parser("verify", help="check sizes and checksums against the manifest")
    p.add_argument("path", metavar="PATH", help="a checkpoint-<step> folder (or one component's part of it), "
                                                "or a folder of checkpoints")
    component_arg(p, "verify only this component's part of the step (of every step, for a folder)")
    storage_args(p)
    p.set_defaults(func=cmd_verify)


def add_inspect_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help="verify, then show manifest, trainer state and DCP keys")
    p.add_argument("path", metavar="PATH", help="a checkpoint-<step> folder, or one component's part of it")
    component_arg(p, "show this component's part of the step (trainer state, DCP keys or driver state)")
    storage_args(p)
    p.set_defaults(func=cmd_inspect)
