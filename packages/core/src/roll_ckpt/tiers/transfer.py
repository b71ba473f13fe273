"""Copying committed checkpoints between any two backends: streamed, verified, committed.

:func:`copy_checkpoint` is what ``roll-ckpt copy`` and background replication
(:mod:`roll_ckpt.tiers.replication`) are built on:

1. the source's ``manifest.json`` is read first (a source that is not committed is
   refused) and only the files it lists are copied;
2. every file is streamed in chunks (never held whole in memory) and hashed while it is
   copied; a size or checksum that differs from the manifest stops the copy — a damaged
   source is never turned into a healthy-looking copy;
3. the destination is written through the commit protocol of its own backend
   (:mod:`roll_ckpt.format.commit`): a temporary folder renamed into place on disks, the data in
   place and the manifest last, create-only, on object stores;
4. before the commit, every file is read back from the destination and checked against
   the manifest again;
5. the source's manifest is committed unchanged (its signature, if any, still holds).

An interrupted copy (an error, ``stop``, Ctrl-C) removes what it wrote; a killed one
leaves an uncommitted folder and an owner marker that the next copy or save there
removes (:func:`roll_ckpt.format.commit.clean_stale`). Nothing partial ever looks committed, so
a copy can simply be run again.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import xxhash
from dataclasses import dataclass
from typing import Callable, Iterable

from ..format.commit import pending_checkpoint
from ..format.manifest import MANIFEST_NAME, Manifest, hash_stream
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, RollCkptError
from ..format.layout import CheckpointRef, scan
from ..contracts import Storage
from ..format.manifest import list_files, read_manifest

__all__ = ["copy_checkpoint", "copy_checkpoints", "CopyReport", "CopyInterrupted", "CHUNK_BYTES",
           "relative_path", "committed_manifest", "same_checkpoint"]

log = logging.getLogger("roll_ckpt")

CHUNK_BYTES = 8 << 20
"""Bytes read and written at a time: what a copy holds in memory per file."""

OnBytes = Callable[[int], None]


class CopyInterrupted(RollCkptError):
    """The copy was asked to stop; nothing of it was committed."""


@dataclass(frozen=True)
class CopyReport:
    """One checkpoint copied (or found already there)."""

    src: str
    dst: str
    step: int
    files: int
    bytes: int
    seconds: float
    skipped: bool = False
    """True when the destination already held this very checkpoint (same manifest)."""


def relative_path(root: str, path: str) -> str:
    """``path`` relative to ``root`` as ``a/b`` (both paths of the same backend)."""
    r = root.rstrip("/\\")
    if path == r:
        return ""
    if not path.startswith(r + "/") and not path.startswith(r + "\\"):
        raise ValueError(f"{path} is not below {root}")
    return path[len(r) + 1:].replace("\\", "/")


def committed_manifest(storage: Storage, path: str) -> bytes | None:
    """The bytes of ``path``'s ``manifest.json``, or ``None`` when it is not committed."""
    try:
        with storage.open_read(storage.join(path, MANIFEST_NAME)) as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


def same_checkpoint(a: bytes | None, b: bytes | None) -> bool:
    return a is not None and b is not None and a == b


def _stopped(stop: threading.Event | Callable[[], bool] | None) -> bool:
    if stop is None:
        return False
    return stop.is_set() if isinstance(stop, threading.Event) else bool(stop())


def _join(storage: Storage, base: str, rel: str) -> str:
    return storage.join(base, *rel.split("/")) if rel else base


def _copy_file(src: Storage, src_file: str, dst: Storage, dst_file: str, name: str, size: int,
               checksum: str, src_path: str, on_bytes: OnBytes | None, stop, chunk: int) -> None:
    h = xxhash.xxh3_128()
    copied = 0
    try:
        reader = src.open_read(src_file)
    except FileNotFoundError:
        raise CheckpointCorruptError(src_path, [(name, "missing")]) from None
    except OSError as exc:  # e.g. a planted link, refused by O_NOFOLLOW
        raise CheckpointCorruptError(src_path, [(name, f"cannot be read safely ({exc.strerror or exc})")]) from None
    with reader:
        buf = bytearray(chunk)
        view = memoryview(buf)
        with dst.open_write(dst_file) as w:
            while True:
                if _stopped(stop):
                    raise CopyInterrupted(f"copy of {src_path} stopped")
                n = reader.readinto(view) if hasattr(reader, "readinto") else None
                if n is None:
                    data = reader.read(chunk)
                    n = len(data)
                    piece: memoryview | bytes = data
                else:
                    piece = view[:n]
                if not n:
                    break
                h.update(piece)
                w.write(piece)
                copied += n
                if on_bytes is not None:
                    on_bytes(n)
                if copied > size:
                    break
    if copied != size:
        raise CheckpointCorruptError(src_path, [(name, f"read {copied}{'+' if copied > size else ''} bytes, "
                                                       f"the manifest says {size} (truncated or altered)")])
    if h.hexdigest() != checksum:
        raise CheckpointCorruptError(src_path, [(name, "checksum mismatch (the content changed after it "
                                                       "was written)")])


