"""DCP's standard on-disk format, written by roll-ckpt's own writer with per-file checksums.

:class:`DigestingWriter` is a DCP ``StorageWriter``: DCP plans the save and writes
``.metadata`` as always, and the folder stays what plain ``dcp.load`` reads. The data
files are written by this module's loop instead of DCP's: the same layout (one
``__<rank>_<n>.distcp`` per writer thread, byte values first, then tensors, each
``torch.save``-framed), but each file is hashed while written, each tensor's frame is kept
for the next tensor of its shape (:mod:`roll_ckpt.dcp.files`), and the tensors skip
torch's CRC-32 (the manifest's xxh3-128 covers every byte). Each rank's checksums ride
back to the coordinator inside DCP's own gather of write results (no extra collective)
and are taken out again before ``.metadata`` is written.

**Fixed layouts.** Saves of an unchanged structure, coordinated with a fixed-size message per process.

A DCP save gathers every process's plan on the coordinator, builds and scatters a global
plan, gathers every process's write results and pickles ``.metadata``: work and bytes
that grow with the job (at 1,024 processes, seconds of the coordinator's CPU and hundreds
of MB through its collectives at every save). Yet a periodic save almost always has the
structure of the one before, and roll-ckpt's writer makes every offset a function of the
structure (tensors first, byte values in slots: :mod:`roll_ckpt.dcp.files`). Then the
``.metadata`` of the last full save holds for the next one byte for byte, and a save needs
only:

1. each process checks locally that its state is the one the layout was written from (the
   same keys: each value's name, shape, dtype, mesh and placements, :func:`layout_keys`) and
   that its byte values fit their slots; no plan is made: the layout keeps each file's write
   items (the *write program*), and the save writes them as they are, each value looked up
   by DCP's own lookup;
2. one all-reduce of three integers: every process agrees, from the same layout
   (``generation``);
3. each process writes its files at the layout's offsets and sends the coordinator one
   message: whether it wrote exactly the layout, and its files' sizes and checksums;
4. the coordinator writes the kept ``.metadata`` bytes and broadcasts the outcome: done,
   an error (raised on every process), or *redo* — a process wrote something else than
   the layout (never expected; no correctness rests on this cache), and every process
   writes the save again through DCP's full path.

Any change the check sees takes the full path (DCP's protocol, as before), whose result
becomes the next layout: shape, dtype, placement, mesh, world size, a new or removed key,
a byte value that outgrew its slot, another file split. A resumed job starts from the
layout of the checkpoint it resumed from (:meth:`FixedLayouts.adopt`), so the first save
after a restart takes this path too. The folder is plain DCP either way.

**Increments.** Incremental saves: a data file whose bytes are those of the file of the same name in the
newest committed checkpoint of the run is taken over from it, not written again.

*Unchanged is proven, not assumed.* A candidate file is first serialized into a sink that
only hashes (the very bytes the writer would write, frames and all); only when its size
and XXH3-128 checksum equal the ones recorded for the base checkpoint's file is the file
taken over, by the storage (:class:`~roll_ckpt.contracts.TakesOver`: a hard link on POSIX
disks, a server-side copy on object stores; a plain copy through this process where the
storage has neither). Anything else is written as before. ``requires_grad``, version
counters and the like decide nothing: they only choose which files are worth hashing first.

*The unit is a file.* The writer puts the tensors that no optimizer updates
(``requires_grad=False``, or in no optimizer's param groups) into files of their own
(:func:`roll_ckpt.dcp.writer.plan_files`), so a frozen base is whole files, and byte values
(counters, RNG states), which change at every step, never share a file with them. A
per-tensor unit would need a DCP folder whose items point into another checkpoint's files:
no longer self-contained, and no longer plain DCP. A file is hashed first when it holds
only such tensors or when it was taken over at the last save; every other file is written
straight away, so a full fine-tune pays nothing for the feature.

Every checkpoint stays a complete, plain DCP folder with all its files: deleting an older
checkpoint never breaks a newer one (a hard link keeps the bytes; a copy is a copy). On a
POSIX disk a linked file is one inode shared by both checkpoints: damage *to the disk's
blocks* of it shows in both.
"""

from __future__ import annotations

import concurrent.futures as cf
import torch
import traceback
import logging
from typing import Any, Callable, Mapping
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.checkpoint.storage import WriteResult
from dataclasses import dataclass, field

