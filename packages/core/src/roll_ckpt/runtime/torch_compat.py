"""Every private torch API roll-ckpt uses, in one place.

Each accessor notes the torch versions it was checked on. When torch changes one of
them, the accessor raises :class:`TorchCompatError` naming the API and the installed
torch version, instead of a bare ``AttributeError`` deep inside a save. Nothing here
patches torch: every override is scoped to roll-ckpt's own writer and reader.

Importing this module imports torch (not ``torch.distributed``); DCP's modules are
imported by the accessors that need them.
"""

from __future__ import annotations

import functools
import pickle
import time
import types
from typing import Any, Callable, Mapping

import torch

from ..errors import TorchCompatError

__all__ = ["TorchCompatError", "fsdp2_options", "gloo_averages", "local_tensor", "set_local_tensor", "rewrap_dtensor", "save_tensor_without_crc",
           "serializes_plainly", "create_write_items",
           "weights_only_load", "file_reader", "storage_info", "transform_descriptors", "dcp_format_version", "set_element", "get_element",
           "dcp_save", "load_state_dict_no_dist", "module_tensor_ids", "empty_state_dict_load_planner", "planner_set_value", "storage_prefix",
           "local_chunk", "loaded_in_place", "optimizer_loaded_in_place",
           "take_param_groups", "local_load_plan", "collective", "all_reduce_ints", "CHECKED_ON",
           "default_stager", "process_mode", "caching_save_planner", "without_collectives", "compare_save_plans", "storage_prefix_record",
           "set_plan_cache_key", "cached_local_plan", "forget_cached_plans", "numpy_arrays_admitted"]

CHECKED_ON = ("2.6", "2.8", "2.10", "2.11", "2.13", "2.14")
"""torch releases the whole suite ran on: the legs of ``make test-matrix`` (``matrix/results/``;
``tests/compat/test_seams.py`` keeps them equal)."""


def _missing(api: str, exc: BaseException) -> TorchCompatError:
    return TorchCompatError(
        f"torch {torch.__version__} lacks {api} ({type(exc).__name__}: {exc}), which roll-ckpt uses "
        f"(the suite ran on torch {', '.join(CHECKED_ON)}); install one of those torch versions or a "
        "roll-ckpt release that supports this one")


# --------------------------------------------------------------------------- FSDP2 on the CPU


_OLD_CPU_FSDP2 = not hasattr(torch.cpu.Stream, "record_event")
"""torch 2.6 (before :func:`fsdp2_options` adds the stubs)."""


def fsdp2_options(device_type: str) -> dict[str, Any]:
    """The ``fully_shard`` keyword arguments FSDP2 needs to train on ``device_type`` with this
    torch: ``{}`` everywhere but on the CPU (gloo) with torch 2.6, whose FSDP2 was not yet made
    to run there.

    torch 2.6's CPU stream stub (``torch.cpu.Stream``) lacks the no-op ``record_event`` and
    ``wait_event`` that torch 2.7 added for FSDP2 (pytorch PR 145935; CPU work is synchronous,
    so there is nothing to wait for): they are added to the stub here, as torch 2.8-2.14 have
    them. Its backward then fails the autograd version check when parameters were resharded
    after the forward pass (the all-gather of the backward writes into the buffer the forward's
    views saved), so on 2.6 the parameters stay unsharded until the backward ends
    (``reshard_after_forward=False``): what a checkpoint sees between steps, the sharded
    parameters and optimizer state, is the same. roll-ckpt's saves and loads never need this;
    the demo's, the example's, the benchmark's and the tests' CPU jobs call it."""
    if device_type != "cpu" or not _OLD_CPU_FSDP2:
        return {}
    torch.cpu.Stream.record_event = lambda self: None  # type: ignore[attr-defined]
    torch.cpu.Stream.wait_event = lambda self, event: None  # type: ignore[attr-defined]
    return {"reshard_after_forward": False}


