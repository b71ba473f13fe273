"""One benchmark run on N ranks (FSDP2 on gloo, or NCCL on GPUs), started by :mod:`bench.run`:

    python -m torch.distributed.run --standalone --nproc_per_node N -m bench.worker SPEC.json OUT.json

SPEC lists groups (a state and the cases to run on it: ``width`` x ``depth`` Linear layers,
or ``tensors``, :func:`bench.many.build`'s many small ones). Every case of a group runs on the
same FSDP2 model + AdamW state, ``reps`` times, the order reversed on every other
repetition. Per case and repetition each rank measures its own blocking time, time until
durable, extra peak RSS (sampled every millisecond, plus the kernel's high-water mark)
and the bytes it copied while staging; rank 0 gathers them and writes OUT.json. Before the
repetitions each save case of :data:`KEPT_CASES` saves twice alone: the host memory it then
keeps between saves (:func:`kept`) is measured, and it is warm for the repetitions. The peer
libraries' cases (``tc_*``, ``bcp_*``) drive :mod:`bench.peers`' adapters.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
import warnings
from typing import Any

import torch
import xxhash
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from roll_ckpt.runtime.torch_compat import TorchCompatError, default_stager, fsdp2_options, gloo_averages

from roll_ckpt import CheckpointManager, load_config

from . import peers
from .common import PeakRSS, announce, drop_cache, io_read_bytes, rss_bytes, state_size, tree_bytes, tree_files

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")

DEVICE = "cpu"

# ----------------------------------------------------------------------------- hashing time

_HASH_S = [0.0]
_xxh3_128 = xxhash.xxh3_128


class _TimedXXH3:
    """``xxhash.xxh3_128`` with its ``update`` timed into ``_HASH_S``. roll-ckpt hashes through
    these objects: the writer's stream (whole file and 8 MiB pieces), the sink of an
    incremental save, the reads of a load and of a copy; without this the hashing went
    uncounted and T5 read 0."""

    __slots__ = ("_h",)

    def __init__(self, *args: Any) -> None:
        self._h = _xxh3_128(*args)

    def update(self, data: Any) -> None:
        t0 = time.perf_counter()
        self._h.update(data)
        _HASH_S[0] += time.perf_counter() - t0  # summed over writer threads: an upper bound

    def hexdigest(self) -> str:
        return self._h.hexdigest()


xxhash.xxh3_128 = _TimedXXH3  # looked up at each use by roll-ckpt: every hasher it makes is timed


# ----------------------------------------------------------------------------- state


def build(width: int, depth: int, mesh_kind: str = "fsdp") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    ws = dist.get_world_size()
    if mesh_kind == "hsdp":
        mesh = init_device_mesh(DEVICE, (ws, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(DEVICE, (ws,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)]).to(DEVICE)
    for layer in model:
        fully_shard(layer, mesh=mesh, **fsdp2_options(mesh.device_type))
    fully_shard(model, mesh=mesh, **fsdp2_options(mesh.device_type))
    if mesh_kind == "hsdp" and DEVICE == "cpu" and not gloo_averages():
        # torch 2.6's gloo cannot average over the replicas; they hold the same weights and
        # inputs, so their gradients are the same without it
        model.set_requires_all_reduce(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, width, device=DEVICE)
    model(x).pow(2).mean().backward()  # one step materialises AdamW's exp_avg / exp_avg_sq
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    return state_size(model, opt)[1]


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Group:
    """One state (model + AdamW) and everything the cases need to save and load it."""

    def __init__(self, spec: dict[str, Any], scratch: str) -> None:
        self.name = spec["name"]
        self.spec = spec
        self.rank = dist.get_rank()
        self.dir = os.path.join(scratch, self.name)
        if spec.get("tensors"):
            from .many import build as build_blocks

            self.model, self.opt = build_blocks(spec["tensors"], DEVICE)
        else:
            self.model, self.opt = build(spec["width"], spec["depth"])
        self.state = {"model": self.model, "optimizer": self.opt}
        self.tensors, self.state_bytes = state_size(self.model, self.opt)
        self.pg = dist.new_group(backend="gloo")  # checkpoint collectives off FSDP's group
        self.step = 0
        _trim()
        held0 = held()
        cfg = {"checkpoint_config": {"output_dir": os.path.join(self.dir, "rc"), "timestamp_subdir": False},
               "strategy_config": {"async_save_ckpt": True}}
        self.m = CheckpointManager.from_config(load_config(cfg), quiet=True)
        self.m.bind(self.state)
        self.m_load = CheckpointManager.from_config(load_config(cfg), quiet=True)
        self.m_load.bind(self.state)
        self.cfg = cfg
        self.managers: dict[Any, Any] = {}  # more managers, made when a case first needs them
        self.stager: Any = None
        self.dedup: tuple[Any, ...] | None = None
        self.invariants: list[str] = []
        self.peer_paths: dict[str, str] = {}  # the checkpoint each peer's load reads, written once
        # The checkpoint both loaders read (roll-ckpt's dcp/ folder is a plain DCP folder).
        self.load_path = self.m.save(self.next_step(), self.state, final=True)
        self.load_bytes = tree_bytes(self.load_path) if self.rank == 0 else 0
        _trim()
        # what self.m's first save kept (its writer's buffers): counted in the kept memory of
        # the cases that save through self.m
        self.init_kept = {k: held()[k] - held0[k] for k in held0}

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def path(self, kind: str) -> str:
        return os.path.join(self.dir, f"{kind}-{self.step}")

    def sd(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optimizer": osd}

    def manager(self, key: Any, checkpoint: dict[str, Any] | None = None,
                strategy: dict[str, Any] | None = None) -> Any:
        """A manager of its own for a case whose configuration differs from ``self.m``'s."""
        if key not in self.managers:
            cfg = {"checkpoint_config": {**self.cfg["checkpoint_config"], **(checkpoint or {})},
                   "strategy_config": {**self.cfg["strategy_config"], **(strategy or {})}}
            m = CheckpointManager.from_config(load_config(cfg), quiet=True)
            m.bind(self.state)
            self.managers[key] = m
        return self.managers[key]

    def dedup_group(self) -> tuple[Any, ...]:
        if self.dedup is None:
            model, opt = build(self.spec["width"], self.spec["depth"], mesh_kind="hsdp")
            state = {"model": model, "optimizer": opt}
            cfg = {"checkpoint_config": {"output_dir": os.path.join(self.dir, "dedup"), "timestamp_subdir": False},
                   "strategy_config": {"async_save_ckpt": True}, "offload_backend": "local_dedup"}
            m = CheckpointManager.from_config(load_config(cfg), quiet=True)
            m.bind(state)
            self.dedup = (m, state, local_bytes(model, opt))
        return self.dedup

    def close(self) -> None:
        self.m.close()
        self.m_load.close()
        for m in self.managers.values():
            m.close()
        if self.dedup is not None:
            self.dedup[0].close()
        if self.stager is not None:
            self.stager.close()