from ..runtime.collector import CollectorPause
from ..contracts import Storage
from .files import DigestSink, StorageFileSystem, padded_value, slot_capacity, write_tensor
from ..runtime.torch_compat import create_write_items, dcp_format_version, local_tensor, storage_info, storage_prefix, all_reduce_ints
from .checked import METADATA_NAME, safe_load_metadata
from ..format.manifest import CHUNK_SIZE
from ..errors import portable
from ..format.commit import take_over_file
from ..format.layout import CKPT_RE

__all__ = ['DigestingWriter', 'ReusingSavePlanner', 'plan_files', 'FixedLayouts', 'RankLayout', 'layout_keys', 'Base', 'Increments', 'TakeOver', 'cold_names']


# ---- the writer ------------------------------------------------------------

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
    go to a file of their own, first, without byte values (:mod:`roll_ckpt.dcp.writer`)."""
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
    values pickle to (:mod:`roll_ckpt.dcp.files`)."""
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
    bytes hash to the base checkpoint's is taken over from it instead (:mod:`roll_ckpt.dcp.writer`)."""
    previous = take.candidate(name, [i.index.fqn for i in items]) if take is not None else None
    if previous is not None:
        sink = DigestSink()
        results, written = _serialize(sink, name, items, planner, None, slots, dict(values or {}))
        if sink.digest()[:2] == tuple(previous[:2]) and take.take(name, path):  # type: ignore[union-attr]
            take.taken[name] = (*previous[:3], CHUNK_SIZE, take.base.name)  # type: ignore[union-attr]
            fs.digests[name] = take.taken[name]  # type: ignore[union-attr]
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
    unchanged structure no longer goes through DCP at all (:mod:`roll_ckpt.dcp.writer`).

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
        self.values: dict[str, Any] = {}
        """The flattened state dict's own values, by name (``state_dict`` holds their kept
        write items instead); the fixed layouts key a save by them."""

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.values = self.state_dict
        if len(self.items) > 2 * len(self.values) + 64:  # another structure: start over
            self.items.clear()
        self.state_dict = {fqn: self._planned(fqn, obj) for fqn, obj in self.values.items()}

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
        return find_state_dict_object(self.values, index)

    def create_global_plan(self, all_plans: list[Any]) -> tuple[list[Any], Metadata]:
        """DCP's global plan, with small replicated values in the lowest process's file and
        the planner-data merge and chunk validation in linear time (:mod:`roll_ckpt.dcp.global_plan`).
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
        self.path = str(path)
        self.fs = StorageFileSystem(storage, on_bytes, root=self.path)
        self.own_digests = self.fs.digests
        """This process's files (relative to the DCP folder) and their digests."""
        self.file_digests: dict[str, tuple] = {}
        self.gate = gate
        """Regular staging in waves (``roll_ckpt.save.staging.WaveGate``), or ``None``."""
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

    def write_files(self, files: list[tuple[str, list[Any]]], planner: Any,
                    slots: dict[MetadataIndex, int] | None = None,
                    values: dict[MetadataIndex, Any] | None = None) -> list[WriteResult]:
        """Write each ``(name, items)`` of ``files`` (one thread each), recording
        :attr:`written`; the collector is let go meanwhile."""
        specs = [(self.fs.storage.join(self.path, name), name, items) for name, items in files]
        extra = (planner, self.gate, slots, values, self.take)
        self.pause.release()
        try:  # the first file in this thread, each other one in a thread of its own
            with cf.ThreadPoolExecutor(max(1, len(specs) - 1), thread_name_prefix="roll-ckpt-write") as pool:
                others = [pool.submit(_write_file, self.fs, *spec, *extra) for spec in specs[1:]]
                done = [_write_file(self.fs, *specs[0], *extra)] if specs else []
            # (leaving the pool waited for every thread: an error is raised once all are done)
            done += [f.result() for f in others]
        finally:
            self.pause.hold()  # the gather of write results and .metadata follow
        self.written = {name: written for (_, name, _), (_, written) in zip(specs, done)}
        return [r for results, _ in done for r in results]

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
        flat.append(WriteResult(index=MetadataIndex(_DIGEST_FQN), size_in_bytes=0, storage_data=dict(self.own_digests)))
        out: Future = Future()
        out.set_result(flat)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator writes ``.metadata`` (DCP's own ``finish``, without its temporary
        file: the whole folder is temporary until the commit) and keeps its bytes, which a
        later save of the same structure writes again (:mod:`roll_ckpt.dcp.writer`)."""
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
        path = self.fs.storage.join(self.path, METADATA_NAME)
        with self.fs.create_stream(path, "wb") as stream:
            stream.write(data)
        return stream.digest


# ---- fixed layouts ---------------------------------------------------------

_REDO = "redo"


@dataclass
class RankLayout:
    """One process's part of the last full save: what its next save must repeat."""

    generation: int
    """The same on every process for the same full save (or resumed checkpoint)."""
    keys: tuple
    """What the layout holds for: world size, rank, writer threads, and every value of the
    flattened state dict as its write items depend on it (:func:`layout_keys`)."""
    files: list[tuple[str, Written]]
    """The process's files, each with its items' index, offset and length in file order."""
    items: list[tuple[str, list[Any]]]
    """The write program: each file's write items in file order (after the global plan's
    dedup), which a save that repeats the layout writes as they are."""
    metadata: bytes | None = None
    """The coordinator's ``.metadata`` bytes (``None`` on the other processes)."""
    meshes: tuple = ()
    """The device meshes whose ``id`` :attr:`keys` holds, kept alive: an ``id`` is never another's."""