def gloo_averages() -> bool:
    """Whether gloo's all-reduce takes ``ReduceOp.AVG``, with which FSDP2's HSDP averages
    gradients over the replicas: torch 2.8-2.14; torch 2.6's gloo refuses it ("Cannot use
    ReduceOp.AVG with Gloo"), so HSDP with replicas cannot train on its CPU."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 8)


# --------------------------------------------------------------------------- DTensor internals


def local_tensor(t: Any) -> Any:
    """The local shard of a DTensor itself (not a view: ``to_local()`` may wrap it for
    autograd), or ``t`` when it is a plain tensor. ``DTensor._local_tensor``: torch 2.6-2.14."""
    return getattr(t, "_local_tensor", t)


def set_local_tensor(t: Any, local: Any) -> None:
    """Swap a DTensor's local shard (the offload store releases memory this way;
    ``DTensor._local_tensor``, torch 2.6-2.14)."""
    if not hasattr(t, "_local_tensor"):
        raise _missing("DTensor._local_tensor", AttributeError("_local_tensor"))
    t._local_tensor = local


def local_chunk(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where this process's shard of the DTensor ``t`` lies in the global tensor: its
    ``(offsets, sizes)``, for any placements (``Shard``, ``Replicate``, FSDP2's strided
    shards). ``DTensor.__create_chunk_list__``, the call DCP's planner makes for every
    DTensor it saves (since torch 2.2; ran on torch 2.6-2.14, with uneven and empty shards)."""
    try:
        chunks = t.__create_chunk_list__()
    except AttributeError as exc:
        raise _missing("DTensor.__create_chunk_list__", exc) from None
    if len(chunks) != 1:
        raise _missing("DTensor.__create_chunk_list__ (one chunk per process)",
                       ValueError(f"{len(chunks)} chunks"))
    return tuple(chunks[0].offsets), tuple(chunks[0].sizes)


def optimizer_loaded_in_place(optim: Any, osd: Mapping[str, Any], names_before: list[list[str]]) -> bool:
    """True when the optimizer's state was loaded into its own per-parameter dicts and only its
    groups' hyperparameters are left to take: ``osd`` is ``get_optimizer_state_dict``'s (its
    ``state`` the live per-parameter dicts, filled in place), the checkpoint's groups list the
    same parameter names in the same order as ``names_before`` (the groups before the load)
    with the same keys, and nothing of the optimizer's own load would run that this skips: its
    class keeps ``Optimizer.load_state_dict`` and it has no load hooks. Then
    ``set_optimizer_state_dict`` would re-map every parameter (``_verify_options``: ~25 ms at
    3,000 tensors) to put each tensor back where it is. ``Optimizer.state``/``param_groups``/
    ``_optimizer_load_state_dict_pre_hooks``/``_post_hooks``: torch 2.6-2.14."""
    try:
        if type(optim).load_state_dict is not torch.optim.Optimizer.load_state_dict:
            return False
        if optim._optimizer_load_state_dict_pre_hooks or optim._optimizer_load_state_dict_post_hooks:
            return False
        groups, saved = optim.param_groups, osd.get("param_groups")
        if not isinstance(saved, list) or len(saved) != len(groups) or len(names_before) != len(groups):
            return False
        for group, new, before in zip(groups, saved, names_before):
            if list(new.get("params", ())) != before or len(before) != len(group["params"]):
                return False
            if set(new) - {"param_names"} != set(group) - {"param_names"}:
                return False
        live = {id(d) for d in optim.state.values()}
        loaded = osd.get("state")
        return isinstance(loaded, Mapping) and len(loaded) == len(live) and all(
            id(d) in live for d in loaded.values())
    except AttributeError as exc:
        raise _missing("Optimizer.state / param_groups / load-state-dict hooks", exc) from None


def take_param_groups(optim: Any, osd: Mapping[str, Any]) -> None:
    """The checkpoint's hyperparameters into the optimizer's groups (what ``load_state_dict``
    does to them), its parameters left as they are; after :func:`optimizer_loaded_in_place`.
    ``Optimizer.param_groups``: torch 2.6-2.14."""
    import copy

    for group, new in zip(optim.param_groups, osd["param_groups"]):
        for key, value in new.items():
            if key not in ("params", "param_names"):
                group[key] = copy.deepcopy(value)


