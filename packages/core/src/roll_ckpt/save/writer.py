"""DCP's standard on-disk format, written by roll-ckpt's own writer with per-file checksums.

:class:`DigestingWriter` is a DCP ``StorageWriter``: DCP plans the save and writes
``.metadata`` as always, and the folder stays what plain ``dcp.load`` reads. The data
files are written by this module's loop instead of DCP's: the same layout (one
``__<rank>_<n>.distcp`` per writer thread, byte values first, then tensors, each
``torch.save``-framed), but each file is hashed while written, each tensor's frame is kept
for the next tensor of its shape (:mod:`roll_ckpt.format.tensor_frames`), and the tensors skip
torch's CRC-32 (the manifest's xxh3-128 covers every byte). Each rank's checksums ride
back to the coordinator inside DCP's own gather of write results (no extra collective)
and are taken out again before ``.metadata`` is written.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.checkpoint.storage import WriteResult

from ..runtime.collector import CollectorPause
from ..contracts import Storage
from ..format.dcp_fs import StorageFileSystem
from ..format.tensor_frames import write_tensor
from ..runtime.torch_compat import create_write_items, dcp_format_version, local_tensor, storage_info, storage_prefix
from ..format.unpickle import METADATA_NAME
from ..format.digest import CHUNK_SIZE
from ..format.value_slots import padded_value, slot_capacity
from .incremental import TakeOver

__all__ = ["DigestingWriter", "ReusingSavePlanner", "plan_files"]

_DIGEST_FQN = "__roll_ckpt_file_digests__"


def _item_bytes(item: Any) -> int:
    data = item.tensor_data
    n = data.properties.dtype.itemsize
    for s in data.size:
        n *= s
    return n


def _buckets(items: list[Any], n: int, cold: frozenset[str] = frozenset()) -> list[list[Any]]:
    """Items split over ``n`` files: byte values round-robin, tensors largest first into the
    lightest file (DCP's own split). Tensors named in ``cold`` (no optimizer updates them)
    go to a file of their own, first, without byte values (:mod:`roll_ckpt.save.incremental`)."""
    frozen = [i for i in items if i.type != WriteItemType.BYTE_IO and i.index.fqn in cold]
    if frozen and len(frozen) < len(items):
        rest = [i for i in items if not (i.type != WriteItemType.BYTE_IO and i.index.fqn in cold)]
        return [*_buckets(frozen, n), *_buckets(rest, n)]
    buckets: list[list[Any]] = [[] for _ in range(n)]
    sizes = [0] * n
    values = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_bytes, reverse=True)
    for k, item in enumerate(values):
        buckets[k % n].append(item)
    for item in tensors:
        k = sizes.index(min(sizes))
        buckets[k].append(item)
        sizes[k] += _item_bytes(item)
    return [b for b in buckets if b] or [[]]


def plan_files(items: list[Any], n: int, gate: Any = None, cold: frozenset[str] = frozenset()) -> list[list[Any]]:
    """``items`` over ``n`` files (one more for ``cold`` tensors), each in writing order:
    tensors first (in the order they are staged when staged in waves), byte values last.
    The tensors' offsets are then a function of the structure alone, whatever size the
    values pickle to (:mod:`roll_ckpt.format.value_slots`)."""
    out = []
    for bucket in _buckets(items, n, cold):
        tensors = [i for i in bucket if i.type != WriteItemType.BYTE_IO]
        if gate is not None:
            tensors = [tensors[k] for k in gate.order([i.index.fqn for i in tensors])]
        out.append(tensors + [i for i in bucket if i.type == WriteItemType.BYTE_IO])
    return out


Written = list[tuple[MetadataIndex, int, int]]
"""What a file holds, in file order: each item's index, offset and length."""


def _write_file(fs: StorageFileSystem, path: str, name: str, items: list[Any], planner: Any,
                gate: Any = None, slots: dict[MetadataIndex, int] | None = None,
                values: dict[MetadataIndex, Any] | None = None,
                take: TakeOver | None = None) -> tuple[list[WriteResult], Written]:
    """Write ``items`` (in this order) into one file. Byte values go into slots: the
    capacity in ``slots`` (a save that keeps the layout) or a new one (a full save);
    ``values`` holds byte values serialized already. With ``take``, a candidate file whose
    bytes hash to the base checkpoint's is taken over from it instead (:mod:`roll_ckpt.save.incremental`)."""
    previous = take.candidate(name, [i.index.fqn for i in items]) if take is not None else None
    if previous is not None:
        with fs.hashing_stream() as sink:
            results, written = _serialize(sink, name, items, planner, None, slots, dict(values or {}))
        if sink.digest()[:2] == tuple(previous[:2]) and take.take(name, path):  # type: ignore[union-attr]
            take.taken[name] = (*previous[:3], CHUNK_SIZE, take.base.name)  # type: ignore[union-attr]
            fs.record(path, take.taken[name])  # type: ignore[union-attr]
            return results, written
    with fs.create_stream(path, "wb") as stream:
        return _serialize(stream, name, items, planner, gate, slots, values)


def _serialize(stream: Any, name: str, items: list[Any], planner: Any, gate: Any,
               slots: dict[MetadataIndex, int] | None,
               values: dict[MetadataIndex, Any] | None) -> tuple[list[WriteResult], Written]:
    results = []
    written: Written = []
    for item in items:
        offset = stream.tell()
        if item.type == WriteItemType.BYTE_IO:
            data = values.pop(item.index) if values and item.index in values else planner.resolve_data(item)
            buf = data.getbuffer()
            capacity = slots[item.index] if slots is not None else slot_capacity(buf)
            pieces = padded_value(buf, capacity)
            if pieces is None:
                raise RuntimeError(f"{item.index.fqn} does not fit its slot of {capacity} bytes")
            for piece in pieces:
                stream.write(piece)
        else:
            if gate is not None:
                gate.before(item.index.fqn)
            tensor = planner.resolve_data(item).detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            write_tensor(tensor, stream)
            if gate is not None:
                gate.after(item.index.fqn)
        length = stream.tell() - offset
        written.append((item.index, offset, length))
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=storage_info(name, offset, length)))
    return results, written


class ReusingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with each value's write items kept across saves while
    what they are made of stays the same.

    DCP's own plan caching is off: it finds a plan unchanged when names, shapes and chunks
    are, so a tensor saved in another dtype of the same shape kept the old ``.metadata``
    (torch 2.13's ``_compare_save_plans`` ignores the properties), and a save of an
    unchanged structure no longer goes through DCP at all (:mod:`roll_ckpt.save.fixed_layout`).

    ``DefaultSavePlanner`` makes every save's local plan anew before it finds it equal to
    the cached one: 15-20 µs per DTensor (its shard's offsets from mesh and placements),
    about 95 ms of each save at 2,300 tensors per rank. The items are frozen dataclasses
    made only of a value's name, its global shape, mesh and placements, and its local
    shard's dtype, layout, ``requires_grad`` and pinning: :attr:`items` maps those to the
    items, so a save of an unchanged structure makes none. The plan is still DCP's own
    (its ``create_local_plan`` walks the values; each known one answers DCP's
    ``__create_write_items__`` with its kept items), and the data is still looked up in the
    real state dict. ``items`` belongs to the caller (one per strategy, kept across saves);
    its values hold the meshes whose ``id`` its keys use, so that ``id`` is never another's.
    """

    def __init__(self, items: dict[tuple, tuple[Any, "_Planned"]]) -> None:
        super().__init__()  # DCP's plan caching is off by default (torch 2.8-2.14; 2.6 has none)
        self.items = items
        self._values: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._values = self.state_dict
        if len(self.items) > 2 * len(self._values) + 64:  # another structure: start over
            self.items.clear()
        self.state_dict = {fqn: self._planned(fqn, obj) for fqn, obj in self._values.items()}

    def _planned(self, fqn: str, obj: Any) -> Any:
        key = _items_key(fqn, obj)
        if key is None:
            return obj
        found = self.items.get(key)
        if found is None:
            mesh = getattr(obj, "device_mesh", None)
            made = create_write_items(fqn, obj) if mesh is None or mesh.get_coordinate() is not None else []
            found = self.items[key] = (mesh, _Planned(made))
        return found[1]

    def lookup_object(self, index: MetadataIndex) -> Any:
        return find_state_dict_object(self._values, index)

    def create_global_plan(self, all_plans: list[Any]) -> tuple[list[Any], Metadata]:
        """DCP's global plan, with small replicated values in the lowest process's file and
        the planner-data merge and chunk validation in linear time (:mod:`roll_ckpt.save.global_plan`).
        A unit one process writes alone lists only its own chunks: no check that they fill
        the tensor. (The planner's public method: torch 2.6 has no ``_create_global_plan`` to
        override, and 2.8-2.14's ``create_global_plan`` only adds plan caching, which is off.)"""
        import dataclasses

        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        from .global_plan import chunk_errors, dedup_plans, merge_planner_data

        global_plan, metadata = create_default_global_save_plan(dedup_plans(all_plans))
        if self.flatten_state_dict:
            metadata = dataclasses.replace(metadata, planner_data=merge_planner_data(global_plan))
        errors = chunk_errors(metadata, len(global_plan) > 1)
        if errors:
            summary = "; ".join(errors)
            raise ValueError(f"Failed to validate global plan: {summary[:500]}")
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata


class _Planned:
    """A value whose write items are known (DCP asks ``__create_write_items__``)."""

    __slots__ = ("made",)

    def __init__(self, made: list[Any]) -> None:
        self.made = made

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        return self.made


def _items_key(fqn: str, obj: Any) -> tuple | None:
    if not isinstance(obj, torch.Tensor):
        return None  # a value saved as bytes: one item, cheap to make
    local = local_tensor(obj)
    if type(local) is not torch.Tensor:  # a subclass may make its own items
        return None
    shard = (local.dtype, local.layout, local.requires_grad, local.is_pinned())
    if local is obj:
        return (fqn, tuple(obj.shape), *shard)
    return (fqn, tuple(obj.shape), id(obj.device_mesh), obj.placements, *shard)


class DigestingWriter(FileSystemWriter):
    """DCP's writer interface on a backend, with per-file checksums for the manifest.

    After ``dcp.save`` returns on the coordinator, :attr:`file_digests` maps each file
    name (relative to the DCP folder, ``.metadata`` included) to ``(size, checksum)``.
    """

    def __init__(self, storage: Storage, path: str, *, thread_count: int = 1,
                 on_bytes: Callable[[int], None] | None = None, gate: Any = None,
                 pause: CollectorPause | None = None, cold: frozenset[str] = frozenset(),
                 take: TakeOver | None = None) -> None:
        # sync_files=False: durability comes from the backend's close(), never from the
        # system-wide os.sync() DCP falls back to for streams without a file descriptor.
        super().__init__(path, single_file_per_rank=True, sync_files=False,
                         thread_count=thread_count, overwrite=True)
        self.fs = StorageFileSystem(storage, on_bytes)
        self.path = str(path)
        self.file_digests: dict[str, tuple] = {}
        self.gate = gate
        """Regular staging in waves (``roll_ckpt.save.regular_copy.WaveGate``), or ``None``."""
        self.pause = pause or CollectorPause(False)
        self.cold = cold
        """Tensors no optimizer updates: written into files of their own."""
        self.take = take
        """What this save may take over from the newest committed checkpoint, or ``None``."""
        self.written: dict[str, Written] = {}
        """Per file this process wrote: each item's index, offset and length, in file order."""
        self.final_items: list[Any] = []
        """The items of this process's final plan (after DCP's global plan)."""
        self.metadata_bytes: bytes | None = None
        """The coordinator's ``.metadata``, as written."""
        """The save's hold on the garbage collector, let go while the data is written (a long
        write would otherwise keep the training loop's garbage uncollected)."""

    def own_digests(self) -> dict[str, tuple]:
        """This process's files (relative to the DCP folder) and their digests."""
        root = self.path.rstrip("/") + "/"
        return {k[len(root):] if k.startswith(root) else k: v for k, v in self.fs.digests.items()}

    def write_files(self, files: list[tuple[str, list[Any]]], planner: Any,
                    slots: dict[MetadataIndex, int] | None = None,
                    values: dict[MetadataIndex, Any] | None = None) -> list[WriteResult]:
        """Write each ``(name, items)`` of ``files`` (one thread each), recording
        :attr:`written`; the collector is let go meanwhile."""
        specs = [(self.fs.concat_path(self.path, name), name, items) for name, items in files]
        results: list[list[WriteResult]] = [[] for _ in specs]
        layout: list[Written] = [[] for _ in specs]
        errors: list[BaseException] = []

        def run(k: int) -> None:
            try:
                results[k], layout[k] = _write_file(self.fs, *specs[k], planner, self.gate, slots, values, self.take)
            except BaseException as exc:  # raised below, once every thread is done
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(k,), name="roll-ckpt-write") for k in range(1, len(specs))]
        self.pause.release()
        try:
            for t in threads:
                t.start()
            if specs:
                run(0)
            for t in threads:
                t.join()
        finally:
            self.pause.hold()  # the gather of write results and .metadata follow
        if errors:
            raise errors[0]
        self.written = {name: w for (_, name, _), w in zip(specs, layout)}
        return [r for rs in results for r in rs]

    def write_data(self, plan: Any, planner: Any) -> Any:
        from torch.futures import Future

        prefix = storage_prefix(plan)
        if self.gate is not None:
            self.gate.expect([i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO])
        groups = plan_files(list(plan.items), max(1, self.thread_count), self.gate, self.cold)
        self.final_items = list(plan.items)
        flat = self.write_files([(f"{prefix}{k}.distcp", items) for k, items in enumerate(groups)], planner)
        if len(flat) != len(plan.items):
            raise RuntimeError(f"the writer returned {len(flat)} results for {len(plan.items)} items")
        # Checksums travel with DCP's own gather of write results.
        flat.append(WriteResult(index=MetadataIndex(_DIGEST_FQN), size_in_bytes=0, storage_data=self.own_digests()))
        out: Future = Future()
        out.set_result(flat)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator writes ``.metadata`` (DCP's own ``finish``, without its temporary
        file: the whole folder is temporary until the commit) and keeps its bytes, which a
        later save of the same structure writes again (:mod:`roll_ckpt.save.fixed_layout`)."""
        import pickle

        digests: dict[str, tuple] = {}
        storage_md = {}
        for rank_results in results:
            for wr in rank_results:
                if wr.index.fqn == _DIGEST_FQN:
                    digests.update(wr.storage_data)
                else:
                    storage_md[wr.index] = wr.storage_data
        version = dcp_format_version()
        if version is not None:  # torch < 2.10 writes no version, and its Metadata has no field for one
            metadata.version = version
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        self.metadata_bytes = pickle.dumps(metadata)
        self.file_digests = {**digests, METADATA_NAME: self.write_metadata(self.metadata_bytes)}

    def write_metadata(self, data: bytes) -> tuple:
        """Write ``.metadata`` with these bytes; its ``(size, checksum, chunks)``."""
        path = self.fs.concat_path(self.path, METADATA_NAME)
        with self.fs.create_stream(path, "wb") as stream:
            stream.write(data)
        return self.fs.digests[path]
