"""Checksums: xxHash's XXH3-128 (fast, maintained), computed while data streams by.

A file is described by its whole checksum and, for files written by roll-ckpt's own
writer, the checksums of its :data:`CHUNK_SIZE` pieces: a reader can then check the pieces
in parallel, or each piece before it uses it, without reading the file twice.
"""

from __future__ import annotations

from typing import BinaryIO

import xxhash

__all__ = ["ALGORITHM", "CHUNK_SIZE", "Hasher", "FileHasher", "hash_stream", "hash_bytes", "hash_chunk"]

ALGORITHM = "xxh3_128"
CHUNK_SIZE = 8 << 20
"""The pieces a file's chunk checksums cover (the last one may be shorter)."""
_CHUNK = 256 << 10
"""Read size of :func:`hash_stream`: small enough that the hash reads the chunk from the CPU
cache the read just filled (8 MiB chunks cost about 40% more CPU per byte)."""


class Hasher:
    """Running size and checksum of a byte stream."""

    __slots__ = ("_h", "size")

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)
        self.size += memoryview(data).nbytes

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def hash_stream(stream: BinaryIO, on_bytes=None) -> tuple[int, str]:
    h = Hasher()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while True:
        n = stream.readinto(view) if hasattr(stream, "readinto") else None
        if n is None:
            chunk = stream.read(_CHUNK)
            n = len(chunk)
            if not n:
                break
            h.update(chunk)
        else:
            if not n:
                break
            h.update(view[:n])
        if on_bytes is not None:
            on_bytes(n)
    return h.size, h.hexdigest()


def hash_bytes(data: bytes) -> tuple[int, str]:
    return len(data), xxhash.xxh3_128_hexdigest(data)


class FileHasher:
    """The whole checksum of a byte stream and the checksums of its :data:`CHUNK_SIZE` pieces."""

    __slots__ = ("_file", "_chunk", "chunks", "size")

    def __init__(self) -> None:
        self._file = xxhash.xxh3_128()
        self._chunk = xxhash.xxh3_128()
        self.chunks: list[str] = []
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._file.update(view)
        pos = 0
        while pos < view.nbytes:
            room = CHUNK_SIZE - self.size % CHUNK_SIZE
            piece = view[pos:pos + room]
            self._chunk.update(piece)
            pos += piece.nbytes
            self.size += piece.nbytes
            if self.size % CHUNK_SIZE == 0:
                self.chunks.append(self._chunk.hexdigest())
                self._chunk = xxhash.xxh3_128()

    def digest(self) -> tuple[int, str, tuple[str, ...]]:
        """``(size, checksum, chunk checksums)``."""
        chunks = list(self.chunks)
        if self.size % CHUNK_SIZE:
            chunks.append(self._chunk.hexdigest())
        return self.size, self._file.hexdigest(), tuple(chunks)


def hash_chunk(data: bytes | bytearray | memoryview) -> str:
    """The checksum of one piece (``xxhash`` releases the GIL: pieces hash in parallel)."""
    return xxhash.xxh3_128_hexdigest(data)