def loaded_in_place(module: Any, sd: Mapping[str, Any]) -> bool:
    """True when ``module.load_state_dict(sd)`` would only copy each tensor onto itself: every
    value of ``sd`` a tensor over the memory of one of the module's own parameters or buffers
    (its live state dict, which a load filled in place), no module overriding
    ``_load_from_state_dict`` outside ``torch.nn``, and no load hook but FSDP2's, which
    re-point its shards after a load that replaced them (none did). A resume then skips the
    hand-over: at 3,000 DTensors, 35 ms of ``copy_`` through DTensor's dispatch.
    ``nn.Module._parameters``/``_buffers``/``_load_state_dict_pre_hooks``/``_load_state_dict_post_hooks``
    (a pre hook wrapped in ``_WrappedHook.hook``), ``DTensor._local_tensor``: torch 2.6-2.14."""
    live = set()
    try:
        for m in module.modules():
            cls = type(m)._load_from_state_dict
            if cls is not torch.nn.Module._load_from_state_dict and not cls.__module__.startswith("torch.nn."):
                return False
            hooks = [getattr(h, "hook", h) for h in m._load_state_dict_pre_hooks.values()]
            hooks += list(m._load_state_dict_post_hooks.values())
            if any(not getattr(h, "__module__", "").startswith("torch.distributed.fsdp.") for h in hooks):
                return False
            for t in (*m._parameters.values(), *m._buffers.values()):
                if t is not None:
                    t = getattr(t, "_local_tensor", t)
                    live.add((t.data_ptr(), t.dtype, t.shape, t.stride()))
    except AttributeError as exc:
        raise _missing("nn.Module._parameters / _buffers / load-state-dict hooks", exc) from None
    for v in sd.values():
        if not isinstance(v, torch.Tensor):
            return False
        t = getattr(v, "_local_tensor", v)
        if t.numel() and (t.data_ptr(), t.dtype, t.shape, t.stride()) not in live:
            return False
    return True


def local_load_plan(state_dict: Mapping[str, Any], metadata: Any) -> Any:
    """DCP's strict ``create_default_local_load_plan`` with a DTensor's reads planned once per
    mesh, global shape, placements and saved chunks instead of once per tensor (they depend on
    nothing else but the name): at 3,000 FSDP2 tensors of a few shapes, 2/3 of a resume's planning. Unlike
    ``DefaultLoadPlanner.create_local_plan`` it never retries with torch 2.3's flattened keys
    (roll-ckpt reads nothing written before torch 2.6). ``planner_helpers._create_read_items``
    and ``create_read_items_for_chunk_list``, ``DTensor.__create_chunk_list__``: torch 2.6-2.14."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.checkpoint.planner_helpers import _create_read_items, create_read_items_for_chunk_list
    except ImportError as exc:
        raise _missing("torch.distributed.checkpoint.planner_helpers._create_read_items", exc) from None
    saved = metadata.state_dict_metadata
    reads: dict[tuple, list[Any]] = {}
    on_mesh: dict[int, bool] = {}
    requests: list[Any] = []
    for fqn, obj in state_dict.items():
        md = saved.get(fqn)
        if md is None:
            raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")  # DCP's own words
        if not isinstance(md, TensorStorageMetadata) or not isinstance(obj, DTensor) \
                or type(obj._local_tensor) is not torch.Tensor or any(p.is_partial() for p in obj.placements):
            if isinstance(md, TensorStorageMetadata) and isinstance(obj, torch.Tensor) and md.size != obj.size():
                raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
            if not isinstance(obj, DTensor) or obj.device_mesh.get_coordinate() is not None:
                requests += _create_read_items(fqn, md, obj)
            continue
        if md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        mesh = obj.device_mesh
        if not on_mesh.setdefault(id(mesh), mesh.get_coordinate() is not None):
            continue  # this process holds no part of it (a submesh)
        key = (id(mesh), obj.shape, tuple(obj.placements), tuple((c.offsets, c.sizes) for c in md.chunks))
        if key not in reads:  # the reads of every tensor of this shape, but for its name
            reads[key] = create_read_items_for_chunk_list(fqn, md, obj.__create_chunk_list__())
        requests += [ReadItem(type=r.type, dest_index=MetadataIndex(fqn, r.dest_index.offset, r.dest_index.index),
                              dest_offsets=r.dest_offsets, storage_offsets=r.storage_offsets, lengths=r.lengths,
                              storage_index=MetadataIndex(fqn, r.storage_index.offset, r.storage_index.index))
                     for r in reads[key]]
    return LoadPlan(requests)


def rewrap_dtensor(like: Any, local: Any) -> Any:
    """A DTensor over ``local`` with ``like``'s mesh, placements, global shape and stride
    (public ``DTensor.from_local``; its ``shape``/``stride`` arguments exist since torch 2.4; ran on 2.6-2.14)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def module_tensor_ids(module: Any) -> tuple[tuple[int, int], ...]:
    """The identity of every parameter and buffer of ``module`` and its submodules, and of
    the storage it uses, in one pass (``nn.Module._parameters``/``_buffers``, a DTensor's
    ``_local_tensor``, ``UntypedStorage._cdata``): what a cached state dict depends on,
    compared on every save, so it must be cheap; torch 2.6-2.14. The storage catches
    ``p.data = other`` (the same parameter over other memory, which the cached state
    dict's views do not see); a storage resized in place (offloaded, then brought back)
    stays the same storage, and the views follow it."""
    try:
        return tuple((id(t), _storage_id(getattr(t, "_local_tensor", t)))
                     for m in module.modules() for d in (m._parameters, m._buffers)
                     for t in d.values() if t is not None)
    except AttributeError as exc:
        raise _missing("nn.Module._parameters / _buffers", exc) from None


