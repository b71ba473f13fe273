"""roll-ckpt export: a checkpoint's tensors, unsharded, as one safetensors file
(``--format safetensors``, the default) or as a Hugging Face folder (``--format hf``)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ._common import (UsageError, component_arg, formats, human_bytes, open_storage_arg, progress_bar, resolve, say,
                      storage_args)

_HF_ONLY = ("key", "dtype", "max_shard_size", "hf_config")
_FILE_ONLY = ("only", "strip_prefix")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _size(text: str) -> str:
    from ..runtime.units import parse_size

    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def cmd_export(args: argparse.Namespace) -> int:
    if args.format not in ("safetensors", "hf"):
        return cmd_export_format(args)
    wrong = _FILE_ONLY if args.format == "hf" else _HF_ONLY
    given = [_flag(n) for n in wrong if getattr(args, n) not in (None, False)]
    if given:
        other = "safetensors" if args.format == "hf" else "hf"
        raise UsageError(f"{', '.join(given)}: only with --format {other} (see 'roll-ckpt export --help')")
    return cmd_export_hf(args) if args.format == "hf" else cmd_export_file(args)


def cmd_export_hf(args: argparse.Namespace) -> int:
    from ..hf.export import export_hf

    t0 = time.perf_counter()
    report = export_hf(args.path, args.out, component=args.component, key=args.key or "model", dtype=args.dtype,
                       max_shard_size=args.max_shard_size or "5GB", hf_config=args.hf_config,
                       overwrite=args.force, type=args.type, storage_options=dict(args.storage_option or []),
                       notes=say)
    part = f" (component {report.component})" if report.component else ""
    files = f"{len(report.shards)} shards" if len(report.shards) > 1 else report.shards[0]
    say(f"exported {report.tensors} tensors of state['{report.key}'] ({human_bytes(report.bytes)}, {report.dtype}) "
        f"of step {report.step}{part} to {report.out} ({files}) in {time.perf_counter() - t0:.1f}s")
    if report.copied:
        say(f"copied {', '.join(report.copied)} from {args.hf_config}")
    if report.skipped:
        say(f"left out {len(report.skipped)} non-tensor values (safetensors holds tensors only), "
            f"e.g. {', '.join(report.skipped[:3])}")
    return 0


def cmd_export_format(args: argparse.Namespace) -> int:
    """``--format <name>`` of a format plugin: another framework's own layout."""
    from ..errors import UnknownPluginError
    from ..format.layout import FORMAT_EXTRAS

    given = [_flag(n) for n in _FILE_ONLY + _HF_ONLY if getattr(args, n) not in (None, False)]
    if given:
        raise UsageError(f"{', '.join(given)}: not with --format {args.format}")
    record = formats().get(args.format)
    if record is None or record.export is None:
        known = sorted(["safetensors", "hf", *(n for n, r in formats().items() if r.export is not None)])
        hint = f"; install it with: {FORMAT_EXTRAS[args.format]}" if args.format in FORMAT_EXTRAS else ""
        raise UnknownPluginError(f"--format {args.format}: no installed plugin writes that format (these do: "
                                 f"{', '.join(known)}){hint}")
    storage = open_storage_arg(args, args.path)
    t0 = time.perf_counter()
    line = record.export(storage, storage.root, args.out, component=args.component, overwrite=args.force, notes=say)
    say(f"{line} in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_export_file(args: argparse.Namespace) -> int:
    from ..hf.export import export_safetensors, require_tensors
    from ..format.manifest import read_manifest, verify

    storage = open_storage_arg(args, args.path)
    target, note = resolve(storage, storage.root, args.component)
    manifest = read_manifest(storage, target)
    require_tensors(manifest, target)  # a step of components, a json part: say so before any work
    from ..dcp import reader as dcp_read  # noqa: F401  (torch: imported before the progress bars start their clocks)

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
    from ..hf.export import DTYPES

    p = sub.add_parser("export", help="write a checkpoint's tensors, unsharded: one safetensors file, or a "
                                      "Hugging Face folder (--format hf)")
    p.add_argument("path", metavar="PATH", help="a checkpoint-<step> folder, or one component's part of it")
    component_arg(p, "export this component's part of the step (needed for a step made of components)")
    p.add_argument("--format", default="safetensors", metavar="FORMAT",
                   help="safetensors: one FILE of every tensor, state-prefixed names (default); hf: a Hugging "
                        "Face folder of one module (sharded safetensors, index, config); a format plugin's name: "
                        "that framework's own layout, e.g. roll (ROLL's load_checkpoint reads it; "
                        "roll-ckpt plugins lists them)")
    p.add_argument("--out", required=True, metavar="FILE|DIR",
                   help="the .safetensors file (or, with --format hf, the folder) to write (local path)")
    p.add_argument("-f", "--force", "--overwrite", dest="force", action="store_true",
                   help="replace FILE or DIR if it exists")
    file_opts = p.add_argument_group("--format safetensors")
    file_opts.add_argument("--only", action="append", metavar="KEY",
                           help="export only the tensors under this top-level key (e.g. model), repeatable")
    file_opts.add_argument("--strip-prefix", action="store_true",
                           help="with one --only, drop that prefix from the names (loadable by model.load_state_dict)")
    hf = p.add_argument_group("--format hf")
    hf.add_argument("--key", metavar="NAME", help="the state key of the module to export (default: model)")
    hf.add_argument("--dtype", choices=DTYPES, help="convert floating tensors (default: as saved)")
    hf.add_argument("--max-shard-size", metavar="SIZE", type=_size,
                    help="the most bytes per file: 5GB (default), 500MB, 200KB, 2GiB, or a number of bytes")
    hf.add_argument("--hf-config", metavar="DIR",
                    help="copy config.json, generation_config.json and the tokenizer files from DIR")
    storage_args(p)
    p.set_defaults(func=cmd_export)
