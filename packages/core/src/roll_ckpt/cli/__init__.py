"""The ``roll-ckpt`` command line.

::

    roll-ckpt [--quiet] plugins
    roll-ckpt ls DIR                       every checkpoint under DIR, committed or not
    roll-ckpt verify PATH [--component C]  sizes and checksums against the manifest
    roll-ckpt inspect PATH [--component C] manifest, trainer state, every DCP key
    roll-ckpt prune DIR --keep N           keep the newest N committed checkpoints
    roll-ckpt export PATH [--component C] --out F.safetensors
    roll-ckpt export PATH [--component C] --format hf --out DIR   a Hugging Face folder of one module
    roll-ckpt copy SRC DST                 one checkpoint or a folder of them, between any two backends
    roll-ckpt config PATH                  the resolved checkpoint settings, per worker, and their sources
    roll-ckpt COMMAND ...                  commands plugins add (``roll-ckpt demo``: roll-ckpt-demo)

DIR and PATH are local paths or fsspec URLs; ``--type`` picks the backend plugin and
``--storage-option KEY=VALUE`` passes options to it, as ``checkpoint_config`` would.

Steps made of components (``checkpoint_config.components``, see
:mod:`roll_ckpt.format.components`): ``ls`` shows each step's parts (and, for a step that is
not committed, which are missing); ``verify`` and ``inspect`` take the step's folder
(every part) or one part (``--component C``, or the part's folder itself); ``export``
writes one part's tensors (``--component C``), as one file or as a Hugging Face folder.

A user error (a :class:`~roll_ckpt.errors.RollCkptError`, a missing path, a bad
argument) prints one line ``roll-ckpt: error: ...`` on stderr and exits 2 for usage
errors, 1 otherwise. Anything else is a bug and keeps its traceback.

Each command is a module of this package with its ``add_parser``; plugins add commands
through ``roll_ckpt_commands`` (:class:`~roll_ckpt.contracts.CommandRecord`). Importing this
package is cheap: torch is imported only by the commands that read tensors.
"""


from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from ..errors import PluginError, RollCkptError
from . import config_cmd, copy, export, ls, plugins_cmd, prune, verify
from ._common import UsageError

__all__ = ["main", "build_parser"]

PROG = "roll-ckpt"
_ADD_PARSERS = (plugins_cmd.add_parser, ls.add_parser, verify.add_verify_parser, verify.add_inspect_parser,
                prune.add_parser, export.add_parser, copy.add_parser, config_cmd.add_parser)


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are raised (one line, no usage dump) instead of exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        cmd = self.prog.removeprefix(PROG).strip()
        hint = f"see '{PROG} {cmd + ' ' if cmd else ''}--help'"
        raise UsageError(f"{message} ({hint})")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from ..plugins import get_plugins

    parser = _Parser(prog=PROG, description="Inspect, verify, prune, export and copy roll-ckpt checkpoints.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="hide progress bars (ROLL_CKPT_QUIET=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add_parser in _ADD_PARSERS:
        add_parser(sub)
    try:
        commands = get_plugins().commands()
    except PluginError:  # two plugins claim one command: `roll-ckpt plugins` shows it; the rest works
        commands = {}
    for name, record in sorted(commands.items()):
        if name in sub.choices:
            continue  # core's own commands keep their names
        p = sub.add_parser(name, help=record.help)
        record.add_arguments(p)
        p.set_defaults(func=record.run)
    return parser


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
