"""Scale: what a save and a resume cost the coordinator and the collectives as the job grows.

    python -m bench.scale [--quick|--full|--smoke] [--out bench/results/scale.json] [--no-jobs]

One process simulates N ranks (N = 8, 64, 256, 1,024, 4,096; ``--quick``: up to 1,024 with
P = 300 only) of an FSDP2 Llama-shaped state of P parameters (embeddings, q/k/v/o,
gate/up/down, norms, lm_head; every parameter ``Shard(0)`` over N) with AdamW (``exp_avg``,
``exp_avg_sq`` sharded like the parameter, a replicated 0-d ``step`` per parameter, the
param group's values) and the per-process values roll-ckpt saves (``per_rank.<r>.__rng__.*``
tensors, a scheduler and counters as byte values; see ``roll_ckpt.strategies.dcp``). Each rank's
DCP ``WriteItem``s are built directly (as ``planner_helpers._create_write_items_for_dtensor``
makes them for a ``Shard(0)`` DTensor: no process group, no tensor), and DCP's own code runs
on them: ``DefaultSavePlanner.create_global_plan`` (dedup, ``ChainMap`` merge of planner
data, validation; plan caching on), ``FileSystemWriter.prepare_global_plan`` and its
``finish`` step (``storage_data`` from all write results, ``pickle.dump`` of ``Metadata``).
Every collective is what ``_DistWrapper`` does: each object is pickled on its sender and
unpickled on its receiver; the coordinator's share of that is timed with it.

Methods (see ``METHODS``): DCP default (the first save, = plan caching's first save),
DCP with plan caching (a second save of the same structure), DCP ``use_collectives=False``
(every rank plans alone and writes ``__<r>.metadata``: the "no coordination" reference) and
roll-ckpt's save of an unchanged structure (``roll_ckpt.dcp.writer`` when it is there,
else modelled by its message shapes: see :class:`RollCkptFastPath`).

Each (N, P) cell runs in a process of its own (memory and the collector's heap are the
cell's alone); this process gathers the cells, runs the real jobs of :mod:`bench.scale_jobs`
(storage operations and collective bytes of real ``CheckpointManager`` saves on gloo) and
writes ``scale.json``, ``scale.md`` and ``scale.png`` beside ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import json
import os
import pickle
import subprocess
import sys
import time
from typing import Any, Callable, Iterable

from .common import writer_digest
from .launch import RESULTS, ROOT, child_env, module
from .scale_limits import OPS_LIMIT, T12_LIMIT, T12_OVERHEAD_LIMIT, T13_LIMIT

MB = 1 << 20

# Llama-2-7B's shapes (the simulation writes no data: shapes decide chunk offsets, item
# counts and the files' chunk checksums, one per 8 MiB).
HIDDEN, INTERMEDIATE, VOCAB, KV = 4096, 11008, 32000, 4096
LAYER = [("input_layernorm.weight", (HIDDEN,)), ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
         ("self_attn.k_proj.weight", (KV, HIDDEN)), ("self_attn.v_proj.weight", (KV, HIDDEN)),
         ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)), ("post_attention_layernorm.weight", (HIDDEN,)),
         ("mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)), ("mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
         ("mlp.down_proj.weight", (HIDDEN, INTERMEDIATE))]
PARAM_GROUP_KEYS = ["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                    "differentiable", "fused", "decoupled_weight_decay", "initial_lr", "params"]
RNG = [("python", (627,), "int64"), ("python_gauss", (1,), "float64"), ("numpy", (626,), "int64"),
       ("numpy_gauss", (1,), "float64"), ("torch", (5056,), "uint8")]
PER_RANK_VALUES = ["scheduler", "counters"]  # boxed per-process values (BYTE_IO)
CHUNK = 8 << 20  # roll_ckpt.format.manifest.CHUNK_SIZE

MODES: dict[str, dict[str, Any]] = {
    "smoke": {"cells": [(8, 20), (16, 20)], "jobs": {"worlds": [2], "reshard": (2, 1), "keeps": [(2, 1)],
                                                     "saves": 2}},
    "quick": {"cells": [(8, 300), (64, 300), (256, 300), (1024, 300)],
              "jobs": {"worlds": [1, 2, 4], "reshard": (4, 2), "keeps": [(2, 1), (2, 10)], "saves": 3}},
    "full": {"cells": [(n, p) for p in (300, 800) for n in (8, 64, 256, 1024, 4096)],
             "jobs": {"worlds": [1, 2, 4, 8, 16], "reshard": (8, 4), "keeps": [(0, 1), (0, 10), (2, 1), (2, 10)],
                      "saves": 3, "s3": True}},
}

METHODS = {
    "dcp": "DCP default (first save; = plan caching's first save)",
    "rc_full": "roll-ckpt's full save (first of a structure): DCP's protocol, roll-ckpt's global plan",
    "dcp_cached": "DCP, plan caching on (a save of an unchanged structure)",
    "dcp_nocoord": "DCP use_collectives=False (each rank its own __<r>.metadata; no resharding)",
    "rc": "roll-ckpt, save of an unchanged structure",
}

# DCP paths hold every rank's plan on the coordinator; a cell whose estimate passes this
# many GiB of coordinator memory is not run for them (reported as skipped).
DEFAULT_MAX_GIB = 8.0


# ----------------------------------------------------------------------------- the state


def params(p: int) -> list[tuple[str, tuple[int, ...]]]:
    """``p`` parameters of a Llama, in module order (embedding, layers, final norm, lm_head)."""
    head = [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    body = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    layer = 0
    while len(body) < p - len(head):
        body += [(f"model.layers.{layer}.{n}", s) for n, s in LAYER]
        layer += 1
    return body[: max(0, p - len(head))] + head[: p]


def shard0(shape: tuple[int, ...], n: int, r: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local sizes, global offsets) of rank ``r``'s ``Shard(0)`` piece over ``n`` ranks
    (torch.chunk semantics, as ``compute_local_shape_and_global_offset``)."""
    d0 = shape[0]
    per = -(-d0 // n)
    off = min(r * per, d0)
    size = max(0, min(per, d0 - off))
    return (size, *shape[1:]), (off, *([0] * (len(shape) - 1)))


class State:
    """One rank's write items and planner data, made as DCP makes them for the real state."""

    def __init__(self, p: int, n: int) -> None:
        import torch

        self.torch = torch
        self.p, self.n = p, n
        self.params = params(p)
        self.dtypes = {"float32": torch.float32, "int64": torch.int64, "float64": torch.float64,
                       "uint8": torch.uint8}

    def _props(self, dtype: Any, requires_grad: bool = False) -> Any:
        from torch.distributed.checkpoint.metadata import TensorProperties

        return TensorProperties(dtype=dtype, requires_grad=requires_grad)

    def local_plan(self, r: int, prefix: str | None = None) -> Any:
        """Rank ``r``'s local plan (``create_default_local_save_plan`` + planner data), with
        ``prefix`` as its storage data (``use_collectives=False``)."""
        torch = self.torch
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

        Size = torch.Size
        f32 = torch.float32
        items = []
        mappings: dict[str, tuple] = {}

        def shard(fqn: str, shape: tuple[int, ...], grad: bool) -> None:
            sizes, offsets = shard0(shape, self.n, r)
            sizes_, offsets_ = Size(sizes), Size(offsets)
            items.append(WriteItem(index=_index(fqn, offsets_), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets_, sizes=sizes_),
                                                               properties=self._props(f32, grad), size=Size(shape))))

        def tensor(fqn: str, shape: tuple[int, ...], dtype: Any) -> None:
            offsets = Size([0] * len(shape))
            items.append(WriteItem(index=_index(fqn, offsets), type=WriteItemType.TENSOR,
                                   tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=Size(shape)),
                                                               properties=self._props(dtype), size=Size(shape))))

        def value(fqn: str) -> None:
            items.append(WriteItem(index=_index(fqn), type=WriteItemType.BYTE_IO))

        for name, shape in self.params:
            fqn = f"model.{name}"
            shard(fqn, shape, True)
            mappings[fqn] = ("model", name)
        for name, shape in self.params:
            base = f"optimizer.state.{name}"
            tensor(f"{base}.step", (), f32)
            mappings[f"{base}.step"] = ("optimizer", "state", name, "step")
            for k in ("exp_avg", "exp_avg_sq"):
                shard(f"{base}.{k}", shape, False)
                mappings[f"{base}.{k}"] = ("optimizer", "state", name, k)
        for k in PARAM_GROUP_KEYS:
            fqn = f"optimizer.param_groups.0.{k}"
            value(fqn)
            mappings[fqn] = ("optimizer", "param_groups", 0, k)
        for k, shape, dt in RNG:
            fqn = f"per_rank.{r}.__rng__.{k}"
            tensor(fqn, shape, self.dtypes[dt])
            mappings[fqn] = ("per_rank", str(r), "__rng__", k)
        for k in PER_RANK_VALUES:
            fqn = f"per_rank.{r}.{k}"
            value(fqn)
            mappings[fqn] = ("per_rank", str(r), k)
        plan = SavePlan(items, planner_data=mappings)
        if prefix is not None:
            from roll_ckpt.runtime.torch_compat import storage_prefix_record

            plan = dataclasses.replace(plan, storage_data=storage_prefix_record(prefix))
        return plan

    def rank_bytes(self, r: int) -> int:
        """Bytes of rank ``r``'s data files (its shards, 3 x 4 B per element; its values)."""
        total = 0
        for _, shape in self.params:
            sizes, _ = shard0(shape, self.n, r)
            k = 1
            for s in sizes:
                k *= s
            total += 3 * 4 * k
        return total + 627 * 8 + 626 * 8 + 16 + 5056 + 4 * len(self.params) + 4096


