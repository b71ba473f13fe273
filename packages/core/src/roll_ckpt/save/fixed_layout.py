"""Saves of an unchanged structure, coordinated with a fixed-size message per process.

A DCP save gathers every process's plan on the coordinator, builds and scatters a global
plan, gathers every process's write results and pickles ``.metadata``: work and bytes
that grow with the job (at 1,024 processes, seconds of the coordinator's CPU and hundreds
of MB through its collectives at every save). Yet a periodic save almost always has the
structure of the one before, and roll-ckpt's writer makes every offset a function of the
structure (tensors first, byte values in slots: :mod:`roll_ckpt.format.value_slots`). Then the
``.metadata`` of the last full save holds for the next one byte for byte, and a save needs
only:

1. each process checks locally that its plan, its files and their order are those of the
   layout, and that its byte values fit their slots;
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
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

from .writer import DigestingWriter, Written, plan_files
from ..errors import portable
from ..runtime.torch_compat import all_reduce_ints
from ..format.unpickle import METADATA_NAME, safe_load_metadata
from ..format.value_slots import padded_value

__all__ = ["FixedLayouts", "RankLayout", "structure_of"]

_REDO = "redo"


@dataclass
class RankLayout:
    """One process's part of the last full save: what its next save must repeat."""

    generation: int
    """The same on every process for the same full save (or resumed checkpoint)."""
    structure: tuple
    """World size, rank, files, and each DTensor's mesh and placements."""
    local_items: list[Any]
    """The process's local plan (DCP's write items, before the global plan's dedup)."""
    files: list[tuple[str, Written]]
    """The process's files, each with its items' index, offset and length in file order."""
    metadata: bytes | None = None
    """The coordinator's ``.metadata`` bytes (``None`` on the other processes)."""


@dataclass
class FastPlan:
    """A save that repeats the layout: what to write, where, with the values serialized."""

    planner: Any
    files: list[tuple[str, list[Any]]]
    slots: dict[Any, int]
    values: dict[Any, Any]


def _mesh_key(mesh: Any) -> tuple:
    return (tuple(mesh.shape), mesh.mesh_dim_names, mesh.get_coordinate())


def structure_of(values: dict[str, Any], world_size: int, rank: int, threads: int) -> tuple:
    """What a layout depends on beyond DCP's write items: each DTensor's mesh and placements."""
    from torch.distributed.tensor import DTensor

    meshes: dict[int, tuple] = {}
    parts = []
    for fqn, obj in values.items():
        if isinstance(obj, DTensor):
            mesh = obj.device_mesh
            key = meshes.get(id(mesh))
            if key is None:
                key = meshes[id(mesh)] = _mesh_key(mesh)
            parts.append((fqn, key, obj.placements))
    return (world_size, rank, threads, tuple(parts))


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

    def prepare(self, planner: Any, threads: int, gate: Any) -> FastPlan | None:
        """The save repeating the layout, if this process's state allows it (no collective)."""
        from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
        from torch.distributed.checkpoint.planner import WriteItemType

        layout = self.layout
        if layout is None:
            return None
        local = create_default_local_save_plan(planner.state_dict, planner.is_coordinator).items
        if local != layout.local_items:
            return None
        if structure_of(planner._values, self.world_size, self.rank, threads) != layout.structure:
            return None
        mine = {index for _, written in layout.files for index, _, _ in written}
        final = [i for i in local if i.index in mine]
        prefix = f"__{self.rank}_"
        files = [(f"{prefix}{k}.distcp", items) for k, items in enumerate(plan_files(final, threads, gate))]
        if [(n, [i.index for i in items]) for n, items in files] != \
                [(n, [index for index, _, _ in w]) for n, w in layout.files]:
            return None
        lengths = {index: length for _, w in layout.files for index, _, length in w}
        slots, values = {}, {}
        for item in final:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                if padded_value(data.getbuffer(), lengths[item.index]) is None:
                    return None  # the value outgrew its slot
                slots[item.index], values[item.index] = lengths[item.index], data
        return FastPlan(planner, files, slots, values)

    # ------------------------------------------------------------ collectives

    def agree(self, fast: FastPlan | None, group: Any) -> bool:
        """True on every process when every process can repeat the same layout (one
        all-reduce of three integers)."""
        if self.layout is None:  # then on every process: no collective (see record, adopt, forget)
            return False
        gen = self.layout.generation
        failed, top, bottom = self._max([0 if fast is not None else 1, gen, -gen], group)
        return failed == 0 and top == -bottom

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

    def save(self, fast: FastPlan, writer: DigestingWriter, group: Any) -> dict[str, tuple] | None:
        """Write the files at the layout's offsets; the coordinator's file digests (``{}`` on
        the others), or ``None`` when the save must be written again by the full path."""
        layout = self.layout
        assert layout is not None
        message: tuple
        try:
            if writer.gate is not None:
                writer.gate.expect([i.index.fqn for _, items in fast.files for i in items
                                    if i.index not in fast.slots])
            writer.write_files(fast.files, fast.planner, fast.slots, fast.values)
            exact = [(n, writer.written.get(n)) for n, _ in fast.files] == layout.files
            message = ("ok" if exact else _REDO, writer.own_digests() if exact else None)
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
        written = writer.written
        self.layout = RankLayout(
            generation=self._full_saves,
            structure=structure_of(planner._values, self.world_size, self.rank, threads),
            local_items=create_default_local_save_plan(planner.state_dict, planner.is_coordinator).items,
            files=[(name, written[name]) for name in written],
            metadata=writer.metadata_bytes if self.rank == 0 else None,
        )

    def adopt_later(self, md_bytes: bytes, checksum: str) -> None:
        """Keep a resumed checkpoint's ``.metadata`` bytes (checked; every process, after the
        load) for the next save's :meth:`adopt`: the resume does not pay for a layout only a
        save uses, nor keeps its tens of thousands of objects alive until then."""
        self.layout, self.resumed = None, (md_bytes, checksum)

    def adopt(self, planner: Any, threads: int, group: Any) -> None:
        """Take the layout of the resumed checkpoint (:meth:`adopt_later`) where every process's
        state has its structure and the checkpoint was written with fixed offsets (one
        all-reduce: a layout is kept on every process or on none)."""
        from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

        assert self.resumed is not None
        (md_bytes, checksum), self.resumed = self.resumed, None
        local = create_default_local_save_plan(planner.state_dict, planner.is_coordinator).items
        try:
            md = safe_load_metadata(md_bytes, ".metadata")  # (checked at the resume)
            files = _files_of(md, local, self.rank, self.world_size, threads)
        except Exception:  # a checkpoint this reading does not understand: the full path, as always
            files = None
        self.layout = None
        if self._max([1 if files is None else 0], group)[0]:
            return
        assert files is not None
        self.layout = RankLayout(
            generation=(1 << 40) + int(checksum[:8], 16),  # the same checkpoint on every process
            structure=structure_of(planner._values, self.world_size, self.rank, threads),
            local_items=list(local),
            files=files,
            metadata=md_bytes if self.rank == 0 else None,
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