# ----------------------------------------------------------------------------- cases
#
# A case is prepare() -> run() -> cleanup(); only run() is timed and memory-sampled. run()
# returns (blocked_s, durable_s, extra) measured from its own start, and leaves the
# checkpoint durable. ``extra`` holds per-rank facts (bytes copied at staging...).


class Case:
    name = ""
    title = ""
    kind = "save"  # or "load"
    ranks_min = 1

    def __init__(self, g: Group) -> None:
        self.g = g
        self.written: str | None = None

    uses_group_manager = False
    """Saves through ``g.m``, whose first save (in :class:`Group`) its kept memory includes."""

    def setup(self) -> None:
        """Once, before the group's repetitions and after :func:`kept` (a peer's load writes
        the checkpoint it then reads)."""

    def prepare(self) -> None:
        pass

    def unavailable(self) -> str | None:
        """Why this torch cannot run the case (an older release without the DCP option it
        measures), or ``None``."""
        return None

    def run(self) -> tuple[float, float, dict[str, Any]]:
        raise NotImplementedError

    def cleanup(self) -> None:
        dist.barrier()
        if self.written and self.g.rank == 0:
            shutil.rmtree(self.written, ignore_errors=True)
        self.written = None

    def state_bytes(self) -> int:
        return self.g.state_bytes

    def load_bytes(self) -> int:
        """A load's checkpoint bytes (rank 0; 0 elsewhere)."""
        return self.g.load_bytes

    def owned(self) -> set[int] | None:
        """The processes whose memory this case's library keeps for it (a peer's), or ``None``:
        then :func:`kept` counts the children that appeared during its saves."""
        return None

    def before_kept(self) -> None:
        """Before :func:`kept` measures this case: drop what another case of the same library
        made and this one would reuse (else whichever is measured second looks free)."""


