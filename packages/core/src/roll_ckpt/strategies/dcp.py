"""The ``dcp`` strategy and its I/O: a training state as a DCP checkpoint and back.

:class:`DCPStrategy` (name ``dcp``) is core's own: one process, or several processes
whose modules are plain or replicated. It says what a save holds (:meth:`~DCPStrategy.state_dict`)
and where loaded values go (:meth:`~DCPStrategy.load_targets`, :meth:`~DCPStrategy.hand_over`).
:class:`DCPIO`, which the manager owns, writes and reads the DCP folders with the pieces of
:mod:`roll_ckpt.dcp` (checked reader, digesting writer, fixed layouts, increments). Plugins
subclass the strategy (``fsdp2``) to add their own process group, offload store and staging
policies; the I/O is the same.

A state is a mapping of names to:

* ``torch.nn.Module`` — saved with ``get_model_state_dict`` (sharded when it is);
* ``torch.optim.Optimizer`` — saved with ``get_optimizer_state_dict`` against the module
  in the same state that owns its parameters (keys are parameter names, not ids);
* :class:`~roll_ckpt.GlobalState` -- an object whose state dict is the job's (sharded
  tensors, values every process shares), saved as a module's is under ``<key>.``;
* anything with ``state_dict()``/``load_state_dict()`` (LR scheduler, stateful
  dataloader, counters), a ``dict``, a tensor or a plain value — saved **per process**
  under ``per_rank.<rank>.<name>`` (one leaf each, so keys and empty containers come back
  exactly), with this process's RNG state.

On load, an object that finds no entry for its own rank (the job grew) takes rank 0's.

**The state-dict cache.** The module and optimizer state dicts of a training state, built once per structure.

``get_model_state_dict``/``get_optimizer_state_dict`` cost ~20 µs per tensor, on every save.
While the state keeps its structure -- the same modules, parameters, buffers, optimizer
state tensors -- the dicts they return stay valid: a model's holds detached views of the
live parameters and buffers, an optimizer's holds the optimizer's own per-parameter state
dicts (``Optimizer.state_dict`` does not copy them), so later saves read the current
values through them. Only the optimizer's ``param_groups`` (copies, with the learning rate
the scheduler changes) are rebuilt every time.

The structure is compared on every save (the identity of every module, parameter, buffer
and optimizer state tensor, and the optimizer's state keys): a change is detected, never
assumed, and the dicts are built again.

**Optimizers.** A torch optimizer's state dict across a save and a load, through torch's state-dict helpers.

``get_optimizer_state_dict`` makes the state of an optimizer that has none yet (never
stepped: Adam creates it lazily at its first step) by running a step with zero gradients and
a learning rate of 0 -- which leaves Adam's ``step`` at 1, so the first real step's bias
correction is no longer a fresh optimizer's and training goes elsewhere. A save must not
change the training state: :func:`optimizer_state_dict` gives such an optimizer back as it was
(no state) and saves it so (its ``param_groups`` only); :func:`fit_target` loads a checkpoint
saved so into a fresh optimizer again.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, MutableMapping

import torch

from ..runtime.distributed import bounded, checkpoint_group, decide, from_rank
from ..runtime.collector import CollectorPause
from ..contracts import SpaceEstimate, Storage, Strategy, StrategyIO
from ..errors import RollCkptError, portable
from ..format.global_state import GlobalState
from ..format.layout import basename, parent, parse_step
from ..runtime.rng import capture_rng, restore_rng
from ..dcp.checked import METADATA_NAME, safe_load_metadata
from ..dcp.reader import assigned_files, read_dcp, placeholders, top_keys
from ..dcp.writer import FixedLayouts, Increments, cold_names
from ..runtime.torch_compat import (all_reduce_ints, collective, dcp_save, loaded_in_place, local_tensor,
                                   module_tensor_ids)

__all__ = ["DCPStrategy", "DCPIO", "PER_RANK", "RNG_KEY"]

PER_RANK = "per_rank"
RNG_KEY = "__rng__"


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class DCPStrategy(Strategy):
    """The :class:`~roll_ckpt.contracts.Strategy` ``dcp``: DCP state dicts on the default
    process group; its files are written and read by :class:`DCPIO`."""

    name = "dcp"
    data_dir = "dcp"

    def __init__(self, config: Any, plugins: Any = None) -> None:
        self.config = config
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        """``torch.distributed`` when the job runs on a process group, else ``None``."""
        self._control: Any = None
        self.state_dicts = StateDictCache()
        self.incremental = bool(getattr(config.checkpoint_config, "incremental", False))
        self.cold: frozenset[str] = frozenset()
        """With incremental saves, the state's tensors no optimizer updates (a hint of what
        to hash first, :func:`roll_ckpt.dcp.writer.cold_names`), found per build of the state dicts."""
        self._names_before: dict[str, list[list[str]]] = {}  # (load_targets, for hand_over)
        self.rank = self.dist.get_rank() if self.dist else 0
        self.world_size = self.dist.get_world_size() if self.dist else 1
        self.is_coordinator = self.rank == 0
        self.collective_timeout_s = float(config.checkpoint_config.collective_timeout_s)
        """How long a collective of a save, commit or resume waits for the other ranks (:mod:`roll_ckpt.runtime.distributed`)."""
        self.process_group: Any = None
        """The group DCP's collectives use: a gloo group of roll-ckpt's own, whose collectives
        give up after ``checkpoint_config.collective_timeout_s`` (``None``: one process)."""
        if self.dist is not None and self.world_size > 1:  # (every rank creates its strategy at the same point)
            # both now: creating a group is itself a wait for every rank, with no bound of ours
            self.process_group = checkpoint_group(self.dist, self.collective_timeout_s)
            self._control = checkpoint_group(self.dist, self.collective_timeout_s)

    # ------------------------------------------------------------ collectives
    # (each bounded: a peer that never answers raises CollectiveTimeoutError, roll_ckpt.runtime.distributed)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (used once per manager, never per save)."""
        if self.dist is None or self.world_size == 1:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.process_group)
        return box[0]

    def agree(self, error: BaseException | None, phase: str, step: int | None = None) -> None:
        """Raise on every process the error of the lowest rank that has one, as the roll-ckpt
        error that names that rank; return when none has (:mod:`roll_ckpt.runtime.distributed`).
        Every process calls it at the same point: one all-reduce of an integer (the lowest
        failing rank), then, only when one failed, a broadcast of its error."""
        dist, group = self.dist, self.process_group
        if dist is None or self.world_size == 1:
            if error is not None:
                raise error
            return
        if error is not None:
            error = from_rank(portable(error), self.rank, phase)
        with bounded(self.rank, phase, step, self.collective_timeout_s):
            first = all_reduce_ints(dist, [self.rank if error is not None else self.world_size],
                                    dist.ReduceOp.MIN, group)[0]
            if first == self.world_size:
                return
            box = [error if self.rank == first else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, first) if group is not None else first,
                                       group=group)
        found = box[0]
        if found is error:  # this rank's own: its traceback and cause
            raise found
        raise found from None

    def any_true(self, flag: bool, step: int | None = None) -> bool:
        """True on every process when ``flag`` is true on one (an all-reduce of one integer).

        On a gloo group of its own, created with the strategy: it never interleaves with the
        collectives of an asynchronous save still writing in the background, and works
        whatever backend the job's group uses.
        """
        if self.dist is None or self.world_size == 1:
            return flag
        if self._control is None:
            self._control = checkpoint_group(self.dist, self.collective_timeout_s)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        with bounded(self.rank, "maybe_save: the preemption check", step, self.collective_timeout_s):
            collective(self.dist.all_reduce, (t,), t, op=self.dist.ReduceOp.MAX, group=self._control)
        return bool(t.item())

    # ------------------------------------------------------------ state dicts

    def state_dict(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The DCP state dict of ``state``: live tensors, nothing copied."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        def build(key: str, obj: Any) -> dict[str, Any]:
            if isinstance(obj, torch.nn.Module):
                return get_model_state_dict(obj)
            return optimizer_state_dict(state[owners_of(state)[key]], obj)  # (a fresh one left fresh)

        for key in state:
            if not isinstance(key, str) or not key or "." in key or key == PER_RANK:
                raise RollCkptError(f"state key {key!r} must be a non-empty string without '.' "
                                    f"and not '{PER_RANK}'")
        builds = self.state_dicts.builds
        out: dict[str, Any] = self.state_dicts.get(state, build)
        if self.state_dicts.builds != builds and self.incremental:
            # (a hint only, so a later requires_grad change may wait for the next build)
            self.cold = cold_names(state)
        mine: dict[str, Any] = {RNG_KEY: capture_rng()}
        for key, obj in state.items():
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                continue
            if isinstance(obj, GlobalState):  # the job's: global entries under its key, like a module's
                out[key] = obj.state_dict()
            elif _is_stateful(obj):
                mine[key] = _box(obj.state_dict())
            else:
                mine[key] = _box(obj)
        out[PER_RANK] = {str(self.rank): mine}
        return out

    # ------------------------------------------------------------ a load's two ends (DCPIO.load reads between them)

    def load_targets(self, state: Mapping[str, Any], md: Any, dcp_path: str) -> tuple[dict[str, Any], str]:
        """A load's first step (then the read, :meth:`hand_over`): the state dict to load
        into, and the rank whose per-process values this process takes."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict, get_optimizer_state_dict, get_state_dict)

        owners = owners_of(state)
        target: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, torch.nn.Module) and (opt := sole_optimizer(owners, key)) is not None:
                # one call for the module and its optimizer: torch maps the parameters once
                target[key], target[opt] = get_state_dict(obj, state[opt])
            elif isinstance(obj, torch.nn.Module):
                target[key] = get_model_state_dict(obj)
            elif isinstance(obj, torch.optim.Optimizer) and sole_optimizer(owners, owners[key]) != key:
                # (its state made, if it had none: loaded into)
                target[key] = get_optimizer_state_dict(state[owners[key]], obj)
            elif isinstance(obj, GlobalState):  # its own dict: tensors loaded in place, values replaced
                target[key] = obj.state_dict()
        for key in owners:
            fit_target(target[key], key, md)
        self._names_before = {key: group_names(target[key]) for key in owners}  # (before the load replaces them)
        top, ranks = top_keys(md, PER_RANK)
        src = str(self.rank)  # whose per-process values (RNG, scheduler, data position) this process takes
        if src not in ranks:
            if "0" not in ranks:
                raise RollCkptError("the checkpoint holds no per-process state (RNG, scheduler...)")
            warnings.warn(f"roll-ckpt: the checkpoint was saved by fewer processes; rank {src} "
                          "takes rank 0's per-process state (RNG, scheduler, data position)", stacklevel=3)
            src = "0"
        target[PER_RANK] = {src: placeholders(md, (PER_RANK, src))}
        missing = [k for k in target if k != PER_RANK and k not in top]
        if missing:
            raise RollCkptError(f"the checkpoint at {dcp_path} has no entry for state key(s) "
                                f"{', '.join(missing)}; it holds {', '.join(sorted(top))}")
        return target, src

    def hand_over(self, state: MutableMapping[str, Any], target: dict[str, Any], src: str) -> None:
        """A load's last step: hand the loaded values to the modules, optimizers and objects of ``state``."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        owners = owners_of(state)
        before, self._names_before = self._names_before, {}
        for key, obj in state.items():
            if isinstance(obj, torch.nn.Module):
                in_place = loaded_in_place(obj, target[key])  # then loaded already: its load would copy onto itself
                opt = sole_optimizer(owners, key)
                if opt is not None and not in_place:  # one call: torch maps the parameters once
                    set_state_dict(obj, state[opt], model_state_dict=target[key], optim_state_dict=target[opt])
                elif opt is not None:
                    load_optimizer(obj, state[opt], target[opt], before.get(opt, []))
                elif not in_place:
                    set_model_state_dict(obj, target[key])
            elif isinstance(obj, torch.optim.Optimizer) and sole_optimizer(owners, owners[key]) != key:
                load_optimizer(state[owners[key]], obj, target[key], before.get(key, []))
            elif isinstance(obj, GlobalState):
                obj.load_state_dict(target[key])
        loaded = target[PER_RANK][src]
        for key, obj in list(state.items()):
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, GlobalState)):
                continue
            if key not in loaded:
                warnings.warn(f"roll-ckpt: the checkpoint has no saved value for state['{key}']; "
                              "it keeps its current value", stacklevel=4)
                continue
            value = _unbox(loaded[key])
            if _is_stateful(obj):
                obj.load_state_dict(value)
            elif isinstance(obj, dict) and isinstance(value, dict):
                obj.clear()
                obj.update(value)
            else:
                state[key] = value
        if RNG_KEY in loaded:
            restore_rng(loaded[RNG_KEY])

    def close(self) -> None:
        self.state_dicts.clear()