def _verify_written(dst: Storage, write_path: str, manifest: Manifest, dst_path: str,
                    on_bytes: OnBytes | None, stop) -> None:
    """The copy, read back from the destination, against the manifest (before the commit)."""
    present = list_files(dst, write_path)
    present.pop(MANIFEST_NAME, None)
    faults: list[tuple[str, str]] = []
    for name in sorted(set(present) - set(manifest.files)):
        faults.append((name, "unexpected file at the destination"))
    for name, ent in sorted(manifest.files.items()):
        if _stopped(stop):
            raise CopyInterrupted(f"copy to {dst_path} stopped")
        if name not in present:
            faults.append((name, "missing at the destination after the copy"))
            continue
        if present[name] != ent.size:
            faults.append((name, f"{present[name]} bytes at the destination, the manifest says {ent.size}"))
            continue
        with dst.open_read(_join(dst, write_path, name)) as f:
            size, digest = hash_stream(f, on_bytes)
        if size != ent.size or digest != ent.checksum:
            faults.append((name, "differs from the manifest when read back from the destination"))
    if faults:
        raise CheckpointCorruptError(dst_path, faults)


def copy_checkpoint(src: Storage, src_path: str, dst: Storage, dst_path: str,
                    progress: OnBytes | None = None, *, verify_progress: OnBytes | None = None,
                    stop: threading.Event | Callable[[], bool] | None = None,
                    token: str | None = None, chunk: int | None = None) -> CopyReport:
    """Copy the committed checkpoint at ``src_path`` to ``dst_path`` and commit it there.

    ``progress(n)`` is called with the bytes copied, ``verify_progress(n)`` with the bytes
    read back from the destination. ``stop`` (an event or a callable) interrupts the
    copy at the next chunk with :class:`CopyInterrupted`. If ``dst_path`` already holds
    this very checkpoint (the same manifest) nothing is copied (``skipped``); a different
    committed checkpoint there is an error.

    Raises :class:`CheckpointNotFoundError` when the source is not committed and
    :class:`CheckpointCorruptError` when a source file does not match its manifest; in
    every failure the destination is left with nothing committed.
    """
    t0 = time.perf_counter()
    chunk = chunk or CHUNK_BYTES
    manifest = read_manifest(src, src_path)  # committed, parsable, signature checked
    data = committed_manifest(src, src_path)
    if data is None:  # removed between the two reads
        raise CheckpointNotFoundError(f"{src_path} is no longer a committed checkpoint")
    total = sum(e.size for e in manifest.files.values())
    existing = committed_manifest(dst, dst_path)
    if existing is not None:
        if existing == data:
            return CopyReport(src_path, dst_path, manifest.step, len(manifest.files), total,
                              time.perf_counter() - t0, skipped=True)
        raise RollCkptError(f"a different checkpoint is already committed at {dst_path}; remove it "
                            "first (roll-ckpt prune) or copy to another destination")
    pending = pending_checkpoint(dst, dst_path, token or uuid.uuid4().hex[:12])
    begun = False
    try:
        pending.begin()
        begun = True
        folders: set[str] = set()
        for name, ent in sorted(manifest.files.items()):
            parent = name.rsplit("/", 1)[0] if "/" in name else ""
            while parent and parent not in folders:
                folders.add(parent)
                parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
        for rel in sorted(folders):
            dst.makedirs(_join(dst, pending.write_path, rel))
        for name, ent in sorted(manifest.files.items()):
            _copy_file(src, _join(src, src_path, name), dst, _join(dst, pending.write_path, name), name,
                       ent.size, ent.checksum, src_path, progress, stop, chunk)
        _verify_written(dst, pending.write_path, manifest, dst_path, verify_progress, stop)
        if _stopped(stop):
            raise CopyInterrupted(f"copy to {dst_path} stopped")
        try:
            pending.commit(data)
        except FileExistsError:
            # Another copy committed the same path first: fine if it is this very checkpoint.
            if same_checkpoint(committed_manifest(dst, dst_path), data):
                pending.abort()
                return CopyReport(src_path, dst_path, manifest.step, len(manifest.files), total,
                                  time.perf_counter() - t0, skipped=True)
            raise
    except BaseException:
        if begun:
            try:
                pending.abort()
            except Exception:  # the original error matters more; leftovers are cleaned later
                log.warning("roll-ckpt: could not clean up the interrupted copy at %s", pending.write_path,
                            exc_info=True)
        raise
    return CopyReport(src_path, dst_path, manifest.step, len(manifest.files), total, time.perf_counter() - t0)


def copy_checkpoints(src: Storage, src_root: str, dst: Storage, dst_root: str,
                     refs: Iterable[CheckpointRef] | None = None, **kwargs) -> list[CopyReport]:
    """Copy every committed checkpoint below ``src_root`` to the same place below ``dst_root``.

    ``<src_root>/<run>/checkpoint-<step>`` goes to ``<dst_root>/<run>/checkpoint-<step>``.
    Checkpoints already at the destination are skipped (reported with ``skipped``).
    """
    out = []
    for ref in (refs if refs is not None else scan(src, src_root)):
        if not ref.committed:
            continue
        rel = relative_path(src_root, ref.path)
        out.append(copy_checkpoint(src, ref.path, dst, _join(dst, dst_root, rel), **kwargs))
    return out