def _storage_id(t: Any) -> int:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): its identity alone
        return 0


# --------------------------------------------------------------------------- serialization


class _PicklerFactory(type):
    """The metaclass of the ``Pickler`` handed to ``torch.serialization._save``.

    ``_save`` subclasses ``pickle_module.Pickler`` on every call (``class PyTorchPickler``,
    to give it a ``persistent_id`` method): a class object per tensor written, freed only
    by the cyclic garbage collector (about 9 objects in reference cycles per tensor). A
    checkpoint of thousands of tensors then set off collections that scan the whole heap,
    hundreds of milliseconds each with a large model in memory, holding the GIL in the
    writer thread or falling into ``save`` itself. Here that subclass is a factory
    instead: one pickler class, made once, whose ``persistent_id`` calls the one ``_save``
    defined; nothing in a cycle. (An instance attribute ``persistent_id`` on a plain
    pickler did the same on Python 3.10-3.12; 3.13 made that attribute read-only.)
    """

    def __new__(mcls, name: str, bases: tuple, namespace: dict) -> Any:
        persistent_id = namespace.get("persistent_id")
        if persistent_id is None or not any(isinstance(b, _PicklerFactory) for b in bases):
            return super().__new__(mcls, name, bases, namespace)

        def make(file: Any, protocol: int | None = None) -> Any:
            return _DelegatingPickler(file, protocol, functools.partial(persistent_id, None))  # (its self is unused)

        return make


class _DelegatingPickler(pickle.Pickler):
    def __init__(self, file: Any, protocol: int | None, persistent_id: Callable[[Any], Any]) -> None:
        super().__init__(file, protocol=protocol)
        self._persistent_id = persistent_id

    def persistent_id(self, obj: Any) -> Any:
        return self._persistent_id(obj)


class _Pickler(pickle.Pickler, metaclass=_PicklerFactory):
    pass


_PICKLE = types.SimpleNamespace(Pickler=_Pickler)
"""What ``_save`` is given as its ``pickle_module`` (it only reads ``Pickler``)."""