def _index(fqn: str, offset: Any = None) -> Any:
    """A ``MetadataIndex`` equal to ``MetadataIndex(fqn, offset)``, made without its
    ``__init__`` (which re-wraps ``offset`` in ``torch.Size``: 50 µs each, most of a rank's
    planning here). Rank-side only; the coordinator unpickles, which never calls it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    idx = object.__new__(MetadataIndex)
    object.__setattr__(idx, "fqn", fqn)
    object.__setattr__(idx, "index", None)
    object.__setattr__(idx, "offset", offset)
    return idx


def write_results(plan: Any, r: int, files: int = 1) -> list[Any]:
    """The write results of rank ``r``'s final plan: DCP's ``_StorageInfo`` per item, in
    ``files`` files, offsets as a writer lays the items out (values first)."""
    from roll_ckpt.runtime.torch_compat import storage_info
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    out = []
    offsets = [0] * files
    prefix = getattr(plan.storage_data, "prefix", f"__{r}_")
    for k, item in enumerate(sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)):
        f = k % files
        if item.type == WriteItemType.BYTE_IO:
            length = 64 + 2 * len(item.index.fqn)
        else:
            n = item.tensor_data.properties.dtype.itemsize
            for s in item.tensor_data.chunk.sizes:
                n *= s
            length = n + 1100  # torch.save's framing of one tensor
        out.append(WriteResult(index=item.index, size_in_bytes=length,
                               storage_data=storage_info(f"{prefix}{f}.distcp", offsets[f], length)))
        offsets[f] += length
    return out


# ----------------------------------------------------------------------------- measuring


class Coordinator:
    """CPU seconds (``time.process_time``) the coordinator spends, by phase."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    def run(self, phase: str, fn: Callable[[], Any]) -> Any:
        t0 = time.process_time()
        out = fn()
        self.phases[phase] = self.phases.get(phase, 0.0) + time.process_time() - t0
        return out

    @property
    def total(self) -> float:
        return sum(self.phases.values())


