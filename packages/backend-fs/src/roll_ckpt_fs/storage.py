"""Local disks (POSIX: rename commits) and fsspec targets (manifest-last commits)."""

from __future__ import annotations

import io
import os
import posixpath
import shutil
import stat
from typing import Any, BinaryIO, Mapping

from roll_ckpt import StorageError
from roll_ckpt.storage import Entry

__all__ = ["LocalStorage", "FsspecStorage", "open_storage"]

_WRITE_BUFFER = 8 << 20


class _DurableFile(io.BufferedWriter):
    """A buffered file whose ``close()`` returns only once the data is on disk."""

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
            os.fsync(self.fileno())
        finally:
            super().close()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A POSIX file system: atomic rename of a fsynced temporary folder commits."""

    atomic_rename = True

    def __init__(self, url: str) -> None:
        self.url = url
        path = url[len("file://"):] if url.startswith("file://") else url
        self.root = os.path.abspath(os.path.expanduser(path))

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path) and not os.path.islink(path)

    def list(self, path: str) -> list[Entry]:
        try:
            it = os.scandir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        with it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                out.append(Entry(e.name, e.path, stat.S_ISDIR(st.st_mode), st.st_size, st.st_mtime))
        return out

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def open_read(self, path: str) -> BinaryIO:
        # O_NOFOLLOW: a link planted in a checkpoint folder is never followed.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        return os.fdopen(fd, "rb")

    def open_write(self, path: str) -> BinaryIO:
        raw = io.FileIO(path, "w")
        return _DurableFile(raw, buffer_size=_WRITE_BUFFER)  # type: ignore[return-value]

    def write_create(self, path: str, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        except BaseException:
            # A partial file (disk full...) must not stand in for the whole one, nor block a retry.
            os.close(fd)
            fd = -1
            self.remove(path)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        _fsync_dir(os.path.dirname(path) or ".")

    def rename_dir(self, src: str, dst: str) -> None:
        if os.path.lexists(dst):
            raise FileExistsError(dst)
        os.rename(src, dst)
        _fsync_dir(os.path.dirname(dst) or ".")

    def rename_file(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def sync_dir(self, path: str) -> None:
        if os.path.isdir(path):
            _fsync_dir(path)

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        if os.path.islink(path) or os.path.isfile(path):
            self.remove(path)
        else:
            shutil.rmtree(path, ignore_errors=False, onerror=_ignore_missing)

    def free_bytes(self, path: str) -> int | None:
        p = os.path.abspath(path)
        while not os.path.exists(p):
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
        return shutil.disk_usage(p).free

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"


def _ignore_missing(func: Any, path: str, exc_info: Any) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


class FsspecStorage:
    """Any fsspec file system; commits by writing ``manifest.json`` last, create-only.

    fsspec's ``mv`` (copy + delete) and ``transaction`` (not atomic) are never used to
    commit. ``write_create`` opens with mode ``"xb"``, which stores that support it
    (memory, S3 with conditional writes) honour on the server side; for the others it
    checks first, which is create-only as long as one writer owns the folder — the case
    for roll-ckpt, whose folders are owned by one run.
    """

    atomic_rename = False

    def __init__(self, url: str, storage_options: Mapping[str, Any]) -> None:
        import fsspec

        self.url = url
        protocol, _ = fsspec.core.split_protocol(url)
        try:
            self.fs = fsspec.filesystem(protocol or "file", **dict(storage_options))
        except (ImportError, ValueError) as exc:
            hint = ' (pip install "roll-ckpt[s3]")' if protocol in ("s3", "s3a") else ""
            raise StorageError(f"checkpoint_config.output_dir {url}: cannot use the {protocol}:// "
                               f"store: {exc}{hint}") from None
        except TypeError as exc:
            raise StorageError(f"checkpoint_config.storage_options for {url}: {exc}") from None
        self.root = self.fs._strip_protocol(url).rstrip("/") or "/"

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def list(self, path: str) -> list[Entry]:
        try:
            items = self.fs.ls(path, detail=True, refresh=True) if _takes_refresh(self.fs) else self.fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        base = path.rstrip("/")
        for it in items:
            name = it["name"].rstrip("/")
            if name == base:
                continue
            mtime = it.get("mtime") or it.get("created") or it.get("LastModified")
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            out.append(Entry(posixpath.basename(name), name, it.get("type") == "directory",
                             int(it.get("size") or 0), float(mtime) if mtime else None))
        return out

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def open_read(self, path: str) -> BinaryIO:
        return self.fs.open(path, "rb")

    def open_write(self, path: str) -> BinaryIO:
        return self.fs.open(path, "wb")

    def write_create(self, path: str, data: bytes) -> None:
        try:
            f = self.fs.open(path, "xb")
        except (ValueError, NotImplementedError, TypeError):
            if self.fs.exists(path):
                raise FileExistsError(path) from None
            f = self.fs.open(path, "wb")
        with f:
            f.write(data)

    def rename_dir(self, src: str, dst: str) -> None:
        raise NotImplementedError("object stores commit by manifest, not by rename")

    def rename_file(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst)

    def sync_dir(self, path: str) -> None:
        pass

    def remove(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)

    def free_bytes(self, path: str) -> int | None:
        return None

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"


def _takes_refresh(fs: Any) -> bool:
    import inspect

    try:
        return "refresh" in inspect.signature(fs.ls).parameters
    except (TypeError, ValueError):
        return False


def open_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> LocalStorage | FsspecStorage:
    """The right storage for ``url``: plain paths and ``file://`` are local disks."""
    if "://" not in url or url.startswith("file://"):
        return LocalStorage(url)
    return FsspecStorage(url, storage_options or {})
