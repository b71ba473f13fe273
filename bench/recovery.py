"""Recovery benchmark of the fast recovery tier (``checkpoint_config.local``), in one run.

``python -m bench.recovery [--width 1024] [--depth 4] [--out DIR]`` prints one JSON object.

A 2-rank FSDP2 job (gloo, CPU; each rank its own simulated node) trains with persistent
async saves every ``--save-steps`` steps and local saves every step. At ``--die-at`` the
ranks of node1 are killed (SIGKILL), the job is ended and node1's local folder is wiped
(a replaced node). The job is then launched again twice from that same state:

* ``local``: resumes from the local tier (node0's own units, node1's fetched from node0's replicas);
* ``persistent``: the same job without ``checkpoint_config.local`` resumes from ``output_dir``.

Reported per relaunch: ``resume_s`` (``manager.resume``), ``launch_to_training_s`` (the
relaunch starting to the first training step done after the resume; the scheduler's
delay to notice the failure and relaunch is not included), the step resumed and the steps
lost. Reported for the first run: what local and persistent saves blocked the loop and cost
in total, and the bytes the tier holds per node (tmpfs: memory).

This module is also the job's worker (run by torchrun as ``-m bench.recovery --worker ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .launch import ROOT, child_env, torchrun


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def worker(out: str, local: str, steps: int, die_at: int, use_local: bool, width: int, depth: int,
           save_steps: int) -> None:
    t_start = time.time()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from roll_ckpt.runtime.torch_compat import fsdp2_options

    from roll_ckpt import CheckpointManager, load_config

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    Path(out, f"pid-{rank}").write_text(str(os.getpid()))
    os.environ["ROLL_CKPT_NODE"] = f"node{rank * 2 // world}"
    torch.manual_seed(0)
    layers = []
    for i in range(depth):
        layers += [torch.nn.Linear(width if i else 64, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))
    mesh = init_device_mesh("cpu", (world,))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, **fsdp2_options(mesh.device_type))
    fully_shard(model, mesh=mesh, **fsdp2_options(mesh.device_type))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cc = {"output_dir": os.path.join(out, "persist")}
    if use_local:
        cc["local"] = {"dir": local, "save_steps": 1, "max_to_keep": 2, "replicas": 1}
    m = CheckpointManager.from_config(load_config({
        "exp_name": "bench", "save_steps": save_steps, "resume_from_checkpoint": "latest",
        "strategy_config": {"async_save_ckpt": True}, "checkpoint_config": cc}), quiet=True)
    state = {"model": model, "optimizer": opt}
    t0 = time.perf_counter()
    if os.environ.get("RECOVERY_PROFILE"):  # where a resume spends its time, per rank
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            start = m.resume(state)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    else:
        start = m.resume(state)
    resume_s = time.perf_counter() - t0
    torch.manual_seed(100 + rank)
    blocked: dict[str, list[float]] = {"local": [], "persistent": []}
    first_step_done = None
    for step in range(start + 1, steps + 1):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if first_step_done is None:
            first_step_done = time.time()
        t = time.perf_counter()
        m.maybe_save(step, state)
        kind = "persistent" if step % save_steps == 0 else "local" if use_local else None
        if kind:
            blocked[kind].append(time.perf_counter() - t)
        if step == die_at:
            m.wait()
            if rank == 0:
                Path(out, "first.json").write_text(json.dumps({
                    "blocked": blocked, "local_last": m.local.last_save if m.local else None,
                    "local_bytes": m.local.bytes_used if m.local else 0,
                    "persistent_total_s": m.stats.last.total_s, "persistent_bytes": m.stats.last.bytes}))
            dist.barrier()
            if rank * 2 // world == 1:
                Path(out, "killed_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)
    m.wait()
    body = {"start": start, "resume_s": resume_s, "launch_to_training_s": (first_step_done or time.time()) - t_start,
            "resumed_from": m.resumed.path, "blocked": blocked, "local_last": m.local.last_save if m.local else None,
            "local_bytes": m.local.bytes_used if m.local else 0,
            "persistent_total_s": m.stats.last.total_s if m.stats.last else None}
    m.close()
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(body))
    dist.destroy_process_group()


def _launch(out: Path, local: Path, steps: int, die_at: int, use_local: bool, a: argparse.Namespace,
            wait: bool = True) -> subprocess.Popen:
    cmd = torchrun(2, "recovery", "--worker", str(out), str(local), str(steps), str(die_at), str(int(use_local)),
                   str(a.width), str(a.depth), str(a.save_steps))
    env = child_env(OMP_NUM_THREADS="1", ROLL_CKPT_QUIET="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    if wait:
        output, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise SystemExit(f"the job failed:\n{output[-4000:]}")
        if os.environ.get("RECOVERY_PROFILE"):
            print(output, file=sys.stderr)
    return proc


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--die-at", type=int, default=9)
    p.add_argument("--repeat", type=int, default=3, help="relaunches from each tier (medians are reported)")
    p.add_argument("--out", default=None, help="working folder (default: a temporary one, removed)")
    p.add_argument("--local-root", default="/dev/shm", help="where the local tier goes (tmpfs)")
    p.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        out, local, steps, die_at, use_local, width, depth, save_steps = a.worker
        worker(out, local, int(steps), int(die_at), use_local == "1", int(width), int(depth), int(save_steps))
        return
    # absolute: the job runs from the repository root
    work = Path(a.out or tempfile.mkdtemp(prefix="roll-ckpt-recovery-")).resolve()
    local = Path(tempfile.mkdtemp(prefix="roll-ckpt-recovery-", dir=a.local_root)).resolve()
    try:
        first = work / "first"
        first.mkdir(parents=True)
        proc = _launch(first, local / "first", a.die_at + 5, a.die_at, True, a, wait=False)
        deadline = time.monotonic() + 240
        while not (first / "killed_at").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(1.0)  # node0 is left waiting in a collective; a scheduler ends the job
        for pid_file in first.glob("pid-*"):  # torchrun's workers live in sessions of their own
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        shutil.rmtree(local / "first" / "node1", ignore_errors=True)  # the replaced node's tmpfs is empty
        results: dict[str, dict] = {}
        runs: dict[str, list[dict]] = {"local": [], "persistent": []}
        for i in range(a.repeat):  # alternating, each from the same state: the machine's noise hits both
            for name, use_local in (("local", True), ("persistent", False)):
                run_dir, run_local = work / f"{name}-{i}", local / f"{name}-{i}"
                shutil.copytree(first / "persist", run_dir / "persist")
                shutil.copytree(local / "first", run_local)
                _launch(run_dir, run_local, a.die_at + 2, 0, use_local, a)
                runs[name].append(json.loads((run_dir / "result.json").read_text()))
                shutil.rmtree(run_local, ignore_errors=True)
        for name, rs in runs.items():
            results[name] = {**rs[0], "resume_s": median([r["resume_s"] for r in rs]),
                             "launch_to_training_s": median([r["launch_to_training_s"] for r in rs]),
                             "resume_s_all": [round(r["resume_s"], 3) for r in rs]}
        stats = json.loads((first / "first.json").read_text())
        med = lambda xs: median(xs) if xs else None  # noqa: E731
        report = {
            "model_bytes_per_rank": None,
            "saves_before_the_failure": {
                "local_blocked_s_median": med(stats["blocked"]["local"]),
                "persistent_blocked_s_median": med(stats["blocked"]["persistent"]),
                "local_total_s_last": (stats["local_last"] or {}).get("seconds"),
                "persistent_total_s_last": stats["persistent_total_s"],
                "local_tier_bytes_node0": stats["local_bytes"],
                "persistent_checkpoint_bytes": stats["persistent_bytes"],
            },
            "die_at": a.die_at, "save_steps": a.save_steps,
            "recovery": {name: {"resumed_step": r["start"], "steps_lost": a.die_at - r["start"],
                                "resume_s": round(r["resume_s"], 3), "resume_s_runs": r["resume_s_all"],
                                "launch_to_training_s": round(r["launch_to_training_s"], 3),
                                "resumed_from": r["resumed_from"]} for name, r in results.items()},
            "steps_lost_per_failure_expected": {
                "local_every_step": 0.5, f"persistent_every_{a.save_steps}": a.save_steps / 2,
                "note": "a failure at a uniformly random time loses half a save interval on average (plus the "
                        "step in progress); the run above failed right after step die_at's saves"},
        }
        report["recovery"]["speedup_resume"] = round(results["persistent"]["resume_s"] /
                                                     max(results["local"]["resume_s"], 1e-9), 2)
        report["model_bytes_per_rank"] = (stats["local_last"] or {}).get("bytes")
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(local, ignore_errors=True)
        if a.out is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
