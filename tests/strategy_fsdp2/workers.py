"""Multi-rank scenarios run under torchrun by the tests next to this file.

``python -m torch.distributed.run --standalone --nproc_per_node N workers.py SCENARIO OUT [args]``
(helpers.launch.torchrun: ``tests/`` on ``PYTHONPATH``, for the shared helpers).
Rank 0 writes what it measured to ``OUT/result-<scenario>.json``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from helpers import training
from helpers.launch import exit_worker
from roll_ckpt import CheckpointManager, load_config


# ROLL_CKPT_TEST_DEVICE=cuda runs the same scenarios on GPUs (NCCL for FSDP, gloo for
# checkpoints): scripts/gpu_check.sh does that on a GPU machine.
DEVICE = os.environ.get("ROLL_CKPT_TEST_DEVICE", "cpu")


def build(width: int = 64, depth: int = 3, mesh_kind: str = "fsdp", seed: int = 0):
    ws = dist.get_world_size()
    mesh = (init_device_mesh(DEVICE, (ws, 1), mesh_dim_names=("replicate", "shard"))
            if mesh_kind == "hsdp" else init_device_mesh(DEVICE, (ws,)))
    model = training.shard(training.mlp(width, depth, seed=seed).to(DEVICE), mesh)
    return (model, *training.optimizer_and_scheduler(model))


def manager(out: str, **cfg):
    base = {"checkpoint_config": {"output_dir": out}, "strategy_config": {"async_save_ckpt": True}}
    base.update(cfg)
    return CheckpointManager.from_config(load_config(base), quiet=True)


def train_step(model, opt, sched, data):
    idx = random.randrange(len(data))
    noise = float(np.random.rand())
    x = data[idx].to(DEVICE)
    x = x + torch.randn(x.shape, generator=None).to(DEVICE) * 0.01 * noise
    return training.train_step({"model": model, "optimizer": opt, "scheduler": sched}, x, scheduler=True).item()


def full(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().cpu().clone() for k, v in model.state_dict().items()}


def optim_full(model, opt) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt)
    return {f"{p}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu().clone()
            for p, st in osd["state"].items() for k, v in st.items()}


def result(out: str, name: str, body: dict) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"result-{name}.json"), "w") as f:
            json.dump(body, f)


# ------------------------------------------------------------------ scenarios


def resume_exact(out: str, mode: str, die_at: str) -> None:
    """Train 11 steps with the offload cycle, async save every 3; maybe die after a save.

    Resumed at 6, the run goes through offload cycles and an async save from the store (9)
    before it ends: a resume must leave the parameters as FSDP2 computes from them."""
    die_at = int(die_at)
    model, opt, sched = build()
    torch.manual_seed(1 + dist.get_rank())
    random.seed(2 + dist.get_rank())
    np.random.seed(3 + dist.get_rank())
    data = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(10)]
    m = manager(out, save_steps=3, resume_from_checkpoint=mode == "resume")
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    start = m.resume(state)
    losses = {}
    for step in range(start + 1, 12):
        losses[step] = train_step(model, opt, sched, data).hex()
        m.strategy.offload_states(state, optimizer=True)  # rollout phase: the store holds it
        m.maybe_save(step, state)
        m.strategy.load_states(state)
        if step == die_at:
            m.wait()
            dist.barrier()
            os._exit(0)  # abrupt: no close, no final save
    periodic = m.wait() or m.stats.last  # the last periodic (async) save
    m.save(11, state, final=True)
    m.close()
    params = full(model)
    result(out, f"resume_exact-{mode}", {"start": start, "losses": losses,
                                         "policies": dict(periodic.policies) if periodic else {}})
    if dist.get_rank() == 0:
        torch.save(params, os.path.join(out, f"params-{mode}.pt"))


def paths_equal(out: str, kind: str) -> None:
    """Save the same state through the regular path, then from the offload store."""
    model, opt, sched = build(mesh_kind="hsdp" if kind == "local_dedup" else "fsdp")
    data = [torch.randn(8, 16) for _ in range(3)]
    for _ in range(2):
        train_step(model, opt, sched, data)
    m = manager(out, offload_backend=kind, checkpoint_config={"output_dir": out, "timestamp_subdir": False})
    state = {"model": model, "optimizer": opt}
    m.save(1, state)
    m.wait()
    regular = dict(m.stats.last.policies)
    m.strategy.offload_states(state, optimizer=True)
    m.save(2, state)
    m.wait()
    from_store = dict(m.stats.last.policies)
    m.strategy.load_states(state)
    m.close()
    result(out, f"paths_equal-{kind}", {"regular": regular, "store": from_store})


class PeakRSS:
    """Samples this process's RSS every millisecond to catch the peak."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.peak = self.base = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self) -> "PeakRSS":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def zero_copy_bytes(out: str, width: str) -> None:
    """A state of >= 256 MB: staging from the store copies nothing and adds no memory."""
    width = int(width)
    model, opt, sched = build(width=width, depth=4)
    data = [torch.randn(4, 16)]
    train_step(model, opt, sched, data)
    state = {"model": model, "optimizer": opt}
    m = manager(out)
    m.bind(state)
    m.save(1, state)  # warm-up: run folder, process group, DCP planner caches
    m.wait()
    m.strategy.offload_states(state, optimizer=True)
    import gc

    gc.collect()
    copies = {"n": 0}
    from torch.overrides import TorchFunctionMode

    def nbytes(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        return sum(nbytes(v) for v in x) if isinstance(x, (list, tuple)) else 0

    class CountCopies(TorchFunctionMode):
        """The bytes every copying call reads (copy_'s source, clone's, cat's inputs...)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("copy_", "clone", "contiguous", "to", "cpu", "detach_copy", "cat"):
                copies["n"] += nbytes(args[1] if name == "copy_" else args[0]) if args else 0
            return func(*args, **(kwargs or {}))

    with PeakRSS() as rss:
        with CountCopies():
            m.save(2, state)
        m.wait()
    zc = m.stats.last
    m.strategy.load_states(state)
    m.save(3, state)  # same state, live: regular staging, for comparison
    m.wait()
    with PeakRSS() as rss_regular:
        m.save(4, state)
        m.wait()
    reg = m.stats.last
    m.close()
    state_bytes = sum(t._local_tensor.numel() * t._local_tensor.element_size() for t in model.parameters())
    state_bytes += sum(v._local_tensor.numel() * v._local_tensor.element_size()
                       for st in opt.state.values() for v in st.values() if hasattr(v, "_local_tensor"))
    stats = torch.tensor([state_bytes, zc.bytes_copied, rss.peak - rss.base, reg.bytes_copied,
                          rss_regular.peak - rss_regular.base, copies["n"], zc.policies.get("regular", 0)],
                         dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, stats)
    result(out, "zero_copy_bytes", {
        "ranks": [dict(zip(["state_bytes", "zc_bytes_copied", "zc_extra_rss", "reg_bytes_copied",
                            "reg_extra_rss", "copied_by_calls", "regular_tensors"], g.tolist())) for g in gathered],
        "zc_policies": dict(zc.policies), "zc_blocked_s": zc.blocked_s, "reg_blocked_s": reg.blocked_s,
        "zc_total_bytes": zc.bytes})


_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                "all_reduce", "all_gather", "broadcast", "barrier", "reduce_scatter_tensor",
                "all_gather_into_tensor", "gather", "scatter", "monitored_barrier")


def count_collectives(fn) -> dict[str, int]:
    counts: dict[str, int] = {}
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def wrap(n, f):
        def inner(*a, **k):
            counts[n] = counts.get(n, 0) + 1
            return f(*a, **k)
        return inner

    for n, f in saved.items():
        setattr(dist, n, wrap(n, f))
    try:
        fn()
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return counts


def collectives(out: str) -> None:
    """The first save issues exactly the collectives of a plain dcp.save of the same state
    and the save's two agreements (before the write, after the commit: one all-reduce of one
    integer each); a zero-copy save of the same structure the fixed-layout protocol's three
    and the same two."""
    import torch.distributed.checkpoint as dcp

    model, opt, sched = build()
    train_step(model, opt, sched, [torch.randn(4, 16)])
    state = {"model": model, "optimizer": opt}
    m = manager(out)
    m.bind(state)
    m.save(1, state)  # (the manager's first save also agrees on its run folder)
    m.wait()
    m.io.layouts.forget()  # as after a change of structure: DCP's full path
    first = count_collectives(lambda: (m.save(2, state), m.wait()))
    m.strategy.offload_states(state, optimizer=True)
    ours = count_collectives(lambda: (m.save(3, state), m.wait()))
    m.strategy.load_states(state)
    sd = m.strategy.state_dict(state)
    group = m.strategy.process_group
    plain = count_collectives(lambda: dcp.save(sd, checkpoint_id=os.path.join(out, "plain"), process_group=group))
    fast = m.io.layouts.fast_saves
    m.close()
    result(out, "collectives", {"first": first, "ours": ours, "plain": plain, "fast": fast})


def reshard_save(out: str) -> None:
    model, opt, sched = build(width=33)
    train_step(model, opt, sched, [torch.randn(4, 16)])
    m = manager(out, checkpoint_config={"output_dir": out, "timestamp_subdir": False})
    m.save(5, {"model": model, "optimizer": opt}, final=True)
    m.close()
    params, optim = full(model), optim_full(model, opt)
    if dist.get_rank() == 0:
        torch.save({"params": params, "optim": optim}, os.path.join(out, "expected.pt"))


def reshard_load(out: str) -> None:
    model, opt, sched = build(width=33, seed=123)
    m = manager(out, resume_from_checkpoint=os.path.join(out, "checkpoint-5"))
    step = m.resume({"model": model, "optimizer": opt})
    m.close()
    params, optim = full(model), optim_full(model, opt)
    if dist.get_rank() == 0:
        torch.save({"params": params, "optim": optim, "step": step},
                   os.path.join(out, f"loaded-{dist.get_world_size()}.pt"))


def race(out: str, guard: str) -> None:
    """Mutate the store right after an async zero-copy save returns, while the write is slow.

    With ``guard=off`` the store's hold is disabled: the test expects a mixed checkpoint
    then, which shows it can tell.
    """
    import roll_ckpt.dcp.files as dcp_io

    model, opt, sched = build(width=256)
    data = [torch.randn(8, 16)]
    train_step(model, opt, sched, data)
    state = {"model": model, "optimizer": opt}
    m = manager(out, checkpoint_config={"output_dir": out, "timestamp_subdir": False})
    m.bind(state)
    if guard == "off":
        m.strategy.store.hold = m.strategy.store.release = lambda: None
    expected = full(model)
    m.strategy.offload_states(state)
    slow_write = dcp_io._HashingStream.write

    def slow(self, b):
        if self.tell() == 0:
            time.sleep(1.0)  # each file starts late: the write outlasts the next step
        return slow_write(self, b)

    dcp_io._HashingStream.write = slow
    m.save(1, state)
    t0 = time.perf_counter()
    m.strategy.load_states(state)
    train_step(model, opt, sched, data)  # forward/backward/step overlap the write
    m.strategy.offload_states(state)     # overwrites the buffers: must wait for the write
    waited = time.perf_counter() - t0
    m.wait()
    dcp_io._HashingStream.write = slow_write
    m.strategy.load_states(state)
    m.close()
    if dist.get_rank() == 0:
        torch.save(expected, os.path.join(out, "expected.pt"))
    result(out, f"race-{guard}", {"waited_s": waited})


def incremental(out: str) -> None:
    """A model whose first two layers are frozen, sharded over the ranks, trained and saved
    asynchronously (zero-copy from the store) 3 times: from the second save on, each rank's
    file of frozen shards is taken over; then the older checkpoints are removed, and a new
    manager resumes the newest: every parameter and optimizer state exactly as saved."""
    import shutil

    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))

    def frozen_base(seed: int) -> dict:
        model = training.mlp(256, 3, seed=seed)
        for layer in (model[0], model[3]):
            layer.requires_grad_(False)
        model = training.shard(model.to(DEVICE), mesh)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return {"model": model, "optimizer": opt, "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)}

    state = frozen_base(0)
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    data = [torch.randn(8, 16) for _ in range(4)]
    m = manager(out)
    stats = []
    m.bind(state)
    for step in (1, 2, 3):
        train_step(model, opt, sched, data)
        m.strategy.offload_states(state, optimizer=True)  # a rollout phase: saved from the store
        m.save(step, state)
        m.wait()
        m.strategy.load_states(state)
        s = m.stats.last
        stats.append({"bytes": s.bytes, "taken": s.bytes_taken_over, "policies": dict(s.policies)})
    expected, expected_opt = full(model), optim_full(model, opt)
    m.close()
    dist.barrier()
    run = next(p for p in os.listdir(out) if not p.startswith("result"))
    folder = os.path.join(out, run)
    manifests = {c: json.load(open(os.path.join(folder, c, "manifest.json"))) for c in sorted(os.listdir(folder))
                 if c.startswith("checkpoint-")}
    taken = {c: sorted(n for n, e in man["files"].items() if e.get("taken_over")) for c, man in manifests.items()}
    links = {}
    for c in manifests:
        for n in os.listdir(os.path.join(folder, c, "dcp")):
            links[f"{c}/{n}"] = os.stat(os.path.join(folder, c, "dcp", n)).st_nlink
    dist.barrier()
    if dist.get_rank() == 0:
        for c in ("checkpoint-1", "checkpoint-2"):
            shutil.rmtree(os.path.join(folder, c))
    dist.barrier()
    state2 = frozen_base(1)
    model2, opt2, sched2 = state2["model"], state2["optimizer"], state2["scheduler"]
    m2 = manager(out, resume_from_checkpoint="latest")
    start = m2.resume(state2)
    got, got_opt = full(model2), optim_full(model2, opt2)
    exact = all(torch.equal(got[k], expected[k]) for k in expected) and \
        all(torch.equal(got_opt[k], expected_opt[k]) for k in expected_opt)
    train_step(model2, opt2, sched2, data)
    m2.save(4, state2)  # the first save after the resume takes over from the checkpoint resumed
    m2.wait()
    after = m2.stats.last.bytes_taken_over
    m2.close()
    result(out, "incremental", {"stats": stats, "taken": taken, "links": links, "start": start, "exact": exact,
                                "taken_after_resume": after,
                                "frozen_bytes": sum(v.numel() * v.element_size() for k, v in expected.items()
                                                    if k.startswith(("0.", "3.")))})


def claimed_by_any_module(out: str) -> None:
    """A state whose first module is an unsharded reference model, then the sharded actor:
    the fsdp2 strategy claims it, and both come back exactly."""
    reference = training.mlp(16, 2, seed=7).to(DEVICE)
    model, opt, sched = build()
    train_step(model, opt, sched, [torch.randn(4, 16)])
    state = {"reference": reference, "model": model, "optimizer": opt}
    m = manager(out)
    name = m.bind(state).name
    m.save(1, state)
    m.close()
    expected_ref = {k: v.clone() for k, v in reference.state_dict().items()}
    expected = full(model)
    with torch.no_grad():
        for p in [*reference.parameters(), *model.parameters()]:
            p.zero_()
    m = manager(out, resume_from_checkpoint="latest")
    m.resume(state)
    m.close()
    exact = all(torch.equal(expected_ref[k], v) for k, v in reference.state_dict().items()) and \
        all(torch.equal(expected[k], v) for k, v in full(model).items())
    result(out, "claimed_by_any_module", {"strategy": name, "exact": exact})


SCENARIOS = {f.__name__: f for f in (resume_exact, race, paths_equal, zero_copy_bytes, collectives,
                                      reshard_save, reshard_load, incremental, claimed_by_any_module)}

if __name__ == "__main__":
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    try:
        SCENARIOS[sys.argv[1]](*sys.argv[2:])
    finally:
        dist.destroy_process_group()
    exit_worker()
