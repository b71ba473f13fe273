"""Verification: a checkpoint is compared with its manifest before torch reads it."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Callable

from .commit import require_committed
from .manifest import hash_stream, MANIFEST_NAME, FileEntry, Manifest, UnsafeManifestError, beside
from ..errors import CheckpointCorruptError, UnsafeCheckpointError
from ..contracts import Storage

__all__ = ["verify", "read_manifest", "list_files", "VerifyReport", "content_fault"]


@dataclass(frozen=True)
class VerifyReport:
    path: str
    manifest: Manifest
    files: int
    bytes: int
    beside: list[str]
    """Files another program added to the folder once it was committed (``checkpoint_config.beside``):
    not covered by the manifest."""


def list_files(storage: Storage, root: str, prefix: str = "") -> dict[str, int]:
    """Every file below ``root`` as ``relative/path -> size``."""
    out: dict[str, int] = {}
    for e in storage.list(root):
        rel = f"{prefix}{e.name}"
        if e.is_dir:
            out.update(list_files(storage, e.path, rel + "/"))
        else:
            out[rel] = e.size
    return out


def unsafe_read_fault(exc: OSError) -> str:
    """What a file that cannot be opened safely is (local disks open with ``O_NOFOLLOW``)."""
    if exc.errno == errno.ELOOP:
        return "is a symbolic link, refused (a checkpoint holds regular files inside its folder)"
    return f"cannot be read safely ({exc.strerror or exc})"


def content_fault(entry: FileEntry | None, size: int, digest: str) -> str | None:
    """What is wrong with a file's bytes as read (``size`` bytes hashing to ``digest``)
    compared with its manifest ``entry`` (``None``: the manifest does not list it); ``None``
    when they match. The one comparison of read bytes with the manifest: :func:`verify`
    and the readers of a resume (:mod:`roll_ckpt.dcp.reader`) use it."""
    if entry is None:
        return "not listed in the manifest"
    if size != entry.size:
        return f"read {size} bytes, the manifest says {entry.size}"
    if digest != entry.checksum:
        return "checksum mismatch (the content changed after it was written)"
    return None


def read_manifest(storage: Storage, path: str) -> Manifest:
    require_committed(storage, path)
    try:
        try:
            with storage.open_read(storage.join(path, MANIFEST_NAME)) as f:
                data = f.read()
        except FileNotFoundError:
            raise
        except OSError as exc:  # e.g. a link planted in place of the manifest
            raise UnsafeCheckpointError(path, [(MANIFEST_NAME, unsafe_read_fault(exc))]) from None
        manifest, problems = Manifest.from_bytes(data)
    except UnsafeManifestError as exc:
        raise UnsafeCheckpointError(path, [(MANIFEST_NAME, p) for p in exc.problems]) from None
    except ValueError as exc:
        raise CheckpointCorruptError(path, [(MANIFEST_NAME, str(exc))]) from None
    if problems:
        raise UnsafeCheckpointError(path, [(MANIFEST_NAME, p) for p in problems])
    return manifest


def verify(storage: Storage, path: str, *, checksums: bool = True,
           on_bytes: Callable[[int], None] | None = None,
           defer: Callable[[str], bool] | None = None) -> VerifyReport:
    """Check every file of the checkpoint at ``path`` against its manifest.

    Raises :class:`CheckpointCorruptError` naming every file that is missing, of the
    wrong size, with the wrong checksum, or not listed. Links are refused. Files for
    which ``defer(name)`` is true get every check but the checksum: the caller checks
    that while it reads them (``resume`` does, through :class:`~roll_ckpt.dcp.reader.SafeReader`).
    """
    manifest = read_manifest(storage, path)
    present = list_files(storage, path)
    present.pop(MANIFEST_NAME, None)
    faults: list[tuple[str, str]] = []
    others = sorted(set(present) - set(manifest.files))
    for name in others:
        if not beside(manifest, name):
            faults.append((name, "unexpected file, not listed in the manifest"))
    total = 0
    for name, ent in sorted(manifest.files.items()):
        if name not in present:
            faults.append((name, "missing"))
            continue
        if present[name] != ent.size:
            faults.append((name, f"size {present[name]} bytes, the manifest says {ent.size} (truncated or altered)"))
            continue
        total += ent.size
        if checksums and not (defer is not None and defer(name)):
            try:
                with storage.open_read(storage.join(path, name)) as f:
                    size, digest = hash_stream(f, on_bytes)
            except OSError as exc:  # e.g. a link, refused by O_NOFOLLOW
                faults.append((name, unsafe_read_fault(exc)))
                continue
            if (fault := content_fault(ent, size, digest)) is not None:
                faults.append((name, fault))
    if faults:
        raise CheckpointCorruptError(path, faults)
    return VerifyReport(path, manifest, len(manifest.files), total, [n for n in others if beside(manifest, n)])
