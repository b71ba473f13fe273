"""T7: blocked time of an async save against the number of tensors (run inside :mod:`bench.worker`).

A transformer-shaped state on FSDP2 + AdamW: blocks of LayerNorm(64) + Linear(64, 64)
(each block its own FSDP unit: 4 parameters, 16 tensors with AdamW's exp_avg, exp_avg_sq
and step), between two large Linear(64, 8192) layers. One state per point of the sweep;
per point every method saves once to warm up (roll-ckpt reuses its state-dict skeleton,
aliases and plan from the second save on; DCP fills its caches), then ``reps`` times in
alternating order. DCP is timed with its ``get_state_dict``, as torchtitan calls it on
every save.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from roll_ckpt.runtime.torch_compat import caching_save_planner, fsdp2_options

from roll_ckpt import CheckpointManager, load_config

from .common import announce, available, state_size

METHODS = ["dcp_async", "dcp_async_plancache", "rc_async", "rc_async_zc_all"]
NEEDS = {"dcp_async_plancache": caching_save_planner}
"""What a method needs of this torch (it raises TorchCompatError where a release lacks it)."""
TITLES = {
    "dcp_async": "get_state_dict + dcp.async_save, default staging",
    "dcp_async_plancache": "get_state_dict + dcp.async_save, DefaultSavePlanner(enable_plan_caching=True)",
    "rc_async": "roll-ckpt async, regular staging",
    "rc_async_zc_all": "roll-ckpt async, zero-copy (model + AdamW in the store)",
}
PER_BLOCK = 16  # tensors per block with AdamW
FIXED = 2 * 4  # the two large layers (weight only): 4 tensors each


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        import sys

        print(f"[worker {dist.get_world_size()}] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class Model(torch.nn.Module):
    def __init__(self, blocks: int, width: int = 64, vocab: int = 8192) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(vocab, width, bias=False)
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(blocks)])
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(tensors: int, device: str = "cpu") -> tuple[Model, torch.optim.Optimizer]:
    """A :class:`Model` of about ``tensors`` tensors with AdamW (each block its own FSDP2 unit),
    one step taken so that AdamW's state exists. Also the state of :mod:`bench.worker`'s
    ``tensors`` group."""
    blocks = max(1, round((tensors - FIXED) / PER_BLOCK))
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Model(blocks).to(device)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **fsdp2_options(mesh.device_type))
    fully_shard(model, mesh=mesh, **fsdp2_options(mesh.device_type))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 8192, device=device)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


class Point:
    def __init__(self, tensors: int, scratch: str, device: str = "cpu") -> None:
        self.dir = os.path.join(scratch, f"many-{tensors}")
        self.model, self.opt = build(tensors, device)
        self.state = {"model": self.model, "optimizer": self.opt}
        self.tensors, self.state_bytes = state_size(self.model, self.opt)
        self.pg = dist.new_group(backend="gloo")
        self.n = 0
        self.m: dict[str, Any] = {}
        for key in ("rc_async", "rc_async_zc_all"):
            cfg = {"checkpoint_config": {"output_dir": os.path.join(self.dir, key), "timestamp_subdir": False},
                   "strategy_config": {"async_save_ckpt": True}}
            m = CheckpointManager.from_config(load_config(cfg), quiet=True)
            m.bind(self.state)
            self.m[key] = m

    def save(self, method: str) -> dict[str, Any]:
        m = self.m.get(method)
        zc = method == "rc_async_zc_all"
        if zc:
            m.strategy.offload_states(self.state, optimizer=True)
        if m is not None:
            announce(m)
        dist.barrier()
        self.n += 1
        gsd = None
        t0 = time.perf_counter()
        if method.startswith("dcp"):
            msd, osd = get_state_dict(self.model, self.opt)
            gsd = time.perf_counter() - t0
            written = os.path.join(self.dir, f"{method}-{self.n}")
            kw = {"planner": caching_save_planner()} if method == "dcp_async_plancache" else {}
            fut = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=written, process_group=self.pg, **kw)
            blocked = time.perf_counter() - t0
            fut.result()
        else:
            written = m.save(self.n, self.state)
            blocked = time.perf_counter() - t0
            m.wait()
        durable = time.perf_counter() - t0
        if zc:
            m.strategy.load_states(self.state)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(written, ignore_errors=True)
        return {"blocked_s": blocked, "durable_s": durable, "get_state_dict_s": gsd}

    def close(self) -> None:
        for m in self.m.values():
            m.close()
        if dist.get_rank() == 0:
            shutil.rmtree(self.dir, ignore_errors=True)


def run_group(spec: dict[str, Any], scratch: str, out: dict[str, Any]) -> None:
    methods, unavailable = available(spec.get("methods", METHODS), NEEDS, lambda msg: log(f"{spec['name']}: {msg}"))
    points = []
    for n in spec["points"]:
        t_build = time.perf_counter()
        p = Point(n, os.path.join(scratch, spec["name"]), spec.get("device", "cpu"))
        build_s = time.perf_counter() - t_build
        for meth in methods:
            p.save(meth)
        res: dict[str, list[Any]] = {m: [] for m in methods}
        for rep in range(spec["reps"]):
            for meth in (methods if rep % 2 == 0 else methods[::-1]):
                mine = p.save(meth)
                everyone: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, mine)
                res[meth].append(everyone)
        log(f"{spec['name']}: {p.tensors} tensors ({p.state_bytes / 2**20:.1f} MiB/rank) built in {build_s:.1f} s, "
            f"measured in {time.perf_counter() - t_build - build_s:.1f} s")
        points.append({"tensors": p.tensors, "state_bytes": p.state_bytes, "methods": res})
        p.close()
    out["groups"].append({"name": spec["name"], "kind": "many", "world_size": dist.get_world_size(),
                          "titles": TITLES, "points": points, "unavailable": unavailable})
    dist.barrier()
