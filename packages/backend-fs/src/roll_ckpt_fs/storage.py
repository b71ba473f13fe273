"""Local disks (POSIX: rename commits) and fsspec targets (manifest-last commits)."""

from __future__ import annotations

import errno
import io
import logging
import os
import posixpath
import shutil
import stat
import time
from typing import Any, BinaryIO, Mapping

from roll_ckpt import StorageError
from roll_ckpt.plugin import Entry, NetworkCounts

from .direct import open_direct
from .network import RETRY_KEYS, FaultCounter, ObjectWriter, RetryingReader, RetryPolicy, botocore_attempts

log = logging.getLogger("roll_ckpt")

__all__ = ["LocalStorage", "FsspecStorage", "open_storage"]

_WRITE_BUFFER = 1 << 20
"""Coalesces small writes (headers, pickles); large ones (tensors) go straight to the file."""
_WRITEBACK_EVERY = 32 << 20
"""Bytes after which a file's dirty pages are handed to the disk (without waiting)."""


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to ``fd`` and make it durable."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    os.fsync(fd)


def _load_sync_file_range() -> Any:
    """Linux's ``sync_file_range`` (not in :mod:`os`), or ``None`` elsewhere."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


class _DurableFile(io.BufferedWriter):
    """A buffered file whose ``close()`` returns only once the data is on disk.

    Every ``_WRITEBACK_EVERY`` bytes it starts the write-out of what it has written so
    far (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait), so the disk
    works while the caller is still producing data and the final fsync only waits for
    the tail. Without it the kernel would hold everything in the page cache until the
    fsync and the disk would sit idle meanwhile.
    """

    _started = 0
    _pending = 0

    def write(self, b: Any) -> int:
        n = super().write(b)
        if _sync_file_range is not None:
            self._pending += n
            if self._pending >= _WRITEBACK_EVERY:
                self._start_writeback()
        return n

    def _start_writeback(self) -> None:
        self.flush()
        end = self.raw.tell()
        if end > self._started and _sync_file_range(self.fileno(), self._started, end - self._started,
                                                    _SYNC_FILE_RANGE_WRITE) == 0:
            self._started = end
        self._pending = 0

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
            os.fsync(self.fileno())
        finally:
            super().close()


_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}
_SERVER_COPY = ("s3", "s3a")


class LocalStorage:
    """A POSIX file system: atomic rename of a fsynced temporary folder commits."""

    atomic_rename = True

    def __init__(self, url: str, direct_io: bool = True) -> None:
        self.url = url
        self.direct_io = direct_io
        """Write data files with ``O_DIRECT`` where the file system allows it (:mod:`roll_ckpt_fs.direct`)."""
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
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:  # removed meanwhile (another run's commit or retention)
                    continue
                out.append(Entry(e.name, e.path, stat.S_ISDIR(st.st_mode), st.st_size, st.st_mtime))
        return out

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def open_read(self, path: str) -> BinaryIO:
        # O_NOFOLLOW: a link planted in a checkpoint folder is never followed.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        return os.fdopen(fd, "rb")

    def open_write(self, path: str) -> BinaryIO:
        if self.direct_io:
            direct = open_direct(path)
            if direct is not None:
                return direct  # type: ignore[return-value]
        raw = io.FileIO(path, "w")
        return _DurableFile(raw, buffer_size=_WRITE_BUFFER)  # type: ignore[return-value]

    def write_create(self, path: str, data: bytes) -> None:
        """Create ``path`` whole or not at all: the bytes go to a fsynced temporary file that
        is then hard-linked into place, which fails if ``path`` exists. Nobody, not even after
        a crash or power loss, sees a partial file there.

        The temporary file lives one folder up (``.tmp-*``, removed by ``clean_stale`` if
        we die before unlinking it), so no stray file ever appears inside a checkpoint; but
        never above this storage's root (``output_dir``: a file of the root itself, such as a
        hold or ``.launch.json`` with ``timestamp_subdir: false``), where ``clean_stale`` would
        not look: its temporary file stays in the root.
        """
        folder = os.path.dirname(path) or "."
        above = os.path.dirname(os.path.abspath(folder))
        within = os.path.commonpath([above, self.root]) == self.root
        tmp_dir = above if within and os.path.isdir(above) and os.access(above, os.W_OK) else folder
        tmp = os.path.join(tmp_dir, f".tmp-{os.path.basename(path)}-{os.getpid()}-{time.monotonic_ns()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except OSError as exc:
                if exc.errno == errno.EEXIST:
                    raise FileExistsError(errno.EEXIST, "already exists", path) from None
                if exc.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                self._create_in_place(path, data)  # a file system without hard links
        finally:
            self.remove(tmp)
        self.sync_dir(folder)

    def _create_in_place(self, path: str, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, data)
        except BaseException:
            # A partial file (disk full...) must not stand in for the whole one, nor block a retry.
            os.close(fd)
            fd = -1
            self.remove(path)
            raise
        finally:
            if fd >= 0:
                os.close(fd)

    def rename_dir(self, src: str, dst: str) -> None:
        if os.path.lexists(dst):
            raise FileExistsError(dst)
        os.rename(src, dst)
        self.sync_dir(os.path.dirname(dst) or ".")

    def rename_file(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def take_over(self, src: str, dst: str) -> str:
        """A hard link (the bytes stay as long as one checkpoint holds them); a copy where
        the file system has none (another device, a file system without links)."""
        try:
            os.link(src, dst, follow_symlinks=False)
            return "link"
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise
        with open(src, "rb") as f, self.open_write(dst) as out:
            shutil.copyfileobj(f, out, 8 << 20)
        return "copy"

    def sync_dir(self, path: str) -> None:
        if not os.path.isdir(path):
            return
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

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
    commit. ``write_create`` checks that the file is missing, then writes with mode
    ``"xb"``, which stores that support it honour on the server side (memory; S3 and
    S3-compatible servers with conditional writes: s3fs sends ``If-None-Match: *`` and a
    412 means another writer won). Where the store cannot refuse, the check alone stands,
    which is create-only as long as one writer owns the folder — the case for roll-ckpt,
    whose folders are owned by one run.

    Listings are never answered from fsspec's listing cache (``use_listings_cache`` is
    off unless ``storage_options`` sets it): whether a manifest exists decides what is
    committed, and another process may have written or removed it since.
    """

    atomic_rename = False

    def __init__(self, url: str, storage_options: Mapping[str, Any]) -> None:
        import fsspec

        self.url = url
        protocol, _ = fsspec.core.split_protocol(url)
        options = dict(storage_options)
        self.network: FaultCounter | None = None
        if protocol in ("s3", "s3a"):  # roll-ckpt's retries and timeouts (roll_ckpt_fs.network)
            self.network = FaultCounter(RetryPolicy.pop_from(options, url), botocore_attempts(options))
            options = self.network.policy.s3fs_options(options)
            options.setdefault("skip_instance_cache", True)  # a client (and counters) of its own
        elif any(k in options for k in RETRY_KEYS):
            log.warning("roll-ckpt: storage_options %s have no effect on %s (only on s3://)",
                        ", ".join(k for k in RETRY_KEYS if k in options), url)
            options = {k: v for k, v in options.items() if k not in RETRY_KEYS}
        try:
            try:
                self.fs = fsspec.filesystem(protocol or "file", **{"use_listings_cache": False, **options})
            except TypeError:
                if "use_listings_cache" in options:
                    raise
                self.fs = fsspec.filesystem(protocol or "file", **options)  # takes no such option
        except (ImportError, ValueError) as exc:
            hint = ' (pip install "roll-ckpt[s3]")' if protocol in ("s3", "s3a") else ""
            raise StorageError(f"checkpoint_config.output_dir {url}: cannot use the {protocol}:// "
                               f"store: {exc}{hint}") from None
        except TypeError as exc:
            raise StorageError(f"checkpoint_config.storage_options for {url}: {exc}") from None
        self.root = self.fs._strip_protocol(url).rstrip("/") or "/"
        if self.network is not None:
            self.network.install(self.fs)

    def network_counts(self) -> NetworkCounts | None:
        """The faults met so far (``None``: not a networked store); see :mod:`roll_ckpt_fs.network`."""
        return None if self.network is None else self.network.counts()

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(self.fs.isdir(path))

    def list(self, path: str) -> list[Entry]:
        try:
            items = self.fs.ls(path, detail=True, refresh=True) if _takes_refresh(self.fs) else self.fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return _entries(items, path)

    def list_prefix(self, path: str, prefix: str) -> list[Entry]:
        """The files directly in ``path`` whose name starts with ``prefix``. An object store
        that lists by key prefix (s3fs) is asked for those keys only: the request does not
        grow with what else the folder holds (the checkpoints kept)."""
        import inspect

        if "prefix" not in inspect.signature(self.fs.find).parameters:
            return [e for e in self.list(path) if e.name.startswith(prefix)]
        try:
            found = self.fs.find(path, prefix=prefix, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = path.rstrip("/")
        return [e for e in _entries(found.values(), path) if posixpath.dirname(e.path) == self.fs._strip_protocol(base)]

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def open_read(self, path: str) -> BinaryIO:
        if self.network is None:
            return self.fs.open(path, "rb")
        return RetryingReader(lambda: self.fs.open(path, "rb"), path, self.network)  # type: ignore[return-value]

    def open_write(self, path: str) -> BinaryIO:
        if self.network is None:
            return self.fs.open(path, "wb")
        return ObjectWriter(self.fs.open(path, "wb"))  # type: ignore[return-value]

    def write_create(self, path: str, data: bytes) -> None:
        for attempt in range(4):
            # Checked on every store: the only guard where the store cannot refuse itself.
            if self.exists(path):
                raise FileExistsError(errno.EEXIST, "already exists", path)
            try:
                self._write(path, data, "xb")
                return
            except FileExistsError:
                raise
            except (ValueError, NotImplementedError, TypeError):
                break  # this file system has no create-only mode
            except OSError as exc:
                answer = _conditional_write_answer(exc)
                if answer == "exists":
                    raise FileExistsError(errno.EEXIST, f"already exists (the store refused a "
                                                        f"create-only write: {exc})", path) from exc
                if answer == "unsupported":
                    break
                if answer == "conflict" and attempt < 3:
                    time.sleep(0.05 * (attempt + 1))  # a concurrent conditional write: ask again
                    continue
                raise
        self._write(path, data, "wb")

    def _write(self, path: str, data: bytes, mode: str) -> None:
        f = self.fs.open(path, mode)
        with f:
            f.write(data)

    def take_over(self, src: str, dst: str) -> str:
        """fsspec's ``copy``: on S3 a server-side copy (CopyObject, or UploadPartCopy parts
        above 5 GiB), no byte through this process; elsewhere whatever the store does."""
        self.fs.copy(src, dst)
        protocol = self.url.split("://", 1)[0] if "://" in self.url else "file"
        return "server_copy" if protocol in _SERVER_COPY else "copy"

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
        self._remove_folder_entries(path)
        self._abort_uploads(path)

    def _abort_uploads(self, path: str) -> None:
        """Abort the multipart uploads left under ``path`` (a writer that died mid-file):
        their parts are stored, and billed, until someone aborts them."""
        call_s3 = getattr(self.fs, "call_s3", None)
        split = getattr(self.fs, "split_path", None)
        if call_s3 is None or split is None:
            return
        bucket, key, _ = split(path.rstrip("/"))
        try:
            listing = call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key + "/" if key else "")
        except Exception as exc:  # a store without the call: nothing we can do
            log.debug("roll-ckpt: cannot list multipart uploads under %s: %s", path, exc)
            return
        for upload in listing.get("Uploads") or ():
            try:
                call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            except FileNotFoundError:
                pass

    def _remove_folder_entries(self, path: str) -> None:
        """Remove the folders an S3 server may keep after their objects are gone.

        Some S3-compatible servers backed by a file system (SeaweedFS) keep a folder after
        its last object is deleted and go on listing it as a common prefix: a removed
        checkpoint would still be listed as an uncommitted one. Deleting the key
        ``folder/`` removes such a folder (and only an empty one); on AWS S3 it is a no-op
        unless a zero-byte folder marker of that name exists.
        """
        call_s3 = getattr(self.fs, "call_s3", None)
        split = getattr(self.fs, "split_path", None)
        if call_s3 is None or split is None:
            return
        folders: list[str] = []

        def walk(folder: str) -> None:
            for e in self.list(folder):
                if e.is_dir:
                    walk(e.path)
                    folders.append(e.path)

        # (a folder that is not there is not listed: s3fs would list its parent to find out,
        # a request that grows with the checkpoints kept beside it)
        if self.isdir(path):
            walk(path)
        for folder in folders + [path]:
            bucket, key, _ = split(folder.rstrip("/"))
            if key:
                try:
                    call_s3("delete_object", Bucket=bucket, Key=key + "/")
                except FileNotFoundError:
                    pass
        self.fs.invalidate_cache(path)

    def free_bytes(self, path: str) -> int | None:
        return None

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"