@dataclass
class FastPlan:
    """A save that repeats the layout: what to write, where, with the values serialized."""

    planner: Any
    files: list[tuple[str, list[Any]]]
    slots: dict[Any, int]
    values: dict[Any, Any]


def layout_keys(values: dict[str, Any], world_size: int, rank: int, threads: int) -> tuple:
    """What a layout holds for (:attr:`RankLayout.keys`): world size, rank, writer threads and
    each value of the flattened state dict: a byte value by its name, a tensor by what its
    write items are made of (:func:`_items_key`: name, global shape, mesh and placements, its
    local shard's dtype and layout), or, for a subclass that may make its own (a float8
    weight's local shard), by the items DCP makes of it."""
    out: list[Any] = [world_size, rank, threads]
    for fqn, obj in values.items():
        if not isinstance(obj, torch.Tensor):  # a byte value: one item, but an object may make its own
            out.append(tuple(create_write_items(fqn, obj)) if hasattr(obj, "__create_write_items__") else fqn)
            continue
        key = _items_key(fqn, obj)
        if key is None:
            mesh = getattr(obj, "device_mesh", None)
            made = create_write_items(fqn, obj) if mesh is None or mesh.get_coordinate() is not None else []
            key = (fqn, id(mesh), getattr(obj, "placements", None), tuple(made))
        out.append(key)
    return tuple(out)


def _meshes(values: dict[str, Any]) -> tuple:
    return tuple({id(m): m for v in values.values() if (m := getattr(v, "device_mesh", None)) is not None}.values())