class TorchSave(Case):
    name, title = "torch_save", "torch.save + fsync (per rank)"

    def run(self):
        g = self.g
        folder = g.path("torch_save")
        os.makedirs(folder, exist_ok=True)
        t0 = time.perf_counter()
        sd = g.sd()
        local = {k: {n: getattr(v, "_local_tensor", v) for n, v in sub.items()} if isinstance(sub, dict) else sub
                 for k, sub in sd.items()}
        local["optimizer"] = {"state": {p: {k: getattr(v, "_local_tensor", v) for k, v in st.items()}
                                        for p, st in sd["optimizer"]["state"].items()},
                              "param_groups": sd["optimizer"]["param_groups"]}
        with open(os.path.join(folder, f"rank{g.rank}.pt"), "wb") as f:
            torch.save(local, f)
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        self.written = folder
        return dt, dt, {}


class DCPSave(Case):
    name, title = "dcp_save", "dcp.save (FileSystemWriter defaults)"

    def run(self):
        g = self.g
        path = g.path("dcp_save")
        t0 = time.perf_counter()
        dcp.save(g.sd(), checkpoint_id=path, process_group=g.pg)
        dt = time.perf_counter() - t0
        self.written = path
        return dt, dt, {}


class DCPAsync(Case):
    name, title = "dcp_async", "dcp.async_save, default staging (torchtitan async)"

    def run(self):
        g = self.g
        path = g.path("dcp_async")
        t0 = time.perf_counter()
        fut = dcp.async_save(g.sd(), checkpoint_id=path, process_group=g.pg)
        blocked = time.perf_counter() - t0
        fut.result()
        self.written = path
        return blocked, time.perf_counter() - t0, {"copied": g.state_bytes}


class DCPAsyncStager(Case):
    name, title = "dcp_async_stager", "dcp.async_save + DefaultStager"

    def unavailable(self):
        try:
            if self.g.stager is None:
                self.g.stager = default_stager(DEVICE == "cuda")
        except TorchCompatError as exc:
            return str(exc)
        return None

    def run(self):
        g = self.g
        path = g.path("dcp_async_stager")
        t0 = time.perf_counter()
        resp = dcp.async_save(g.sd(), checkpoint_id=path, process_group=g.pg, async_stager=g.stager)
        blocked = time.perf_counter() - t0
        staged = None
        if hasattr(resp, "staging_completion"):
            resp.staging_completion.result()
            staged = time.perf_counter() - t0
            resp.upload_completion.result()
        else:
            resp.result()
        self.written = path
        return blocked, time.perf_counter() - t0, {"copied": g.state_bytes, "staged_s": staged}


class RCSave(Case):
    name, title = "rc_save", "roll-ckpt sync save"
    threads: int | None = None
    uses_group_manager = True

    def run(self):
        g = self.g
        io = g.m.io
        if self.threads is not None:
            io.writer_threads = lambda nbytes=0: self.threads
        _HASH_S[0] = 0.0
        try:
            t0 = time.perf_counter()
            self.written = g.m.save(g.next_step(), g.state, final=True)
            dt = time.perf_counter() - t0
        finally:
            io.__dict__.pop("writer_threads", None)
        st = g.m.stats.last
        return dt, dt, {"copied": st.bytes_copied, "hash_s": _HASH_S[0],
                        "threads": io.writer_threads(g.state_bytes) if self.threads is None else self.threads}


class RCSaveT1(RCSave):
    name, title = "rc_save_t1", "roll-ckpt sync save, 1 writer thread"
    threads = 1