def dumps(obj: Any) -> bytes:
    """What torch's object collectives put on the wire (``_object_to_tensor``: a pickle)."""
    return pickle.dumps(obj)


def _unpickle_times(data: bytes, reps: int = 1) -> dict[str, float]:
    """One rank's unpickle of ``.metadata``: plain / restricted, collector on / off (best of
    ``reps``): CPU seconds (``*_s``) and wall seconds (``*_wall_s``)."""
    from roll_ckpt.dcp.checked import safe_load_metadata

    out: dict[str, float] = {}
    gc.collect()
    for name, fn in (("plain", pickle.loads), ("safe", safe_load_metadata)):
        for gc_on in (False, True):
            best = None
            for _ in range(reps):
                (gc.enable if gc_on else gc.disable)()
                t0, c0 = time.perf_counter(), time.process_time()
                md = fn(data)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                gc.disable()
                del md  # freed by reference counts (a tree): no collection needed
                best = (dc, dt) if best is None else min(best, (dc, dt))
            # CPU seconds (one thread's work; wall time on a shared machine includes waiting for a core)
            out[f"{name}_gc_{'on' if gc_on else 'off'}_s"] = best[0] if best else 0.0
            out[f"{name}_gc_{'on' if gc_on else 'off'}_wall_s"] = best[1] if best else 0.0
    gc.enable()
    return out