class FixedLayouts:
    """The layout of one strategy's saves, and the protocol of a save that repeats it."""

    def __init__(self, dist: Any, rank: int, world_size: int) -> None:
        self._dist = dist
        self.rank = rank
        self.world_size = world_size
        self.layout: RankLayout | None = None
        self.resumed: tuple[bytes, str] | None = None
        """A resumed checkpoint's ``.metadata`` bytes and checksum, for the next save to adopt."""
        self._full_saves = 0
        self.fast_saves = 0
        """Saves that took this path (for tests and the benchmark)."""

    # ------------------------------------------------------------ the local check

    def prepare(self, sd: dict[str, Any], threads: int, gate: Any, is_coordinator: bool) -> FastPlan | None:
        """The save repeating the layout, if this process's state allows it (no collective):
        the state has the layout's keys, its tensors come in the waves' order (staged in
        waves) and its byte values fit their slots. No plan is made: the layout's write
        items are written as they are, each value looked up in the state dict by DCP's own
        lookup."""
        from torch.distributed.checkpoint import DefaultSavePlanner
        from torch.distributed.checkpoint.planner import WriteItemType

        layout = self.layout
        if layout is None:
            return None
        planner = DefaultSavePlanner()  # DCP's flattening of the state dict and its lookups
        planner.set_up_planner(sd, None, is_coordinator)
        if layout_keys(planner.state_dict, self.world_size, self.rank, threads) != layout.keys:
            return None
        if gate is not None:  # each file's tensors in the order their waves are staged
            for _, items in layout.items:
                names = [i.index.fqn for i in items if i.type != WriteItemType.BYTE_IO]
                if gate.order(names) != list(range(len(names))):
                    return None
        lengths = {index: length for _, w in layout.files for index, _, length in w}
        slots, values = {}, {}
        for _, items in layout.items:
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    data = planner.resolve_data(item)
                    if padded_value(data.getbuffer(), lengths[item.index]) is None:
                        return None  # the value outgrew its slot
                    slots[item.index], values[item.index] = lengths[item.index], data
        return FastPlan(planner, layout.items, slots, values)

    # ------------------------------------------------------------ collectives

    def _max(self, values: list[int], group: Any) -> list[int]:
        if self._dist is None or self.world_size == 1:
            return values
        return all_reduce_ints(self._dist, values, self._dist.ReduceOp.MAX, group)

    def _gather(self, message: Any, group: Any) -> list[Any] | None:
        if self._dist is None or self.world_size == 1:
            return [message]
        out = [None] * self.world_size if self.rank == 0 else None
        dst = self._dist.get_global_rank(group, 0) if group is not None else 0
        self._dist.gather_object(message, out, dst=dst, group=group)
        return out

    def _broadcast(self, obj: Any, group: Any) -> Any:
        if self._dist is None or self.world_size == 1:
            return obj
        box = [obj]
        src = self._dist.get_global_rank(group, 0) if group is not None else 0
        self._dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    # ------------------------------------------------------------ the save

    def save(self, fast: FastPlan | None, writer: DigestingWriter, group: Any) -> dict[str, tuple] | None:
        """Write the files at the layout's offsets; the coordinator's file digests (``{}`` on
        the others), or ``None`` when the save takes the full path: some process cannot
        repeat the layout (``fast`` is ``None`` there, or its layout is another), which every
        process learns from one all-reduce of three integers before anything is written; or
        one wrote something else than the layout (the save is written again)."""
        layout = self.layout
        if layout is None:  # then on every process: no collective (see record, adopt, forget)
            return None
        failed, top, bottom = self._max([0 if fast is not None else 1, layout.generation, -layout.generation], group)
        if failed or top != -bottom:
            self.forget()
            return None
        assert fast is not None
        message: tuple
        try:
            if writer.gate is not None:
                writer.gate.expect([i.index.fqn for _, items in fast.files for i in items
                                    if i.index not in fast.slots])
            writer.write_files(fast.files, fast.planner, fast.slots, fast.values)
            exact = [(n, writer.written.get(n)) for n, _ in fast.files] == layout.files
            message = ("ok" if exact else _REDO, writer.own_digests if exact else None)
        except Exception as exc:  # every process must hear of it: none may stay in the gather
            message = ("error", portable(exc))
        gathered = self._gather(message, group)
        outcome: Any = None
        digests: dict[str, tuple] = {}
        if gathered is not None:  # the coordinator
            errors = {r: m[1] for r, m in enumerate(gathered) if m[0] == "error"}
            if errors:
                outcome = errors
            elif any(m[0] == _REDO for m in gathered):
                outcome = _REDO
            else:
                try:
                    for m in gathered:
                        digests.update(m[1])
                    digests[METADATA_NAME] = writer.write_metadata(layout.metadata)  # type: ignore[arg-type]
                except Exception as exc:
                    outcome = {0: portable(exc)}
        outcome = self._broadcast(outcome, group)
        if outcome == _REDO:
            self.layout = None
            return None
        if outcome:
            from torch.distributed.checkpoint.api import CheckpointException

            raise CheckpointException("save", {r: (e, traceback.StackSummary()) for r, e in outcome.items()})
        self.fast_saves += 1
        return digests

    # ------------------------------------------------------------ layouts

    def forget(self) -> None:
        self.layout = self.resumed = None

    def record(self, planner: Any, writer: DigestingWriter, threads: int) -> None:
        """Keep the layout of the full save just done (every process, after ``dcp.save``)."""
        from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

        self._full_saves += 1
        self.resumed = None
        keys = layout_keys(planner.values, self.world_size, self.rank, threads)
        written = writer.written
        by_index = {i.index: i for i in create_default_local_save_plan(planner.state_dict, planner.is_coordinator).items}
        self.layout = RankLayout(
            generation=self._full_saves,
            keys=keys,
            files=[(name, written[name]) for name in written],
            items=[(name, [by_index[index] for index, _, _ in written[name]]) for name in written],
            metadata=writer.metadata_bytes if self.rank == 0 else None,
            meshes=_meshes(planner.values),
        )

    def adopt_later(self, md_bytes: bytes, checksum: str) -> None:
        """Keep a resumed checkpoint's ``.metadata`` bytes (checked at the resume; every process,
        at the first save after it) for that save's :meth:`adopt`: the resume does not pay for a
        layout only a save uses, nor keeps its tens of thousands of objects alive until then."""
        self.layout, self.resumed = None, (md_bytes, checksum)

    def adopt(self, planner: Any, threads: int, group: Any) -> None:
        """Take the layout of the resumed checkpoint (:meth:`adopt_later`) where every process's
        state has its structure and the checkpoint was written with fixed offsets (one
        all-reduce: a layout is kept on every process or on none)."""
        from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

        assert self.resumed is not None
        (md_bytes, checksum), self.resumed = self.resumed, None
        local = create_default_local_save_plan(planner.state_dict, planner.is_coordinator).items
        keys = layout_keys(planner.values, self.world_size, self.rank, threads)
        try:
            md = safe_load_metadata(md_bytes, ".metadata")  # (checked at the resume)
            files = _files_of(md, local, self.rank, self.world_size, threads)
        except Exception:  # a checkpoint this reading does not understand: the full path, as always
            files = None
        self.layout = None
        if self._max([1 if files is None else 0], group)[0]:
            return
        assert files is not None
        by_index = {i.index: i for i in local}
        self.layout = RankLayout(
            generation=(1 << 40) + int(checksum[:8], 16),  # the same checkpoint on every process
            keys=keys,
            files=files,
            items=[(name, [by_index[index] for index, _, _ in written]) for name, written in files],
            metadata=md_bytes if self.rank == 0 else None,
            meshes=_meshes(planner.values),
        )