class RCAsync(Case):
    name, title = "rc_async", "roll-ckpt async, regular staging (default: buffers freed between saves, made ready " \
                              "the step before)"
    offload: bool | None = None  # None: live state; False: model in the store; True: model + optimizer

    @property
    def uses_group_manager(self) -> bool:  # type: ignore[override]
        return self.offload is not None

    def manager(self) -> tuple[Any, dict[str, Any]]:
        if self.offload is None:
            # A manager of its own: a manager keeps the staging buffers of 2 layouts, and the
            # live, model-offloaded and all-offloaded saves are 3; sharing ``g.m`` rebuilt them
            # on every save (1.0x extra RSS, fresh-memory copies in the blocked time).
            return self.g.manager("async-live"), self.g.state
        return self.g.m, self.g.state

    def prepare(self):
        m, state = self.manager()
        if self.offload is not None:
            m.strategy.offload_states(state, optimizer=self.offload)
            sync()
        if self.announced:
            announce(m)

    announced = True
    """The save announced the step before, as ``maybe_save`` does (:func:`bench.common.announce`)."""

    def run(self):
        m, state = self.manager()
        _HASH_S[0] = 0.0
        t0 = time.perf_counter()
        self.written = m.save(self.g.next_step(), state)
        blocked = time.perf_counter() - t0
        m.wait()
        durable = time.perf_counter() - t0
        st = m.stats.last
        return blocked, durable, {"copied": st.bytes_copied, "policies": dict(st.policies), "hash_s": _HASH_S[0]}

    def cleanup(self):
        m, state = self.manager()
        self.g.invariants += check_no_store_alias(m, state, self.name)
        if self.offload is not None:
            m.strategy.load_states(state)
            sync()
        super().cleanup()


def check_no_store_alias(m: Any, state: dict[str, Any], case: str) -> list[str]:
    """A save must leave the training state's tensors alone: none may alias the offload store."""
    store = getattr(m.strategy, "store", None)
    if store is None or not store.buffers:
        return []
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in store.buffers.values()]
    bad = []
    for key, obj in state.items():
        if isinstance(obj, torch.optim.Optimizer):
            for st in obj.state.values():
                for k, v in st.items():
                    local = getattr(v, "_local_tensor", v)
                    if isinstance(local, torch.Tensor) and local.numel() and any(
                            a <= local.data_ptr() < b for a, b in spans):
                        bad.append(f"{case}: optimizer state {k} aliases the offload store after the save")
    return bad[:1]


class RCAsyncKeep(RCAsync):
    name, title = "rc_async_keep", "roll-ckpt async, regular staging, keep_staging_buffers: true"

    def manager(self):
        return self.g.manager("async-keep", strategy={"keep_staging_buffers": True}), self.g.state


class RCAsyncCold(RCAsync):
    """A save nobody announced (a direct ``save()`` call): its buffers' memory is made in the call."""

    name, title = "rc_async_cold", "roll-ckpt async, regular staging, a save not announced (buffers made in the call)"
    announced = False

    def manager(self):
        return self.g.manager("async-cold"), self.g.state


class RCAsyncZCModel(RCAsync):
    name, title = "rc_async_zc_model", "roll-ckpt async, zero-copy (model in the store)"
    offload = False


class RCAsyncZCAll(RCAsync):
    name, title = "rc_async_zc_all", "roll-ckpt async, zero-copy (model + optimizer in the store)"
    offload = True


class RCBudget(RCAsync):
    """Regular staging within ``strategy_config.max_staging_bytes`` = ``frac`` x the rank's state.

    Cold: the manager's staging buffers are dropped before each save, so the extra peak
    RSS counts them (a warm save reuses buffers that are already resident); the blocked
    time then includes their first-touch page faults.
    """

    frac: float = 0.0  # 0: no bound

    def manager(self):
        g = self.g
        budget = int(self.frac * g.state_bytes)
        return g.manager(("budget", self.frac), strategy={"max_staging_bytes": budget}), g.state

    def prepare(self):
        m, _ = self.manager()
        m.wait()
        m._saves._reuse.clear()  # the arenas go; measure() gives the memory back before the save


class RCBudget010(RCBudget):
    name, title, frac = "rc_budget_0.1", "roll-ckpt async, regular staging, max_staging_bytes 0.1x state (cold)", 0.1


class RCBudget025(RCBudget):
    name, title, frac = "rc_budget_0.25", "roll-ckpt async, regular staging, max_staging_bytes 0.25x state (cold)", 0.25


class RCBudget050(RCBudget):
    name, title, frac = "rc_budget_0.5", "roll-ckpt async, regular staging, max_staging_bytes 0.5x state (cold)", 0.5


class RCBudgetNone(RCBudget):
    name, title, frac = "rc_budget_none", "roll-ckpt async, regular staging, no budget (cold)", 0.0


