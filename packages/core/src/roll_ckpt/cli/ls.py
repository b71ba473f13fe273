"""roll-ckpt ls: every checkpoint under a folder, committed or not, with its components."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._common import (format_table, formats, human_bytes, in_flight, local_time, open_storage_arg, parent_dir,
                      require_dir, say, storage_args, uncommitted_step)


def _describe_other(found: Any) -> dict[str, Any]:
    """The row of a folder that is not roll-ckpt's: another framework's checkpoint, or unknown."""
    row: dict[str, Any] = {"step": found.step, "run": found.run, "path": found.path, "committed": False,
                           "created": "", "bytes": None, "components": [], "missing_components": [],
                           "format": found.kind, "resumable": found.usable}
    if found.foreign is not None:
        row["bytes"] = sum(found.foreign.files().values())
        row["components"] = found.foreign.components()
        row["title"] = found.foreign.title
    if found.reason:
        row["problem"] = found.reason
    return row


def _describe(storage: Any, ref: Any, expected: Any = None, guess: bool = True) -> dict[str, Any]:
    """created / size / committed / components of one checkpoint, read from its manifest
    when committed; for a step of components that is not committed, its parts (``expected``:
    the components its run's steps have; when ``None`` and ``guess``, found beside it)."""
    from ..hf.export import hf_status
    from ..format.layout import parts_status
    from ..format.manifest import MANIFEST_NAME, Manifest
    from ..format.manifest import list_files

    row: dict[str, Any] = {"step": ref.step, "run": ref.run, "path": ref.path, "committed": ref.committed,
                           "created": "", "bytes": None, "components": [], "missing_components": []}
    if ref.committed:
        try:
            with storage.open_read(storage.join(ref.path, MANIFEST_NAME)) as f:
                manifest, _ = Manifest.from_bytes(f.read())
            row["created"] = manifest.created
            row["bytes"] = sum(e.size for e in manifest.files.values())
            row["taken_over"] = sum(e.size for e in manifest.files.values() if e.taken_over)
            row["components"] = sorted(manifest.parts)
            row["hf"] = hf_status(manifest.extra) + (" (model only)" if manifest.extra.get("save_only_model") else "")
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


def cmd_ls(args: argparse.Namespace) -> int:
    from ..format.layout import CheckpointRef, parse_step, scan
    from ..format.manifest import MANIFEST_NAME
    from ..format.manifest import read_manifest

    from .ls_local import is_local_tier, local_rows, show_local

    storage = open_storage_arg(args, args.dir)
    root = storage.root
    require_dir(storage, args.dir)
    refs = scan(storage, root)
    local = None
    if args.local:
        local_storage = open_storage_arg(args, args.local)
        local = (local_rows(local_storage, local_storage.root), args.local)
    elif not any(r.committed for r in refs) and is_local_tier(storage, root):  # DIR is checkpoint_config.local.dir or a node folder
        rows = local_rows(storage, root)
        if args.json:
            print(json.dumps({"dir": args.dir, "checkpoints": [], "local": rows}, indent=1))
        else:
            show_local(rows, args.dir)
        return 0
    step = parse_step(root.rstrip("/").rsplit("/", 1)[-1])
    if not refs and step is not None:  # DIR is itself one checkpoint
        refs = [CheckpointRef(root, step, "", storage.exists(storage.join(root, MANIFEST_NAME)))]
    elif not refs and storage.exists(storage.join(root, MANIFEST_NAME)):
        part = read_manifest(storage, root)
        if part.component is not None and not args.json:  # one component's part of a step
            status = uncommitted_step(storage, parent_dir(root))
            where = "its step is not committed: " + status.describe() if status is not None else \
                "its step is committed" if storage.exists(storage.join(parent_dir(root), MANIFEST_NAME)) else ""
            say(f"{args.dir} is the part of component '{part.component}' of step {part.step}, committed on its own"
                 + (f"; {where}" if where else "") + f"; `roll-ckpt ls {parent_dir(parent_dir(root)) or '.'}` lists the steps")
            return 0
    from ..format.layout import survey, what_is

    if len(refs) == 1 and refs[0].path == root:  # DIR is one folder: ours, another framework's, or unknown
        others = [f for f in [what_is(storage, root, formats)] if f.kind != "roll-ckpt"]
    else:
        others = [f for f in survey(storage, root, formats) if f.kind != "roll-ckpt"]
    refs = [r for r in refs if r.path not in {f.path for f in others}]
    rows = [_describe(storage, r) for r in refs if r.committed]
    # The components a step needs, per run: those of the run's newest committed step (one
    # launch writes one run folder, with one config); a run without any looks beside the step.
    expected = {r["run"]: (r["components"] or None) for r in rows if "problem" not in r}
    rows += [_describe(storage, r, expected.get(r.run), guess=r.run not in expected)
             for r in refs if not r.committed]
    rows += [_describe_other(f) for f in others]
    from ..format.layout import run_key

    rows.sort(key=lambda row: (run_key(row["run"]), row["step"]))
    pending = in_flight(storage, root)
    if args.json:
        print(json.dumps({"dir": args.dir, "checkpoints": rows, "in_flight": pending,
                          **({"local": local[0]} if local else {})}, indent=1))
        return 0
    if not rows:
        say(f"no checkpoints under {args.dir}")
    else:
        header = ["STEP", "RUN", "CREATED", "SIZE", "COMMITTED"]
        cells = [[str(r["step"]), r["run"] or ".", local_time(r["created"]), human_bytes(r["bytes"]),
                  "yes" if r["committed"] else
                  f"n/a: {r['title']}" + ("" if r["resumable"] else ", UNFINISHED") if r.get("title") else
                  "NO" + (f" ({r['problem']})" if "problem" in r and "format" not in r else "")]
                 for r in rows]
        if any(r.get("taken_over") for r in rows):  # incremental saves: bytes taken over unchanged, not written
            header.append("WRITTEN")
            for line, r in zip(cells, rows):
                line.append(human_bytes(r["bytes"] - r.get("taken_over", 0)) if r.get("bytes") is not None else "-")
        if any(r.get("hf") for r in rows):  # the Hugging Face files each checkpoint carries (hf_weights)
            header.append("HF")
            for line, r in zip(cells, rows):
                line.append(r.get("hf") or "-")
        if any(r["components"] or "parts" in r for r in rows):
            header.append("COMPONENTS")
            for line, r in zip(cells, rows):
                line.append(r.get("parts") or ", ".join(r["components"]) or "-")
        say(*format_table(header, cells, right={0, 3} | ({5} if "WRITTEN" in header else set())))
        done = [r for r in rows if r["committed"]]
        total = sum(r["bytes"] or 0 for r in rows)
        say("", f"{len(rows)} checkpoints ({len(done)} committed, {human_bytes(total)}) under {args.dir}")
        if done:
            say(f"newest committed: {done[-1]['path']}")
        if len(done) + len(others) < len(rows):
            say("uncommitted folders are saves that never finished; they are never resumed from")
        for f in others:
            if f.foreign is not None and f.usable:
                say(f"step {f.step} ({f.path}): a {f.foreign.title}, whole; resumed read-only (no checksums to "
                    "verify: it has none) by resume_from_checkpoint: latest when it is the newest, or by its path")
            else:
                say(f"step {f.step} ({f.path}): never resumed from: {f.reason}")
        if "WRITTEN" in header:
            say("WRITTEN: what each save wrote; the rest of SIZE was taken over unchanged from the checkpoint "
                "before (incremental saves); every checkpoint holds all its files")
        if any("parts" in r for r in rows):
            say("a step made of components counts once every part is committed; COMPONENTS lists the parts "
                 "committed, then those missing")
        for r in rows:
            if r.get("parts_complete"):
                say(f"step {r['step']} ({r['path']}): every part is committed but not the step (its last writer "
                     "stopped first); the next resume of any component commits it")
    if pending:
        say("", "saves in flight or left by a crash (`roll-ckpt prune` removes them once their writer is gone):")
        say(*(f"  {p}" for p in pending))
    if local is not None:
        say("")
        show_local(*local)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("ls", help="list the checkpoints under a folder")
    p.add_argument("dir", metavar="DIR", help="checkpoint_config.output_dir, or one run folder")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--local", metavar="LOCAL_DIR", default=None,
                   help="also list the fast recovery tier at LOCAL_DIR (checkpoint_config.local.dir)")
    storage_args(p)
    p.set_defaults(func=cmd_ls)
