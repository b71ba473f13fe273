"""Checked checkpoint files, and tensors loaded from them without an intermediate copy.

A file whose checksum was checked stays open (local disks: its pages are in the cache the
check filled) or in memory (backends without file descriptors) until the load is done;
:func:`load_tensor` reads one DCP item from it straight into the target tensor.

**Files checked piece by piece.** Checkpoint files loaded in one pass: each piece checked just before its bytes are used.

``checkpoint_config.verify_before_load: false`` (:class:`roll_ckpt.dcp.reader.SafeReader`
with ``stream=True``). Every byte is read from storage once, whatever the size of the
checkpoint against the page cache, and memory stays bounded (a few pieces per file being
loaded). The price: a damaged piece is found after the pieces before it went into the live
state, so the load fails with :class:`~roll_ckpt.errors.PartlyLoadedError` instead of
leaving the state untouched. The default (verify every file, then load) keeps that promise.

**The restricted unpickler.** Reading a checkpoint never runs its code.

DCP's ``.metadata`` is a pickle: :func:`safe_load_metadata` admits only DCP's metadata
classes. Every other value DCP reads goes through ``torch.load(weights_only=True)``
(:class:`SafeLoadPlanner`, :class:`SafeEmptyLoadPlanner`); a refusal names the item.
"""

from __future__ import annotations

import enum
import io
import os
import pickle
import sys
import torch
import threading
from typing import Any, Callable
from concurrent.futures import Future
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import UnsafeCheckpointError
from ..runtime import torch_compat
from ..runtime.torch_compat import empty_state_dict_load_planner, planner_set_value
from .files import writable_view, tensor_frame
from ..format.manifest import hash_chunk

__all__ = ['Verified', 'WindowReader', 'MemoryReader', 'load_tensor', 'pread_into', 'verify_budget', 'READ_CHUNK', 'CHECK_STREAMS', 'piece_pool', 'StreamedFile', 'MAX_PIECE', 'AHEAD', 'ENDS', 'METADATA_NAME', 'safe_load_metadata', 'SafeLoadPlanner', 'SafeEmptyLoadPlanner', 'pickle_reason']


# ---- files checked whole ---------------------------------------------------

class WindowReader(io.RawIOBase):
    """A seekable read-only stream over ``length`` bytes; subclasses say where they come from."""

    def __init__(self, length: int) -> None:
        self._len, self._pos = length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        dst = memoryview(b)
        if dst.format != "B" or dst.ndim != 1:
            dst = dst.cast("B")
        n = max(0, min(len(dst), self._len - self._pos))
        if n:
            n = self._fill(dst[:n], self._pos)
        self._pos += n
        return n

    def _fill(self, dst: memoryview, pos: int) -> int:
        raise NotImplementedError