class DCPAsyncHSDP(Case):
    name, title = "dcp_async_hsdp", "dcp.async_save, default staging, on the local_dedup case's HSDP state"
    ranks_min = 2

    def run(self):
        g = self.g
        _, state, _ = g.dedup_group()
        path = g.path("dcp_async_hsdp")
        t0 = time.perf_counter()
        msd, osd = get_state_dict(state["model"], state["optimizer"])
        fut = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=path, process_group=g.pg)
        blocked = time.perf_counter() - t0
        fut.result()
        self.written = path
        return blocked, time.perf_counter() - t0, {"copied": self.state_bytes()}

    def state_bytes(self) -> int:
        return self.g.dedup_group()[2]


class RCDedup(RCAsync):
    name, title = "rc_dedup", "roll-ckpt async, local_dedup store (HSDP, rebuilt + staged)"
    offload = True
    ranks_min = 2
    uses_group_manager = False  # its own manager, on its own state

    def manager(self):
        m, state, _ = self.g.dedup_group()
        return m, state

    def state_bytes(self) -> int:
        return self.g.dedup_group()[2]


class RCDedupCold(RCDedup):
    """``rc_dedup`` with the manager's reused staging buffers dropped first: the extra RSS
    then counts the buffers a warm save finds already resident."""

    name, title = "rc_dedup_cold", "roll-ckpt async, local_dedup store, staging buffers dropped first (cold)"

    def prepare(self):
        m, _ = self.manager()
        m.wait()
        m._saves._reuse.clear()
        super().prepare()


class _Limit(Case):
    """The machine's own limits, measured by rank 0 in the same alternation as the cases."""

    kind = "limit"

    def limits(self) -> Any:
        g = self.g
        if getattr(g, "_limits", None) is None:
            from .limits import Limits

            g._limits = Limits(os.path.join(g.dir, "limits"), g.load_bytes) if g.rank == 0 else None
        return g._limits

    def prepare(self):
        self.limits()

    def run(self):
        lim = self.limits()
        rate, method = (self.measure(lim) if lim is not None else (0.0, ""))
        return 0.0, 0.0, {"rate": rate, "method": method, "nbytes": lim.nbytes if lim else 0}

    def state_bytes(self) -> int:
        return 0


class LimitWrite(_Limit):
    name, title = "limit_write", "disk: sequential write + fdatasync"

    def measure(self, lim):
        return lim.disk_write(1), "dd bs=16M conv=fdatasync"


class LimitWrite2(_Limit):
    name, title = "limit_write2", "disk: 2 files written at once + fdatasync"

    def measure(self, lim):
        return lim.disk_write(2), "2 x dd bs=16M conv=fdatasync"


class LimitWriteDirect(_Limit):
    name, title = "limit_write_direct", "disk: sequential write with O_DIRECT + fdatasync"

    def measure(self, lim):
        try:
            return lim.disk_write(1, direct=True), "dd bs=16M oflag=direct conv=fdatasync"
        except OSError:  # no O_DIRECT on this file system
            return 0.0, "O_DIRECT refused"


class LimitRead(_Limit):
    name, title = "limit_read", "disk: uncached sequential read"

    def measure(self, lim):
        return lim.disk_read()


class LimitRead2(_Limit):
    name, title = "limit_read2", "disk: 2 files read at once, uncached"

    def measure(self, lim):
        return lim.disk_read(2)


class LimitMemcpy(_Limit):
    name, title = "limit_memcpy", "memory: memcpy between touched buffers"

    def measure(self, lim):
        return lim.memcpy(), "numpy.copyto"


class LimitMemcpyFresh(_Limit):
    name, title = "limit_memcpy_fresh", "memory: copy into a fresh allocation (clone)"

    def measure(self, lim):
        return lim.memcpy_fresh(), "torch.clone"


class _Load(Case):
    kind = "load"

    def source(self) -> str:
        """The checkpoint this load reads."""
        return self.g.load_path

    def prepare(self):
        dist.barrier()
        if self.g.rank == 0:
            drop_cache(tree_files(self.source()))  # cold: read from the disk, not the page cache
        dist.barrier()


class RCLoad(_Load):
    name, title = "rc_load", "roll-ckpt resume (verify every file, then load)"

    def loader(self) -> Any:
        return self.g.m_load

    def prepare(self):
        self.loader()
        super().prepare()

    def run(self):
        g = self.g
        m = self.loader()
        _HASH_S[0] = 0.0
        io0 = io_read_bytes()
        t0 = time.perf_counter()
        m.resume(g.state, target=g.load_path)
        sync()
        dt = time.perf_counter() - t0
        return dt, dt, {"hash_s": _HASH_S[0], "read_bytes": io_read_bytes() - io0}