def save_tensor_without_crc(tensor: torch.Tensor, stream: Any) -> None:
    """``torch.save(tensor, stream)``, but without torch's per-record CRC-32.

    The bytes are what ``torch.save`` writes with ``set_crc32_options(False)``, which
    ``torch.load`` reads; roll-ckpt's files are covered by the manifest's xxh3-128, computed
    in the same pass, and the CRC-32 costs about as much CPU as copying the data. Only this
    call skips it: other ``torch.save`` calls keep torch's setting. Its pickler is a plain
    one (:data:`_PICKLE`): no class is made per tensor.
    ``torch.serialization._save`` / ``torch._C.PyTorchFileWriter``: torch 2.6-2.14
    (``_get_storage_alignment`` and the writer's alignment argument: 2.8-2.14).
    """
    import torch.serialization as ser

    try:
        if hasattr(ser, "_get_storage_alignment"):  # torch 2.8-2.14: torch.serialization's setting
            writer = torch._C.PyTorchFileWriter(stream, False, ser._get_storage_alignment())
        else:  # torch 2.6: storages aligned to 64 bytes, not configurable
            writer = torch._C.PyTorchFileWriter(stream, False)
        save = ser._save
    except (AttributeError, TypeError) as exc:
        raise _missing("torch.serialization._save / PyTorchFileWriter(stream, compute_crc32, alignment)",
                       exc) from None
    try:
        save(tensor, writer, _PICKLE, ser.DEFAULT_PROTOCOL, False)
    except BaseException:
        # A failed write (a full disk) leaves the writer unfinished: its destructor, whenever the
        # failed frame is freed, would write the zip's end into the failed stream and abort the
        # process (c10::Error "unexpected pos"). Finishing it here marks it finished even when
        # this write fails too, so the destructor does nothing.
        try:
            writer.write_end_of_file()
        except Exception:
            pass
        raise
    writer.write_end_of_file()


def serializes_plainly(t: Any) -> bool:
    """Whether ``torch.save`` frames ``t`` as it frames any plain tensor of its dtype, shape
    and stride, with the tensor's own bytes as the one record (what
    :mod:`roll_ckpt.dcp.files` relies on): a ``torch.Tensor`` (no subclass), strided,
    contiguous, on the CPU, not empty, not quantized, without autograd and without the
    conjugate/negative bits or any other entry of ``torch._C._get_tensor_metadata``, not a
    zero tensor (``_is_zerotensor``, which has no memory). Ran on torch 2.6-2.14."""
    try:
        return (type(t) is torch.Tensor and t.layout is torch.strided and t.device.type == "cpu"
                and not t.requires_grad and not t.is_quantized and t.is_contiguous() and t.numel() > 0
                and not t._is_zerotensor() and not torch._C._get_tensor_metadata(t))
    except AttributeError as exc:
        raise _missing("Tensor._is_zerotensor / torch._C._get_tensor_metadata", exc) from None


def file_reader(stream: Any) -> Any:
    """``torch._C.PyTorchFileReader`` over a seekable stream (torch 2.6-2.14)."""
    try:
        return torch._C.PyTorchFileReader(stream)
    except AttributeError as exc:
        raise _missing("torch._C.PyTorchFileReader", exc) from None


def weights_only_load(reader: Any, overall_storage: Any) -> Any:
    """``torch.load(weights_only=True)`` of a zip record set, its storages taken from
    ``overall_storage`` (the mechanism behind ``torch.load(mmap=True)``):
    ``torch.serialization._load(..., overall_storage=)`` and ``_weights_only_unpickler``,
    torch 2.6-2.14."""
    import torch.serialization as ser

    try:
        load, unpickler = ser._load, ser._weights_only_unpickler
    except AttributeError as exc:
        raise _missing("torch.serialization._load / _weights_only_unpickler", exc) from None
    return load(reader, "cpu", unpickler, overall_storage=overall_storage, encoding="utf-8")