def _conditional_write_answer(exc: BaseException) -> str | None:
    """What a failed create-only write means: ``exists``, ``conflict``, ``unsupported`` or ``None``.

    s3fs turns a 412 into ``FileExistsError`` only when the error names its condition
    (AWS does); other S3 servers (SeaweedFS) answer a bare ``PreconditionFailed`` that
    s3fs raises as ``OSError(EINVAL)``, so the botocore error it chains is read here.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = str((response.get("Error") or {}).get("Code") or "")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                return "exists"
            if code == "ConditionalRequestConflict" or status == 409:
                return "conflict"  # AWS: another conditional write to the key is in progress
            if code == "NotImplemented" or status == 501:
                return "unsupported"
        e = e.__cause__ or e.__context__
    if isinstance(exc, OSError) and exc.errno == errno.ENOSYS:
        return "unsupported"
    return None


def _entries(items: Any, path: str) -> list[Entry]:
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


def _takes_refresh(fs: Any) -> bool:
    import inspect

    try:
        return "refresh" in inspect.signature(fs.ls).parameters
    except (TypeError, ValueError):
        return False


def open_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> LocalStorage | FsspecStorage:
    """The right storage for ``url``: plain paths and ``file://`` are local disks.

    A local disk reads one storage option, ``direct_io`` (default true: data files are
    written with ``O_DIRECT`` where the file system allows it). Any other option has no
    effect there and is named in a warning, not refused: a job moved from S3 to a local
    copy keeps its config."""
    if "://" not in url or url.startswith("file://"):
        options = dict(storage_options or {})
        direct_io = options.pop("direct_io", True)
        if not isinstance(direct_io, bool):
            raise StorageError(f"storage_options.direct_io must be true or false, got {direct_io!r} (for {url})")
        if options:
            log.warning("roll-ckpt: storage_options %s have no effect on the local path %s (only direct_io does)",
                        ", ".join(sorted(map(str, options))), url)
        return LocalStorage(url, direct_io=direct_io)
    return FsspecStorage(url, storage_options or {})
