"""T19: verl's FSDP2 engine saving its checkpoints, verl's own manager against roll-ckpt-verl's
with asynchronous saves: how long the training loop is blocked, and how long until the
checkpoint is durable. Needs verl (the verl leg: ``.matrix/verl/bin/python -m bench --groups verl``).

    python -m bench.verl [--quick|--smoke] [--reps R] [--out DIR]

The same model, ranks and loop for both, each in a torchrun job of its own (2 gloo ranks,
the tests' CPU platform for verl): verl's ``TrainingWorker`` (its FSDP2 engine from verl's
registry: verl's own with no vendor, roll-ckpt's with ``VERL_ENGINE_VENDOR=roll_ckpt``), a
Llama (hidden 512, 8 layers: 25 M parameters, AdamW: 290 MiB of state), trained a few steps
between saves. Each save is what verl's PPO trainer asks of a role's workers:
``save_checkpoint(<dir>/global_step_<N>/actor, global_step=N, max_ckpt_to_keep=2)`` on every
rank, then the driver's ``data.pt`` (rank 0 here), with ``checkpoint.async_save: true``.

* blocked: the ``save_checkpoint`` call, the slowest rank (the loop waits for it there);
* durable: from the call until the checkpoint is on disk. roll-ckpt: the step's manifest is
  committed (every file fsynced, the trainer's ``data.pt`` included), as seen by a watcher on
  rank 0. verl's manager fsyncs nothing (``torch.save``) and ignores ``async_save``: its
  durable time is its call plus each rank's fsync of the files it wrote, the slowest rank.

Medians over ``reps`` saves after a first one (warm-up: process groups, staging buffers).
Target: roll-ckpt's blocked time <= 0.2 x verl's manager's. Writes DIR/verl.json and
DIR/verl.md (default DIR: bench/results).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from .common import median
from .launch import RESULTS, ROOT, child_env, use_test_helpers

LIMIT = 0.2
MODES = {"quick": {"hidden": 512, "layers": 8, "reps": 4, "between": 2},
         "smoke": {"hidden": 64, "layers": 2, "reps": 1, "between": 1}}


# ----------------------------------------------------------------------------- one rank (under torchrun)


def _fsync_tree(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    use_test_helpers()
    spec = json.load(open(spec_path))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from functools import partial

    import verl  # noqa: F401
    from tensordict.tensorclass import NonTensorData
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import sft_loss

    from integration_verl._common import Toy, worker_config

    client = TrainingWorker(config=worker_config(spec["model"], async_save=True, total_steps=10_000))
    client.set_loss_fn(loss_fn=partial(sft_loss, config=None))
    client.reset()
    engine = client.engine
    ds = Toy(256)
    loader = StatefulDataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=world, rank=rank, seed=5),
                                num_workers=0, drop_last=True, collate_fn=SFTTensorCollator(DatasetPadMode.NO_PADDING))
    it = iter(loader)

    def step() -> float:
        data = tu.get_tensordict(tensor_dict=next(it), non_tensor_dict={
            "use_remove_padding": True, "use_dynamic_bsz": False, "max_token_len_per_gpu": None,
            "micro_batch_size_per_gpu": 2, "temperature": 1.0, "global_batch_size": 4 * world,
            "pad_mode": DatasetPadMode.NO_PADDING, "pad_token_id": 0})
        seqlens = data["input_ids"].offsets().diff()
        every = [torch.zeros_like(seqlens) for _ in range(world)]
        dist.all_gather(every, seqlens)
        tu.assign_non_tensor(data, update_lr_scheduler=True, global_token_num=NonTensorData(torch.cat(every).tolist()))
        t = time.perf_counter()
        client.train_batch(data=data)
        return time.perf_counter() - t

    from roll_ckpt.plugin import local_tensor

    state_bytes = sum(t.numel() * t.element_size() for t in
                      [local_tensor(p) for p in engine.module.parameters()]) * 3  # + AdamW's 2 moments
    ours = type(engine.checkpoint_manager).__name__ != "FSDPCheckpointManager"
    saves: list[dict[str, float]] = []
    watchers: list[threading.Thread] = []
    step_s: list[float] = []
    for n in range(1, spec["reps"] + 2):
        for _ in range(spec["between"]):
            step_s.append(step())
        folder = os.path.join(spec["ckpt"], f"global_step_{n}")
        record: dict[str, float] = {}
        dist.barrier()
        t0 = time.perf_counter()
        if ours and rank == 0:  # the watcher: when the step is committed (its manifest, written last)
            def watch(folder: str = folder, record: dict = record, t0: float = t0) -> None:
                while not os.path.exists(os.path.join(folder, "manifest.json")):
                    time.sleep(0.005)
                record["durable_s"] = time.perf_counter() - t0

            watchers.append(threading.Thread(target=watch, daemon=True))
            watchers[-1].start()
        engine.save_checkpoint(os.path.join(folder, "actor"), global_step=n, max_ckpt_to_keep=2)
        record["blocked_s"] = time.perf_counter() - t0
        if rank == 0:  # the trainer's driver, once every role's save returned
            torch.save(loader.state_dict(), os.path.join(folder, "data.pt"))
        if not ours:  # verl's manager fsyncs nothing: the files each rank wrote, then rank 0's
            mine = [os.path.join(folder, "actor", f"{k}_world_size_{world}_rank_{rank}.pt")
                    for k in ("model", "optim", "extra_state")]
            if rank == 0:
                hf = os.path.join(folder, "actor", "huggingface")
                mine += [os.path.join(hf, f) for f in os.listdir(hf)] + [
                    os.path.join(folder, "actor", "fsdp_config.json"), os.path.join(folder, "data.pt"), hf,
                    os.path.join(folder, "actor"), folder, spec["ckpt"]]
            _fsync_tree(mine)
            record["durable_s"] = time.perf_counter() - t0
        saves.append(record)
    manager = engine.checkpoint_manager
    if hasattr(manager, "close"):
        manager.close()
    for w in watchers:
        w.join(120)
    blocked = [torch.tensor([s["blocked_s"] for s in saves], dtype=torch.float64)]
    dist.all_reduce(blocked[0], op=dist.ReduceOp.MAX)
    durable = torch.tensor([s.get("durable_s", 0.0) for s in saves], dtype=torch.float64)
    dist.all_reduce(durable, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(spec["result"], "w") as f:
            json.dump({"manager": type(manager).__name__, "blocked_s": blocked[0].tolist(), "durable_s": durable.tolist(),
                       "step_s": median(step_s), "state_bytes_per_rank": state_bytes}, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the driver


def _job(name: str, vendor: bool, spec: dict[str, Any], work: str, timeout: float) -> dict[str, Any]:
    use_test_helpers()
    from integration_verl._common import cpu_env

    spec = {**spec, "ckpt": os.path.join(work, f"ckpt-{name}"), "result": os.path.join(work, f"result-{name}.json")}
    path = os.path.join(work, f"spec-{name}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "bench.verl",
           "--worker", path]
    env = child_env(**cpu_env(vendor), ROLL_CKPT_QUIET="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env["PYTHONPATH"]])
    print(f"[verl] {name}: {'VERL_ENGINE_VENDOR=roll_ckpt' if vendor else 'verl own manager'}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
                          start_new_session=True)
    if proc.returncode != 0 or not os.path.exists(spec["result"]):
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"bench.verl: the {name} job failed (exit {proc.returncode})")
    with open(spec["result"]) as f:
        return json.load(f)


def _summary(raw: dict[str, Any]) -> dict[str, Any]:
    kept = {k: raw[k][1:] or raw[k] for k in ("blocked_s", "durable_s")}  # the first save warms up
    return {"manager": raw["manager"], "blocked_s": median(kept["blocked_s"]), "durable_s": median(kept["durable_s"]),
            "raw": {k: raw[k] for k in ("blocked_s", "durable_s")}, "step_s": raw["step_s"],
            "state_bytes_per_rank": raw["state_bytes_per_rank"]}


def markdown(res: dict[str, Any]) -> str:
    if res.get("unavailable"):
        return f"# T19: verl's manager against roll-ckpt-verl\n\nnot run: {res['unavailable']}\n"
    v, r = res["verl"], res["roll_ckpt"]
    mib = v["state_bytes_per_rank"] / (1 << 20)
    rows = ["# T19: verl's FSDP2 engine saving, verl's manager against roll-ckpt-verl (async)", "",
            f"{res['model']}, 2 gloo ranks, {mib:.0f} MiB of state per rank (model + AdamW), "
            f"medians of {res['reps']} saves after a warm-up one; verl {res.get('verl_version')}, torch "
            f"{res.get('torch')}.", "",
            "| manager | blocked (s) | durable (s) | training step (s) |", "|---|---:|---:|---:|",
            f"| verl's FSDPCheckpointManager (torch.save, sync; durable = + fsync of its files) | "
            f"{v['blocked_s']:.3f} | {v['durable_s']:.3f} | {v['step_s']:.3f} |",
            f"| roll-ckpt-verl, checkpoint.async_save: true (durable = the step committed) | "
            f"{r['blocked_s']:.3f} | {r['durable_s']:.3f} | {r['step_s']:.3f} |", "",
            f"T19 blocked ratio: {res['ratio_blocked']:.3f} (target <= {LIMIT}): {'PASS' if res['pass'] else 'FAIL'}; "
            f"durable ratio: {res['ratio_durable']:.2f}."]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.verl", description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick")
    size.add_argument("--smoke", action="store_const", dest="mode", const="smoke")
    p.add_argument("--full", action="store_const", dest="mode", const="quick", help="(the same as --quick)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    mode = MODES[args.mode or "quick"]
    reps = args.reps or mode["reps"]
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "verl.json")
    if importlib.util.find_spec("verl") is None:
        res: dict[str, Any] = {"unavailable": "verl is not installed in this environment (the verl leg has it: "
                                              ".matrix/verl/bin/python -m bench --groups verl)"}
    else:
        import torch
        from importlib.metadata import version

        use_test_helpers()
        from integration_verl._common import make_model

        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".scratch-verl-", dir=args.out) as work:
            model = make_model(os.path.join(work, "model"), hidden=mode["hidden"], layers=mode["layers"])
            spec = {"model": model, "reps": reps, "between": mode["between"]}
            verl_raw = _job("verl", False, spec, work, timeout=1200)
            ours_raw = _job("roll_ckpt", True, spec, work, timeout=1200)
        v, r = _summary(verl_raw), _summary(ours_raw)
        ratio = r["blocked_s"] / v["blocked_s"] if v["blocked_s"] else None
        res = {"model": f"Llama hidden {mode['hidden']}, {mode['layers']} layers", "reps": reps, "verl": v,
               "roll_ckpt": r, "ratio_blocked": ratio, "ratio_durable": r["durable_s"] / v["durable_s"],
               "pass": ratio is not None and ratio <= LIMIT, "limit": LIMIT, "verl_version": version("verl"),
               "torch": torch.__version__, "duration_s": round(time.perf_counter() - t0, 1)}
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.join(args.out, "verl.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
