"""roll-ckpt prune: keep the newest N committed checkpoints, remove what crashed saves left."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import RollCkptError
from ._common import in_flight, is_checkpoint_dir, keep_count, open_storage_arg, require_dir, say, storage_args


def cmd_prune(args: argparse.Namespace) -> int:
    from ..format.commit import clean_stale
    from ..format.layout import committed
    from ..tiers.retention import apply_retention, plan_retention

    storage = open_storage_arg(args, args.dir)
    root = storage.root
    require_dir(storage, args.dir)
    if is_checkpoint_dir(storage, root):
        raise RollCkptError(f"{args.dir} is one checkpoint; give the folder that holds the checkpoints")
    verb = "would remove" if args.dry_run else "removed"
    if args.dry_run:
        stale = in_flight(storage, root)
        doomed = [r.path for r in plan_retention(committed(storage, root), args.keep)]
        if stale:
            say("in-flight or crashed saves (removed once their writer is gone):", *(f"  {p}" for p in stale))
    else:
        for path in clean_stale(storage, root):
            say(f"removed stale temporary folder {path} (its writer is gone)")
        doomed = apply_retention(storage, root, args.keep)
    for path in doomed:
        say(f"{verb} {path}")
    left = committed(storage, root)
    if args.dry_run:
        left = [r for r in left if r.path not in set(doomed)]
    tail = f"; newest: {left[-1].path}" if left else ""
    say(f"{verb} {len(doomed)} checkpoint(s); {len(left)} committed kept{tail}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("prune", help="keep the newest N committed checkpoints, remove stale temporary folders")
    p.add_argument("dir", metavar="DIR", help="checkpoint_config.output_dir, or one run folder")
    p.add_argument("--keep", type=keep_count, required=True, metavar="N",
                   help="committed checkpoints to keep (>= 1: the newest is never removed)")
    p.add_argument("-n", "--dry-run", action="store_true", help="only say what would be removed")
    storage_args(p)
    p.set_defaults(func=cmd_prune)