class RCLoadStream(RCLoad):
    name, title = "rc_load_stream", "roll-ckpt resume, one pass (verify_before_load: false)"

    def loader(self) -> Any:
        return self.g.manager("stream", checkpoint={"verify_before_load": False})


class DCPLoad(_Load):
    name, title = "dcp_load", "dcp.load (FileSystemReader) + set_state_dict"

    def run(self):
        g = self.g
        io0 = io_read_bytes()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(g.model, g.opt)
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(g.load_path, "dcp"), process_group=g.pg)
        set_state_dict(g.model, g.opt, model_state_dict=msd, optim_state_dict=osd)
        sync()
        dt = time.perf_counter() - t0
        return dt, dt, {"read_bytes": io_read_bytes() - io0}


# ----------------------------------------------------------------------------- peers
#
# The libraries a user would pick instead of roll-ckpt (bench/peers.py: how each saves, waits
# and loads, its settings here). Timed as the cases above: the state dict built in the call,
# blocked = until the training loop may change the state again, durable = until the files
# are on the disk.


class _Peer(Case):
    peer = ""
    """Its key in :data:`bench.peers.PEERS`."""
    processes = ""
    """Which of the adapter's processes serve this case (:meth:`bench.peers.Peer.processes`)."""

    def owned(self):
        return self.adapter().processes(self.processes)

    def adapter(self) -> Any:
        return peers.get(self.peer)

    def unavailable(self):
        return peers.PEERS[self.peer]().why_not()

    def save_once(self, path: str) -> None:
        """A save of the group's state at ``path``, waited for until durable (the load's checkpoint)."""
        a = self.adapter()
        if self.peer == "tc":  # its sync save: the async one stages each tensor in a shared-memory
            a.save(path, self.g.sd())  # file of its own, past the open-file limit at 30,000 tensors
        else:
            a.async_save(path, self.g.model, self.g.opt).written()
        a.durable(path, self.g.rank)


class TCSave(_Peer):
    name, title = "tc_save", "torch-checkpointing sync save; durable: + fsync (it never fsyncs)"
    peer, processes = "tc", "sync"

    def run(self):
        g, a = self.g, self.adapter()
        path = g.path("tc_save")
        t0 = time.perf_counter()
        a.save(path, g.sd())
        written = time.perf_counter() - t0
        a.durable(path, g.rank)
        self.written = path
        return written, time.perf_counter() - t0, {"written_s": written}


class TCAsync(_Peer):
    name, title = ("tc_async", "torch-checkpointing async (its default; blocked: until its staging lock is free, "
                   "i.e. the next optimizer.step() may run); durable: + fsync")
    peer, processes = "tc", "async"

    def run(self):
        g, a = self.g, self.adapter()
        path = g.path("tc_async")
        t0 = time.perf_counter()
        pending = a.async_save(path, g.sd())
        call = time.perf_counter() - t0
        pending.staged()
        blocked = time.perf_counter() - t0
        pending.written()
        written = time.perf_counter() - t0
        a.durable(path, g.rank)
        self.written = path
        return blocked, time.perf_counter() - t0, {"call_s": call, "written_s": written, "copied": g.state_bytes}


class _BCP(_Peer):
    peer, processes = "bcp", "server"

    def before_kept(self):
        # its staging pool and gRPC server serve its sync and async saves alike: each is
        # measured from none, as a job that uses only that one would start
        self.adapter().close()


class BCPSave(_BCP):
    name, title = "bcp_save", "ByteCheckpoint sync save (bytecheckpoint.save, fsdp2)"

    def run(self):
        g, a = self.g, self.adapter()
        path = g.path("bcp_save")
        t0 = time.perf_counter()
        a.save(path, g.model, g.opt)
        dt = time.perf_counter() - t0
        self.written = path
        return dt, dt, {}


class BCPAsync(_BCP):
    name, title = "bcp_async", "ByteCheckpoint async (fast_saving=True: the call copies the state, threads write)"

    def run(self):
        g, a = self.g, self.adapter()
        path = g.path("bcp_async")
        t0 = time.perf_counter()
        pending = a.async_save(path, g.model, g.opt)
        blocked = time.perf_counter() - t0
        pending.written()
        self.written = path
        return blocked, time.perf_counter() - t0, {"copied": g.state_bytes}


