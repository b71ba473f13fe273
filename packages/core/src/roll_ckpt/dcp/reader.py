"""DCP's reader on any backend, verifying every file before torch reads any of it:
:class:`SafeReader` (``.metadata`` unpickled admitting DCP's metadata classes only, tensors
loaded from the checked files: :mod:`roll_ckpt.dcp.checked`).

**The job's load.** The pieces of a load coordinated by the job, not by DCP's global plan: ``.metadata`` read
once, every file checked once, each process planning its own reads (the sequence is
``DCPIO.load``'s).

DCP's load has every process read and unpickle ``.metadata`` (at 1,024 processes, 165 GB
read from storage for a 161 MB file) and gathers and scatters load plans through the
coordinator, which roll-ckpt used only to tell every process which files were checked.
Instead:

1. the coordinator reads ``.metadata`` once and checks it against the manifest
   (:meth:`SafeReader.metadata_bytes`, the same reading as DCP's ``read_metadata``) and
   broadcasts its bytes (``decide``); every process unpickles them (restricted
   unpickler, collector held off);
2. each data file is checked by one process, the one of its writer's rank modulo the
   world size (at the same world size: the process that wrote it, which reads it next),
   and the job agrees that every check passed (one all-reduce: ``strategy.agree``)
   before any process reads a byte it did not check itself;
3. each process plans and reads its own part (resharding needs only the metadata), and
   the job agrees again that every process loaded.

An error on one process is raised on every process (the same type and message).

**The read program.** :func:`read_dcp` is the read itself, for the job's folders, for a
folder one process wrote and for another framework's folder (``load_dcp``). It is DCP's load
without DCP's protocol around it: every read of roll-ckpt is one process's own, so the
planner's and reader's hooks through which DCP builds and scatters a job-wide plan
(``prepare_local_plan``, ``prepare_global_plan``, ``finish_plan``, the plan's ``storage_data``)
had nothing to do but carry which files were checked. The program uses DCP's
``DefaultLoadPlanner`` to flatten the target and look each item up, plans the reads from the
metadata (:func:`~roll_ckpt.runtime.torch_compat.local_load_plan`, DCP's own read items) and
hands the plan to :meth:`SafeReader.load`. ``SafeReader`` stays a DCP ``StorageReader`` for
the unchecked reads that go through ``dcp.load`` (the HF export).
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
import pickle
import threading
import torch
from operator import itemgetter
from typing import Any, Callable, Mapping
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from ..runtime.collector import CollectorPause
from ..contracts import Storage
from .files import StorageFileSystem
from ..format.manifest import hash_bytes, hash_stream
from ..errors import CheckpointCorruptError, PartlyLoadedError, UnsafeCheckpointError
from ..runtime.torch_compat import local_load_plan, local_tensor, set_element, transform_descriptors
from .checked import (CHECK_STREAMS, MAX_PIECE, METADATA_NAME, SafeLoadPlanner, StreamedFile, Verified, load_tensor,
                      piece_pool, pickle_reason, read_hashed, safe_load_metadata, verify_budget)
from ..format.manifest import content_fault
from ..format.layout import writer_rank

__all__ = ['SafeReader', 'read_dcp', 'assigned_files', 'writer_rank', 'top_keys', 'placeholders']


# ---- the reader ------------------------------------------------------------

_LOAD_THREADS = 4


class SafeReader(FileSystemReader):
    """DCP's standard reader on a backend: restricted ``.metadata`` unpickler, and, given
    the manifest's entries (``files``), every file checked before torch reads any of it.

    With ``files``, every file a load reads is checked before any of it is read into a target
    (:meth:`load`): each file once, read from the disk and hashed in cache-sized pieces (started
    early by :meth:`start_checks`); in a job's load each process checks the files assigned to
    it and the job agrees on the result first (``checked``), so a mismatch on any rank fails
    the load on every rank before a single tensor is written. The file stays open from the check to the load, which
    then reads each tensor's bytes from the page cache the check filled, with one
    ``pread`` straight into the target tensor (DCP's own reader allocates a tensor per
    item and copies it once more). Backends without file descriptors keep the checked
    bytes in memory (within a budget; beyond it the file is checked, then read again).
    Files no rank's plan reads are not hashed here: ``verify`` checked their size, and
    ``roll-ckpt verify`` checks everything.
    """

    def __init__(self, storage: Storage, path: str, on_bytes: Callable[[int], None] | None = None, *,
                 files: Mapping[str, Any] | None = None, checkpoint: str | None = None,
                 prefix: str = "dcp/", stream: bool = False) -> None:
        super().__init__(path)
        self.fs = StorageFileSystem(storage)
        self.path = str(path)
        self._storage = storage
        self._on_bytes = on_bytes
        self._files = dict(files) if files is not None else None
        self._checkpoint = checkpoint or self.path
        self._prefix = prefix
        self._verified: dict[str, Verified | StreamedFile] = {}
        self._early: dict[str, cf.Future] = {}
        """The early checks (:meth:`start_checks`), by file: each one's checked file."""
        self._checker: cf.ThreadPoolExecutor | None = None
        self._failed: dict[str, BaseException] = {}
        self._keeps_files = True
        self._targets: dict[Any, torch.Tensor] = {}
        self._metadata: Metadata | None = None
        self.checked = False
        """Every file a load reads was checked: by the process it is assigned to, the job
        agreeing on it (:mod:`roll_ckpt.dcp.reader`), or by this reader's :meth:`load`."""
        self._streamed = frozenset(name for name, entry in (self._files or {}).items()
                                   if entry.chunks and entry.chunk_size <= MAX_PIECE) if stream else frozenset()
        """The files loaded in one pass, each piece checked just before use (``stream``: those
        whose manifest entry has piece checksums)."""
        self._pool: Any = None
        self._pool_lock = threading.Lock()

    # ------------------------------------------------------------ checks

    def _expected(self, name: str) -> Any:
        assert self._files is not None
        entry = self._files.get(name)
        if entry is None:
            raise CheckpointCorruptError(self._checkpoint, [(self._prefix + name, "not listed in the manifest")])
        return entry

    def _fault(self, name: str, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(self._checkpoint, [(self._prefix + name, what)])

    def _piece_pool(self) -> Any:
        with self._pool_lock:  # the early checks and the planner may both ask first
            if self._pool is None:
                self._pool = piece_pool()
            return self._pool

    def _open_streamed(self, name: str) -> StreamedFile:
        entry = self._expected(name)

        def fault(what: str) -> CheckpointCorruptError:
            return PartlyLoadedError(self._checkpoint, [(self._prefix + name, what)])

        f = self._storage.open_read(self._storage.join(self.path, name))
        try:
            data = StreamedFile(f, entry, fault, self._piece_pool(), self._on_bytes)
        except BaseException:
            f.close()
            raise
        self._verified[name] = data
        return data

    def _read_verified(self, name: str, keep: bool) -> Verified | None:
        """Read ``name`` once, hashing it; returns the checked file (``None``: read it again)."""
        entry = self._expected(name)
        with self._storage.open_read(self._storage.join(self.path, name)) as f:
            try:
                fd = f.fileno()
            except (AttributeError, OSError, ValueError):
                fd = -1
            view = None
            if fd >= 0 or not keep:
                if fd >= 0:
                    try:  # one sequential pass: let the kernel read further ahead
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    except (AttributeError, OSError):
                        pass
                size, digest = hash_stream(f, self._on_bytes)
            else:  # no file descriptor to read again: the bytes kept in memory
                view, size, digest = read_hashed(f, entry.size, self._on_bytes)
            if (fault := content_fault(entry, size, digest)) is not None:
                raise self._fault(name, fault)
            if view is not None:
                return Verified(view=view)
            # The loader reads this same open file (a file renamed over it meanwhile is not the
            # one loaded), from the page cache the check just filled.
            return Verified(file=os.fdopen(os.dup(fd), "rb", buffering=0)) if fd >= 0 else None

    def release(self) -> None:
        """Close the checked files (open across one ``DCPIO.load``'s loads); drop the metadata."""
        self._metadata = None
        for data in self._verified.values():
            data.close()
        self._verified.clear()
        if self._checker is not None:  # the checks not begun are dropped; the one running ends
            self._checker.shutdown(wait=True, cancel_futures=True)
        for fut in self._early.values():
            if not fut.cancelled() and fut.exception() is None and fut.result() is not None:
                fut.result().close()
        self._early.clear()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def start_checks(self, names: list[str]) -> None:
        """Start reading and checking ``names`` (the files this process will most likely
        load) in the background, so the disk works while the load is being planned.
        :meth:`check_files` waits for the ones it is given; it checks others itself."""
        names = [n for n in names if self._files is not None and n in self._files and n not in self._streamed]
        if not names or self._checker is not None:
            return
        keep = sum(self._expected(n).size for n in names) <= verify_budget()
        # (an error is kept in its future: check_files raises it, then the job on every rank)
        self._checker = cf.ThreadPoolExecutor(CHECK_STREAMS, thread_name_prefix="roll-ckpt-verify")
        self._early = {name: self._checker.submit(self._read_verified, name, keep) for name in names}

    def _resolve_targets(self, plan: Any, planner: Any) -> None:
        """Look up every tensor item's target now (no data is read or written). A whole local
        shard is what DCP's lookup would give, taken directly (its lookup goes through
        ``DTensor.to_local``'s autograd function); anything else through the planner."""
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.planner import LoadItemType

        self._targets = {}
        flat = planner.state_dict if type(planner).resolve_tensor is DefaultLoadPlanner.resolve_tensor else {}
        try:
            for req in plan.items:  # (read items are frozen dataclasses: they key the targets)
                if req.type == LoadItemType.BYTE_IO:
                    continue
                t = local_tensor(flat.get(req.dest_index.fqn))
                if type(t) is torch.Tensor and not any(req.dest_offsets) and tuple(req.lengths) == t.shape:
                    self._targets[req] = t.detach() if t.requires_grad else t
                else:
                    self._targets[req] = planner.resolve_tensor(req).detach()
        except Exception:  # a planner that resolves only while reading: do it then
            self._targets = {}

    def check_files(self, names: list[str]) -> None:
        """Check every file in ``names`` not checked yet (or take its early check), keeping
        them open for the load; raises the first damage found. Files loaded streamed are
        checked piece by piece as they load instead."""
        names = [n for n in names if n not in self._streamed]
        for name in names:  # the early checks of these: waited for
            early = self._early.pop(name, None)
            if early is not None and (error := early.exception()) is not None:
                self._failed.setdefault(name, error)
            elif early is not None and early.result() is not None:
                self._verified.setdefault(name, early.result())
        todo = [n for n in names if n not in self._verified]
        for name in todo:
            if name in self._failed:
                raise self._failed[name]
        keep = sum(self._expected(n).size for n in todo) <= verify_budget()
        for name in todo:
            data = self._read_verified(name, keep)
            if data is not None:
                self._verified[name] = data
            else:
                self._keeps_files = False  # too large to keep: DCP's reader reads them again

    # ------------------------------------------------------------ the read program's reader

    def load(self, plan: Any, planner: Any) -> None:
        """Read ``plan`` (DCP's read items, made by :func:`read_dcp`) into the targets of
        ``planner``. With ``files``, every file the plan reads is checked first, unless the
        job checked them all (``checked``): a load of this process alone checks them here,
        looking the targets up while its early checks read the disk."""
        import dataclasses

        from torch.distributed.checkpoint.planner import LoadItemType

        if self._files is not None:
            self._resolve_targets(plan, planner)
            if not self.checked:
                self.check_files(sorted({self.storage_data[i.storage_index].relative_path for i in plan.items}))
                self.checked = True
        try:
            # Values (the only pickles: per-process state) before tensors, in one load: a value
            # weights_only refuses stops it before any live tensor is touched.
            values = [i for i in plan.items if i.type == LoadItemType.BYTE_IO]
            tensors = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
            for items in (values, tensors):
                if items:
                    self._read_data(dataclasses.replace(plan, items=items), planner)
        except pickle.UnpicklingError as exc:  # weights_only refused a value or a tensor: it would run code
            item = getattr(exc, "read_item", None)
            if item is not None:
                files = [self.storage_data[item.storage_index].relative_path]
                what = f"the value of '{item.dest_index.fqn}'"
            else:
                files = sorted({self.storage_data[i.storage_index].relative_path for i in plan.items})
                what = "a tensor"
            raise UnsafeCheckpointError(self._checkpoint, [
                (self._prefix + name, f"refused to unpickle {what}: {pickle_reason(exc)}") for name in files
            ]) from None

    # ------------------------------------------------------------ DCP's StorageReader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata``, read, checked and unpickled once (DCP asks again for every load)."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self._metadata is None:
            data = self.metadata_bytes()
            with CollectorPause():
                self._metadata = safe_load_metadata(data, self._storage.join(self.path, METADATA_NAME))
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def metadata_bytes(self) -> bytes:
        """The bytes of ``.metadata``, checked against the manifest's entry (given ``files``):
        read by :meth:`read_metadata`, and, in a job's load, by the coordinator alone, which
        hands them to every process (``DCPIO.load``)."""
        with self._storage.open_read(self._storage.join(self.path, METADATA_NAME)) as f:
            data = f.read()
        if self._files is not None and \
                (fault := content_fault(self._files.get(METADATA_NAME), *hash_bytes(data))) is not None:
            raise self._fault(METADATA_NAME, fault)
        return data

    def _checked_file(self, name: str) -> Verified | None:
        """A file checked for this load but not kept open by this process (another process
        checked it, or it reads a few items of it), opened to read its items (``None``: let
        DCP's reader read just those items, e.g. from an object store)."""
        if not self.checked:
            raise self._fault(name, "read before its checksum was checked")
        f = self._storage.open_read(self._storage.join(self.path, name))
        try:
            fd = f.fileno()
        except (AttributeError, OSError, ValueError):
            fd = -1
        if fd < 0:
            f.close()
            return None
        data = self._verified[name] = Verified(file=f)
        return data

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's hook, for the reads that go through ``dcp.load`` (the HF export): :meth:`load`."""
        from torch.futures import Future

        self.load(plan, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_data(self, plan: Any, planner: Any) -> None:
        if self._files is None:
            super().read_data(plan, planner).wait()
            if self._on_bytes is not None:
                self._on_bytes(sum(self.storage_data[i.storage_index].length for i in plan.items))
            return
        import dataclasses

        from torch.distributed.checkpoint.planner import LoadItemType

        # the checked files stay open until release(): a load may take two passes
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append((info.offset, item))
        per_file = {name: [req for _, req in sorted(reqs, key=itemgetter(0))]  # in file order: the pages
                    for name, reqs in per_file.items()}                        # are touched sequentially
        direct = []
        for name, reqs in per_file.items():
            data = self._verified.get(name)
            if data is None and name in self._streamed:
                data = self._open_streamed(name)
            if data is None and self._expected(name).size and self._keeps_files:
                data = self._checked_file(name)
            if data is None or any(transform_descriptors(self.storage_data[r.storage_index]) for r in reqs):
                if isinstance(data, StreamedFile):  # DCP decodes it itself: check the whole file first
                    self._read_verified(name, False)
                # checked but not kept (too large for memory): DCP reads it again
                super().read_data(dataclasses.replace(plan, items=reqs), planner)
                continue
            direct.append((data, reqs))
        tensors = []
        for data, reqs in direct:  # read_data hands values and tensors over apart
            if any(q.type == LoadItemType.BYTE_IO for q in reqs):
                self._load_items(data, reqs, planner)
            else:
                tensors.append((data, reqs))
        if len(tensors) > 1:  # one thread per file: the preads release the GIL
            with cf.ThreadPoolExecutor(min(len(tensors), _LOAD_THREADS), thread_name_prefix="roll-ckpt-load") as pool:
                for done in [pool.submit(self._load_items, data, reqs, planner) for data, reqs in tensors]:
                    done.result()
        elif tensors:
            self._load_items(*tensors[0], planner)

    def _load_items(self, data: Verified | StreamedFile, reqs: list[Any], planner: Any) -> None:
        """Load ``reqs`` of one checked file, in file order, into their targets."""
        from torch.distributed.checkpoint.planner import LoadItemType

        release = getattr(data, "release_before", None)
        for req in reqs:
            info = self.storage_data[req.storage_index]
            if release is not None:
                release(info.offset)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data.bytes(info.offset, info.length)))
                continue
            target = self._targets.pop(req, None)
            if target is None:
                target = planner.resolve_tensor(req).detach()
            whole = not any(req.storage_offsets) and tuple(req.lengths) == tuple(target.shape)
            tensor = load_tensor(data, info.offset, info.length, target if whole else None)
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                if start or length != tensor.size(dim):  # the part of a saved chunk this item asks for
                    tensor = tensor.narrow(dim, start, length)
            if target.size() != tensor.size():
                raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
            if tensor.data_ptr() != target.data_ptr() or tensor.dtype != target.dtype \
                    or tensor.stride() != target.stride():
                target.copy_(tensor)  # else it was read straight into the target
            del tensor
            planner.commit_tensor(req, target)

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.path:
            self._metadata = None
            self.release()
        super().reset(checkpoint_id)
        self.path = str(self.path)