# --------------------------------------------------------------------------- DCP internals


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's per-item storage record (``filesystem._StorageInfo``, torch 2.6-2.14; its
    ``transform_descriptors`` field, 2.8-2.14, keeps its default)."""
    try:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
    except ImportError as exc:
        raise _missing("torch.distributed.checkpoint.filesystem._StorageInfo", exc) from None
    return _StorageInfo(relative_path, offset, length)


def transform_descriptors(info: Any) -> Any:
    """The stream transforms DCP applied to an item's bytes (``_StorageInfo.transform_descriptors``,
    torch 2.8-2.14: ``None`` or empty for plain bytes); torch 2.6 has no transforms, and a
    ``.metadata`` it wrote has no such attribute."""
    return getattr(info, "transform_descriptors", None)


def dcp_format_version() -> str | None:
    """The version DCP's own writer puts in ``Metadata.version`` (``filesystem.CURRENT_DCP_VERSION``,
    "1.0.0" on torch 2.10-2.14); ``None`` on torch 2.6-2.9, which have neither the constant nor
    the field, and whose readers ignore it when a newer torch wrote it."""
    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    except ImportError:
        return None
    return CURRENT_DCP_VERSION


def create_write_items(fqn: str, obj: Any) -> list[Any]:
    """DCP's write items for one value of a flattened state dict, as ``DefaultSavePlanner``
    makes them (``planner_helpers._create_write_items``, torch 2.6-2.14)."""
    try:
        from torch.distributed.checkpoint.planner_helpers import _create_write_items
    except ImportError as exc:
        raise _missing("torch.distributed.checkpoint.planner_helpers._create_write_items", exc) from None
    return _create_write_items(fqn, obj)


def storage_prefix(plan: Any) -> str:
    """The file-name prefix DCP's planner gave this rank (``_StoragePrefix.prefix``, torch 2.6-2.14)."""
    try:
        return plan.storage_data.prefix
    except AttributeError as exc:
        raise _missing("SavePlan.storage_data.prefix (filesystem._StoragePrefix)", exc) from None


def _traverse(name: str) -> Callable[..., Any]:
    try:
        from torch.distributed.checkpoint import _traverse

        return getattr(_traverse, name)
    except (ImportError, AttributeError) as exc:
        raise _missing(f"torch.distributed.checkpoint._traverse.{name}", exc) from None


def set_element(root: Any, path: tuple, value: Any) -> None:
    """Set ``value`` at DCP's object path ``path`` (``_traverse.set_element``, torch 2.6-2.14)."""
    _traverse("set_element")(root, path, value)


def get_element(root: Any, path: tuple) -> Any:
    """The value at DCP's object path ``path`` (``_traverse.get_element``, torch 2.6-2.14)."""
    return _traverse("get_element")(root, path)