class RollCkptFastPath:
    """roll-ckpt's save of an unchanged structure, as the coordinator and each rank see it.

    Each rank: one all-reduce of 3 int64 (agreement on the layout), then one message in the
    gather, ``("ok", {file: (size, 32-hex checksum, (32-hex checksum per 8 MiB, ...))})``;
    the coordinator writes the kept ``.metadata`` bytes of the last full save (hashed as
    they are written), broadcasts the outcome, and builds the manifest's entries
    (``roll_ckpt.format.manifest.FileEntry``, as ``save/pipeline.py`` does) and ``Manifest.to_bytes()``.

    ``source``: ``"roll_ckpt.dcp.writer"`` when the coordinator's part runs the library's
    own ``FixedLayouts.save`` (over a simulated group: its gather hands it the N ranks'
    pickled messages, unpickled on its time, and its writer is a stub that writes nothing
    and hashes the kept ``.metadata`` as the writer hashes a file, :func:`bench.common.writer_digest`); ``"modelled"``
    when that module is missing or its interface differs (``note`` says why) — the same
    messages, unpickled and merged by this class.
    """

    AGREE_BYTES = 3 * 8

    def __init__(self) -> None:
        self.note = ""
        try:
            from roll_ckpt.dcp.writer import FastPlan, FixedLayouts, RankLayout  # noqa: F401

            self.lib = (FixedLayouts, RankLayout, FastPlan)
            self.source = "roll_ckpt.dcp.writer"
        except ImportError as exc:
            self.lib = None
            self.source = "modelled"
            self.note = f"roll_ckpt.dcp.writer not importable ({exc})"

    def rank_message(self, files: dict[str, tuple]) -> bytes:
        return dumps(("ok", files))

    def coordinator(self, messages: list[bytes], n: int, md_bytes: bytes | None, md_size: int,
                    co: Coordinator) -> tuple[bytes, bytes]:
        """(manifest bytes, outcome broadcast bytes) from the N messages; CPU into ``co``."""
        digests = None
        bcast = b""
        if self.lib is not None and md_bytes is not None:
            try:
                digests, bcast = co.run("fixed_layout_save", lambda: self._library_save(messages, n, md_bytes))
            except Exception as exc:  # noqa: BLE001 - an interface in flux: the model stands in
                self.source, self.lib = "modelled", None
                self.note = f"FixedLayouts.save over a simulated group failed: {type(exc).__name__}: {exc}"[:300]
        if digests is None:
            def model() -> tuple[dict[str, tuple], bytes]:
                out: dict[str, tuple] = {}
                for raw in messages:
                    status, mine = pickle.loads(raw)
                    out.update(mine)
                if md_bytes is not None:
                    out[".metadata"] = writer_digest(md_bytes)
                else:  # the cached .metadata's size only (a cell without the DCP paths)
                    out[".metadata"] = (md_size, _hex(), tuple(_hex() for _ in range(-(-md_size // CHUNK))))
                return out, dumps([None])

            digests, bcast = co.run("merge_messages", model)

        def manifest() -> bytes:
            from roll_ckpt.format.manifest import FileEntry, Manifest

            files = {f"dcp/{name}": FileEntry(*d) for name, d in digests.items()}
            m = Manifest(step=100, files=files, created=_dt.datetime.now(_dt.timezone.utc).isoformat(),
                         world_size=n, plugins={"roll-ckpt": "0", "roll-ckpt-fsdp2": "0"}, extra={"strategy": "fsdp2"})
            return m.to_bytes()

        return co.run("manifest", manifest), bcast

    def _library_save(self, messages: list[bytes], n: int, md_bytes: bytes) -> tuple[dict[str, tuple], bytes]:
        FixedLayouts, RankLayout, FastPlan = self.lib  # noqa: N806
        sim = _SimGroup(messages)
        mine = pickle.loads(messages[0])[1]  # rank 0's own files
        written = {name: [] for name in mine}
        writer = _StubWriter(mine, written)
        fl = FixedLayouts(sim, 0, n)
        fl.layout = RankLayout(generation=1, keys=(), files=list(written.items()),
                               items=[(name, []) for name in mine], metadata=md_bytes)
        fast = FastPlan(planner=None, files=[(name, []) for name in mine], slots={}, values={})
        digests = fl.save(fast, writer, None)
        if digests is None or fl.fast_saves != 1:
            raise RuntimeError(f"FixedLayouts.save did not take the fast path ({digests!r})")
        return digests, sim.bcast


class _SimGroup:
    """The coordinator's side of N ranks' collectives for ``FixedLayouts`` (rank 0): the
    gather hands over the other ranks' messages (unpickled here, as ``gather_object`` does
    on the coordinator); the all-reduce is every rank agreeing; the broadcast is pickled."""

    class ReduceOp:
        MAX = "max"

    def __init__(self, messages: list[bytes]) -> None:
        self.messages = messages
        self.bcast = b""

    def get_backend(self, group: Any = None) -> str:
        return "gloo"

    def get_global_rank(self, group: Any, rank: int) -> int:
        return rank

    def all_reduce(self, tensor: Any, op: Any = None, group: Any = None) -> None:
        return None  # every rank sent the same three integers

    def gather_object(self, obj: Any, object_gather_list: Any = None, dst: int = 0, group: Any = None) -> None:
        object_gather_list[0] = pickle.loads(dumps(obj))
        for r in range(1, len(self.messages)):
            object_gather_list[r] = pickle.loads(self.messages[r])

    def broadcast_object_list(self, object_list: list[Any], src: int = 0, group: Any = None) -> None:
        self.bcast = dumps(object_list)


class _StubWriter:
    """``DigestingWriter``'s part in a fast save, writing nothing: the files are as the
    layout says; ``.metadata``'s bytes are hashed as the real writer hashes what it writes."""

    gate = None

    def __init__(self, mine: dict[str, tuple], written: dict[str, list]) -> None:
        self.own_digests, self.written = dict(mine), written

    def write_files(self, *args: Any, **kwargs: Any) -> None:
        return None

    def write_metadata(self, data: bytes) -> tuple:
        return writer_digest(data)


def _hex() -> str:
    return os.urandom(16).hex()


def rank_files(st: State, r: int) -> dict[str, tuple]:
    """Rank ``r``'s data files as its writer reports them: (size, checksum, chunk checksums);
    two files from 64 MiB on (``DCPStrategy.writer_threads``)."""
    nbytes = st.rank_bytes(r)
    k = 2 if nbytes >= 64 << 20 else 1
    out = {}
    for f in range(k):
        size = nbytes // k + (nbytes % k if f == 0 else 0)
        out[f"__{r}_{f}.distcp"] = (size, _hex(), tuple(_hex() for _ in range(max(1, -(-size // CHUNK)))))
    return out


def checksum_bytes(files: dict[str, tuple]) -> int:
    """Bytes of a rank's files' checksums alone, in the message's own encoding (a pickle of
    the 32-hex strings: 35 B each), the part of its message that grows with its data."""
    return len(dumps(tuple(c for _, ck, ch in files.values() for c in (ck, *ch))))


# ----------------------------------------------------------------------------- one cell


def estimate_gib(n: int, p: int) -> float:
    """Coordinator memory of the DCP paths: ~1.1 KB per write item, kept 3 times (gathered
    plans, global plans, write results) plus the metadata."""
    items = n * (4 * p + 20)
    return items * 1.1e3 * 3.5 / (1 << 30)


def cell(n: int, p: int, methods: list[str], unpickle_reps: int = 1, md_estimate: int | None = None) -> dict[str, Any]:
    """Every method at N = ``n`` ranks, P = ``p`` parameters, in this process."""
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint.planner import SavePlan

    from roll_ckpt.runtime.torch_compat import (caching_save_planner, cached_local_plan, compare_save_plans,
                                                forget_cached_plans, set_plan_cache_key)

    st = State(p, n)
    out: dict[str, Any] = {"ranks": n, "params": p, "methods": {}}
    t_cell = time.perf_counter()
    wall: dict[str, float] = {}
    out["wall_phases"] = wall

    def stamp(name: str, t0: list[float] = [t_cell]) -> None:  # noqa: B006 - a running clock
        now = time.perf_counter()
        wall[name] = wall.get(name, 0.0) + now - t0[0]
        t0[0] = now
    gc.disable()  # DCP holds the collector off while it plans (roll-ckpt's CollectorPause does)
    md_bytes: bytes | None = None
    md_size: int | None = None
    items_per_rank = len(st.local_plan(0).items)
    out["items_per_rank"] = items_per_rank
    if "dcp" in methods or "dcp_cached" in methods:
        planner = caching_save_planner()
        set_plan_cache_key(planner, f"scale-{n}-{p}")
        for save in ("dcp", "dcp_cached"):
            co = Coordinator()
            sent = {"local_plans": 0, "global_plans": 0, "write_results": 0, "metadata_bcast": 0}
            per_rank_sent = 0
            gathered = []
            if save == "dcp":
                plan = st.local_plan(0)
                co.run("pickle_own", lambda: dumps(plan))
                del plan
                # the other ranks' plans, made and pickled by a process of their own (rank-side work)
                stream = _produced(lambda r: dumps(st.local_plan(r)), n)
            else:  # every rank finds its plan unchanged and sends an empty one
                plan = st.local_plan(0)
                cached = cached_local_plan(planner, 0)  # what create_local_plan compares its new plan to
                co.run("compare_local_plan", lambda: compare_save_plans(plan, cached))
                empty = SavePlan([], usable=False)
                co.run("pickle_own", lambda: dumps(empty))
                del plan, cached
                stream = (dumps(SavePlan([], usable=False)) for _ in range(n))
            stamp(f"{save}:setup")
            for r, raw in enumerate(stream):
                sent["local_plans"] += len(raw)
                if r == 1:
                    per_rank_sent += len(raw)
                gathered.append(co.run("unpickle_gathered_plans", lambda: pickle.loads(raw)))
                del raw
            if save == "dcp":
                first_plan0 = gathered[0]
            stamp(f"{save}:gather_plans")
            global_plans, metadata = co.run("create_global_plan", lambda: planner.create_global_plan(gathered))
            if save == "dcp":
                rc_full = _rc_global_plan(gathered, metadata)
            global_plans = co.run("prepare_global_plan",
                                  lambda: FileSystemWriter.prepare_global_plan(None, global_plans))  # type: ignore[arg-type]
            for r in range(n):
                raw = co.run("pickle_scattered_plans", lambda: dumps(global_plans[r]))
                sent["global_plans"] += len(raw)
                del raw  # each rank unpickles its own (not the coordinator's time)
            stamp(f"{save}:global_plan_scatter")
            # (the write itself is not simulated) write results, gathered; a save of the same
            # plan gives the same results: the second save sends the first one's bytes again
            if save == "dcp":
                wr_raw = []
                for r in range(n):
                    wr = write_results(global_plans[r], r)
                    wr_raw.append(co.run("pickle_own", lambda: dumps(wr)) if r == 0 else dumps(wr))
                    del wr
            results = []
            for r in range(n):
                raw = wr_raw[r]
                sent["write_results"] += len(raw)
                if r == 1:
                    per_rank_sent += len(raw)
                results.append(co.run("unpickle_write_results", lambda: pickle.loads(raw)))

            stamp(f"{save}:write_results")

            def finish() -> bytes:
                from roll_ckpt.runtime.torch_compat import dcp_format_version

                if dcp_format_version() is not None:
                    metadata.version = dcp_format_version()
                storage_md = {}
                for wr_list in results:
                    storage_md.update({wr.index: wr.storage_data for wr in wr_list})
                metadata.storage_data = storage_md
                return pickle.dumps(metadata)

            md_bytes = co.run("finish_metadata", finish)
            bcast = co.run("pickle_metadata_bcast", lambda: dumps(metadata))
            sent["metadata_bcast"] = len(bcast) * (n - 1)
            md_size = len(md_bytes)
            del bcast, results, gathered, global_plans
            if save == "dcp" and rc_full is not None:
                # roll-ckpt's full save (the first of a structure): DCP's protocol, its own global plan
                ph = dict(co.phases, create_global_plan=rc_full["cpu_s"])
                out["methods"]["rc_full"] = {
                    "coordinator_cpu_s": sum(ph.values()), "phases": ph, "collective_bytes": dict(sent),
                    "collective_total": sum(sent.values()), "per_rank_sent": per_rank_sent if n > 1 else 0,
                    "metadata_bytes": len(md_bytes), "metadata_files": 1, "same_metadata": rc_full["same"],
                    "source": "roll_ckpt.dcp.writer.ReusingSavePlanner.create_global_plan; the rest as DCP's"}
            out["methods"][save] = {
                "coordinator_cpu_s": co.total, "phases": co.phases, "collective_bytes": sent,
                "collective_total": sum(sent.values()), "per_rank_sent": per_rank_sent if n > 1 else 0,
                "per_rank_received": len(md_bytes) + (sent["global_plans"] // n),
                "metadata_bytes": md_size, "metadata_files": 1,
                "storage_data_share": (len(pickle.dumps(metadata.storage_data)) / md_size
                                       if save == "dcp" and n <= 64 else None),
            }
            del metadata
            stamp(f"{save}:finish")
        del first_plan0, wr_raw
        forget_cached_plans(planner)

    stamp("dcp_cleanup")
    if "dcp_nocoord" in methods:
        # every rank does what rank 0 does here, on its own plan; sizes of a few ranks
        co = Coordinator()
        sample = sorted({0, n // 2, n - 1})
        sizes = {}
        for r in sample:
            planner = DefaultSavePlanner()
            c = co if r == 0 else Coordinator()
            plan = st.local_plan(r, prefix=f"__{r}_")
            gp, md = c.run("create_global_plan", lambda: planner.create_global_plan([plan]))
            wr = write_results(gp[0], r)

            def finish() -> bytes:
                md.storage_data = {w.index: w.storage_data for w in wr}
                return pickle.dumps(md)

            sizes[r] = len(c.run("finish_metadata", finish))
            del plan, gp, md, wr
        mean = sum(sizes.values()) / len(sizes)
        out["methods"]["dcp_nocoord"] = {
            "coordinator_cpu_s": co.total, "phases": co.phases, "collective_bytes": {"barrier": 0},
            "collective_total": 0, "per_rank_sent": 0, "per_rank_received": 0,
            "metadata_bytes": int(mean * n), "metadata_rank0_bytes": sizes[0], "metadata_files": n,
            "metadata_sampled_ranks": sample,
        }

    stamp("dcp_nocoord")
    if "rc" in methods:
        fp = RollCkptFastPath()
        co = Coordinator()
        if md_size is None:  # the DCP paths did not run: the cached .metadata's size is estimated
            md_size = int(md_estimate or 0)
        msgs = []
        total = 0
        overhead = []
        for r in range(n):
            files = rank_files(st, r)
            raw = co.run("rank0_message", lambda: fp.rank_message(files)) if r == 0 else fp.rank_message(files)
            total += len(raw)
            overhead.append(len(raw) - checksum_bytes(files))
            msgs.append(raw)
            del files
        # without the DCP paths the kept .metadata is bytes of its estimated size (hashed as the real ones)
        kept = md_bytes if md_bytes is not None else (bytes(md_size) if md_size else None)
        manifest, outcome = fp.coordinator(msgs, n, kept, md_size, co)
        del kept
        sent = {"agreement_allreduce": fp.AGREE_BYTES * n, "rank_messages": total,
                "outcome_bcast": len(outcome) * (n - 1)}
        out["methods"]["rc"] = {
            "coordinator_cpu_s": co.total, "phases": co.phases, "collective_bytes": sent,
            "collective_total": sum(sent.values()), "per_rank_sent": fp.AGREE_BYTES + max(len(m) for m in msgs),
            "per_rank_overhead_max": fp.AGREE_BYTES + max(overhead), "per_rank_received": len(outcome),
            "metadata_bytes": md_size, "metadata_estimated": md_bytes is None, "metadata_files": 1,
            "manifest_bytes": len(manifest), "source": fp.source, "source_note": fp.note,
        }
        del msgs

    gc.enable()
    # (the unpickle measurement below starts with a collection)
    # ---- resume: who reads .metadata, and one rank's unpickle of it
    res: dict[str, Any] = {}
    stamp("rc")
    if md_bytes is not None:
        times = _unpickle_times(md_bytes, unpickle_reps)
        stamp("unpickle")
        res["unpickle"] = times
        size = len(md_bytes)
        res["metadata_bytes"] = size
        res["read_all_ranks"] = {
            "dcp": n * size,  # dcp.load: every rank reads .metadata
            "rc_today": 2 * n * size,  # DCPStrategy._load reads it, then dcp.load again (no file list)
            "rc": size,  # the coordinator reads it and broadcasts its bytes
        }
        res["rank_unpickle_s"] = {
            "dcp": times["plain_gc_on_s"],
            "rc_today": 2 * times["safe_gc_on_s"],
            "rc": times["safe_gc_off_s"],
        }
        res["rc_bcast_bytes"] = size * (n - 1)
    elif md_size:  # estimated (DCP skipped): reads follow from the size alone
        res["metadata_bytes"] = md_size
        res["metadata_estimated"] = True
        res["read_all_ranks"] = {"dcp": n * md_size, "rc_today": 2 * n * md_size, "rc": md_size}
        res["rc_bcast_bytes"] = md_size * (n - 1)
    if "dcp_nocoord" in out["methods"]:
        m = out["methods"]["dcp_nocoord"]
        res.setdefault("read_all_ranks", {})["dcp_nocoord"] = m["metadata_bytes"]
    out["resume"] = res
    out["wall_s"] = time.perf_counter() - t_cell
    out["max_rss_gib"] = _max_rss_gib()
    return out


def _unavailable() -> dict[str, str]:
    """The methods this torch cannot simulate, and why: DCP's protocol is simulated with its own
    plan caching (``dcp``, ``dcp_cached``, and ``rc_full`` on DCP's gathered plans), and
    ``dcp_nocoord`` is its ``use_collectives=False``; an older release has neither."""
    from roll_ckpt.runtime.torch_compat import TorchCompatError, caching_save_planner, without_collectives

    out = {}
    for methods, probe in ((("dcp", "dcp_cached", "rc_full"), caching_save_planner),
                           (("dcp_nocoord",), without_collectives)):
        try:
            probe()
        except TorchCompatError as exc:
            out.update({m: str(exc) for m in methods})
    return out


def _rc_global_plan(gathered: list[Any], dcp_md: Any) -> dict[str, Any] | None:
    """CPU seconds of roll-ckpt's global plan (``ReusingSavePlanner.create_global_plan``:
    linear-time planner-data merge and chunk validation) on the same gathered plans, and
    whether its metadata equals DCP's; ``None`` where this roll-ckpt has no such planner."""
    try:
        from roll_ckpt.dcp.writer import ReusingSavePlanner
    except ImportError:
        return None
    planner = ReusingSavePlanner({})
    if "create_global_plan" not in type(planner).__dict__:
        return None  # DCP's own: nothing to compare
    c0 = time.process_time()
    _, md = planner.create_global_plan(gathered)
    cpu = time.process_time() - c0
    same = (md.state_dict_metadata.keys() == dcp_md.state_dict_metadata.keys()
            and dict(md.planner_data) == dict(dcp_md.planner_data))
    return {"cpu_s": cpu, "same": bool(same)}


def _produced(make: Callable[[int], bytes], n: int) -> Iterable[bytes]:
    """``make(0)``, ..., ``make(n - 1)``, made by a forked process while this one consumes
    them (the ranks' own work, off the coordinator's CPU and this process's wall time)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        gc.disable()
        try:
            for r in range(n):
                send.send_bytes(make(r))
        finally:
            send.close()
            os._exit(0)

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()
    try:
        for _ in range(n):
            yield recv.recv_bytes()
    finally:
        recv.close()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _max_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


# ----------------------------------------------------------------------------- driver


def run_cell(n: int, p: int, methods: list[str], timeout: float, reps: int,
             md_estimate: int | None = None) -> dict[str, Any]:
    """One cell in a process of its own; its JSON on stdout's last line."""
    cmd = module("scale", "--cell", f"{n},{p}", "--methods", ",".join(methods), "--unpickle-reps", str(reps))
    if md_estimate:
        cmd += ["--md-estimate", str(md_estimate)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=child_env(PYTHONWARNINGS="ignore"))
    except subprocess.TimeoutExpired:
        return {"ranks": n, "params": p, "error": f"timed out after {timeout:.0f} s", "methods": {}, "resume": {}}
    if proc.returncode != 0:
        return {"ranks": n, "params": p, "error": proc.stderr[-2000:], "methods": {}, "resume": {}}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = time.perf_counter() - t0
    return res


def targets(cells: list[dict[str, Any]], jobs: dict[str, Any] | None) -> dict[str, Any]:
    """T12, T13 (from the 1,024-rank cell, P = 300, else the largest cell) and T14 (from the jobs)."""
    done = [c for c in cells if not c.get("error")]
    ref = next((c for c in done if c["ranks"] == 1024 and c["params"] == 300), None)
    if ref is None and done:
        ref = max(done, key=lambda c: (c["ranks"], -c["params"]))
    out: dict[str, Any] = {}

    def entry(value: float | None, limit: float, le: bool, what: str, **more: Any) -> dict[str, Any]:
        ok = value is not None and (value <= limit if le else value >= limit)
        return {"value": value, "limit": limit, "pass": bool(ok), "op": "<=" if le else ">=", "what": what, **more}

    ms = (ref or {}).get("methods", {})
    rc, cached = ms.get("rc") or {}, ms.get("dcp_cached") or {}
    v12 = rc["coordinator_cpu_s"] / cached["coordinator_cpu_s"] if rc and cached.get("coordinator_cpu_s") else None
    over = rc.get("per_rank_overhead_max")
    t12 = entry(v12, T12_LIMIT, True, "coordinator CPU per save of an unchanged structure, roll-ckpt / DCP with plan "
                "caching (simulated ranks); and each rank's bytes sent per save, less its files' checksums, <= 1 KiB",
                ranks=ref and ref["ranks"], params=ref and ref["params"], rc_cpu_s=rc.get("coordinator_cpu_s"),
                dcp_cached_cpu_s=cached.get("coordinator_cpu_s"), per_rank_overhead=over,
                per_rank_sent=rc.get("per_rank_sent"), source=rc.get("source"))
    t12["pass"] = bool(t12["pass"] and over is not None and over <= T12_OVERHEAD_LIMIT)
    out["T12"] = t12
    res = (ref or {}).get("resume", {})
    size = res.get("metadata_bytes")
    read = (res.get("read_all_ranks") or {}).get("rc")
    out["T13"] = entry(read / size if read is not None and size else None, T13_LIMIT, True,
                       "bytes read from storage for .metadata on a resume (all ranks) / its size",
                       ranks=ref and ref["ranks"], metadata_bytes=size,
                       dcp=((res.get("read_all_ranks") or {}).get("dcp") or 0) / size if size else None,
                       rc_today=((res.get("read_all_ranks") or {}).get("rc_today") or 0) / size if size else None,
                       source=rc.get("source"))
    j = jobs or {}
    out["T14"] = entry(j.get("max_ops_per_rank_save"), j.get("limit", OPS_LIMIT), True,
                       f"storage operations per rank per save (max over ranks, jobs of {j.get('worlds')} processes, "
                       "checkpoints kept/present as run); and the same for every N and every number kept",
                       independent=j.get("independent"), by_job=j.get("by_job"))
    out["T14"]["pass"] = bool(out["T14"]["pass"] and j.get("independent"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick")
    size.add_argument("--full", action="store_const", dest="mode", const="full")
    size.add_argument("--smoke", action="store_const", dest="mode", const="smoke")
    p.add_argument("--out", default=os.path.join(RESULTS, "scale.json"))
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--unpickle-reps", type=int, default=None)
    p.add_argument("--md-estimate", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ranks", default=None, help="N values (overrides the mode's), e.g. 8,64")
    p.add_argument("--params", default=None, help="P values (overrides the mode's), e.g. 300")
    p.add_argument("--cells", default=None, help="N:P pairs (overrides the mode's), e.g. 4096:300,64:800")
    p.add_argument("--max-gib", type=float, default=DEFAULT_MAX_GIB,
                   help="skip the DCP paths of a cell whose coordinator memory estimate passes this")
    p.add_argument("--no-jobs", action="store_true", help="skip the real gloo jobs (bench.scale_jobs)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--cell-timeout", type=float, default=1800)
    p.add_argument("--reuse", default=None, help="take the cells of this earlier scale.json instead of running them "
                                                 "(cells given by --cells are run and replace theirs)")
    p.add_argument("--jobs-json", default=None,
                   help="comma-separated results of bench.scale_jobs --json (or scale.json files) to report instead of "
                        "running the jobs; their jobs are merged")
    args = p.parse_args(argv)
    if args.cell:
        n, pp = (int(x) for x in args.cell.split(","))
        res = cell(n, pp, args.methods.split(","), args.unpickle_reps or 1, args.md_estimate)
        print(json.dumps(res))
        return 0
    mode = args.mode or "quick"
    cfg = MODES[mode]
    cells_todo = list(cfg["cells"])
    if args.ranks or args.params:
        ns = [int(x) for x in args.ranks.split(",")] if args.ranks else sorted({c[0] for c in cells_todo})
        ps = [int(x) for x in args.params.split(",")] if args.params else sorted({c[1] for c in cells_todo})
        cells_todo = [(n, q) for q in ps for n in ns]
    if args.cells:
        cells_todo = [(int(a), int(b)) for a, b in (x.split(":") for x in args.cells.split(","))]
    reps = args.unpickle_reps or (3 if mode == "full" else 1)
    t0 = time.perf_counter()
    cells = []
    reused: dict[str, Any] = {}
    if args.reuse:
        with open(args.reuse) as f:
            reused = json.load(f)
        given = {(n, q) for n, q in cells_todo} if args.cells else set()
        cells = [c for c in reused.get("cells", []) if (c["ranks"], c["params"]) not in given]
        cells_todo = sorted(given)
    unavailable = _unavailable()
    for m, why in unavailable.items():
        print(f"[scale] {m} not available: {why}", flush=True)
    for n, q in cells_todo:
        methods = [m for m in args.methods.split(",") if m in METHODS and m not in unavailable]
        skipped = []
        est = estimate_gib(n, q)
        if est > args.max_gib:
            skipped = [m for m in methods if m in ("dcp", "dcp_cached")]
            methods = [m for m in methods if m not in skipped]
        print(f"[scale] N={n} P={q}: {', '.join(methods)}" + (f" (skipped {skipped}: ~{est:.0f} GiB)" if skipped else ""),
              flush=True)
        est_md = None
        if skipped:  # .metadata grows linearly with N: scaled from the largest cell of this P that had it
            ref = max((c for c in cells if c["params"] == q and (c.get("resume") or {}).get("metadata_bytes")
                       and not (c.get("resume") or {}).get("metadata_estimated")),
                      key=lambda c: c["ranks"], default=None)
            if ref is not None:
                est_md = int(ref["resume"]["metadata_bytes"] * n / ref["ranks"])
        if mode == "smoke":  # tiny cells: in this process (no interpreter and torch import per cell)
            t_c = time.perf_counter()
            res = cell(n, q, methods, reps, est_md)
            res["process_wall_s"] = time.perf_counter() - t_c
        else:
            res = run_cell(n, q, methods, args.cell_timeout, reps, est_md)
        if skipped:
            res["skipped"] = {"methods": skipped, "reason": f"coordinator memory estimate {est:.1f} GiB > --max-gib "
                                                            f"{args.max_gib}"}
        if res.get("error"):
            print(f"[scale]   failed: {res['error'][-500:]}", flush=True)
        else:
            print(f"[scale]   {res.get('process_wall_s', 0):.1f} s, max RSS {res.get('max_rss_gib', 0):.2f} GiB; "
                  + ", ".join(f"{m} {r['coordinator_cpu_s']:.3f} s" for m, r in res["methods"].items()), flush=True)
        cells.append(res)
    cells.sort(key=lambda c: (c["params"], c["ranks"]))
    jobs = None
    if args.jobs_json:
        from . import scale_jobs

        merged: list[dict[str, Any]] = []
        s3 = None
        for path in args.jobs_json.split(","):
            with open(path) as f:
                got = json.load(f)
            got = got.get("jobs", got) if "cells" in got else got
            merged += got.get("jobs", [])
            s3 = got.get("s3") or s3
        merged.sort(key=lambda j: (bool(j.get("reshard")), j["world_size"]))
        jobs = {"jobs": merged, "summary": scale_jobs.summarise(merged, OPS_LIMIT), "s3": s3,
                "config": {"from": args.jobs_json}}
    elif not args.no_jobs:
        from . import scale_jobs

        jobs = scale_jobs.run_all(cfg["jobs"], os.path.dirname(os.path.abspath(args.out)))
    result = {
        "schema": 1, "mode": mode if not reused else f"{reused.get('mode')} (+ {args.cells or 'no new cells'})", "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(time.perf_counter() - t0, 1), "machine": _machine(), "shapes": {
            "hidden": HIDDEN, "intermediate": INTERMEDIATE, "vocab": VOCAB, "kv": KV, "dtype": "float32",
            "optimizer": "AdamW", "per_rank_values": [f"__rng__.{k}" for k, _, _ in RNG] + PER_RANK_VALUES},
        "methods": METHODS, "cells": cells, "jobs": jobs,
        "unavailable": unavailable,
        "rc_source": next((c["methods"]["rc"]["source"] for c in cells if "rc" in c.get("methods", {})),
                          RollCkptFastPath().source),
    }
    result["targets"] = targets(cells, (jobs or {}).get("summary"))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    base = os.path.splitext(os.path.abspath(args.out))[0]
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    from .report import scale_markdown, scale_plot

    md = scale_markdown(result)
    with open(base + ".md", "w") as f:
        f.write(md)
    if not args.no_plot:
        scale_plot(result, base + ".png")
    print(md)
    print(f"[scale] {result['duration_s']} s; wrote {base}.{{json,md{',png' if not args.no_plot else ''}}}")
    return 0


def _machine() -> dict[str, Any]:
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "host": platform.node()}
    try:
        info["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    except OSError:
        pass
    return info


if __name__ == "__main__":
    sys.exit(main())