def _files_of(md: Any, local: list[Any], rank: int, world_size: int, threads: int) -> list[tuple[str, Written]] | None:
    """This process's files in ``md`` as the writer would lay out ``local`` now; ``None``
    when they differ (another structure, another world size, an older layout)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.planner import WriteItemType

    from ..format.layout import writer_rank

    prefix = f"__{rank}_"
    files: dict[str, Written] = {}
    ranks = set()
    for index, info in md.storage_data.items():
        name = info.relative_path
        ranks.add(writer_rank(name))
        if name.startswith(prefix):
            files.setdefault(name, []).append((index, info.offset, info.length))
    if ranks != set(range(world_size)):
        return None
    for item in local:  # every value of this process, as the checkpoint holds it
        entry = md.state_dict_metadata.get(item.index.fqn)
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(entry, BytesStorageMetadata):
                return None
            continue
        data = item.tensor_data
        if isinstance(entry, BytesStorageMetadata) or entry is None or entry.size != data.size \
                or entry.properties.dtype != data.properties.dtype \
                or not any(c.offsets == data.chunk.offsets and c.sizes == data.chunk.sizes for c in entry.chunks):
            return None
    by_index = {i.index: i for i in local}
    for written in files.values():
        written.sort(key=lambda w: w[1])
        if any(index not in by_index for index, _, _ in written):
            return None  # a value this process no longer has
    mine = {index for w in files.values() for index, _, _ in w}
    groups = plan_files([i for i in local if i.index in mine], threads)
    out = [(f"{prefix}{k}.distcp", [i.index for i in items]) for k, items in enumerate(groups)]
    if out != [(n, [w[0] for w in files.get(n, [])]) for n, _ in out] \
            or len(out) != len(files):
        return None
    for _, written in files.items():  # contiguous from 0, tensors before values: roll-ckpt's fixed layout
        pos = 0
        for index, offset, length in written:
            if offset != pos:
                return None
            pos += length
    return [(n, files[n]) for n, _ in out]


# ---- increments ------------------------------------------------------------

log = logging.getLogger("roll_ckpt")


@dataclass(frozen=True)
class Base:
    """A committed checkpoint a save may take files over from: its DCP folder on ``url``
    and, per file this process may write, ``(size, checksum, chunks)``."""

    url: str
    dcp_path: str
    files: Mapping[str, tuple]

    @property
    def name(self) -> str:
        """The checkpoint within its run: ``checkpoint-<step>`` (or another name format), or
        ``checkpoint-<step>/<component>``."""
        parts = self.dcp_path.rstrip("/").split("/")[:-1]
        steps = [i for i, p in enumerate(parts) if CKPT_RE.fullmatch(p)]
        return "/".join(parts[steps[-1]:]) if steps else parts[-1]


@dataclass
class TakeOver:
    """What one save may take over: the base, the names of the tensors worth hashing first
    (no optimizer updates them), the files taken over at the last save. Collects what it did."""

    storage: Storage
    base: Base
    cold: frozenset[str]
    warm_files: frozenset[str]
    taken: dict[str, tuple] = field(default_factory=dict)
    """File name -> digest of each file taken over by this save."""

    def candidate(self, name: str, fqns: list[str]) -> tuple | None:
        """The base's digest of ``name`` when the file is worth hashing first, else ``None``."""
        previous = self.base.files.get(name)
        if previous is None or not fqns:
            return None
        if name in self.warm_files or all(f in self.cold for f in fqns):
            return previous
        return None

    def take(self, name: str, dst: str) -> bool:
        """Take ``name`` over from the base into ``dst``; False when the base's file is gone
        or the storage fails (the caller then writes it)."""
        src = self.storage.join(self.base.dcp_path, name)
        try:
            how = take_over_file(self.storage, src, dst)
        except (OSError, RuntimeError) as exc:  # the base pruned meanwhile, a store refusing: write it
            log.info("roll-ckpt: cannot take %s over from %s (%s: %s); writing it", name, self.base.dcp_path,
                     type(exc).__name__, exc)
            try:
                self.storage.remove(dst)
            except OSError:
                pass
            return False
        log.debug("roll-ckpt: %s taken over from %s (%s)", name, self.base.dcp_path, how)
        return True