def numpy_arrays_admitted() -> Any:
    """A context in which ``torch.load(weights_only=True)`` also admits plain NumPy arrays
    (``numpy.random.get_state()``'s, as another framework pickled them): the array
    reconstructor, ``ndarray`` and ``dtype``, under NumPy 1.x's module names and 2.x's
    (``numpy.core`` became ``numpy._core``), nothing that runs code. torch 2.6-2.14:
    ``torch.serialization.safe_globals`` with ``(object, "module.name")`` pairs for the alias."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct  # NumPy 2
    except ImportError:  # NumPy 1.26
        from numpy.core.multiarray import _reconstruct
    names = [(_reconstruct, f"{m}.multiarray._reconstruct") for m in ("numpy.core", "numpy._core")]
    # the dtype classes NumPy pickles with an array (numpy.dtypes: NumPy 1.25 on); numbers and bools only
    kinds = [getattr(np.dtypes, n) for n in dir(np.dtypes)
             if n.endswith("DType") and n not in ("ObjectDType", "VoidDType", "StringDType")]
    try:
        return torch.serialization.safe_globals([*names, np.ndarray, np.dtype, *kinds])
    except AttributeError as exc:
        raise _missing("torch.serialization.safe_globals", exc) from None


def planner_set_value(planner: Any, fqn: str, value: Any) -> None:
    """Store a loaded non-tensor value where DCP's default load planner would
    (``DefaultLoadPlanner.original_state_dict`` / ``mappings``, torch 2.6-2.14)."""
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


@functools.lru_cache(maxsize=None)
def _takes(which: str, argument: str) -> bool:
    import inspect

    import torch.distributed.checkpoint as dcp

    return argument in inspect.signature(getattr(dcp, which)).parameters


def dcp_save(state_dict: dict, *, storage_writer: Any, planner: Any, process_group: Any, no_dist: bool) -> Any:
    """``dcp.save`` with its ``no_dist`` (torch 2.8-2.14). torch 2.6's ``dcp.save`` has no such
    argument and saves without collectives only when no default group exists; a save of one
    process in a job that has one (a job of one rank, the fast tier's own unit) goes there
    through the function ``dcp.save`` calls, ``state_dict_saver._save_state_dict`` (2.6-2.14)."""
    import torch.distributed.checkpoint as dcp

    if _takes("save", "no_dist"):
        return dcp.save(state_dict, storage_writer=storage_writer, planner=planner, process_group=process_group,
                        no_dist=no_dist)
    if not no_dist:
        return dcp.save(state_dict, storage_writer=storage_writer, planner=planner, process_group=process_group)
    try:
        from torch.distributed.checkpoint.state_dict_saver import _save_state_dict, _stateful_to_state_dict
    except ImportError as exc:
        raise _missing("torch.distributed.checkpoint.state_dict_saver._save_state_dict", exc) from None
    return _save_state_dict(state_dict=_stateful_to_state_dict(state_dict), storage_writer=storage_writer,
                            process_group=None, no_dist=True, planner=planner)


def load_state_dict_no_dist(sd: dict, reader: Any, planner: Any) -> None:
    """DCP's load in one process without a process group, into ``sd`` as the planner
    builds it (``state_dict_loader._load_state_dict``, torch 2.6-2.14)."""
    try:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError as exc:
        raise _missing("torch.distributed.checkpoint.state_dict_loader._load_state_dict", exc) from None
    _load_state_dict(sd, storage_reader=reader, planner=planner, no_dist=True)


def empty_state_dict_load_planner() -> type:
    """DCP's planner that rebuilds a whole state dict from metadata
    (``default_planner._EmptyStateDictLoadPlanner``, torch 2.6-2.14)."""
    try:
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    except ImportError as exc:
        raise _missing("torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner", exc) from None
    return _EmptyStateDictLoadPlanner


# --------------------------------------------------------------------------- DCP's newer options
# What the benchmark compares roll-ckpt against, where a release has it: an older release has
# no such baseline, and the benchmark reports the case as not available, with this error.


def _absent(what: str, since: str, exc: BaseException) -> TorchCompatError:
    return TorchCompatError(f"torch {torch.__version__} has no {what} (torch {since} and later have it; "
                            f"{type(exc).__name__}: {exc})")


def default_stager(cuda: bool) -> Any:
    """DCP's ``DefaultStager`` for ``async_save(async_stager=...)``: its default options on a
    GPU, on the CPU pinned memory off (``StagingOptions(False, True, True, False)``). torch
    2.10-2.14; torch 2.6 and 2.8 have none."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as exc:
        raise _absent("torch.distributed.checkpoint.staging.DefaultStager", "2.10", exc) from None
    return DefaultStager(StagingOptions() if cuda else StagingOptions(False, True, True, False))


def process_mode() -> dict[str, Any]:
    """``async_save``'s keyword for its process mode (``AsyncCheckpointerType.PROCESS``): torch
    2.8-2.14; torch 2.6 saves asynchronously in a thread only."""
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError as exc:
        raise _absent("async_save(async_checkpointer_type=AsyncCheckpointerType.PROCESS)", "2.8", exc) from None
    return {"async_checkpointer_type": AsyncCheckpointerType.PROCESS}


def caching_save_planner() -> Any:
    """``DefaultSavePlanner(enable_plan_caching=True)``: torch 2.8-2.14; torch 2.6's planner
    caches no plans."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    try:
        return DefaultSavePlanner(enable_plan_caching=True)
    except TypeError as exc:
        raise _absent("DefaultSavePlanner(enable_plan_caching=True)", "2.8", exc) from None


def without_collectives() -> dict[str, Any]:
    """``dcp.save``'s keyword for a save without collectives, each rank writing its own
    metadata (``use_collectives=False``): torch 2.10-2.14; torch 2.6 and 2.8 have none."""
    if not _takes("save", "use_collectives"):
        raise _absent("dcp.save(use_collectives=False)", "2.10", TypeError("no argument use_collectives"))
    return {"use_collectives": False}


def compare_save_plans(plan: Any, cached: Any) -> bool:
    """DCP's test of a local plan against its cached one (``planner_helpers._compare_save_plans``,
    torch 2.8-2.14; 2.6 has no plan caching)."""
    try:
        from torch.distributed.checkpoint.planner_helpers import _compare_save_plans
    except ImportError as exc:
        raise _absent("planner_helpers._compare_save_plans", "2.8", exc) from None
    return _compare_save_plans(plan, cached)


_PLAN_CACHES = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
                "_cached_metadata")
"""``SavePlanner``'s class-level plan caches (dicts keyed by a planner's ``_cached_plans_key``)."""


def set_plan_cache_key(planner: Any, key: str) -> None:
    """Files a caching planner's plans under ``key`` in DCP's plan caches
    (``DefaultSavePlanner._cached_plans_key``; by default the class's name, so every planner
    of a class shares one entry): torch 2.8-2.14; torch 2.6 caches no plans."""
    if not hasattr(planner, "_cached_plans_key"):
        raise _absent("DefaultSavePlanner._cached_plans_key", "2.8", AttributeError("no _cached_plans_key"))
    planner._cached_plans_key = key


def cached_local_plan(planner: Any, rank: int = 0) -> Any:
    """Rank ``rank``'s local plan as the coordinator cached it for ``planner``'s key after a
    global plan (``SavePlanner._cached_all_plans``; what a later save compares its new plan
    to): torch 2.8-2.14; torch 2.6 caches no plans."""
    from torch.distributed.checkpoint.planner import SavePlanner

    try:
        return SavePlanner._cached_all_plans[planner._cached_plans_key][rank]
    except AttributeError as exc:
        raise _absent("SavePlanner._cached_all_plans", "2.8", exc) from None


def forget_cached_plans(planner: Any) -> None:
    """Drops what ``planner``'s saves left in DCP's plan caches (``SavePlanner._cached_save_plan``,
    ``_cached_final_save_plan``, ``_cached_all_plans``, ``_cached_global_plan``,
    ``_cached_metadata``: class attributes, kept for the life of the process): torch
    2.8-2.14; nothing to drop on torch 2.6."""
    from torch.distributed.checkpoint.planner import SavePlanner

    key = getattr(planner, "_cached_plans_key", None)
    for name in _PLAN_CACHES:
        getattr(SavePlanner, name, {}).pop(key, None)


def storage_prefix_record(prefix: str) -> Any:
    """A plan's file-name prefix as DCP's planner records it (``filesystem._StoragePrefix``,
    torch 2.6-2.14)."""
    try:
        from torch.distributed.checkpoint.filesystem import _StoragePrefix
    except ImportError as exc:
        raise _missing("torch.distributed.checkpoint.filesystem._StoragePrefix", exc) from None
    return _StoragePrefix(prefix)


def collective(call: Callable[..., Any], tensors: tuple[Any, ...], *args: Any, timeout: float = 2.0,
               **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, a blocking collective over ``tensors``, returning only once
    the process group's worker thread has let go of them. Ran on torch 2.6-2.14 (``Tensor._use_count``).

    A gloo collective returns when its data is there; the worker thread drops the finished
    work a moment later, and dropping the last C++ reference to a tensor that Python also
    holds takes the GIL. When that moment falls into interpreter exit (a collective right
    before the job ends, the worker short of CPU), the thread cannot take the GIL and the
    process aborts ("terminate called without an active exception"). Waiting here, while
    the caller still holds the tensors, moves the release back into the job's lifetime.
    """
    if not hasattr(torch.Tensor, "_use_count"):  # another torch: the collective as it is
        return call(*args, **kwargs)
    held = [t._use_count() for t in tensors]
    result = call(*args, **kwargs)
    deadline = time.monotonic() + timeout
    while any(t._use_count() > n for t, n in zip(tensors, held)) and time.monotonic() < deadline:
        time.sleep(0.0002)
    return result


def all_reduce_ints(dist: Any, values: list[int], op: Any, group: Any) -> list[int]:
    """An all-reduce of a few integers on ``group`` (a GPU tensor on an NCCL group), through
    :func:`collective`. Ran on torch 2.6-2.14 (``dist.get_backend``, ``all_reduce``)."""
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.int64, device=device)
    collective(dist.all_reduce, (t,), t, op=op, group=group)
    return [int(v) for v in t.tolist()]
