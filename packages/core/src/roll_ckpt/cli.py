"""The ``roll-ckpt`` command line.

::

    roll-ckpt [--quiet] plugins
    roll-ckpt ls DIR                       every checkpoint under DIR, committed or not
    roll-ckpt verify PATH [--component C]  sizes and checksums against the manifest
    roll-ckpt inspect PATH [--component C] manifest, trainer state, every DCP key
    roll-ckpt prune DIR --keep N           keep the newest N committed checkpoints
    roll-ckpt export PATH [--component C] --out F.safetensors
    roll-ckpt copy SRC DST                 one checkpoint or a folder of them, between any two backends
    roll-ckpt demo [--config F] [--nproc N] [--output DIR] [--resume|--fresh] [--stop-after N]

DIR and PATH are local paths or fsspec URLs; ``--type`` picks the backend plugin and
``--storage-option KEY=VALUE`` passes options to it, as ``checkpoint_config`` would.

Steps made of components (``checkpoint_config.components``, see
:mod:`roll_ckpt.components`): ``ls`` shows each step's parts (and, for a step that is
not committed, which are missing); ``verify`` and ``inspect`` take the step's folder
(every part) or one part (``--component C``, or the part's folder itself); ``export``
writes one part's tensors (``--component C``).

A user error (a :class:`~roll_ckpt.errors.RollCkptError`, a missing path, a bad
argument) prints one line ``roll-ckpt: error: ...`` on stderr and exits 2 for usage
errors, 1 otherwise. Anything else is a bug and keeps its traceback.

Importing this module is cheap: torch is imported only by the commands that read
tensors (inspect, export, demo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Sequence

from .errors import CheckpointCorruptError, CheckpointNotFoundError, RollCkptError

__all__ = ["main", "build_parser"]

PROG = "roll-ckpt"


class UsageError(Exception):
    """A bad command line (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are raised (one line, no usage dump) instead of exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        cmd = self.prog.removeprefix(PROG).strip()
        hint = f"see '{PROG} {cmd + ' ' if cmd else ''}--help'"
        raise UsageError(f"{message} ({hint})")


# --------------------------------------------------------------------------- helpers

def _say(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000, got {text!r}")
    import yaml

    try:  # true/false/numbers like YAML does; anything else stays a string
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if not isinstance(value, (str, int, float, bool)) or value is None:
        value = raw
    return key.strip(), value


def _keep_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: keep at least 1 (the newest committed checkpoint is never removed)")
    return value


def _open(args: argparse.Namespace, url: str) -> Any:
    """The storage for ``url``, rooted there (``storage.root`` is ``url`` as a backend path)."""
    from .manager import open_storage
    from .plugins import get_plugins

    options = dict(args.storage_option or [])
    return open_storage(get_plugins(), args.type, url, options)


def _progress(desc: str, total: int | None = None) -> Any:
    from .progress import Progress

    return Progress(desc, total)


def _local_time(iso: str) -> str:
    from datetime import datetime

    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError):
        return iso or "-"


def _table(header: Sequence[str], rows: list[Sequence[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [fmt(header), *(fmt(r) for r in rows)]


def _is_checkpoint_dir(storage: Any, path: str) -> bool:
    from .layout import parse_step
    from .manifest import MANIFEST_NAME

    name = path.rstrip("/").rsplit("/", 1)[-1]
    return parse_step(name) is not None or storage.exists(storage.join(path, MANIFEST_NAME))


def _require_dir(storage: Any, url: str) -> None:
    if not storage.isdir(storage.root):
        raise CheckpointNotFoundError(f"{url}: no such folder")


# --------------------------------------------------------------------------- components

def _uncommitted_step(storage: Any, path: str) -> Any:
    """The :class:`~roll_ckpt.inspection.PartsStatus` of ``path`` when it is the folder of a
    step made of components that is not committed; ``None`` otherwise."""
    from .layout import parse_step
    from .manifest import MANIFEST_NAME

    if parse_step(_basename(path)) is None or not storage.isdir(path) \
            or storage.exists(storage.join(path, MANIFEST_NAME)):
        return None
    from .inspection import parts_status

    status = parts_status(storage, path)
    return status if status.any else None


def _not_committed(status: Any, component: str | None = None) -> str:
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


def _resolve(storage: Any, path: str, component: str | None) -> tuple[str, str]:
    """The folder a command reads -- ``path``, or its ``component``'s part -- and a note
    for the user (empty when none).

    A part is checked against the step's manifest (:func:`roll_ckpt.components.open_part`).
    A step that is not committed is an error naming its missing parts, except that one of
    its committed parts may be named with ``component`` (with a note saying so).
    """
    from .components import components_of, open_part
    from .verify import read_manifest

    status = _uncommitted_step(storage, path)
    if status is not None:
        if component and component in status.committed:
            return storage.join(path, component), (
                f"note: step {status.step} is not committed ({status.describe()}); its part '{component}' is "
                "committed on its own and checked against its own manifest only")
        raise CheckpointNotFoundError(_not_committed(status, component))
    manifest = read_manifest(storage, path)
    if manifest.component is not None and component in (None, manifest.component):
        faults, note = _part_in_step(storage, path, manifest)  # the folder of one part, given directly
        if faults:
            raise CheckpointCorruptError(path, faults)
        return path, note
    if component is None:
        return path, ""
    parts = components_of(manifest)
    if parts:
        if component not in parts:
            raise CheckpointNotFoundError(f"{path} has no part for component '{component}' (its components: "
                                          f"{', '.join(sorted(parts))}); name one of them")
        return open_part(storage, path, manifest, component), ""
    if manifest.component is not None:
        raise CheckpointNotFoundError(
            f"{path} is the part of component '{manifest.component}', not of '{component}'; give the step "
            f"folder ({_parent(path)}) with --component {component}, or this part without --component")
    raise CheckpointNotFoundError(f"{path} was saved without components, so it has no part '{component}'; "
                                  "drop --component")


def _part_in_step(storage: Any, path: str, manifest: Any) -> tuple[list[tuple[str, str]], str]:
    """For the folder of one part: faults if the step it is in committed another manifest
    for it, and a note when that step is not committed."""
    from .components import open_part
    from .layout import parse_step
    from .manifest import MANIFEST_NAME
    from .verify import read_manifest

    parent = _parent(path)
    if manifest.component is None or not parent or parse_step(_basename(parent)) is None:
        return [], ""
    status = _uncommitted_step(storage, parent)
    if status is not None:
        return [], (f"note: its step {parent} is not committed yet ({status.describe()}); a step counts once "
                    "every part is committed")
    if not storage.exists(storage.join(parent, MANIFEST_NAME)):
        return [], ""
    try:
        step = read_manifest(storage, parent)
        open_part(storage, parent, step, manifest.component)
    except CheckpointNotFoundError:
        return [(MANIFEST_NAME, f"step {manifest.step}'s manifest ({parent}/{MANIFEST_NAME}) has no part "
                                f"'{manifest.component}': this folder is not part of that step")], ""
    except CheckpointCorruptError as exc:
        why = "; ".join(f"{name}: {fault}" for name, fault in exc.faults)
        return [(MANIFEST_NAME, f"is not the part's manifest its step committed ({parent}: {why})")], ""
    return [], ""


# --------------------------------------------------------------------------- plugins

def cmd_plugins(args: argparse.Namespace) -> int:
    from importlib import metadata

    from .errors import PluginError
    from .plugins import get_plugins

    plugins = get_plugins()

    def version(dist: str) -> str:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            return dist

    status = 0
    sections = [("backends (checkpoint_config.type)", plugins.backends),
                ("strategies", plugins.strategies),
                ("staging policies", plugins.staging_policies)]
    for title, collect in sections:
        _say(f"{title}:")
        try:
            records = collect()
        except PluginError as exc:  # two plugins claim one name: show it, keep going
            _say(f"  CONFLICT  {exc}")
            status = 1
            continue
        if not records:
            _say("  (none)")
        rows = []
        for name, rec in sorted(records.items()):
            extra = f"priority {rec.priority}; " if hasattr(rec, "priority") else ""
            rows.append([name, version(rec.distribution), extra + (rec.description or "")])
        _say(*("  " + ln for ln in (_table(["NAME", "DISTRIBUTION", "DESCRIPTION"], rows) if rows else [])))
    broken = list(plugins.broken)
    if broken:
        _say("broken plugins (not loaded; everything else works):")
        _say(*("  " + ln for ln in _table(["ENTRY POINT", "DISTRIBUTION", "ERROR"],
                                           [[b.name, version(b.distribution), b.error] for b in broken])))
    return status


# --------------------------------------------------------------------------- ls

def _describe(storage: Any, ref: Any, expected: Any = None, guess: bool = True) -> dict[str, Any]:
    """created / size / committed / components of one checkpoint, read from its manifest
    when committed; for a step of components that is not committed, its parts (``expected``:
    the components its run's steps have; when ``None`` and ``guess``, found beside it)."""
    from .components import components_of
    from .inspection import parts_status
    from .manifest import MANIFEST_NAME, Manifest
    from .verify import list_files

    row: dict[str, Any] = {"step": ref.step, "run": ref.run, "path": ref.path, "committed": ref.committed,
                           "created": "", "bytes": None, "components": [], "missing_components": []}
    if ref.committed:
        try:
            with storage.open_read(storage.join(ref.path, MANIFEST_NAME)) as f:
                manifest, _ = Manifest.from_bytes(f.read())
            row["created"] = manifest.created
            row["bytes"] = sum(e.size for e in manifest.files.values())
            row["components"] = sorted(components_of(manifest))
            return row
        except (OSError, ValueError) as exc:
            row["problem"] = f"unreadable manifest: {exc}"
    else:
        status = parts_status(storage, ref.path, expected, guess=guess)
        if status.any:
            row.update(components=status.committed, missing_components=status.missing,
                       unfinished_components=status.unfinished, parts=status.describe(), created=status.created,
                       parts_complete=status.complete)
    try:
        with storage.open_read(storage.join(ref.path, "trainer_state.json")) as f:
            row["created"] = str(json.loads(f.read().decode()).get("time", ""))
    except (OSError, ValueError):
        pass
    if not row["created"] and ref.mtime:
        from datetime import datetime, timezone

        row["created"] = datetime.fromtimestamp(ref.mtime, timezone.utc).isoformat(timespec="seconds")
    row["bytes"] = sum(list_files(storage, ref.path).values())
    return row


def _in_flight(storage: Any, root: str) -> list[str]:
    """Temporary folders and owner markers of saves that are running or crashed (parts of a
    step of components are written inside its folder until the step is committed)."""
    from .commit import MARKER_PREFIX
    from .layout import TMP_PREFIX, parse_step, run_folders
    from .manifest import MANIFEST_NAME

    def pending(e: Any) -> bool:
        return (e.is_dir and e.name.startswith(TMP_PREFIX)) or (not e.is_dir and e.name.startswith(MARKER_PREFIX))

    found = []
    folders = [root, *(p for _, p in run_folders(storage, root))]
    if parse_step(_basename(root)) is not None:
        folders = [root]
    for folder in folders:
        for e in storage.list(folder):
            if pending(e):
                found.append(e.path)
            elif e.is_dir and parse_step(e.name) is not None and not storage.exists(storage.join(e.path, MANIFEST_NAME)):
                found.extend(p.path for p in storage.list(e.path) if pending(p))
    return sorted(found)


def cmd_ls(args: argparse.Namespace) -> int:
    from .layout import CheckpointRef, parse_step, scan
    from .manifest import MANIFEST_NAME
    from .verify import read_manifest

    storage = _open(args, args.dir)
    root = storage.root
    _require_dir(storage, args.dir)
    refs = scan(storage, root)
    step = parse_step(root.rstrip("/").rsplit("/", 1)[-1])
    if not refs and step is not None:  # DIR is itself one checkpoint
        refs = [CheckpointRef(root, step, "", storage.exists(storage.join(root, MANIFEST_NAME)))]
    elif not refs and storage.exists(storage.join(root, MANIFEST_NAME)):
        part = read_manifest(storage, root)
        if part.component is not None and not args.json:  # one component's part of a step
            status = _uncommitted_step(storage, _parent(root))
            where = "its step is not committed: " + status.describe() if status is not None else \
                "its step is committed" if storage.exists(storage.join(_parent(root), MANIFEST_NAME)) else ""
            _say(f"{args.dir} is the part of component '{part.component}' of step {part.step}, committed on its own"
                 + (f"; {where}" if where else "") + f"; `roll-ckpt ls {_parent(_parent(root)) or '.'}` lists the steps")
            return 0
    rows = [_describe(storage, r) for r in refs if r.committed]
    # The components a step needs, per run: those of the run's newest committed step (one
    # launch writes one run folder, with one config); a run without any looks beside the step.
    expected = {r["run"]: (r["components"] or None) for r in rows if "problem" not in r}
    rows += [_describe(storage, r, expected.get(r.run), guess=r.run not in expected)
             for r in refs if not r.committed]
    order = {r.path: i for i, r in enumerate(refs)}
    rows.sort(key=lambda row: order[row["path"]])
    pending = _in_flight(storage, root)
    if args.json:
        print(json.dumps({"dir": args.dir, "checkpoints": rows, "in_flight": pending}, indent=1))
        return 0
    if not rows:
        _say(f"no checkpoints under {args.dir}")
    else:
        header = ["STEP", "RUN", "CREATED", "SIZE", "COMMITTED"]
        table = [[str(r["step"]), r["run"] or ".", _local_time(r["created"]),
                  _human(r["bytes"]), "yes" if r["committed"] else "NO" + (f" ({r['problem']})" if "problem" in r else "")]
                 for r in rows]
        if any(r["components"] or "parts" in r for r in rows):
            header.append("COMPONENTS")
            for line, r in zip(table, rows):
                line.append(r.get("parts") or ", ".join(r["components"]) or "-")
        _say(*_table(header, table, right={0, 3}))
        done = [r for r in rows if r["committed"]]
        total = sum(r["bytes"] or 0 for r in rows)
        _say("", f"{len(rows)} checkpoints ({len(done)} committed, {_human(total)}) under {args.dir}")
        if done:
            _say(f"newest committed: {done[-1]['path']}")
        if len(done) < len(rows):
            _say("uncommitted folders are saves that never finished; they are never resumed from")
        if any("parts" in r for r in rows):
            _say("a step made of components counts once every part is committed; COMPONENTS lists the parts "
                 "committed, then those missing")
        for r in rows:
            if r.get("parts_complete"):
                _say(f"step {r['step']} ({r['path']}): every part is committed but not the step (its last writer "
                     "stopped first); the next resume of any component commits it")
    if pending:
        _say("", "saves in flight or left by a crash (`roll-ckpt prune` removes them once their writer is gone):")
        _say(*(f"  {p}" for p in pending))
    return 0


def _human(n: int | None) -> str:
    from .inspection import human_bytes

    return human_bytes(n)


# --------------------------------------------------------------------------- verify

def _damaged(path: str, faults: list[tuple[str, str]]) -> tuple[bool, str]:
    _say(f"DAMAGED  {path}")
    _say(*(f"  {name}: {fault}" for name, fault in faults))
    return False, f"checkpoint {path} is damaged ({len(faults)} bad file(s), listed above); " \
                  "resume from an earlier checkpoint or a backup copy"


def _verify_one(storage: Any, path: str) -> tuple[bool, str]:
    """Verify one checkpoint: a whole one, a step made of components (every file, and each
    part's manifest), or one part (also against its step's manifest)."""
    from .components import components_of
    from .inspection import part_faults
    from .verify import read_manifest, verify

    manifest = read_manifest(storage, path)
    total = sum(e.size for e in manifest.files.values())
    try:
        with _progress("verify", total) as progress:
            report = verify(storage, path, on_bytes=progress)
    except CheckpointCorruptError as exc:
        return _damaged(path, exc.faults)
    m = report.manifest
    faults = part_faults(storage, path, m)
    extra, note = _part_in_step(storage, path, m)
    if faults or extra:
        return _damaged(path, faults + extra)
    parts = components_of(m)
    what = f"step {m.step}" + (f", component {m.component}" if m.component else "")
    tail = f"; {len(parts)} components ({', '.join(sorted(parts))}), each part's manifest matches the step's" \
        if parts else ""
    _say(f"OK  {path}  {what}: {report.files} files, {_human(report.bytes)}, "
         f"sizes and checksums match the manifest{tail}")
    if note:
        _say(note)
    return True, ""


def cmd_verify(args: argparse.Namespace) -> int:
    from .layout import parse_step, scan

    storage = _open(args, args.path)
    root = storage.root
    component = args.component
    if _is_checkpoint_dir(storage, root) or not storage.isdir(root):
        try:
            target, _ = _resolve(storage, root, component)
        except CheckpointCorruptError as exc:  # the part's manifest is not the one the step committed
            _, why = _damaged(exc.checkpoint, exc.faults)
            raise RollCkptError(why) from None
        # (a committed part of a step that is not: _verify_one notes it, as for a part's folder)
        ok, why = _verify_one(storage, target)
        if not ok:
            raise RollCkptError(why)
        return 0
    parent = _parent(root)
    if parent and parse_step(_basename(parent)) is not None:  # a part's folder without its manifest
        raise CheckpointNotFoundError(
            f"{args.path} is not committed (no manifest.json): it is the folder of the part of component "
            f"'{_basename(root)}' of step {parse_step(_basename(parent))}, from a save that never finished "
            "or is still running; use an earlier step")
    # A folder of checkpoints (output_dir or a run folder): verify every committed one.
    refs = scan(storage, root)
    if not refs:
        raise CheckpointNotFoundError(f"{args.path} is neither a checkpoint nor a folder of checkpoints")
    bad = []
    checked = 0
    for ref in refs:
        if not ref.committed:
            status = _uncommitted_step(storage, ref.path)
            parts = f"; parts: {status.describe()}" if status is not None else ""
            _say(f"SKIP  {ref.path}  not committed (a save that never finished{parts})")
            continue
        target = ref.path
        if component:
            try:
                target, _ = _resolve(storage, ref.path, component)
            except CheckpointCorruptError as exc:
                _damaged(exc.checkpoint, exc.faults)
                bad.append(ref.path)
                continue
            except CheckpointNotFoundError:
                _say(f"SKIP  {ref.path}  has no part for component '{component}'")
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


# --------------------------------------------------------------------------- inspect

def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspection import format_inspection, inspect_checkpoint
    from .verify import read_manifest

    storage = _open(args, args.path)
    target, note = _resolve(storage, storage.root, args.component)
    manifest = read_manifest(storage, target)
    if any(name.startswith("dcp/") for name in manifest.files) and not manifest.extra.get("components"):
        from . import dcp_io  # noqa: F401  (torch: imported before the progress bar starts its clock)
    total = sum(e.size for e in manifest.files.values())
    with _progress("verify", total) as progress:
        ins = inspect_checkpoint(storage, target, on_bytes=progress)
    if note:
        _say(note, "")
    _say(format_inspection(ins))
    return 0


# --------------------------------------------------------------------------- prune

def cmd_prune(args: argparse.Namespace) -> int:
    from .commit import clean_stale
    from .layout import committed
    from .retention import apply_retention, plan_retention

    storage = _open(args, args.dir)
    root = storage.root
    _require_dir(storage, args.dir)
    if _is_checkpoint_dir(storage, root):
        raise RollCkptError(f"{args.dir} is one checkpoint; give the folder that holds the checkpoints")
    verb = "would remove" if args.dry_run else "removed"
    if args.dry_run:
        stale = _in_flight(storage, root)
        doomed = [r.path for r in plan_retention(committed(storage, root), args.keep)]
        if stale:
            _say("in-flight or crashed saves (removed once their writer is gone):", *(f"  {p}" for p in stale))
    else:
        for path in clean_stale(storage, root):
            _say(f"removed stale temporary folder {path} (its writer is gone)")
        doomed = apply_retention(storage, root, args.keep)
    for path in doomed:
        _say(f"{verb} {path}")
    left = committed(storage, root)
    if args.dry_run:
        left = [r for r in left if r.path not in set(doomed)]
    tail = f"; newest: {left[-1].path}" if left else ""
    _say(f"{verb} {len(doomed)} checkpoint(s); {len(left)} committed kept{tail}")
    return 0


# --------------------------------------------------------------------------- export

def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_safetensors, require_tensors
    from .verify import read_manifest, verify

    storage = _open(args, args.path)
    target, note = _resolve(storage, storage.root, args.component)
    manifest = read_manifest(storage, target)
    require_tensors(manifest, target)  # a step of components, a json part: say so before any work
    from . import dcp_io  # noqa: F401  (torch: imported before the progress bars start their clocks)

    if note:
        _say(note)
    t0 = time.perf_counter()
    with _progress("verify", sum(e.size for e in manifest.files.values())) as progress:
        verify(storage, target, on_bytes=progress)
    data = sum(e.size for n, e in manifest.files.items() if n.startswith("dcp/"))
    with _progress("export", data) as progress:
        report = export_safetensors(storage, target, args.out, only=args.only,
                                    strip_prefix=args.strip_prefix, overwrite=args.force,
                                    on_bytes=progress, verified=True)
    part = f" (component {manifest.component})" if manifest.component else ""
    _say(f"exported {report.tensors} tensors ({_human(report.bytes)}) of step {report.step}{part} "
         f"to {report.out} in {time.perf_counter() - t0:.1f}s")
    if report.skipped:
        _say(f"left out {len(report.skipped)} non-tensor values (safetensors holds tensors only), "
             f"e.g. {', '.join(report.skipped[:3])}")
    return 0


# --------------------------------------------------------------------------- copy

def _side_storage(args: argparse.Namespace, url: str, side: str) -> Any:
    """The storage for one side of ``copy``: ``--type``/``--storage-option``, then ``--src-*``/``--dst-*``."""
    from .manager import open_storage
    from .plugins import get_plugins

    type_ = getattr(args, f"{side}_type") or args.type
    options = dict(args.storage_option or [])
    options.update(dict(getattr(args, f"{side}_storage_option") or []))
    return open_storage(get_plugins(), type_, url, options)


def _basename(path: str) -> str:
    return path.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]


def _parent(path: str) -> str:
    p = path.rstrip("/\\")
    return p[: len(p) - len(_basename(p))].rstrip("/\\")


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url and not url.startswith("file://") else "file"


def cmd_copy(args: argparse.Namespace) -> int:
    from .commit import clean_stale
    from .layout import parse_step, scan
    from .manifest import MANIFEST_NAME
    from .transfer import copy_checkpoint, relative_path

    src = _side_storage(args, args.src, "src")
    dst = _side_storage(args, args.dst, "dst")
    if src.exists(src.join(src.root, MANIFEST_NAME)) or parse_step(_basename(src.root)) is not None:
        # One checkpoint: DST is that checkpoint's folder when named checkpoint-<step>, else the folder to put it in.
        target = dst.root if parse_step(_basename(dst.root)) is not None else dst.join(dst.root, _basename(src.root))
        jobs = [(src.root, target)]
        parent = _parent(target) or dst.root
    else:
        if not src.isdir(src.root):
            raise CheckpointNotFoundError(f"{args.src}: no such checkpoint or folder")
        refs = scan(src, src.root)
        if not refs:
            raise CheckpointNotFoundError(f"{args.src} is neither a checkpoint nor a folder of checkpoints")
        for ref in refs:
            if not ref.committed:
                status = _uncommitted_step(src, ref.path)
                parts = f"; parts: {status.describe()}" if status is not None else ""
                _say(f"SKIP  {ref.path}  not committed (a save that never finished{parts})")
        jobs = []
        for ref in refs:
            if ref.committed:
                rel = relative_path(src.root, ref.path)
                jobs.append((ref.path, dst.join(dst.root, *rel.split("/"))))
        parent = dst.root
    same_store = type(src) is type(dst) and _scheme(src.url) == _scheme(dst.url)
    if same_store and any(s.rstrip("/\\") == d.rstrip("/\\") for s, d in jobs):
        raise RollCkptError(f"{args.src} and {args.dst} are the same location; copy to another one")
    # What a killed earlier copy left there (its process is gone) goes first: the rerun starts clean.
    for path in clean_stale(dst, parent):
        _say(f"removed {path}, left by an interrupted copy")
    failed: list[str] = []
    copied = skipped = 0
    total_bytes = 0
    t0 = time.perf_counter()
    from .verify import read_manifest

    for s_path, d_path in jobs:
        try:
            manifest = read_manifest(src, s_path)
            named = parse_step(_basename(d_path))
            if named is not None and named != manifest.step:
                raise RollCkptError(f"{d_path} is named for step {named} but {s_path} holds step {manifest.step}; "
                                    f"name the destination checkpoint-{manifest.step} or give its folder")
            size = sum(e.size for e in manifest.files.values())
            # One bar: the bytes copied, then the same bytes read back at the destination.
            with _progress(f"copy {_basename(s_path)} (+ check at destination)", 2 * size) as progress:
                report = copy_checkpoint(src, s_path, dst, d_path, progress, verify_progress=progress)
        except RollCkptError as exc:
            if len(jobs) == 1:
                raise
            _say(f"FAILED  {s_path}: {exc}")
            failed.append(s_path)
            continue
        if report.skipped:
            skipped += 1
            _say(f"SKIP  {d_path}  already holds this checkpoint (same manifest)")
            continue
        copied += 1
        total_bytes += report.bytes
        _say(f"copied {s_path} -> {d_path}: step {report.step}, {report.files} files, {_human(report.bytes)} "
             f"in {report.seconds:.1f}s; verified at the destination and committed")
    if len(jobs) > 1 or failed:
        _say(f"{copied} checkpoint(s) copied ({_human(total_bytes)} in {time.perf_counter() - t0:.1f}s), "
             f"{skipped} already there, {len(failed)} failed, to {args.dst}")
    if failed:
        raise RollCkptError(f"{len(failed)} checkpoint(s) could not be copied: {', '.join(failed)}; nothing of "
                            "them is committed at the destination; run the same command again once fixed")
    return 0


# --------------------------------------------------------------------------- demo

def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.run(args)


# --------------------------------------------------------------------------- parser

def _storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--type", default="file_system", metavar="NAME",
                   help="backend plugin (checkpoint_config.type); `roll-ckpt plugins` lists them "
                        "(default: file_system)")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", type=_parse_option,
                   help="option for the backend (checkpoint_config.storage_options), repeatable")


def _component_arg(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--component", metavar="NAME", help=text + " (checkpoint_config.components)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .demo import add_demo_arguments

    parser = _Parser(prog=PROG, description="Inspect, verify, prune and export roll-ckpt checkpoints.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="hide progress bars (ROLL_CKPT_QUIET=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("plugins", help="installed backends, strategies, staging policies, broken plugins")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("ls", help="list the checkpoints under a folder")
    p.add_argument("dir", metavar="DIR", help="checkpoint_config.output_dir, or one run folder")
    p.add_argument("--json", action="store_true", help="print JSON")
    _storage_args(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("verify", help="check sizes and checksums against the manifest")
    p.add_argument("path", metavar="PATH", help="a checkpoint-<step> folder (or one component's part of it), "
                                                "or a folder of checkpoints")
    _component_arg(p, "verify only this component's part of the step (of every step, for a folder)")
    _storage_args(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("inspect", help="verify, then show manifest, trainer state and DCP keys")
    p.add_argument("path", metavar="PATH", help="a checkpoint-<step> folder, or one component's part of it")
    _component_arg(p, "show this component's part of the step (trainer state, DCP keys or driver state)")
    _storage_args(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("prune", help="keep the newest N committed checkpoints, remove stale temporary folders")
    p.add_argument("dir", metavar="DIR", help="checkpoint_config.output_dir, or one run folder")
    p.add_argument("--keep", type=_keep_count, required=True, metavar="N",
                   help="committed checkpoints to keep (>= 1: the newest is never removed)")
    p.add_argument("-n", "--dry-run", action="store_true", help="only say what would be removed")
    _storage_args(p)
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("export", help="write a checkpoint's tensors, unsharded, to one safetensors file")
    p.add_argument("path", metavar="PATH", help="a checkpoint-<step> folder, or one component's part of it")
    _component_arg(p, "export this component's part of the step (needed for a step made of components)")
    p.add_argument("--out", required=True, metavar="FILE", help="the .safetensors file to write (local path)")
    p.add_argument("--only", action="append", metavar="KEY",
                   help="export only the tensors under this top-level key (e.g. model), repeatable")
    p.add_argument("--strip-prefix", action="store_true",
                   help="with one --only, drop that prefix from the names (loadable by model.load_state_dict)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite FILE if it exists")
    _storage_args(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("copy", help="copy a checkpoint or a folder of them between any two backends",
                       description="Copy one checkpoint, or every committed checkpoint below a folder (an "
                                   "output_dir or a run folder, keeping the layout below it), from SRC to DST. "
                                   "Files are streamed and checked against the manifest while copied, read back "
                                   "and checked again at DST, then committed there by DST's own protocol. An "
                                   "interrupted copy leaves nothing committed: run the same command again. "
                                   "A single checkpoint goes to DST/<its name>, or to DST itself when DST is "
                                   "named checkpoint-<step>.")
    p.add_argument("src", metavar="SRC", help="a checkpoint-<step> folder, or a folder of checkpoints")
    p.add_argument("dst", metavar="DST", help="where to put it (path or fsspec URL: s3://..., memory://...)")
    _storage_args(p)
    for side, what in (("src", "SRC"), ("dst", "DST")):
        p.add_argument(f"--{side}-type", metavar="NAME", help=f"backend plugin of {what} (default: --type)")
        p.add_argument(f"--{side}-storage-option", action="append", metavar="KEY=VALUE", type=_parse_option,
                       help=f"option for {what}'s backend only, repeatable (added to --storage-option)")
    p.set_defaults(func=cmd_copy)

    p = sub.add_parser("demo", help="a small RL training job that saves, crashes and resumes")
    add_demo_arguments(p)
    p.set_defaults(func=cmd_demo)
    return parser


# --------------------------------------------------------------------------- main

def _fail(message: str) -> None:
    one_line = " ".join(str(message).split())
    print(f"{PROG}: error: {one_line}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.quiet:
            os.environ["ROLL_CKPT_QUIET"] = "1"
        return int(args.func(args) or 0)
    except UsageError as exc:
        _fail(str(exc))
        return 2
    except RollCkptError as exc:
        _fail(str(exc))
        return 1
    except BrokenPipeError:  # `roll-ckpt ls DIR | head`: the reader left; not an error to report
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except OSError as exc:  # a missing path, permissions, a store that cannot be reached
        message = exc.strerror or str(exc) or type(exc).__name__
        _fail(f"{exc.filename}: {message}" if getattr(exc, "filename", None) else message)
        return 1
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
