"""DCP on any :class:`~roll_ckpt.storage.Storage`: checksums while writing, safe reading.

* :class:`StorageFileSystem` adapts a backend to DCP's ``FileSystemBase``, so DCP's own
  ``FileSystemWriter``/``FileSystemReader`` (the standard on-disk format) run on every
  backend, third parties' included.
* :class:`DigestingWriter` hashes each file while DCP writes it. Each rank's checksums
  ride back to the coordinator inside DCP's own gather of write results (no extra
  collective) and are taken out again before ``.metadata`` is written, which therefore
  stays exactly what plain DCP writes.
* :class:`SafeReader` never unpickles ``.metadata`` with the full unpickler: only DCP's
  metadata classes are admitted. Given the manifest's entries, it reads each file once,
  checking its checksum, before DCP deserializes anything from it (verify while reading).
  :class:`SafeLoadPlanner` reads non-tensor values with ``torch.load(weights_only=True)``.

Importing this module imports ``torch.distributed``; core imports it only when a
checkpoint is actually written or read.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
from contextlib import contextmanager
from typing import Any, Callable, Generator, Mapping

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from .digest import Hasher, hash_bytes, hash_stream
from .errors import carried, CheckpointCorruptError, RollCkptError, UnsafeCheckpointError
from .storage import Storage

__all__ = ["StorageFileSystem", "DigestingWriter", "SafeReader", "SafeLoadPlanner",
           "SafeEmptyLoadPlanner", "safe_load_metadata", "roll_error_in", "METADATA_NAME"]

METADATA_NAME = ".metadata"
_DIGEST_FQN = "__roll_ckpt_file_digests__"

_local = threading.local()
_WRITE_PIECE = 1 << 20


def _skip_torch_crc32() -> None:
    """Let ``torch.save`` skip its per-record CRC-32 in the threads writing our files.

    Every byte of those files is already covered by the manifest's xxh3-128, computed in
    the same pass, and the CRC-32 costs about as much CPU as copying the data. torch
    reads the files either way (``torch.serialization.set_crc32_options`` documents it);
    other threads' ``torch.save`` calls keep torch's setting.
    """
    import torch.serialization as ser

    current = getattr(ser, "get_crc32_options", None)
    if current is None or getattr(current, "_roll_ckpt", False):
        return

    def get_crc32_options() -> bool:
        return False if getattr(_local, "skip_crc32", False) else current()

    get_crc32_options._roll_ckpt = True  # type: ignore[attr-defined]
    ser.get_crc32_options = get_crc32_options


class _HashingStream(io.RawIOBase):
    """Write-through stream that counts and hashes; ``tell`` is what DCP records as offsets."""

    def __init__(self, inner: Any, on_close: Callable[[int, str], None],
                 on_bytes: Callable[[int], None] | None) -> None:
        self._inner = inner
        self._hasher = Hasher()
        self._on_close = on_close
        self._on_bytes = on_bytes

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        # In pieces that stay in the CPU cache between the copy into the file and the
        # hash: a tensor is read from memory once, not twice (half the CPU time).
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
        self._on_close(self._hasher.size, self._hasher.hexdigest())


class StorageFileSystem(FileSystemBase):
    """DCP's ``FileSystemBase`` over a roll-ckpt backend."""

    def __init__(self, storage: Storage, on_bytes: Callable[[int], None] | None = None) -> None:
        self.storage = storage
        self.on_bytes = on_bytes
        self.digests: dict[str, tuple[int, str]] = {}
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def _record(self, path: str, size: int, digest: str) -> None:
        with self._lock:
            self.digests[path] = (size, digest)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[io.IOBase, None, None]:
        path = str(path)
        if mode == "wb":
            stream = _HashingStream(self.storage.open_write(path),
                                    lambda s, d: self._record(path, s, d), self.on_bytes)
            skipping = getattr(_local, "skip_crc32", False)
            _local.skip_crc32 = True  # this thread writes this file: see _skip_torch_crc32
            try:
                yield stream  # type: ignore[misc]
            except BaseException as exc:
                # DCP's extra writer threads (thread_count > 1) drop their exceptions:
                # keep them, DigestingWriter raises them once DCP's write returns.
                with self._lock:
                    self.errors.append(exc)
                raise
            finally:
                _local.skip_crc32 = skipping
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