class DCPIO(StrategyIO):
    """The :class:`~roll_ckpt.contracts.StrategyIO` of :class:`DCPStrategy` (and of the
    strategies built on it): writes and reads standard DCP folders, each file checked.

    What it keeps across saves: the layout of the last full save (repeated by saves of the
    same structure, :class:`roll_ckpt.dcp.writer.FixedLayouts`), the base of incremental saves
    (:class:`roll_ckpt.dcp.writer.Increments`), DCP's write items, and the checkpoint the last
    resume loaded, which the next save starts from.
    """

    def __init__(self, strategy: DCPStrategy) -> None:
        self.strategy = strategy
        self._estimate: tuple[int, Any] = (-1, None)
        self._write_items: dict[bool, dict] = {}  # DCP's write items kept across saves (ReusingSavePlanner)
        self.layouts: FixedLayouts | None = None
        """The layout of the last full save, repeated by saves of the same structure; made by the first save."""
        self.increments: Increments | None = None
        """The newest committed checkpoint, which a save takes unchanged files over from
        (:mod:`roll_ckpt.dcp.writer`); made by the first save, as :attr:`layouts` is."""
        self.resumed_from: tuple[Storage, str, dict[str, Any], tuple[bytes, str] | None] | None = None
        """The checkpoint the last resume loaded, which the next save starts from: its storage,
        DCP folder and manifest entries (the base of incremental saves) and its ``.metadata``
        bytes and checksum (the layout to repeat, where it fits). A resume records it only; the
        save makes of it what it uses (:meth:`_start_saving`)."""

    def _start_saving(self) -> None:
        """What saves keep across saves (:mod:`roll_ckpt.dcp.writer`), made by the first save,
        then brought to the checkpoint a resume loaded since (:attr:`resumed_from`)."""
        if self.layouts is None:
            strategy = self.strategy
            self.layouts = FixedLayouts(strategy.dist, strategy.rank, strategy.world_size)
            self.increments = Increments(strategy.incremental)
        if self.resumed_from is not None:
            (storage, dcp_path, files, layout), self.resumed_from = self.resumed_from, None
            self.increments.seed(storage, dcp_path, files)
            if layout is not None:
                self.layouts.adopt_later(*layout)

    # ------------------------------------------------------------ write

    def write(self, sd: dict[str, Any], storage: Storage, dcp_path: str,
              on_bytes: Any = None, *, save: Any = None, alone: bool = False) -> dict[str, tuple]:
        """Write ``sd`` as a standard DCP folder; returns per-file (size, checksum) on the coordinator.

        A save of the last full save's structure repeats its layout and ``.metadata`` with
        a fixed-size message per process (:mod:`roll_ckpt.dcp.writer`); any other takes
        DCP's protocol.
        ``alone``: this process writes a DCP folder of its own, without any collective
        (the fast recovery tier's unit): its metadata lists only this process's chunks, and
        replicated values are written in full, so it loads without any other process's files.
        """
        from ..dcp.writer import ReusingSavePlanner

        strategy = self.strategy
        if self.layouts is None or self.resumed_from is not None:  # the first save, or the first after a resume
            self._start_saving()
        self.increments.cold = strategy.cold
        gate = getattr(save, "gate", None)
        threads = 1 if gate is not None else self.writer_threads(_local_bytes(sd))
        # the collector is held off while DCP plans, gathers and writes .metadata; the
        # writer lets go of it while it writes the data (roll_ckpt.runtime.collector)
        pause = CollectorPause(strategy.config.checkpoint_config.pause_gc)
        options = {"thread_count": threads, "on_bytes": on_bytes, "gate": gate, "pause": pause}
        step = getattr(save, "step", None)
        after = f"Nothing of checkpoint-{step} was committed; earlier ones are intact."
        with warnings.catch_warnings(), pause, bounded(strategy.rank, "save: writing", step, strategy.collective_timeout_s, after):
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            # (each writer from the increments anew: what one takes over is its own)
            writer = self.increments.writer(storage, dcp_path, alone, **options)
            if not alone:  # a save of the last full save's structure: a fixed-size message per process
                digests = self._write_fixed(sd, writer, threads, gate)
                if digests is not None:
                    return digests
                tried = writer
                writer = self.increments.writer(storage, dcp_path, False, **options)
                for name in tried.take.taken if tried.take else ():  # a link is never written through
                    storage.remove(storage.join(dcp_path, name))
            planner = ReusingSavePlanner(self._write_items.setdefault(alone, {}))
            dcp_save(sd, storage_writer=writer, planner=planner, **self._dcp_group(alone))
            if not alone:
                self.layouts.record(planner, writer, threads)
                for name in set(tried.written) - set(writer.written):  # a layout written, then redone
                    storage.remove(storage.join(dcp_path, name))
        return writer.file_digests

    def _write_fixed(self, sd: dict[str, Any], writer: Any, threads: int, gate: Any) -> dict[str, tuple] | None:
        """The save at the last full save's offsets (:mod:`roll_ckpt.dcp.writer`): the
        coordinator's file digests, or ``None`` when it takes DCP's full path."""
        from ..dcp.writer import ReusingSavePlanner

        strategy, layouts = self.strategy, self.layouts
        if layouts.layout is None and layouts.resumed is None:  # then on no process: DCP's protocol
            return None
        if layouts.layout is None:  # the first save after a resume: the checkpoint's layout, if it fits
            planner = ReusingSavePlanner(self._write_items.setdefault(False, {}))
            planner.set_up_planner(sd, None, strategy.is_coordinator)
            layouts.adopt(planner, threads, strategy.process_group)
            if layouts.layout is None:
                return None
        try:
            fast = layouts.prepare(sd, threads, gate, strategy.is_coordinator)
        except Exception:  # a state this rank cannot lay out as before: DCP's full path, on every rank
            fast = None
        return layouts.save(fast, writer, strategy.process_group)

    def estimate(self, sd: dict[str, Any], user: Mapping[str, Any] | None = None) -> SpaceEstimate:
        """The size of a save of ``sd`` (every process's files). The modules' and optimizers'
        part is estimated once per structure of the state (:class:`StateDictCache`)."""
        from ..tiers.space import estimate_checkpoint_bytes, estimate_items

        strategy = self.strategy
        if self._estimate[0] != strategy.state_dicts.builds:
            tensors = {k: v for k, v in sd.items() if k != PER_RANK}
            self._estimate = (strategy.state_dicts.builds, estimate_items(tensors, world_size=strategy.world_size))
        return estimate_checkpoint_bytes({PER_RANK: sd[PER_RANK]}, world_size=strategy.world_size, user=user,
                                         base=self._estimate[1])

    def writer_threads(self, nbytes: int = 0) -> int:
        """Files this process writes at once (DCP's ``thread_count``) for ``nbytes`` of tensors.

        Two from 64 MiB on: one thread's CPU work (serializing, hashing, copying into the
        page cache) overlaps the other's wait on the disk, and the disk gets two streams.
        Below that the second file only adds a file to sync.
        """
        return 2 if nbytes >= 64 << 20 else 1

    def _dcp_group(self, alone: bool) -> dict[str, Any]:
        """DCP's ``process_group``/``no_dist`` for a folder of the job (``alone``: of this process only).

        A job of one process saves without DCP's collectives too: over a group of one they
        only pickle and unpickle the plans, the write results and the metadata (about 60 ms
        per save at 2,300 tensors), with the same folder as the result."""
        strategy = self.strategy
        if alone or strategy.dist is None or strategy.world_size == 1:
            return {"process_group": None, "no_dist": True}
        return {"process_group": strategy.process_group, "no_dist": False}

    # ------------------------------------------------------------ read

    def load(self, state: MutableMapping[str, Any], storage: Storage, dcp_path: str,
             on_bytes: Any = None, *, files: Mapping[str, Any] | None = None,
             checkpoint: str | None = None, stream: bool = False, alone: bool = False) -> None:
        """Load the DCP folder at ``dcp_path`` into ``state`` in place.

        ``files`` (the manifest's entries for this folder, by name) makes every file be
        checked as it is read, before anything of it is deserialized; a mismatch raises
        :class:`~roll_ckpt.errors.CheckpointCorruptError` on every rank with ``state``
        untouched. Without it the folder must have been verified already. ``alone``: a folder
        this process wrote alone (``write(alone=True)``), loaded without collectives. ``stream``:
        one pass, each piece checked just before its bytes are used (:mod:`roll_ckpt.dcp.checked`);
        damage then raises :class:`~roll_ckpt.errors.PartlyLoadedError`."""
        from ..dcp.reader import SafeReader

        strategy = self.strategy
        reader = SafeReader(storage, dcp_path, on_bytes, files=files, checkpoint=checkpoint, stream=stream)
        step = parse_step(basename(parent(dcp_path)))
        # The collector is held off as during a save (planning and state dicts allocate per tensor);
        # the reader and its metadata go before it is back on (or its first collection walks them).
        with CollectorPause(strategy.config.checkpoint_config.pause_gc), \
                bounded(strategy.rank, "resume: loading", step, strategy.collective_timeout_s):
            try:
                if alone:  # a folder this process wrote alone: its own files, checked as DCP plans the load
                    if files:
                        reader.start_checks(sorted(n for n in files if n.startswith(f"__{strategy.rank}_")
                                                   and n.endswith(".distcp")))
                    md = reader.read_metadata()
                    target, src = strategy.load_targets(state, md, dcp_path)
                    read_dcp(target, reader, md)
                    strategy.hand_over(state, target, src)
                    return
                self._load_job(state, reader, storage, dcp_path, files, step)
            finally:
                reader.release()  # the checked files, kept open across the loads below
                del reader

    def _load_job(self, state: MutableMapping[str, Any], reader: Any, storage: Storage, dcp_path: str,
                  files: Mapping[str, Any] | None, step: int | None) -> None:
        """A folder of the job (the pieces: dcp/reader.py, "the job's load"): ``.metadata`` read once, each file checked by
        one process before any process reads it; an error anywhere is raised everywhere."""
        # .metadata read and checked by the coordinator alone, unpickled by every process
        strategy = self.strategy
        path = storage.join(dcp_path, METADATA_NAME)
        md_bytes = decide(strategy, reader.metadata_bytes, where=f"cannot read {path}", phase="resume: reading .metadata")
        md = safe_load_metadata(md_bytes, path)
        error: BaseException | None = None
        try:
            mine = assigned_files(files, strategy.rank, strategy.world_size) if files else []
            if mine:
                reader.start_checks(mine)  # the disk works while the target is built
            target, src = strategy.load_targets(state, md, dcp_path)
            if files:
                reader.check_files(mine)
                reader.checked = True
        except Exception as exc:
            error = exc
        strategy.agree(error, "resume: checking the files", step)  # every check passed before any read
        try:
            read_dcp(target, reader, md)
        except Exception as exc:
            error = exc
        strategy.agree(error, "resume: loading", step)
        try:
            strategy.hand_over(state, target, src)
        except Exception as exc:  # e.g. a stateful object refusing its value: before the agreement
            error = exc
        strategy.agree(error, "resume: handing the values over", step)
        layout = (md_bytes, files[METADATA_NAME].checksum) if files is not None and METADATA_NAME in files else None
        self.resumed_from = (storage, dcp_path, dict(files or {}), layout)  # the next save starts from it

    def close(self) -> None:
        self.layouts = self.increments = self.resumed_from = None
        self._write_items.clear()