class MemoryReader(WindowReader):
    """Over bytes already in memory (``readinto``: one copy)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__(len(data))
        self._data = data

    def _fill(self, dst: memoryview, pos: int) -> int:
        dst[:] = self._data[pos:pos + len(dst)]
        return len(dst)


CHECK_STREAMS = 1
"""Files one process checks at once in the background (2 measured slower here: more CPU)."""
READ_CHUNK = 256 << 10
"""Read and hash in pieces that stay in the CPU cache (16 MiB pieces cost 40% more CPU)."""


def verify_budget() -> int:
    """Bytes of checkpoint files one process may copy into memory while it loads them
    (only for backends without file descriptors)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        free = 0
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(256 << 20, free // (4 * local_ranks))


def read_hashed(f: Any, size: int, on_bytes: Any = None) -> tuple[memoryview, int, str]:
    """Read a stream of ``size`` bytes (as the manifest says) into memory, hashing it: the
    bytes, how many were there (one more when the stream is longer) and their checksum."""
    import xxhash

    view = memoryview(torch.empty(size, dtype=torch.uint8).numpy())
    hasher = xxhash.xxh3_128()
    pos = 0
    while pos < size:
        n = f.readinto(view[pos:pos + READ_CHUNK])
        if not n:
            break
        hasher.update(view[pos:pos + n])
        pos += n
        if on_bytes is not None:
            on_bytes(n)
    if pos == size and f.read(1):
        pos += 1  # longer than the manifest says
    return view, pos, hasher.hexdigest()


def pread_into(fd: int, dst: memoryview, offset: int) -> None:
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n <= 0:
            raise OSError(f"file ended {len(dst) - done} bytes early (changed while it was being loaded)")
        done += n


class _FdReader(WindowReader):
    """Over ``length`` bytes of an open file from ``base`` (pread)."""

    def __init__(self, fd: int, base: int, length: int) -> None:
        super().__init__(length)
        self._fd, self._base = fd, base

    def _fill(self, dst: memoryview, pos: int) -> int:
        return os.preadv(self._fd, [dst], self._base + pos)


class Verified:
    """A checked file: kept open (local disks; loaded from the page cache the check filled,
    straight into the target tensors), or its bytes in memory (other backends)."""

    def __init__(self, file: Any = None, view: memoryview | None = None) -> None:
        self.file = file
        self.fd = file.fileno() if file is not None else -1
        self.view = view
        self._storage: Any = None

    def bytes(self, offset: int, length: int) -> memoryview:
        if self.view is not None:
            return self.view[offset:offset + length]
        buf = memoryview(bytearray(length))
        pread_into(self.fd, buf, offset)
        return buf

    def read_into(self, dst: memoryview, offset: int) -> None:
        """Copy the file's bytes ``[offset, offset + len(dst))`` into ``dst``."""
        if self.view is not None:
            dst[:] = self.view[offset:offset + len(dst)]
        else:
            pread_into(self.fd, dst, offset)

    def stream(self, offset: int, length: int) -> io.RawIOBase:
        if self.view is not None:
            return MemoryReader(self.view[offset:offset + length])
        return _FdReader(self.fd, offset, length)

    def storage(self) -> Any:
        """The in-memory bytes as one ``torch.UntypedStorage`` (no copy)."""
        if self._storage is None:
            self._storage = torch.frombuffer(self.view, dtype=torch.uint8).untyped_storage()
        return self._storage

    def close(self) -> None:
        self._storage = None
        if self.view is not None:
            try:
                self.view.release()
            except (BufferError, ValueError):
                pass
        if self.file is not None:
            self.file.close()


class _Storages:
    """``overall_storage`` for torch's loader: hands out the target tensor's own storage
    when the record is exactly its bytes (else a fresh one) and notes where each record
    lies; the bytes are read in afterwards, straight from the file."""

    def __init__(self, target: torch.Tensor | None) -> None:
        self.target = target
        self.spans: list[tuple[int, int, Any]] = []
        self.gave_target = False

    def __getitem__(self, span: slice) -> Any:
        nbytes = span.stop - span.start
        t = self.target
        if (t is not None and not self.spans and t.device.type == "cpu" and t.is_contiguous()
                and t.storage_offset() == 0 and t.numel() * t.element_size() == nbytes):
            storage = t.untyped_storage()
            self.gave_target = True
        else:
            storage = torch.UntypedStorage(nbytes)
        self.spans.append((span.start, nbytes, storage))
        return storage


def load_tensor(data: Any, offset: int, length: int, target: torch.Tensor | None) -> torch.Tensor:
    """``torch.load(weights_only=True)`` of one DCP item, without its intermediate copy.

    ``data`` is a :class:`Verified` file or a :class:`~roll_ckpt.dcp.checked.StreamedFile`.
    The same unpickler and the same mechanism as ``torch.load(..., mmap=True)`` (torch's
    loader with an ``overall_storage``): in memory, the tensor aliases the checked bytes;
    from a file, its bytes are read with one ``pread`` into the target tensor itself when
    the item is exactly the target (same world size: the usual case), else into a fresh
    tensor. Falls back to a plain ``torch.load`` where torch's internals differ.
    """
    def plain() -> torch.Tensor:
        return torch.load(MemoryReader(data.bytes(offset, length)), map_location="cpu", weights_only=True)

    check_ends = getattr(data, "check_ends", None)
    if check_ends is not None:
        check_ends(offset, length)
    if target is not None and data.view is None:
        framed = _read_framed(data, offset, length, target)
        if framed is not None:
            return framed
    try:
        reader = torch_compat.file_reader(data.stream(offset, length))
        if data.view is not None:
            return torch_compat.weights_only_load(reader, data.storage()[offset:offset + length])
        if reader.has_record("byteorder") and bytes(reader.get_record("byteorder")).decode() != sys.byteorder:
            return plain()  # torch swaps the bytes itself
        storages = _Storages(target)
        tensor = torch_compat.weights_only_load(reader, storages)
        if storages.gave_target and target is not None and not (
                tensor.data_ptr() == target.data_ptr() and tensor.dtype == target.dtype
                and tensor.shape == target.shape and tensor.stride() == target.stride()):
            # the record has the target's size but not its layout: load it apart, then copy
            reader = torch_compat.file_reader(data.stream(offset, length))
            storages = _Storages(None)
            tensor = torch_compat.weights_only_load(reader, storages)
        for start, nbytes, storage in storages.spans:
            # the record's bytes only: a target's storage may be longer (FSDP pads shards)
            data.read_into(writable_view(storage, nbytes), offset + start)
        return tensor
    except (AttributeError, TypeError):  # torch's loader is not what this was written against
        return plain()


def _read_framed(data: Any, offset: int, length: int, target: torch.Tensor) -> torch.Tensor | None:
    """``target`` filled with the item's tensor bytes when the item is exactly ``torch.save``'s
    frame of a tensor of the target's layout (what roll-ckpt's writer writes:
    :mod:`roll_ckpt.dcp.files`) -- its ends compared byte for byte, nothing
    unpickled; ``None`` for anything else, which is loaded the general way."""
    if target.device.type != "cpu" or not target.is_contiguous() or target.storage_offset() != 0:
        return None
    frame = tensor_frame(target.dtype, tuple(target.shape), target.stride())
    nbytes = target.numel() * target.element_size()
    if frame is None or len(frame[0]) + nbytes + len(frame[1]) != length:
        return None
    prefix, suffix = frame
    dst = writable_view(target.untyped_storage(), nbytes)
    if getattr(data, "fd", -1) >= 0:  # a file kept open: the frame and the bytes in one read
        ends = bytearray(len(prefix) + len(suffix))
        parts = [memoryview(ends)[:len(prefix)], dst, memoryview(ends)[len(prefix):]]
        if os.preadv(data.fd, parts, offset) != length:  # short (never on a local file): read it piece by piece
            for part, at in zip(parts, (offset, offset + len(prefix), offset + len(prefix) + nbytes)):
                pread_into(data.fd, part, at)
        return target if ends == prefix + suffix else None  # else loaded again the general way
    if (bytes(data.bytes(offset, len(prefix))) != prefix
            or bytes(data.bytes(offset + length - len(suffix), len(suffix))) != suffix):
        return None
    data.read_into(dst, offset + len(prefix))
    return target


CHECK_THREADS = 4
"""Pieces a one-pass load reads and hashes ahead at once (pread and xxhash release the GIL)."""


def piece_pool() -> Any:
    """Threads that read and hash pieces of checkpoint files, for one load (shut down by its
    owner when the load is done: no thread outlives it, so a process may fork afterwards)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="roll-ckpt-check")


# ---- files checked piece by piece ------------------------------------------

MAX_PIECE = 64 << 20
"""Pieces larger than this (a manifest's ``chunk_size``) are not streamed: the file is
checked whole first, as by default, so a manifest cannot make the reader allocate more."""
ENDS = 64 << 10
"""Bytes at each end of an item (its zip directory, its pickle) checked before torch reads it."""
AHEAD = 2
"""Pieces read and checked ahead of the one being copied (the disk and the hashing keep
working while the loader copies)."""


class StreamedFile:
    """One checkpoint file, read in its manifest's pieces as the loader asks for bytes.

    A piece is checked against the manifest before any of its bytes are handed out. Pieces
    behind the loader's position are dropped (their buffers reused); the loader walks the
    file in order, so each is read once. ``fault(what)`` makes the error to raise.
    """

    view = None  # the loader's test for in-memory files: this is not one

    def __init__(self, file: Any, entry: Any, fault: Callable[[str], BaseException], pool: Any,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.file = file
        self._pool = pool  # reads and checks pieces ahead (a piece_pool)
        try:
            self.fd = file.fileno()
        except (AttributeError, OSError, ValueError):
            self.fd = -1
        self._entry = entry
        self._fault = fault
        self._on_bytes = on_bytes
        self._pieces: dict[int, Future] = {}
        self._free: list[memoryview] = []
        self._io_lock = threading.Lock()  # a file object without a descriptor reads with seek + readinto
        self.pieces_read = 0
        if self.fd >= 0:
            size = os.fstat(self.fd).st_size
            if size != entry.size:
                raise fault(f"size {size} bytes, the manifest says {entry.size} (truncated or altered)")
            try:
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass

    # ------------------------------------------------------------ pieces

    def _read_piece(self, k: int, buf: memoryview) -> memoryview:
        size = self._entry.chunk_size
        offset = k * size
        n = min(size, self._entry.size - offset)
        view = buf[:n]
        if self.fd >= 0:
            pread_into(self.fd, view, offset)
        else:
            with self._io_lock:
                self.file.seek(offset)
                got = 0
                while got < n:
                    m = self.file.readinto(view[got:])
                    if not m:
                        raise self._fault(f"ends at byte {offset + got}, the manifest says {self._entry.size}")
                    got += m
        if self._on_bytes is not None:
            self._on_bytes(n)
        if hash_chunk(view) != self._entry.chunks[k]:
            raise self._fault(f"checksum mismatch (the content changed after it was written) in the piece "
                              f"at byte {offset}")
        return view

    def _start(self, k: int) -> None:
        if k in self._pieces or k >= len(self._entry.chunks):
            return
        buf = self._free.pop() if self._free else memoryview(bytearray(self._entry.chunk_size))
        self.pieces_read += 1
        self._pieces[k] = self._pool.submit(self._read_piece, k, buf)

    def _piece(self, k: int) -> memoryview:
        self._start(k)
        for ahead in range(k + 1, k + 1 + AHEAD):
            self._start(ahead)
        return self._pieces[k].result()

    def release_before(self, pos: int) -> None:
        """Drop the pieces that end at or before byte ``pos`` (the loader is past them)."""
        size = self._entry.chunk_size
        for k in [k for k in self._pieces if (k + 1) * size <= pos]:
            fut = self._pieces.pop(k)
            try:
                view = fut.result()
            except Exception:  # that piece's failure is raised where it is read; a Ctrl-C is not caught
                continue
            self._free.append(memoryview(view.obj))

    # ------------------------------------------------------------ what the loader calls

    def read_into(self, dst: memoryview, offset: int, *, release: bool = True) -> None:
        """Copy the checked bytes ``[offset, offset + len(dst))`` into ``dst``."""
        size = self._entry.chunk_size
        done = 0
        while done < len(dst):
            pos = offset + done
            k, at = divmod(pos, size)
            piece = self._piece(k)
            n = min(len(dst) - done, len(piece) - at)
            if n <= 0:
                raise self._fault(f"has no byte {pos} (the manifest says {self._entry.size} bytes)")
            dst[done:done + n] = piece[at:at + n]
            done += n
            if release:
                self.release_before(offset + done)

    def check_ends(self, offset: int, length: int) -> None:
        """Check the pieces holding the first and last :data:`ENDS` bytes of an item now:
        torch's zip reader reads its directory and its pickle there, and an error raised
        inside torch's reader would reach the caller as something else."""
        for pos in (offset, max(offset, offset + length - ENDS)):
            self.read_into(memoryview(bytearray(min(ENDS, length))), pos, release=False)

    def bytes(self, offset: int, length: int) -> memoryview:
        buf = memoryview(bytearray(length))
        self.read_into(buf, offset, release=False)
        return buf

    def stream(self, offset: int, length: int) -> WindowReader:
        return _PieceReader(self, offset, length)

    def close(self) -> None:
        for fut in self._pieces.values():
            fut.cancel()
        for fut in self._pieces.values():
            if not fut.cancelled():
                try:
                    fut.result()
                except Exception:  # closing: a read that failed is of no use now; a Ctrl-C still goes up
                    pass
        self._pieces.clear()
        self._free.clear()
        self.file.close()


class _PieceReader(WindowReader):
    """A seekable stream over ``length`` bytes of a :class:`StreamedFile` from ``base``
    (torch's zip reader reads an item's directory, then its pickle, through it)."""

    def __init__(self, source: StreamedFile, base: int, length: int) -> None:
        super().__init__(length)
        self._source, self._base = source, base

    def _fill(self, dst: memoryview, pos: int) -> int:
        self._source.read_into(dst, self._base + pos, release=False)
        return len(dst)


# ---- the restricted unpickler ----------------------------------------------

METADATA_NAME = ".metadata"

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
              "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def _enum_member(cls: Any, name: Any) -> Any:
    """What ``getattr(cls, name)`` gives in a pickle, admitted for the members of an admitted enum only.

    CPython 3.11.0 to 3.11.4 (3.11.2 is Debian 12's system Python) pickle an enum member as
    ``getattr(EnumClass, "NAME")``; other releases as ``EnumClass(value)``. ``cls`` here was
    itself admitted by :meth:`_MetadataUnpickler.find_class`, so this adds no class.
    """
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not a "
                                 "member of a DCP metadata enum")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module in ("builtins", "__builtin__") and name == "getattr":
            return _enum_member
        if module == "pathlib._local" and name in ("PosixPath", "PurePosixPath"):
            # Python 3.13 moved pathlib's classes there; what DCP's FileSystemWriter records as the
            # checkpoint_id then names them so. Read as pathlib's own on every Python.
            import pathlib

            return getattr(pathlib, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def safe_load_metadata(data: bytes, where: str = METADATA_NAME) -> Metadata:
    """Unpickle DCP metadata, admitting only DCP's metadata classes."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise UnsafeCheckpointError(where, [(METADATA_NAME, f"refused to unpickle: {exc}")]) from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(where, [(METADATA_NAME, f"holds a {type(md).__name__}, not DCP Metadata")])
    return md


class _RefusedValue(pickle.UnpicklingError):
    """``torch.load(weights_only=True)`` refused a non-tensor value; names the item."""

    def __init__(self, message: str, read_item: Any) -> None:
        super().__init__(message)
        self.read_item = read_item


def pickle_reason(exc: BaseException) -> str:
    """The line of torch's (long) weights-only refusal that says what was refused."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if "GLOBAL" in ln or "global" in ln:
            return ln[:300].rstrip(".")
    return (lines[-1] if lines else type(exc).__name__)[:300].rstrip(".")


def _load_bytes_safely(value: io.BytesIO, read_item: Any = None) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _RefusedValue(pickle_reason(exc), read_item) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are read with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        planner_set_value(self, read_item.dest_index.fqn, _load_bytes_safely(value, read_item))


class SafeEmptyLoadPlanner(empty_state_dict_load_planner()):  # type: ignore[misc]
    """Rebuilds a full state dict from metadata (export, inspect), reading safely."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        planner_set_value(self, read_item.dest_index.fqn, _load_bytes_safely(value, read_item))