class _PeerLoad(_Load, _Peer):
    def setup(self):
        if self.peer not in self.g.peer_paths:
            path = os.path.join(self.g.dir, f"{self.peer}-load")
            self.save_once(path)
            dist.barrier()
            self.g.peer_paths[self.peer] = path

    def source(self) -> str:
        return self.g.peer_paths[self.peer]

    def load_bytes(self) -> int:
        return tree_bytes(self.source()) if self.g.rank == 0 else 0


class TCLoad(_PeerLoad):
    name, title = "tc_load", "torch-checkpointing load (mmap, into get_state_dict's tensors) + set_state_dict"
    peer = "tc"

    def run(self):
        g = self.g
        io0 = io_read_bytes()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(g.model, g.opt)
        self.adapter().load(self.source(), {"model": msd, "optimizer": osd})
        set_state_dict(g.model, g.opt, model_state_dict=msd, optim_state_dict=osd)
        sync()
        dt = time.perf_counter() - t0
        return dt, dt, {"read_bytes": io_read_bytes() - io0}


class BCPLoad(_PeerLoad):
    name, title = "bcp_load", "ByteCheckpoint load (bytecheckpoint.load, fsdp2)"
    peer = "bcp"

    def run(self):
        g = self.g
        io0 = io_read_bytes()
        t0 = time.perf_counter()
        self.adapter().load(self.source(), g.model, g.opt)
        sync()
        dt = time.perf_counter() - t0
        return dt, dt, {"read_bytes": io_read_bytes() - io0}


PEER_CASES = ["tc_save", "tc_async", "tc_load", "bcp_save", "bcp_async", "bcp_load"]

CASES: dict[str, type[Case]] = {c.name: c for c in (
    TorchSave, DCPSave, DCPAsync, DCPAsyncStager, RCSave, RCSaveT1, RCAsync, RCAsyncKeep, RCAsyncCold, RCAsyncZCModel,
    RCAsyncZCAll,
    RCDedup, RCDedupCold, DCPAsyncHSDP, RCBudget010, RCBudget025, RCBudget050, RCBudgetNone, DCPLoad, RCLoad, RCLoadStream,
    LimitWrite, LimitWrite2, LimitWriteDirect, LimitRead, LimitRead2, LimitMemcpy, LimitMemcpyFresh,
    TCSave, TCAsync, TCLoad, BCPSave, BCPAsync, BCPLoad)}

KEPT_CASES = ["torch_save", "dcp_save", "dcp_async", "rc_save", "rc_async", "rc_async_keep", "rc_async_zc_all", "tc_save",
              "tc_async", "bcp_save", "bcp_async"]
"""The saves whose kept host memory is measured (:func:`kept`): the warm ones each library
is used with (the budgets and the cold local_dedup case drop their buffers on purpose)."""


# ----------------------------------------------------------------------------- driver


def _trim() -> None:
    """Give freed heap memory back to the OS, so a case's extra RSS is what it allocates itself.

    Without it, memory a previous case freed but glibc kept would be reused silently (and
    would count in the next case's baseline).
    """
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def uss(pids: set[int] | None = None) -> int:
    """The unique memory (USS) of this process's children (``pids``: of those only)."""
    total = 0
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            if pids is None or child.pid in pids:
                try:
                    total += child.memory_full_info().uss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
    except ImportError:
        pass
    return total


def held() -> dict[str, int]:
    """Host memory this rank holds: its RSS, and the USS of its child processes."""
    return {"rss": rss_bytes(), "children": uss()}


