"""DCP's file system on any :class:`~roll_ckpt.contracts.Storage`, hashing what it writes.

:class:`StorageFileSystem` adapts a backend to DCP's ``FileSystemBase``, so DCP's own
reader and roll-ckpt's writer run on every backend, third parties' included. Every file
written through it is hashed while it streams by (:class:`_HashingStream`); the sizes and
checksums end up in the manifest.
"""

from __future__ import annotations

import io
import threading
from contextlib import contextmanager
from typing import Any, Callable, Generator

from torch.distributed.checkpoint.filesystem import FileSystemBase

from ..contracts import AbortableWrite, Storage
from .digest import FileHasher, Hasher

__all__ = ["StorageFileSystem"]

_WRITE_PIECE = 8 << 20


class _HashingStream(io.RawIOBase):
    """Write-through stream that counts and hashes; ``tell`` is what DCP records as offsets."""

    def __init__(self, inner: Any, on_close: Callable[[tuple[int, str, tuple[str, ...]]], None],
                 on_bytes: Callable[[int], None] | None) -> None:
        self._inner = inner
        self._hasher = FileHasher()
        self._on_close = on_close
        self._on_bytes = on_bytes

    @property
    def inner(self) -> Any:
        """The backend's file object written through."""
        return self._inner

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        # In pieces of a chunk's size: each piece is one write call and one hash call
        # (both release the GIL), so the loop's thread gets the GIL back fewer times.
        # Measured on a 108 MiB state: 8 MiB pieces cost 12% less CPU than 1 MiB pieces.
        mv = memoryview(b).cast("B")
        total = 0
        while total < mv.nbytes:
            part = mv[total:total + _WRITE_PIECE]
            n = self._inner.write(part)
            n = part.nbytes if n is None else n
            self._hasher.update(part[:n])
            total += n
            if n < part.nbytes:
                break
        if self._on_bytes is not None:
            self._on_bytes(total)
        return total

    def tell(self) -> int:
        return self._hasher.size

    def flush(self) -> None:
        if not self._inner.closed:
            self._inner.flush()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._inner.close()  # the backend makes it durable here
        finally:
            super().close()
        self._on_close(self._hasher.digest())


class _DigestSink(io.RawIOBase):
    """Where a file is serialized to learn its checksum without writing it."""

    def __init__(self) -> None:
        self._hasher = Hasher()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self._hasher.update(b)
        return memoryview(b).nbytes

    def tell(self) -> int:
        return self._hasher.size

    def digest(self) -> tuple[int, str]:
        return self._hasher.size, self._hasher.hexdigest()


class StorageFileSystem(FileSystemBase):
    """DCP's ``FileSystemBase`` over a roll-ckpt backend."""

    def __init__(self, storage: Storage, on_bytes: Callable[[int], None] | None = None) -> None:
        self.storage = storage
        self.on_bytes = on_bytes
        self.digests: dict[str, tuple[int, str, tuple[str, ...]]] = {}
        """Per file written: ``(size, checksum, chunk checksums)``."""
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def record(self, path: str, digest: tuple) -> None:
        """Record a file's digest: one written here, or taken over from another checkpoint."""
        with self._lock:
            self.digests[path] = digest

    @contextmanager
    def hashing_stream(self) -> Generator[_DigestSink, None, None]:
        """A stream that hashes what is written to it and keeps nothing (``digest()``: size
        and whole checksum)."""
        yield _DigestSink()

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[io.IOBase, None, None]:
        path = str(path)
        if mode == "wb":
            stream = _HashingStream(self.storage.open_write(path),
                                    lambda d: self.record(path, d), self.on_bytes)
            try:
                yield stream  # type: ignore[misc]
            except BaseException as exc:
                # Kept for the writer: a failure in one of its threads must fail the save.
                with self._lock:
                    self.errors.append(exc)
                if isinstance(stream.inner, AbortableWrite):  # an object store: no short object from a failed write
                    try:
                        stream.inner.abort()
                    except Exception:  # the folder is removed by the save's cleanup anyway
                        pass
                raise
            finally:
                stream.close()
        elif mode == "rb":
            with self.storage.open_read(path) as f:
                yield f
        else:
            raise ValueError(f"unsupported mode {mode!r}")

    def concat_path(self, path: Any, suffix: str) -> str:
        return self.storage.join(str(path), suffix)

    def rename(self, path: Any, new_path: Any) -> None:
        self.storage.rename_file(str(path), str(new_path))
        with self._lock:
            if str(path) in self.digests:
                self.digests[str(new_path)] = self.digests.pop(str(path))

    def init_path(self, path: Any, **kwargs: Any) -> str:
        return str(path)

    def mkdir(self, path: Any) -> None:
        self.storage.makedirs(str(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def exists(self, path: Any) -> bool:
        return self.storage.exists(str(path))

    def rm_file(self, path: Any) -> None:
        self.storage.remove(str(path))

    def ls(self, path: Any) -> list[str]:
        return [e.path for e in self.storage.list(str(path))]
