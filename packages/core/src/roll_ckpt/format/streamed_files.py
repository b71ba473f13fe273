"""Checkpoint files loaded in one pass: each piece checked just before its bytes are used.

``checkpoint_config.verify_before_load: false`` (:class:`roll_ckpt.load.reader.SafeReader`
with ``stream=True``). Every byte is read from storage once, whatever the size of the
checkpoint against the page cache, and memory stays bounded (a few pieces per file being
loaded). The price: a damaged piece is found after the pieces before it went into the live
state, so the load fails with :class:`~roll_ckpt.errors.PartlyLoadedError` instead of
leaving the state untouched. The default (verify every file, then load) keeps that promise.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any, Callable

from .digest import hash_chunk
from .verified_files import WindowReader, pread_into

__all__ = ["StreamedFile", "MAX_PIECE", "AHEAD", "ENDS"]

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
        self._pool = pool  # reads and checks pieces ahead (a verified_files.piece_pool)
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
