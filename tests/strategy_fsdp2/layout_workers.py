"""Ranks of the fixed-layout tests (test_fixed_layout_ranks.py), launched by torchrun.

``layout_save``: saves of one structure take the short path; a change of placement and of
mesh each takes the full path once. ``layout_resume``: a resume reads ``.metadata`` once for
the job, is exact (at the same or another world size), and starts from the checkpoint's
layout when the world size agrees.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(__file__))
from workers import DEVICE, full, manager, optim_full, train_step  # noqa: E402

from helpers import training  # noqa: E402
from helpers.launch import exit_worker  # noqa: E402


def _model(kind: str, seed: int = 0):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from roll_ckpt.runtime.torch_compat import fsdp2_options

    ws = dist.get_world_size()
    model = training.mlp(64, 3, seed=seed).to(DEVICE)
    if kind == "hsdp":
        mesh = init_device_mesh(DEVICE, (1, ws), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(DEVICE, (ws,))
    kw = {"shard_placement_fn": lambda p: Shard(1) if p.dim() > 1 else Shard(0)} if kind == "dim1" else {}
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, **kw, **fsdp2_options(mesh.device_type))
    fully_shard(model, mesh=mesh, **kw, **fsdp2_options(mesh.device_type))
    if kind == "hsdp" and not training.gloo_averages():
        model.set_requires_all_reduce(False)  # one replica: its average is itself (GLOO_AVG_MISSING)
    return (model, *training.optimizer_and_scheduler(model))


def _result(out: str, name: str, value: dict) -> None:
    with open(os.path.join(out, f"{name}-{dist.get_rank()}.json"), "w") as f:
        json.dump(value, f)


def layout_save(out: str) -> None:
    data = [torch.randn(8, 16)]
    model, opt, sched = _model("fsdp")
    m = manager(out, checkpoint_config={"output_dir": out, "timestamp_subdir": False})
    fast = []
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    for step in (1, 2, 3):
        train_step(model, opt, sched, data)
        m.save(step, state)
        m.wait()
        fast.append(m.io.layouts.fast_saves)
    expected = {3: {"params": full(model), "optim": optim_full(model, opt)}}
    step = 3
    for kind in ("dim1", "hsdp"):  # each a change of placement or mesh, same values
        other, other_opt, other_sched = _model(kind)
        state = {"model": other, "optimizer": other_opt, "scheduler": other_sched}
        for _ in range(2):
            step += 1
            train_step(other, other_opt, other_sched, data)
            m.save(step, state)
            m.wait()
            fast.append(m.io.layouts.fast_saves)
        model, opt = other, other_opt
    expected[step] = {"params": full(model), "optim": optim_full(model, opt)}
    m.close()
    if dist.get_rank() == 0:
        torch.save(expected, os.path.join(out, "expected.pt"))
    _result(out, "save", {"fast": fast})


def layout_resume(out: str, step: str, kind: str) -> None:
    """Resume ``checkpoint-<step>`` into a ``kind`` model, count what the resume read, save once more."""
    import roll_ckpt.dcp.checked as unpickle
    import roll_ckpt.dcp.reader as dcp_reader
    import roll_ckpt.strategies.dcp as dcp_strategy
    from roll_ckpt_fs.storage import LocalStorage

    opened: list[str] = []
    real_open = LocalStorage.open_read

    def open_read(self, path):
        opened.append(os.path.basename(path))
        return real_open(self, path)

    unpickles: list[bool] = []
    real_load = unpickle.safe_load_metadata

    def safe_load(data, where=".metadata"):
        unpickles.append(gc.isenabled())
        return real_load(data, where)

    LocalStorage.open_read = open_read
    # (the job's load unpickles in the strategy, a load of one process's own folder in the reader)
    dcp_reader.safe_load_metadata = dcp_strategy.safe_load_metadata = safe_load
    model, opt, sched = _model(kind, seed=123)
    m = manager(out, checkpoint_config={"output_dir": out, "timestamp_subdir": False},
                resume_from_checkpoint=os.path.join(out, f"checkpoint-{step}"))
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    got = m.resume(state)
    LocalStorage.open_read = real_open
    dcp_reader.safe_load_metadata = dcp_strategy.safe_load_metadata = real_load
    kept = m.io.resumed_from[3] is not None  # for the first save to adopt where it holds
    loaded = {"params": full(model), "optim": optim_full(model, opt)}
    data = [torch.randn(8, 16)]
    fast = []
    for extra in (1, 2):
        train_step(model, opt, sched, data)
        m.save(int(step) + 100 * dist.get_world_size() + extra, state)
        m.wait()
        fast.append(m.io.layouts.fast_saves)
    m.close()
    if dist.get_rank() == 0:
        torch.save(loaded, os.path.join(out, f"loaded-{step}-{dist.get_world_size()}.pt"))
    _result(out, f"resume-{step}-{dist.get_world_size()}", {
        "step": got, "kept": kept, "fast": fast, "metadata_opens": opened.count(".metadata"),
        "manifest_opens": opened.count("manifest.json"), "unpickles": unpickles})


SCENARIOS = {f.__name__: f for f in (layout_save, layout_resume)}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        SCENARIOS[sys.argv[1]](*sys.argv[2:])
    finally:
        dist.destroy_process_group()
    exit_worker()
