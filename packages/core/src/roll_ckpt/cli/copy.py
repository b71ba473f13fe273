"""roll-ckpt copy: one checkpoint, or a folder of them, between any two backends."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..errors import CheckpointNotFoundError, RollCkptError
from ._common import basename, human_bytes, parent_dir, parse_option, progress_bar, say, side_storage, storage_args, uncommitted_step


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url and not url.startswith("file://") else "file"


def cmd_copy(args: argparse.Namespace) -> int:
    from ..format.commit import clean_stale
    from ..format.layout import parse_step, scan
    from ..format.manifest import MANIFEST_NAME
    from ..tiers.transfer import copy_checkpoint, relative_path

    src = side_storage(args, args.src, "src")
    dst = side_storage(args, args.dst, "dst")
    if src.exists(src.join(src.root, MANIFEST_NAME)) or parse_step(basename(src.root)) is not None:
        # One checkpoint: DST is that checkpoint's folder when named checkpoint-<step>, else the folder to put it in.
        target = dst.root if parse_step(basename(dst.root)) is not None else dst.join(dst.root, basename(src.root))
        jobs = [(src.root, target)]
        parent = parent_dir(target) or dst.root
    else:
        if not src.isdir(src.root):
            raise CheckpointNotFoundError(f"{args.src}: no such checkpoint or folder")
        refs = scan(src, src.root)
        if not refs:
            raise CheckpointNotFoundError(f"{args.src} is neither a checkpoint nor a folder of checkpoints")
        for ref in refs:
            if not ref.committed:
                status = uncommitted_step(src, ref.path)
                parts = f"; parts: {status.describe()}" if status is not None else ""
                say(f"SKIP  {ref.path}  not committed (a save that never finished{parts})")
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
        say(f"removed {path}, left by an interrupted copy")
    failed: list[str] = []
    copied = skipped = 0
    total_bytes = 0
    t0 = time.perf_counter()
    from ..format.manifest import read_manifest

    for s_path, d_path in jobs:
        try:
            manifest = read_manifest(src, s_path)
            named = parse_step(basename(d_path))
            if named is not None and named != manifest.step:
                raise RollCkptError(f"{d_path} is named for step {named} but {s_path} holds step {manifest.step}; "
                                    f"name the destination checkpoint-{manifest.step} or give its folder")
            size = sum(e.size for e in manifest.files.values())
            # One bar: the bytes copied, then the same bytes read back at the destination.
            with progress_bar(f"copy {basename(s_path)} (+ check at destination)", 2 * size) as progress:
                report = copy_checkpoint(src, s_path, dst, d_path, progress, verify_progress=progress)
        except RollCkptError as exc:
            if len(jobs) == 1:
                raise
            say(f"FAILED  {s_path}: {exc}")
            failed.append(s_path)
            continue
        if report.skipped:
            skipped += 1
            say(f"SKIP  {d_path}  already holds this checkpoint (same manifest)")
            continue
        copied += 1
        total_bytes += report.bytes
        say(f"copied {s_path} -> {d_path}: step {report.step}, {report.files} files, {human_bytes(report.bytes)} "
             f"in {report.seconds:.1f}s; verified at the destination and committed")
    if len(jobs) > 1 or failed:
        say(f"{copied} checkpoint(s) copied ({human_bytes(total_bytes)} in {time.perf_counter() - t0:.1f}s), "
             f"{skipped} already there, {len(failed)} failed, to {args.dst}")
    if failed:
        raise RollCkptError(f"{len(failed)} checkpoint(s) could not be copied: {', '.join(failed)}; nothing of "
                            "them is committed at the destination; run the same command again once fixed")
    return 0


def add_parser(sub: Any) -> None:
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
    storage_args(p)
    for side, what in (("src", "SRC"), ("dst", "DST")):
        p.add_argument(f"--{side}-type", metavar="NAME", help=f"backend plugin of {what} (default: --type)")
        p.add_argument(f"--{side}-storage-option", action="append", metavar="KEY=VALUE", type=parse_option,
                       help=f"option for {what}'s backend only, repeatable (added to --storage-option)")
    p.set_defaults(func=cmd_copy)
