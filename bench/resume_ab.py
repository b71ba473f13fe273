"""A resume side by side: this checkout's against another commit's, on one state, alternated.

    python -m bench.resume_ab --base REV [--runs 9] [--resumes 5] [--width 2048] [--depth 11]

Where ``make bench-check``'s T24/T25 move, this tells whether a change made the resume slower:
a 2-rank FSDP2 + AdamW state (``width`` x ``depth`` ``Linear`` layers with AdamW: the
``target`` group's 528 MiB at the defaults) is saved once by each run, then resumed cold
``resumes`` times, each resume followed by a cold ``dcp.load`` of the same folder, in one
process per rank. ``--base`` is checked out into a temporary worktree; the runs alternate
between the two checkouts (this one first), each importing roll-ckpt from its own
``packages/*/src``. What is printed: each run's median resume as a multiple of its
``dcp.load``, and the median of those per checkout (the machine's noise cancels in the ratio).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worker(out: str, width: int, depth: int, resumes: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from roll_ckpt import CheckpointManager, load_config

    from .common import drop_cache, tree_files

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).pow(2).mean().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    group = dist.new_group(backend="gloo")  # dcp.load's, off FSDP's group
    cfg = load_config({"checkpoint_config": {"output_dir": out, "timestamp_subdir": False}})
    with CheckpointManager(cfg, quiet=True) as saver, CheckpointManager(cfg, quiet=True) as loader:
        path = saver.save(1, state, final=True)

        def cold() -> float:
            dist.barrier()
            if dist.get_rank() == 0:
                drop_cache(tree_files(path))
            dist.barrier()
            return time.perf_counter()

        ratios = []
        for _ in range(resumes):
            t0 = cold()
            loader.resume(state, target=path)
            dist.barrier()
            rc = time.perf_counter() - t0
            t0 = cold()
            msd, osd = get_state_dict(model, opt)
            dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(path, "dcp"), process_group=group)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            dist.barrier()
            ratios.append(rc / (time.perf_counter() - t0))
    if dist.get_rank() == 0:
        print(f"RATIO {statistics.median(ratios):.4f}", flush=True)
    dist.destroy_process_group()


def _run(checkout: Path, args: argparse.Namespace, scratch: str) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(p) for p in sorted((checkout / "packages").glob("*/src"))] + [str(ROOT)]))
    out = tempfile.mkdtemp(dir=scratch)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "-m", "bench.resume_ab", "--worker", out, "--width", str(args.width), "--depth", str(args.depth),
             "--resumes", str(args.resumes)],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RATIO ")]
    if proc.returncode or not lines:
        raise SystemExit(f"a run in {checkout} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return float(lines[-1].split()[1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.resume_ab", description=__doc__.splitlines()[0])
    p.add_argument("--base", help="the commit to compare with (a worktree of it is made and removed)")
    p.add_argument("--runs", type=int, default=9, help="runs per checkout, alternated")
    p.add_argument("--resumes", type=int, default=5, help="cold resumes (and dcp.loads) per run")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=11)
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)  # (one rank, under torchrun)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.width, args.depth, args.resumes)
    if not args.base:
        p.error("--base REV is required")
    scratch = tempfile.mkdtemp(prefix="resume-ab-")
    base = Path(scratch) / "base"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base), args.base], cwd=ROOT, check=True)
    ratios: dict[str, list[float]] = {"this checkout": [], args.base: []}
    try:
        for i in range(args.runs):
            for name, checkout in (("this checkout", ROOT), (args.base, base)):
                ratios[name].append(_run(checkout, args, scratch))
                print(f"run {i + 1}, {name}: resume / dcp.load {ratios[name][-1]:.2f}", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    for name, values in ratios.items():
        print(f"{name}: median {statistics.median(values):.2f} "
              f"(runs {min(values):.2f}-{max(values):.2f}) x dcp.load's time")


if __name__ == "__main__":
    main()
