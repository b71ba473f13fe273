"""What the machine itself allows: durable sequential writes, uncached reads, memcpy.

Every figure is bytes / seconds of one repetition; ``run.py`` alternates these with the
checkpoint cases and reports medians.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Any

import numpy as np

__all__ = ["Limits"]

CHUNK = 16 << 20


class Limits:
    """Scratch files under ``folder``; ``nbytes`` per measurement."""

    def __init__(self, folder: str, nbytes: int) -> None:
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self.nbytes = max(CHUNK, nbytes // CHUNK * CHUNK)
        rng = np.random.default_rng(0)
        self._block = rng.integers(0, 256, CHUNK, dtype=np.uint8)  # incompressible
        self._read_files: dict[int, list[str]] = {}
        self._src: np.ndarray | None = None
        self._dst: np.ndarray | None = None

    # ---------------------------------------------------------------- disk

    def _write_one(self, path: str, nbytes: int, direct: bool = False) -> None:
        view = memoryview(self._block)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if direct:  # O_DIRECT needs page-aligned memory: an anonymous mapping is
            aligned = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            aligned[:] = view
            view = memoryview(aligned)
            flags |= os.O_DIRECT
        fd = os.open(path, flags, 0o644)
        try:
            done = 0
            while done < nbytes:
                done += os.write(fd, view[: min(CHUNK, nbytes - done)])
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def disk_write(self, streams: int = 1, direct: bool = False) -> float:
        """Sequential write + fdatasync (``dd bs=16M conv=fdatasync``, with ``direct``
        ``oflag=direct`` too), ``streams`` files at once."""
        paths = [os.path.join(self.folder, f"write-{i}.bin") for i in range(streams)]
        per = self.nbytes // streams
        t0 = time.perf_counter()
        if streams == 1:
            self._write_one(paths[0], per, direct)
        else:
            ts = [threading.Thread(target=self._write_one, args=(p, per, direct)) for p in paths]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        dt = time.perf_counter() - t0
        # the read tests read freshly written files
        self._read_files[streams] = []
        for i, p in enumerate(paths):
            keep = os.path.join(self.folder, f"read-{streams}-{i}.bin")
            os.replace(p, keep)
            self._read_files[streams].append(keep)
        return per * streams / dt

    def disk_read(self, streams: int = 1) -> tuple[float, str]:
        """Sequential read bypassing the page cache (O_DIRECT, else a cache-dropped read),
        ``streams`` files at once."""
        if streams not in self._read_files:
            self.disk_write(streams)
        files = self._read_files[streams]
        if streams == 1:
            done, dt, method = self._read_one(files[0])
            return done / dt, method
        out: list[Any] = [None] * streams

        def one(i: int) -> None:
            out[i] = self._read_one(files[i])

        t0 = time.perf_counter()
        ts = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        return sum(o[0] for o in out) / dt, out[0][2]

    def _read_one(self, path: str) -> tuple[int, float, str]:
        buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
        method = "O_DIRECT"
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            if not hasattr(os, "O_DIRECT"):
                raise OSError
        except OSError:
            method = "fadvise(DONTNEED) + read"
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            t0 = time.perf_counter()
            done = 0
            while True:
                try:
                    n = os.readv(fd, [buf])
                except OSError:  # a file system that accepts O_DIRECT at open but not at read
                    if method != "O_DIRECT":
                        raise
                    os.close(fd)
                    fd = os.open(path, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    method = "fadvise(DONTNEED) + read"
                    t0, done = time.perf_counter(), 0
                    continue
                done += n
                if n < CHUNK:
                    break
            dt = time.perf_counter() - t0
        finally:
            os.close(fd)
            buf.close()
        return done, dt, method

    # ---------------------------------------------------------------- memory

    def memcpy(self) -> float:
        """Copy between two already-touched buffers (what reused staging buffers cost)."""
        n = min(self.nbytes, 256 << 20)
        if self._src is None or self._src.nbytes != n:
            self._src = np.ones(n, dtype=np.uint8)
            self._dst = np.zeros(n, dtype=np.uint8)
        t0 = time.perf_counter()
        np.copyto(self._dst, self._src)
        return n / (time.perf_counter() - t0)

    def memcpy_fresh(self) -> float:
        """Copy into a fresh allocation (what a clone / default staging pays: page faults)."""
        import torch

        n = min(self.nbytes, 256 << 20)
        if self._src is None or self._src.nbytes != n:
            self.memcpy()
        src = torch.from_numpy(self._src)
        t0 = time.perf_counter()
        dst = src.clone()
        dt = time.perf_counter() - t0
        del dst
        return n / dt

    def close(self) -> None:
        for name in os.listdir(self.folder):
            if name.endswith(".bin"):
                os.unlink(os.path.join(self.folder, name))