def cold_names(state: Mapping[str, Any]) -> frozenset[str]:
    """DCP names (``<key>.<parameter>``) of the parameters of ``state``'s modules that no
    optimizer in ``state`` updates: ``requires_grad=False`` ones, and, when ``state`` holds
    optimizers, those in none of their param groups. Only a hint of what to hash first."""
    import torch

    optimizers = [o for o in state.values() if isinstance(o, torch.optim.Optimizer)]
    updated = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    out = set()
    for key, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            for name, p in obj.named_parameters():
                if not p.requires_grad or (optimizers and id(p) not in updated):
                    out.add(f"{key}.{name}")
    return frozenset(out)


class Increments:
    """One strategy's record, across saves, of the newest committed checkpoint it knows and
    of the files this process wrote into it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.base: Base | None = None
        self.cold: frozenset[str] = frozenset()
        """The state's tensors that no optimizer updates (:func:`cold_names`), set by the
        strategy each time it builds the state's state dicts."""
        self._writer: DigestingWriter | None = None
        """The writer of the save in flight, until it is committed or failed."""
        self._warm: frozenset[str] = frozenset()

    def writer(self, storage: Storage, dcp_path: str, alone: bool, **options: Any) -> DigestingWriter:
        """The writer of a save into ``dcp_path`` (``options``: :class:`DigestingWriter`'s), given
        this record's ``cold`` and ``take``; the files it writes become the next save's base once
        the save is committed (:meth:`committed`; the last writer made counts). Without either
        for a folder a process writes alone (the fast tier's unit, on another storage) and for
        regular staging in waves, whose halves are reused once written (a file hashed first
        could not be)."""
        if not self.enabled or alone:
            return DigestingWriter(storage, dcp_path, **options)
        base = self.base
        usable = base is not None and options.get("gate") is None and base.url == storage.url
        take = TakeOver(storage, base, self.cold, self._warm) if usable else None  # type: ignore[arg-type]
        self._writer = DigestingWriter(storage, dcp_path, cold=self.cold, take=take, **options)
        return self._writer

    def committed(self, storage: Storage, checkpoint_path: str, data_dir: str) -> None:
        """The save is committed at ``checkpoint_path``: what its writer wrote is the next save's base."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        self.base = Base(storage.url, storage.join(checkpoint_path, data_dir), dict(writer.own_digests))
        self._warm = frozenset(writer.take.taken if writer.take else ())

    def failed(self) -> None:
        self._writer = None

    def seed(self, storage: Storage, dcp_path: str, files: Mapping[str, Any]) -> None:
        """A checkpoint this job resumed from, with its manifest's entries for ``dcp_path``."""
        if self.enabled and files:
            self.base = Base(storage.url, dcp_path, {n: (e.size, e.checksum, tuple(e.chunks)) for n, e in files.items()})
            self._warm = frozenset()