def kept(case: Case, saves: int = 2) -> dict[str, int]:
    """Host memory ``case`` keeps between saves: what this rank holds after ``saves`` saves of
    it, alone and waited for until durable, against before its first (with its manager's first
    save in :class:`Group` where it saves through ``g.m``). Freed heap is given back first
    (:func:`_trim`), so what is left is what the library holds on to: staging buffers, pools,
    its processes."""
    case.before_kept()
    _trim()
    dist.barrier()
    before = held()
    for _ in range(saves):
        case.prepare()
        # as in measure(): a case's cleanup removes its folder on rank 0 after a barrier, and the
        # next run may write a folder of the same name (torch_save's): no rank starts before it is gone
        dist.barrier()
        case.run()
        case.cleanup()
    _trim()
    after = held()
    out = {k: after[k] - before[k] for k in before}
    if case.uses_group_manager:
        out = {k: out[k] + case.g.init_kept[k] for k in out}
    own = case.owned()
    if own is not None:  # a peer's processes, started by this case or an earlier one of its library
        out["children"] = uss(own)
    return out


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[worker {dist.get_world_size()}] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def measure(case: Case) -> dict[str, Any]:
    case.prepare()
    _trim()
    sync()
    dist.barrier()
    rss = PeakRSS().start()
    try:
        blocked, durable, extra = case.run()
    finally:
        extra_rss = rss.stop()
    mine = {"blocked_s": blocked, "durable_s": durable, "extra_rss": extra_rss, "rss_base": rss.base,
            "state_bytes": case.state_bytes(), **extra}
    written = case.written
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    nbytes = 0
    if dist.get_rank() == 0:
        if case.kind == "load":
            nbytes = case.load_bytes()
        elif written:
            nbytes = tree_bytes(written)
    case.cleanup()
    return {"ranks": everyone, "bytes": nbytes}


def run_group(spec: dict[str, Any], scratch: str, out: dict[str, Any]) -> None:
    ws = dist.get_world_size()
    t_build = time.perf_counter()
    g = Group(spec, scratch)
    build_s = time.perf_counter() - t_build
    gc.collect()
    gc.freeze()  # what exists now lives on: the collections between cases skip it (else ~0.3 s each)
    names = [n for n in spec["cases"] if CASES[n].ranks_min <= ws]
    cases = {n: CASES[n](g) for n in names}
    unavailable = {n: why for n in names if (why := cases[n].unavailable()) is not None}
    names = [n for n in names if n not in unavailable]
    for n, why in unavailable.items():
        log(f"{g.name}: {n} not available: {why}")
    results: dict[str, list[Any]] = {n: [] for n in names}
    log(f"{g.name}: state {g.state_bytes / 2**20:.0f} MiB/rank, {g.tensors} tensors, built in {build_s:.1f} s")
    held_kept: dict[str, list[Any]] = {}
    t_kept = time.perf_counter()
    for n in names:
        if n in KEPT_CASES:
            everyone: list[Any] = [None] * ws
            dist.all_gather_object(everyone, kept(cases[n]))
            held_kept[n] = everyone
    for n in names:
        cases[n].setup()
    log(f"{g.name}: kept memory of {len(held_kept)} saves measured, loads set up in "
        f"{time.perf_counter() - t_kept:.1f} s")
    if spec.get("warmup", True):
        for n in names:  # first calls pay for thread pools, process groups, staging buffers
            measure(cases[n])
        log(f"{g.name}: warm-up done")
    for rep in range(spec["reps"]):
        order = names if rep % 2 == 0 else names[::-1]
        t_rep = time.perf_counter()
        for n in order:
            results[n].append(measure(cases[n]))
        log(f"{g.name}: repetition {rep + 1} took {time.perf_counter() - t_rep:.1f} s")
    g.close()
    peers.close_all()
    out["groups"].append({
        "name": g.name, "world_size": ws, "width": spec.get("width"), "depth": spec.get("depth"),
        "tensors": g.tensors, "state_bytes": g.state_bytes, "build_s": build_s,
        "checkpoint_bytes": g.load_bytes, "invariants": g.invariants,
        "cases": {n: {"title": cases[n].title, "kind": cases[n].kind, "reps": results[n],
                      **({"kept": held_kept[n]} if n in held_kept else {})} for n in names},
        "unavailable": unavailable,
    })
    if dist.get_rank() == 0:
        shutil.rmtree(g.dir, ignore_errors=True)
    dist.barrier()


def main() -> None:
    global DEVICE
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    DEVICE = spec.get("device", "cpu")
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    out: dict[str, Any] = {"world_size": dist.get_world_size(), "device": DEVICE, "groups": []}
    try:
        for gspec in spec["groups"]:
            kind = gspec.get("kind", "state")
            if kind == "loop":
                from . import loop

                loop.run_group(gspec, spec["scratch"], out)
            elif kind == "transformer":
                from . import transformer

                transformer.run_group(gspec, spec["scratch"], out)
            elif kind == "many":
                from . import many

                many.run_group({"device": DEVICE, **gspec}, spec["scratch"], out)
            else:
                run_group(gspec, spec["scratch"], out)
            _trim()
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(out, f)
    finally:
        peers.shutdown_all()  # the peers' processes (a writer, a gRPC server), ended by their pids
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