# ---- the job's load --------------------------------------------------------

def assigned_files(files: Mapping[str, Any], rank: int, world_size: int) -> list[str]:
    """The data files process ``rank`` checks for the job."""
    return sorted(n for n in files if (w := writer_rank(n)) is not None and w % world_size == rank)


def read_dcp(target: dict[str, Any], reader: Any, md: Any) -> None:
    """The read program: ``target`` loaded in place from ``reader``'s folder (a
    :class:`~roll_ckpt.dcp.reader.SafeReader`), whose ``.metadata`` is ``md``: DCP's planner
    flattens ``target`` (tensors, DTensors resharded, values in their slots), the reads are
    planned from ``md`` alone, and the reader checks and reads them (the module docstring)."""
    planner = SafeLoadPlanner()
    planner.set_up_planner(target, md, True)
    reader.set_up_storage_reader(md, True)  # (DCP's StorageReader call: the items' places in the files)
    reader.load(local_load_plan(planner.state_dict, md), planner)


# ---- what a resume loads into: a checkpoint's top-level keys, and a structure rebuilt from .metadata

def top_keys(md: Any, per_rank: str) -> tuple[set[str], set[str]]:
    """The top-level keys of a checkpoint, and the ranks that saved per-process values under
    ``per_rank`` (one pass)."""
    top: set[str] = set()
    ranks: set[str] = set()
    for path in md.planner_data.values():
        if path:
            top.add(path[0])
            if len(path) > 1 and path[0] == per_rank:
                ranks.add(path[1])
    return top, ranks


def placeholders(md: Any, prefix: tuple[str, ...]) -> dict[str, Any]:
    """Rebuild the nested structure saved under ``prefix`` with empty tensors to load into."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root: dict[str, Any] = {}
    n = len(prefix)
    for fqn, path in md.planner_data.items():
        if tuple(str(p) for p in path[:n]) != prefix:
            continue
        entry = md.state_dict_metadata[fqn]
        if isinstance(entry, TensorStorageMetadata):
            value: Any = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            value = None
        set_element(root, tuple(path[n:]), value)
    return root
