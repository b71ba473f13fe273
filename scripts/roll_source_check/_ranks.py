"""ROLL's real FSDP2TrainStrategy, built in N fresh gloo processes (no Ray), then loaded from a checkpoint.

    $ROLL_PYTHON _ranks.py --workdir DIR --cluster actor_train|critic --world-size N --result FILE
        --load roll-ckpt --target PATH|latest --root DIR     plain roll-ckpt: CheckpointManager(load_config(
                                                             {"checkpoint_config": {"type": "file_system",
                                                             "output_dir": ROOT}})).resume(state, TARGET)
        --load roll --target DIR                             ROLL's own strategy.load_checkpoint(DIR) (as
                                                             ActorWorker/CriticWorker.initialize calls it)

The strategy is built as ActorWorker/CriticWorker.initialize builds it (create_strategy +
strategy.initialize with ROLL's model providers) through a stand-in for ROLL's Worker (whose
__init__ needs Ray). The result (JSON): per rank, the step resume returned, where from, the
seconds, and the digests (roll_cpu_shims.strategy_digests) after the load.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


class StandInWorker:
    """What FSDP2TrainStrategy reads of ROLL's Worker: worker_config, pipeline_config, rank, rank_info."""

    def __init__(self, worker_config, pipeline_config, cluster_name):
        from roll.distributed.executor.worker import RankInfo

        self.worker_config = worker_config
        self.pipeline_config = pipeline_config
        self.cluster_name = cluster_name
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.worker_name = f"{cluster_name}-{self.rank}"
        self.rank_info = RankInfo(world_size=self.world_size, rank=self.rank, dp_rank=self.rank,
                                  dp_size=self.world_size)


def rank_main(rank, a, port, q):
    try:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(a["world_size"]),
                           "LOCAL_WORLD_SIZE": str(a["world_size"]), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
        os.chdir(a["workdir"])
        sys.path[:0] = [HERE]
        q.put((rank, "ok", _rank_main(rank, a)))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def _rank_main(rank, a):
    import torch.distributed as dist

    from roll_cpu_shims import apply_cpu_patches, strategy_digests
    from _common import build_pipeline_config

    apply_cpu_patches(patch_download_model=True)
    from roll.distributed.strategy.factory import create_strategy
    from roll.models.model_providers import default_actor_model_provider, default_value_model_provider

    cfg = build_pipeline_config(a["model_dir"], os.path.join(a["workdir"], "output"),
                                os.path.join(a["workdir"], "unused_ckpt"), max_steps=a["max_steps"],
                                save_steps=a["max_steps"], world_size=a["world_size"], ray=False)
    worker_config = getattr(cfg, a["cluster"])
    worker = StandInWorker(worker_config, cfg, a["cluster"])
    strategy = create_strategy(worker=worker)
    provider = default_actor_model_provider if a["cluster"] == "actor_train" else default_value_model_provider
    strategy.initialize(model_provider=provider)
    out = {"pid": os.getpid(), "installed_patches": "roll_ckpt_roll.patches" in sys.modules}
    t0 = time.monotonic()
    if a["load"] == "roll-ckpt":
        from roll_ckpt import CheckpointManager, load_config

        manager = CheckpointManager(load_config({"checkpoint_config": {"type": "file_system",
                                                                       "output_dir": a["root"]}}))
        if a["target"] == "latest":
            found = manager.resumed.candidates("latest")
            out["latest_resolves_to"] = found[1] if found else None
        state = {"model": strategy.model, "optimizer": strategy.optimizer, "scheduler": strategy.scheduler}
        out["resumed_step"] = manager.resume(state, a["target"])
        out["resumed_from"] = manager.resumed.path
        manager.close()
    else:
        if a["prime_optimizer"]:  # a zero Adam state for DCP to load into (a fresh AdamW has none)
            import torch

            for group in strategy.optimizer.param_groups:
                for p in group["params"]:
                    strategy.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                                   "exp_avg_sq": torch.zeros_like(p)}
        strategy.load_checkpoint(load_dir=a["target"], tag="checkpoint")  # ROLL's own
    out["load_s"] = round(time.monotonic() - t0, 3)
    strategy.offload_states()  # as ActorWorker/CriticWorker.initialize do right after
    out["digests"] = strategy_digests(strategy)
    dist.barrier()
    dist.destroy_process_group()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    import multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--cluster", required=True, choices=["actor_train", "critic"])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--load", required=True, choices=["roll-ckpt", "roll"])
    p.add_argument("--target", required=True)
    p.add_argument("--root", default=None)
    p.add_argument("--result", required=True)
    p.add_argument("--prime-optimizer", type=int, default=0, help="--load roll: zero Adam state first")
    p.add_argument("--timeout", type=float, default=240)
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    a = dict(workdir=args.workdir, model_dir=args.model, cluster=args.cluster, world_size=args.world_size,
             max_steps=args.max_steps, load=args.load, target=args.target, root=args.root,
             prime_optimizer=bool(args.prime_optimizer))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, a, port, q)) for r in range(args.world_size)]
    t0 = time.monotonic()
    for pr in procs:
        pr.start()
    results: dict = {}
    deadline = time.monotonic() + args.timeout
    while len(results) < args.world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = q.get(timeout=1.0)
            results[rank] = {"status": status, **(payload if status == "ok" else {"traceback": payload})}
            if status == "error":
                break
        except queue.Empty:
            if any(pr.exitcode not in (None, 0) for pr in procs):
                break
    for pr in procs:
        pr.join(timeout=20 if len(results) == args.world_size else 3)
    killed = []
    for pr in procs:
        if pr.is_alive():
            killed.append(pr.pid)
            pr.kill()
            pr.join(5)
    ok = len(results) == args.world_size and all(r["status"] == "ok" for r in results.values())
    with open(args.result, "w") as f:
        json.dump({"ok": ok, "seconds": round(time.monotonic() - t0, 2), "killed": killed,
                   "exitcodes": [pr.exitcode for pr in procs],
                   "ranks": {str(k): v for k, v in sorted(results.items())}}, f, indent=1, default=repr)
    for r, v in sorted(results.items()):
        if v["status"] != "ok":
            print(f"rank {r} failed:\n{v['traceback']}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
