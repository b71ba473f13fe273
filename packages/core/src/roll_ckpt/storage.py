"""The narrow storage protocol every backend implements.

Core builds everything else on these few calls: DCP reads and writes through an adapter
over them, and the commit protocol (:mod:`roll_ckpt.commit`) picks one of its two forms
from :attr:`Storage.atomic_rename`. Paths are strings in the backend's own namespace,
made with :meth:`Storage.join`; a backend decides what they look like.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Protocol, runtime_checkable

__all__ = ["Storage", "Entry"]


@dataclass(frozen=True)
class Entry:
    """One item of a folder listing."""

    name: str
    path: str
    is_dir: bool
    size: int = 0
    mtime: float | None = None


@runtime_checkable
class Storage(Protocol):
    """What a backend must do. See ``roll_ckpt.testing`` for the conformance tests."""

    url: str
    """The root the backend was created for, as the user wrote it (for messages)."""

    root: str
    """That root as a path of this backend (what :meth:`join` builds on)."""

    atomic_rename: bool
    """True when :meth:`rename_dir` atomically publishes a folder (POSIX disks).

    Then a checkpoint is written into a temporary sibling and renamed into place.
    Otherwise (object stores) it is written in place and committed by writing its
    manifest last with :meth:`write_create`.
    """

    def join(self, *parts: str) -> str:
        """Join path parts with the backend's separator."""

    def exists(self, path: str) -> bool: ...

    def isdir(self, path: str) -> bool: ...

    def list(self, path: str) -> list[Entry]:
        """The direct children of ``path``; an empty list when it does not exist."""

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents; no error when it exists."""

    def open_read(self, path: str) -> BinaryIO:
        """A seekable binary reader. ``FileNotFoundError`` when missing."""

    def open_write(self, path: str) -> BinaryIO:
        """A binary writer, replacing any file there. The data is durable once ``close()`` returns."""

    def write_create(self, path: str, data: bytes) -> None:
        """Write ``data`` durably only if ``path`` does not exist, else ``FileExistsError``.

        This is the commit point on stores without atomic rename, so it must be
        create-only on the server side where the store offers that.
        """

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically rename a folder; ``FileExistsError`` if ``dst`` exists. Durable on return.

        Only called when :attr:`atomic_rename` is true.
        """

    def rename_file(self, src: str, dst: str) -> None:
        """Rename one file inside an uncommitted folder (need not be atomic)."""

    def sync_dir(self, path: str) -> None:
        """Make the folder's entries durable (fsync on POSIX; nothing on object stores)."""

    def remove(self, path: str) -> None:
        """Remove one file; no error when it is missing."""

    def remove_tree(self, path: str) -> None:
        """Remove a folder and everything below it; no error when it is missing."""

    def free_bytes(self, path: str) -> int | None:
        """Free space where ``path`` lives, or ``None`` when the store cannot tell."""