DCPStrategy.io_class = DCPIO  # (set here: the strategy's class comes first in this module, its I/O second)


def _local_bytes(node: Any) -> int:
    """Bytes of the tensors (local shards of DTensors) this process would write for ``node``."""
    if isinstance(node, torch.Tensor):
        t = local_tensor(node)
        return t.numel() * t.element_size()
    if isinstance(node, Mapping):
        return sum(_local_bytes(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return sum(_local_bytes(v) for v in node)
    return 0


def _box(value: Any) -> Any:
    """One DCP leaf for a per-process value, so its structure survives exactly.

    DCP flattens mappings into paths of strings: empty dicts vanish and ``{0: x}`` comes
    back as ``{"0": x}``. A tuple is a single leaf to DCP (written with ``torch.save``,
    read with ``weights_only=True``), so a value boxed in a 1-tuple round-trips as it was.
    Tensors stay tensors.
    """
    return value if isinstance(value, torch.Tensor) else (value,)


def _unbox(value: Any) -> Any:
    return value[0] if isinstance(value, tuple) and len(value) == 1 else value


# ---- the state-dict cache --------------------------------------------------


def structure_of(state: Mapping[str, Any]) -> tuple:
    """What a cached state dict depends on: the identity of every tensor it holds."""
    parts: list[Any] = []
    for key, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            parts.append((key, id(obj), module_tensor_ids(obj)))
        elif isinstance(obj, torch.optim.Optimizer):
            parts.append((key, id(obj), len(obj.param_groups),
                          tuple((id(p), tuple(st), tuple(map(id, st.values()))) for p, st in obj.state.items())))
    return tuple(parts)


class StateDictCache:
    """The state dicts of a state's modules and optimizers, kept while its structure lasts."""

    def __init__(self) -> None:
        self._structure: tuple | None = None
        self._dicts: dict[str, dict[str, Any]] = {}
        self.builds = 0
        """How often the dicts were built (a test can tell a reuse from a rebuild)."""

    def get(self, state: Mapping[str, Any], build: Callable[[str, Any], dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``{key: state dict}`` for every module and optimizer of ``state``; ``build(key, obj)``
        makes one when the structure changed."""
        if structure_of(state) != self._structure:
            self._dicts = {key: build(key, obj) for key, obj in state.items()
                           if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))}
            # after the build: building an optimizer's state dict may create its state
            self._structure = structure_of(state)
            self.builds += 1
            return dict(self._dicts)
        out = dict(self._dicts)
        for key, obj in state.items():
            if isinstance(obj, torch.optim.Optimizer):
                out[key] = _with_current_groups(self._dicts[key], obj)
        return out

    def clear(self) -> None:
        self._structure, self._dicts = None, {}


def _with_current_groups(osd: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """``osd`` with its ``param_groups`` as the optimizer has them now (learning rates move)."""
    groups = [{**{k: v for k, v in live.items() if k != "params"}, "params": saved["params"]}
              for live, saved in zip(optimizer.param_groups, osd["param_groups"])]
    return {**osd, "param_groups": groups}


# ---- optimizers ------------------------------------------------------------

def optimizer_state_dict(module: Any, optimizer: Any) -> dict[str, Any]:
    """``get_optimizer_state_dict(module, optimizer)``; an optimizer with no state yet is left
    without one, and its state dict holds its ``param_groups`` and an empty ``state``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fresh = not optimizer.state
    osd = get_optimizer_state_dict(module, optimizer)
    if fresh:
        optimizer.state.clear()  # Optimizer.state is a defaultdict: lazily made again at the first step
        osd = {**osd, "state": {}}
    return osd


def fit_target(osd: dict[str, Any], key: str, md: Any) -> None:
    """An optimizer's load target (``osd``: ``get_optimizer_state_dict`` of the live one, its state
    made if it had none, to be loaded into) made
    to what the checkpoint under ``key`` holds: no ``state`` when it was saved with none (the
    optimizer's ``load_state_dict`` then leaves the live one fresh), and none of the
    hyperparameters it does not hold -- ones a later torch added (AdamW's
    ``decoupled_weight_decay`` from 2.7 on, absent from a torch 2.6 checkpoint), which the
    optimizer's ``load_state_dict`` gives their default, as for any state dict an older torch wrote."""
    saved = md.state_dict_metadata
    if not any(name.startswith(f"{key}.state.") for name in saved):
        osd["state"] = {}
    for i, group in enumerate(osd.get("param_groups", [])):
        for name in [n for n in group if n != "params" and f"{key}.param_groups.{i}.{n}" not in saved]:
            del group[name]


def owners_of(state: Mapping[str, Any]) -> dict[str, str]:
    """For each optimizer key of ``state``, the key of the module that owns its parameters."""
    import torch

    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    owners: dict[str, str] = {}
    for key, opt in state.items():
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        first = next((p for g in opt.param_groups for p in g["params"]), None)
        for mkey, mod in modules.items():
            if first is not None and any(p is first for p in mod.parameters()):
                owners[key] = mkey
                break
        else:
            raise RollCkptError(
                f"state['{key}'] is an optimizer whose parameters belong to no module in the "
                "state; put the model in the same state dict (e.g. state={'model': model, "
                f"'{key}': optimizer}})"
            )
    return owners


def sole_optimizer(owners: Mapping[str, str], module_key: str) -> str | None:
    """The key of the one optimizer of the module under ``module_key`` (``owners``: :func:`owners_of`);
    ``None`` for none or several."""
    mine = [opt for opt, mod in owners.items() if mod == module_key]
    return mine[0] if len(mine) == 1 else None


def group_names(osd: Any) -> list[list[str]]:
    """An optimizer state dict's parameter names, group by group (taken before a load
    replaces them with the checkpoint's, for :func:`load_optimizer`)."""
    groups = osd.get("param_groups", ()) if isinstance(osd, Mapping) else ()
    return [list(g.get("params", ())) for g in groups]


def load_optimizer(module: Any, optimizer: Any, osd: dict[str, Any], names_before: list[list[str]]) -> None:
    """Hand a loaded optimizer state dict (``get_optimizer_state_dict``'s, filled by the load)
    to ``optimizer``: where the load filled its own state in place, only the groups'
    hyperparameters are left to take; else torch's ``set_optimizer_state_dict``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from ..runtime.torch_compat import optimizer_loaded_in_place, take_param_groups

    if optimizer_loaded_in_place(optimizer, osd, names_before):
        take_param_groups(optimizer, osd)
    else:
        set_optimizer_state_dict(module, optimizer, osd)
