"""What the ``roll-ckpt`` commands share: output, argument types, opening a storage, and
resolving a path (a checkpoint, a step made of components, or one part of it)."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from ..errors import CheckpointNotFoundError
from ..format.layout import basename, parent as parent_dir
from ..format.targets import not_committed, part_in_step, resolve, uncommitted_step
from ..runtime.units import human_bytes

__all__ = ["UsageError", "say", "parse_option", "keep_count", "open_storage_arg", "progress_bar", "local_time",
           "format_table", "is_checkpoint_dir", "require_dir", "uncommitted_step", "not_committed", "resolve",
           "part_in_step", "side_storage", "storage_args", "component_arg", "human_bytes", "basename", "parent_dir", "in_flight",
           "formats", "foreign_at", "foreign_verdict"]


class UsageError(Exception):
    """A bad command line (exit status 2)."""


def say(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


def parse_option(text: str) -> tuple[str, Any]:
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


def keep_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: keep at least 1 (the newest committed checkpoint is never removed)")
    return value


def open_storage_arg(args: argparse.Namespace, url: str) -> Any:
    """The storage for ``url``, rooted there (``storage.root`` is ``url`` as a backend path)."""
    from ..tiers.run import open_storage
    from ..plugins import get_plugins

    options = dict(args.storage_option or [])
    return open_storage(get_plugins(), args.type, url, options)


def progress_bar(desc: str, total: int | None = None) -> Any:
    from ..runtime.progress import Progress

    return Progress(desc, total)


def local_time(iso: str) -> str:
    from datetime import datetime

    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError):
        return iso or "-"


def format_table(header: Sequence[str], rows: list[Sequence[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [fmt(header), *(fmt(r) for r in rows)]


def is_checkpoint_dir(storage: Any, path: str) -> bool:
    from ..format.layout import parse_step
    from ..format.manifest import MANIFEST_NAME

    name = path.rstrip("/").rsplit("/", 1)[-1]
    return parse_step(name) is not None or storage.exists(storage.join(path, MANIFEST_NAME))


def formats() -> dict[str, Any]:
    """The installed checkpoint formats of other frameworks (``roll_ckpt_formats``)."""
    from ..plugins import get_plugins

    return get_plugins().formats()


def foreign_at(storage: Any, path: str) -> Any:
    """Another framework's checkpoint at ``path`` -- or of which ``path`` is one part's
    folder (a ROLL step's ``critic/``) -- as a format plugin recognizes it; else ``None``."""
    from ..format.layout import recognize
    from ..format.manifest import MANIFEST_NAME

    if storage.exists(storage.join(path, MANIFEST_NAME)) or not storage.isdir(path):
        return None
    outer = recognize(storage, parent_dir(path), formats()) if parent_dir(path) else None
    if outer is not None and basename(path) in outer.components():
        say(f"note: {path} is the part '{basename(path)}' of {outer.path}; the whole step follows")
        return outer
    return recognize(storage, path, formats(), any_name=True)


def foreign_verdict(found: Any) -> tuple[bool, str]:
    """Print what ``roll-ckpt verify`` can say of another framework's checkpoint: whole or
    not, as its format defines it; it has no checksums. ``(ok, why)``."""
    files = found.files()
    what = f"{found.title}, step {found.step}"
    if found.problems:
        say(f"UNFINISHED  {found.path}  {what}")
        say(*(f"  {p}" for p in found.problems))
        return False, (f"{found.path} is a {found.title} that was never finished (listed above); it is never resumed "
                       "from: use an earlier checkpoint")
    parts = ", ".join(found.components()) or "no parts"
    refusal = getattr(found, "not_resumable", "")
    say(f"OK  {found.path}  {what} ({parts}): {len(files)} files, {human_bytes(sum(files.values()))}, every file it "
        "needs is there with its size; NO checksums to verify (the framework wrote none): " +
        (f"not a resume point: it {refusal}" if refusal else "it is resumed read-only"))
    return True, ""


def require_dir(storage: Any, url: str) -> None:
    if not storage.isdir(storage.root):
        raise CheckpointNotFoundError(f"{url}: no such folder")



def side_storage(args: argparse.Namespace, url: str, side: str) -> Any:
    """The storage for one side of ``copy``: ``--type``/``--storage-option``, then ``--src-*``/``--dst-*``."""
    from ..tiers.run import open_storage
    from ..plugins import get_plugins

    type_ = getattr(args, f"{side}_type") or args.type
    options = dict(args.storage_option or [])
    options.update(dict(getattr(args, f"{side}_storage_option") or []))
    return open_storage(get_plugins(), type_, url, options)


def storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--type", default="file_system", metavar="NAME",
                   help="backend plugin (checkpoint_config.type); `roll-ckpt plugins` lists them "
                        "(default: file_system)")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", type=parse_option,
                   help="option for the backend (checkpoint_config.storage_options), repeatable")


def component_arg(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--component", metavar="NAME", help=text + " (checkpoint_config.components)")


def in_flight(storage: Any, root: str) -> list[str]:
    """Temporary folders and owner markers of saves that are running or crashed (parts of a
    step of components are written inside its folder until the step is committed)."""
    from ..format.commit import MARKER_PREFIX
    from ..format.layout import TMP_PREFIX, parse_step, run_folders
    from ..format.manifest import MANIFEST_NAME

    def pending(e: Any) -> bool:
        return (e.is_dir and e.name.startswith(TMP_PREFIX)) or (not e.is_dir and e.name.startswith(MARKER_PREFIX))

    found = []
    folders = [root, *(p for _, p in run_folders(storage, root))]
    if parse_step(basename(root)) is not None:
        folders = [root]
    for folder in folders:
        for e in storage.list(folder):
            if pending(e):
                found.append(e.path)
            elif e.is_dir and parse_step(e.name) is not None and not storage.exists(storage.join(e.path, MANIFEST_NAME)):
                found.extend(p.path for p in storage.list(e.path) if pending(p))
    return sorted(found)
