"""DCP on any :class:`~roll_ckpt.storage.Storage`: checksums while writing, safe reading.

* :class:`StorageFileSystem` adapts a backend to DCP's ``FileSystemBase``, so DCP's own
  ``FileSystemWriter``/``FileSystemReader`` (the standard on-disk format) run on every
  backend, third parties' included.
* :class:`DigestingWriter` hashes each file while DCP writes it. Each rank's checksums
  ride back to the coordinator inside DCP's own gather of write results (no extra
  collective) and are taken out again before ``.metadata`` is written, which therefore
  stays exactly what plain DCP writes.
* :class:`SafeReader` never unpickles ``.metadata`` with the full unpickler: only DCP's
  metadata classes are admitted. :class:`SafeLoadPlanner` reads non-tensor values with
  ``torch.load(weights_only=True)``.

Importing this module imports ``torch.distributed``; core imports it only when a
checkpoint is actually written or read.
"""

from __future__ import annotations

import io
import pickle
import threading
from contextlib import contextmanager
from typing import Any, Callable, Generator

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from .digest import Hasher
from .errors import RollCkptError, UnsafeCheckpointError
from .storage import Storage

__all__ = ["StorageFileSystem", "DigestingWriter", "SafeReader", "SafeLoadPlanner",
           "SafeEmptyLoadPlanner", "safe_load_metadata", "roll_error_in", "METADATA_NAME"]

METADATA_NAME = ".metadata"
_DIGEST_FQN = "__roll_ckpt_file_digests__"


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
        mv = memoryview(b).cast("B")
        n = self._inner.write(mv)
        n = mv.nbytes if n is None else n
        self._hasher.update(mv[:n])
        if self._on_bytes is not None:
            self._on_bytes(n)
        return n

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
            try:
                yield stream  # type: ignore[misc]
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
        self.fs = StorageFileSystem(storage, on_bytes)
        self.path = str(path)
        self.file_digests: dict[str, tuple[int, str]] = {}

    def _relative(self) -> dict[str, tuple[int, str]]:
        root = self.path.rstrip("/") + "/"
        return {k[len(root):] if k.startswith(root) else k: v for k, v in self.fs.digests.items()}

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        results = list(fut.wait())
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


class SafeReader(FileSystemReader):
    """DCP's standard reader on a backend, with a restricted ``.metadata`` unpickler."""

    def __init__(self, storage: Storage, path: str, on_bytes: Callable[[int], None] | None = None) -> None:
        super().__init__(path)
        self.fs = StorageFileSystem(storage)
        self.path = str(path)
        self._storage = storage
        self._on_bytes = on_bytes

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._storage.join(self.path, METADATA_NAME)
        with self._storage.open_read(path) as f:
            md = safe_load_metadata(f.read(), path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: Any, planner: Any) -> Any:
        fut = super().read_data(plan, planner)
        if self._on_bytes is not None:
            self._on_bytes(sum(self.storage_data[i.storage_index].length for i in plan.items))
        return fut


def _load_bytes_safely(value: io.BytesIO, read_item: Any, reader: Any) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        where = getattr(reader, "path", "?")
        info = getattr(reader, "storage_data", {}).get(read_item.storage_index)
        name = f"dcp/{info.relative_path}" if info is not None else "dcp"
        why = next((ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln), str(exc).splitlines()[0])
        raise UnsafeCheckpointError(str(where), [(name, f"refused to unpickle the value of "
                                                 f"'{read_item.dest_index.fqn}': {why}")]) from None


def roll_error_in(exc: BaseException) -> BaseException | None:
    """The roll-ckpt error inside DCP's ``CheckpointException`` (which holds per-rank failures)."""
    seen: set[int] = set()
    stack: list[Any] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RollCkptError):
            return e
        stack.extend([getattr(e, "__cause__", None), getattr(e, "__context__", None)])
        failures = [a for a in getattr(e, "args", ()) if isinstance(a, dict)]
        failures.append(getattr(e, "failures", None) or {})
        for per_rank in failures:
            for v in per_rank.values():  # DCP keeps (exception, traceback) per rank
                stack.extend(x for x in (v if isinstance(v, tuple) else (v,)) if isinstance(x, BaseException))
    return None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are read with ``weights_only=True``.

    ``reader`` (the :class:`SafeReader`) lets a refusal name the file it came from.
    """

    reader: Any = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element as set_el

        obj = _load_bytes_safely(value, read_item, self.reader)
        if self.flatten_state_dict:
            set_el(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """Rebuilds a full state dict from metadata (export, inspect), reading safely."""

    reader: Any = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element as set_el

        obj = _load_bytes_safely(value, read_item, self.reader)
        if self.flatten_state_dict:
            set_el(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
