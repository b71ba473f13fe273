"""roll-ckpt export: a checkpoint's tensors, unsharded, as safetensors."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ._common import component_arg, human_bytes, open_storage_arg, progress_bar, resolve, say, storage_args


def cmd_export(args: argparse.Namespace) -> int:
    from ..export import export_safetensors, require_tensors
    from ..verify import read_manifest, verify

    storage = open_storage_arg(args, args.path)
    target, note = resolve(storage, storage.root, args.component)
    manifest = read_manifest(storage, target)
    require_tensors(manifest, target)  # a step of components, a json part: say so before any work
    from .. import dcp_read  # noqa: F401  (torch: imported before the progress bars start their clocks)

    if note:
        say(note)
    t0 = time.perf_counter()
    with progress_bar("verify", sum(e.size for e in manifest.files.values())) as progress:
        verify(storage, target, on_bytes=progress)
    data = sum(e.size for n, e in manifest.files.items() if n.startswith("dcp/"))
    with progress_bar("export", data) as progress:
        report = export_safetensors(storage, target, args.out, only=args.only,
                                    strip_prefix=args.strip_prefix, overwrite=args.force,
                                    on_bytes=progress, verified=True)
    part = f" (component {manifest.component})" if manifest.component else ""
    say(f"exported {report.tensors} tensors ({human_bytes(report.bytes)}) of step {report.step}{part} "
         f"to {report.out} in {time.perf_counter() - t0:.1f}s")
    if report.skipped:
        say(f"left out {len(report.skipped)} non-tensor values (safetensors holds tensors only), "
             f"e.g. {', '.join(report.skipped[:3])}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a checkpoint's tensors, unsharded, to one safetensors file")
    p.add_argument("path", metavar="PATH", help="a checkpoint-<step> folder, or one component's part of it")
    component_arg(p, "export this component's part of the step (needed for a step made of components)")
    p.add_argument("--out", required=True, metavar="FILE", help="the .safetensors file to write (local path)")
    p.add_argument("--only", action="append", metavar="KEY",
                   help="export only the tensors under this top-level key (e.g. model), repeatable")
    p.add_argument("--strip-prefix", action="store_true",
                   help="with one --only, drop that prefix from the names (loadable by model.load_state_dict)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite FILE if it exists")
    storage_args(p)
    p.set_defaults(func=cmd_export)