class DigestingWriter(FileSystemWriter):
    """DCP's standard writer, on a backend, with per-file checksums for the manifest.

    After ``dcp.save`` returns on the coordinator, :attr:`file_digests` maps each file
    name (relative to the DCP folder, ``.metadata`` included) to ``(size, checksum)``.
    """

    def __init__(self, storage: Storage, path: str, *, thread_count: int = 1,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        # sync_files=False: durability comes from the backend's close(), never from the
        # system-wide os.sync() DCP falls back to for streams without a file descriptor.
        super().__init__(path, single_file_per_rank=True, sync_files=False,
                         thread_count=thread_count, overwrite=True)
        _skip_torch_crc32()
        self.fs = StorageFileSystem(storage, on_bytes)
        self.path = str(path)
        self.file_digests: dict[str, tuple[int, str]] = {}

    def _relative(self) -> dict[str, tuple[int, str]]:
        root = self.path.rstrip("/") + "/"
        return {k[len(root):] if k.startswith(root) else k: v for k, v in self.fs.digests.items()}

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        results = list(fut.wait())
        if self.fs.errors:  # a writer thread failed: DCP would have carried on without its file
            raise self.fs.errors[0]
        if len(results) != len(plan.items):
            raise RuntimeError(f"DCP's writer returned {len(results)} results for {len(plan.items)} items")
        # Checksums travel with DCP's own gather of write results.
        results.append(WriteResult(index=MetadataIndex(_DIGEST_FQN), size_in_bytes=0,
                                   storage_data=self._relative()))
        from torch.futures import Future

        out: Future = Future()
        out.set_result(results)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        digests: dict[str, tuple[int, str]] = {}
        clean = []
        for rank_results in results:
            keep = []
            for wr in rank_results:
                if wr.index.fqn == _DIGEST_FQN:
                    digests.update(wr.storage_data)
                else:
                    keep.append(wr)
            clean.append(keep)
        super().finish(metadata, clean)
        digests.update({k: v for k, v in self._relative().items() if k == METADATA_NAME})
        self.file_digests = digests


# ------------------------------------------------------------------------- reading

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


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
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


class _WindowReader(io.RawIOBase):
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


class _MemoryReader(_WindowReader):
    """Over bytes already in memory (``readinto``: one copy)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__(len(data))
        self._data = data

    def _fill(self, dst: memoryview, pos: int) -> int:
        dst[:] = self._data[pos:pos + len(dst)]
        return len(dst)


_CHECK_STREAMS = 1
"""Files one process checks at once in the background (2 measured slower here: more CPU)."""
_READ_CHUNK = 256 << 10
"""Read and hash in pieces that stay in the CPU cache (16 MiB pieces cost 40% more CPU)."""


def _verify_budget() -> int:
    """Bytes of checkpoint files one process may copy into memory while it loads them
    (only for backends without file descriptors)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        free = 0
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(256 << 20, free // (4 * local_ranks))


def _pread_into(fd: int, dst: memoryview, offset: int) -> None:
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n <= 0:
            raise OSError(f"file ended {len(dst) - done} bytes early (changed while it was being loaded)")
        done += n


class _FdReader(_WindowReader):
    """Over ``length`` bytes of an open file from ``base`` (pread)."""

    def __init__(self, fd: int, base: int, length: int) -> None:
        super().__init__(length)
        self._fd, self._base = fd, base

    def _fill(self, dst: memoryview, pos: int) -> int:
        return os.preadv(self._fd, [dst], self._base + pos)


class _Verified:
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
        _pread_into(self.fd, buf, offset)
        return buf

    def stream(self, offset: int, length: int) -> io.RawIOBase:
        if self.view is not None:
            return _MemoryReader(self.view[offset:offset + length])
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


def _load_tensor(data: _Verified, offset: int, length: int, target: torch.Tensor | None) -> torch.Tensor:
    """``torch.load(weights_only=True)`` of one DCP item, without its intermediate copy.

    The same unpickler and the same mechanism as ``torch.load(..., mmap=True)`` (torch's
    loader with an ``overall_storage``): in memory, the tensor aliases the checked bytes;
    from a file, its bytes are read with one ``pread`` into the target tensor itself when
    the item is exactly the target (same world size: the usual case), else into a fresh
    tensor. Falls back to a plain ``torch.load`` where torch's internals differ.
    """
    import sys

    import torch.serialization as ser

    def plain() -> torch.Tensor:
        return torch.load(_MemoryReader(data.bytes(offset, length)), map_location="cpu", weights_only=True)

    try:
        reader = torch._C.PyTorchFileReader(data.stream(offset, length))
        if data.view is not None:
            return ser._load(reader, "cpu", ser._weights_only_unpickler,
                             overall_storage=data.storage()[offset:offset + length], encoding="utf-8")
        if reader.has_record("byteorder") and bytes(reader.get_record("byteorder")).decode() != sys.byteorder:
            return plain()  # torch swaps the bytes itself
        storages = _Storages(target)
        tensor = ser._load(reader, "cpu", ser._weights_only_unpickler, overall_storage=storages, encoding="utf-8")
        if storages.gave_target and target is not None and not (
                tensor.data_ptr() == target.data_ptr() and tensor.dtype == target.dtype
                and tensor.shape == target.shape and tensor.stride() == target.stride()):
            # the record has the target's size but not its layout: load it apart, then copy
            reader = torch._C.PyTorchFileReader(data.stream(offset, length))
            storages = _Storages(None)
            tensor = ser._load(reader, "cpu", ser._weights_only_unpickler, overall_storage=storages,
                               encoding="utf-8")
        for start, nbytes, storage in storages.spans:
            # the record's bytes only: a target's storage may be longer (FSDP pads shards)
            dst = torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]
            _pread_into(data.fd, memoryview(dst.numpy()), offset + start)
        return tensor
    except (AttributeError, TypeError):  # torch's loader is not what this was written against
        return plain()


def _item_key(req: Any) -> Any:
    return (req.dest_index, tuple(req.dest_offsets), req.storage_index, tuple(req.storage_offsets), tuple(req.lengths))


class SafeReader(FileSystemReader):
    """DCP's standard reader on a backend: restricted ``.metadata`` unpickler, and, given
    the manifest's entries (``files``), every file checked before torch reads any of it.

    With ``files``, each rank reads each file its load plan needs once from the disk,
    hashing it in cache-sized pieces, in ``prepare_local_plan`` (started early by
    :meth:`start_checks`): a mismatch on any rank fails the load on every rank before a
    single tensor is written. The file stays open from the check to the load, which
    then reads each tensor's bytes from the page cache the check filled, with one
    ``pread`` straight into the target tensor (DCP's own reader allocates a tensor per
    item and copies it once more). Backends without file descriptors keep the checked
    bytes in memory (within a budget; beyond it the file is checked, then read again).
    Files no rank's plan reads are not hashed here: ``verify`` checked their size, and
    ``roll-ckpt verify`` checks everything.
    """

    def __init__(self, storage: Storage, path: str, on_bytes: Callable[[int], None] | None = None, *,
                 files: Mapping[str, Any] | None = None, checkpoint: str | None = None,
                 prefix: str = "dcp/") -> None:
        super().__init__(path)
        self.fs = StorageFileSystem(storage)
        self.path = str(path)
        self._storage = storage
        self._on_bytes = on_bytes
        self._files = dict(files) if files is not None else None
        self._checkpoint = checkpoint or self.path
        self._prefix = prefix
        self._verified: dict[str, _Verified] = {}
        self._early: dict[str, tuple[_Verified | None, BaseException | None]] = {}
        self._early_thread: threading.Thread | None = None
        self._early_done: dict[str, threading.Event] = {}
        self._early_threads: list[threading.Thread] = []
        self._failed: dict[str, BaseException] = {}
        self._keeps_files = True
        self._targets: dict[Any, torch.Tensor] = {}
        self.planner: Any = None
        """The load planner (set by ``DCPStrategy``): targets are looked up while files are checked."""
        self._metadata_bytes: bytes | None = None

    # ------------------------------------------------------------ checks

    def _expected(self, name: str) -> Any:
        assert self._files is not None
        entry = self._files.get(name)
        if entry is None:
            raise CheckpointCorruptError(self._checkpoint, [(self._prefix + name, "not listed in the manifest")])
        return entry

    def _fault(self, name: str, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(self._checkpoint, [(self._prefix + name, what)])

    def _check(self, name: str, size: int, digest: str) -> None:
        entry = self._expected(name)
        if size != entry.size:
            raise self._fault(name, f"read {size} bytes, the manifest says {entry.size}")
        if digest != entry.checksum:
            raise self._fault(name, "checksum mismatch (the content changed after it was written)")

    def _read_verified(self, name: str, keep: bool) -> _Verified | None:
        """Read ``name`` once, hashing it; returns the checked file (``None``: read it again)."""
        entry = self._expected(name)
        with self._storage.open_read(self._storage.join(self.path, name)) as f:
            try:
                fd = f.fileno()
            except (AttributeError, OSError, ValueError):
                fd = -1
            if fd >= 0 or not keep:
                if fd >= 0:
                    try:  # one sequential pass: let the kernel read further ahead
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    except (AttributeError, OSError):
                        pass
                size, digest = hash_stream(f, self._on_bytes)
                self._check(name, size, digest)
                if fd < 0:
                    return None
                # The loader reads this same open file (a file renamed over it meanwhile is
                # not the one loaded), from the page cache the check just filled.
                return _Verified(file=os.fdopen(os.dup(fd), "rb", buffering=0))
            view = memoryview(torch.empty(entry.size, dtype=torch.uint8).numpy())
            hasher = Hasher()
            pos = 0
            while pos < entry.size:
                n = f.readinto(view[pos:pos + _READ_CHUNK])
                if not n:
                    break
                hasher.update(view[pos:pos + n])
                pos += n
                if self._on_bytes is not None:
                    self._on_bytes(n)
            if pos == entry.size and f.read(1):
                pos += 1  # longer than the manifest says
        self._check(name, pos, hasher.hexdigest())
        return _Verified(view=view)

    def release(self) -> None:
        """Close the checked files (kept open across the loads of one ``DCPStrategy.load``)."""
        for data in self._verified.values():
            data.close()
        self._verified.clear()
        for data, _ in self._take_early().values():
            if data is not None:
                data.close()

    def start_checks(self, names: list[str]) -> None:
        """Start reading and checking ``names`` (the files this process will most likely
        load) in the background, so the disk works while the load is being planned.
        ``prepare_local_plan`` waits for the ones its plan needs; it checks others itself."""
        names = [n for n in names if self._files is not None and n in self._files]
        if not names or self._early_thread is not None:
            return
        keep = sum(self._expected(n).size for n in names) <= _verify_budget()
        done = {n: threading.Event() for n in names}
        self._early_done = dict(done)

        def run(mine: list[str]) -> None:
            for name in mine:
                try:
                    self._early[name] = (self._read_verified(name, keep), None)
                except BaseException as exc:  # raised again by prepare_local_plan, on every rank
                    self._early[name] = (None, exc)
                done[name].set()

        streams = max(1, min(_CHECK_STREAMS, len(names)))
        threads = [threading.Thread(target=run, args=(names[i::streams],), name="roll-ckpt-verify", daemon=True)
                   for i in range(streams)]
        for t in threads:
            t.start()
        self._early_thread = threads[0]
        self._early_threads = threads

    def _take_early(self, names: Any = None) -> dict[str, tuple[_Verified | None, BaseException | None]]:
        """The early checks of ``names`` (all: ``None``), waiting for the ones still running."""
        if self._early_thread is None:
            return {}
        wanted = list(self._early_done) if names is None else [n for n in names if n in self._early_done]
        out = {}
        for name in wanted:
            self._early_done.pop(name).wait()
            out[name] = self._early.pop(name)
        if not self._early_done:
            for t in self._early_threads:
                t.join()
        return out

    def _resolve_targets(self, plan: Any) -> None:
        """Look up every tensor item's target now (no data is read or written): DCP's lookup
        costs about half a millisecond per item."""
        from torch.distributed.checkpoint.planner import LoadItemType

        planner = self.planner
        self._targets = {}
        if planner is None:
            return
        try:
            for req in plan.items:
                if req.type != LoadItemType.BYTE_IO:
                    self._targets[_item_key(req)] = planner.resolve_tensor(req).detach()
        except Exception:  # a planner that resolves only while reading: do it then
            self._targets = {}

    def _verify_plan(self, names: list[str]) -> None:
        """Check every file in ``names`` not checked yet (or take its early check)."""
        for name, (data, error) in self._take_early(names).items():
            if data is not None:
                self._verified.setdefault(name, data)
            elif error is not None:
                self._failed.setdefault(name, error)
        todo = [n for n in names if n not in self._verified]
        for name in todo:
            if name in self._failed:
                raise self._failed[name]
        keep = sum(self._expected(n).size for n in todo) <= _verify_budget()
        for name in todo:
            data = self._read_verified(name, keep)
            if data is not None:
                self._verified[name] = data
            else:
                self._keeps_files = False  # too large to keep: DCP's reader reads them again

    # ------------------------------------------------------------ DCP's StorageReader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._storage.join(self.path, METADATA_NAME)
        data = self._metadata_bytes
        if data is None:  # read (and checked) once; DCP asks again for every load
            with self._storage.open_read(path) as f:
                data = f.read()
            if self._files is not None:
                self._check(METADATA_NAME, *hash_bytes(data))
                self._metadata_bytes = data
        md = safe_load_metadata(data, path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _plan_bytes(self, plan: Any) -> dict[str, int]:
        out: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            out[info.relative_path] = out.get(info.relative_path, 0) + info.length
        return out

    def prepare_local_plan(self, plan: Any) -> Any:
        # Each file is checked by one process: one that reads at least half of it (its
        # writer, at the same world size). Others may read a few items of it (DCP puts a
        # value every rank holds, like AdamW's step, in one rank's file) and rely on that
        # check, announced through the global plan, instead of reading all of it again.
        import dataclasses

        plan = super().prepare_local_plan(plan)
        if self._files is None:
            return plan
        reads = self._plan_bytes(plan)
        mine = sorted(n for n, b in reads.items() if 2 * b >= self._expected(n).size)
        self._resolve_targets(plan)  # while the early checks read the disk
        # the files this plan reads that are being checked early: wait for those only
        self._verify_plan(sorted(set(mine) | {n for n in reads if n in self._early_done}))
        for name in sorted(reads):
            if name in self._failed:  # an early check found it damaged
                raise self._failed[name]
        return dataclasses.replace(plan, storage_data={"roll_ckpt_checked": sorted(self._verified)})

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        import dataclasses

        plans = super().prepare_global_plan(plans)
        if self._files is None:
            return plans
        checked = {n for p in plans for n in ((p.storage_data or {}).get("roll_ckpt_checked") or ())}
        needed = {n for p in plans for n in self._plan_bytes(p)}
        # files no process reads much of: the coordinator checks them, before anyone reads
        self._verify_plan(sorted(needed - checked))
        checked |= needed
        return [dataclasses.replace(p, storage_data={"roll_ckpt_checked": sorted(checked)}) for p in plans]

    def _checked_elsewhere(self, name: str, plan: Any) -> _Verified | None:
        """A file another process checked for this load, opened to read a few items of it
        (``None``: let DCP's reader read just those items, e.g. from an object store)."""
        if name not in ((plan.storage_data or {}).get("roll_ckpt_checked") or ()):
            raise self._fault(name, "read before its checksum was checked")
        f = self._storage.open_read(self._storage.join(self.path, name))
        try:
            fd = f.fileno()
        except (AttributeError, OSError, ValueError):
            fd = -1
        if fd < 0:
            f.close()
            return None
        data = self._verified[name] = _Verified(file=f)
        return data

    def read_data(self, plan: Any, planner: Any) -> Any:
        import dataclasses

        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        try:
            # Values (the only pickles: per-process state) before tensors, in one load: a value
            # weights_only refuses stops it before any live tensor is touched.
            values = [i for i in plan.items if i.type == LoadItemType.BYTE_IO]
            tensors = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
            for items in (values, tensors):
                if items:
                    self._read_data(dataclasses.replace(plan, items=items), planner).wait()
            fut: Future = Future()
            fut.set_result(None)
            return fut
        except pickle.UnpicklingError as exc:  # weights_only refused a value or a tensor: it would run code
            item = getattr(exc, "read_item", None)
            if item is not None:
                files = [self.storage_data[item.storage_index].relative_path]
                what = f"the value of '{item.dest_index.fqn}'"
            else:
                files = sorted({self.storage_data[i.storage_index].relative_path for i in plan.items})
                what = "a tensor"
            raise UnsafeCheckpointError(self._checkpoint, [
                (self._prefix + name, f"refused to unpickle {what}: {_pickle_reason(exc)}") for name in files
            ]) from None

    def _read_data(self, plan: Any, planner: Any) -> Any:
        if self._files is None:
            fut = super().read_data(plan, planner)
            if self._on_bytes is not None:
                self._on_bytes(sum(self.storage_data[i.storage_index].length for i in plan.items))
            return fut
        import dataclasses

        from torch.distributed.checkpoint.filesystem import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        # the checked files stay open until release(): a load may take two passes
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, reqs in per_file.items():
            data = self._verified.get(name)
            if data is None and self._expected(name).size and self._keeps_files:
                data = self._checked_elsewhere(name, plan)
            if data is None or any(self.storage_data[r.storage_index].transform_descriptors for r in reqs):
                # checked but not kept (too large for memory): DCP reads it again
                super().read_data(dataclasses.replace(plan, items=reqs), planner)
                continue
            # in file order: the pages are touched sequentially
            for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                info = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(data.bytes(info.offset, info.length)))
                    continue
                target = self._targets.pop(_item_key(req), None)
                if target is None:
                    target = planner.resolve_tensor(req).detach()
                whole = not any(req.storage_offsets) and tuple(req.lengths) == tuple(target.shape)
                tensor = narrow_tensor_by_index(
                    _load_tensor(data, info.offset, info.length, target if whole else None),
                    req.storage_offsets, req.lengths)
                if target.size() != tensor.size():
                    raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
                if tensor.data_ptr() != target.data_ptr() or tensor.dtype != target.dtype \
                        or tensor.stride() != target.stride():
                    target.copy_(tensor)  # else it was read straight into the target
                del tensor
                planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.path:
            self._metadata_bytes = None
            self.release()
        super().reset(checkpoint_id)
        self.path = str(self.path)


def roll_error_in(exc: BaseException) -> RollCkptError | None:
    """The roll-ckpt error a DCP ``CheckpointException`` carries from any rank, if one does."""
    return next((e for e in carried(exc) if isinstance(e, RollCkptError)), None)


class _RefusedValue(pickle.UnpicklingError):
    """``torch.load(weights_only=True)`` refused a non-tensor value; names the item."""

    def __init__(self, message: str, read_item: Any) -> None:
        super().__init__(message)
        self.read_item = read_item


def _pickle_reason(exc: BaseException) -> str:
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
        raise _RefusedValue(_pickle_reason(exc), read_item) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are read with ``weights_only=True``."""

    reader: Any = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element as set_el

        obj = _load_bytes_safely(value, read_item)
        if self.flatten_state_dict:
            set_el(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """Rebuilds a full state dict from metadata (export, inspect), reading safely."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element as set_el

        obj = _load_bytes_safely(value, read_item)
        if self.flatten_state_dict:
            set_el(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
