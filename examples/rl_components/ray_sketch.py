"""rl_job.py with Ray actors instead of processes and pipes (needs ``pip install ray``; not run by the tests).

::

    python examples/rl_components/ray_sketch.py --output /shared/rl    # or s3://bucket/rl
    python examples/rl_components/ray_sketch.py --output /shared/rl    # after a failure: resumes

The checkpoint calls are the same as in rl_job.py:

* the driver picks ``run_name`` once per launch and gives it to every worker (here as a
  config override; ``runtime_env={"env_vars": {"ROLL_CKPT_RUN_NAME": run_name}}`` with
  ``run_name: ${env:ROLL_CKPT_RUN_NAME}`` in the YAML works as well);
* each rank of each group builds ``CheckpointManager(config, component=...)`` and calls
  ``resume`` once, ``maybe_save`` every step and ``close`` at the end
  (``TrainGroupRank`` in rl_job.py);
* the driver saves its ``DriverState`` with a manager of its own (component ``pipeline``),
  after the groups have saved the step.

``checkpoint_config.output_dir`` must be a location every node sees (a shared file
system or an object store): each part is written by the processes that hold it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rl_job import (DEFAULT_CONFIG, ActorTrain, Critic, dataset, free_port, next_batch,  # noqa: E402
                    read_config, unshard)


@ray.remote(num_cpus=1)
class ActorTrainWorker(ActorTrain):
    """One rank of the actor group (``component = "actor_train"``)."""


@ray.remote(num_cpus=1)
class CriticWorker(Critic):
    """One rank of the critic group (``component = "critic"``)."""


@ray.remote(num_cpus=0)
def master_address() -> tuple[str, int]:
    """Rank 0's node address and a free port there: the group's MASTER_ADDR/MASTER_PORT."""
    return ray.util.get_node_ip_address(), free_port()


class RayGroup:
    """The ranks of one training group: Ray actors packed in a placement group."""

    def __init__(self, worker_cls: type, world_size: int, raw_config: dict) -> None:
        self.pg = placement_group([{"CPU": 1}] * world_size, strategy="PACK")
        ray.get(self.pg.ready())
        addr, port = ray.get(master_address.options(scheduling_strategy=self._bundle(0)).remote())
        # Every rank joins the group's gloo group in its constructor: create them all, then wait.
        self.ranks = [worker_cls.options(scheduling_strategy=self._bundle(rank))
                      .remote(raw_config, rank, world_size, addr, port) for rank in range(world_size)]

    def _bundle(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=index)

    def call(self, method: str, *args) -> list:
        """Start ``method`` on every rank; ``ray.get`` the result for their replies."""
        return [getattr(rank, method).remote(*args) for rank in self.ranks]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--output", required=True, help="output_dir: a path every node sees, or a URL")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start or join a local one)")
    args = p.parse_args()

    from roll_ckpt import CheckpointManager, DriverState, load_config, new_run_name

    run_name = new_run_name()                       # once per launch, by the driver
    output = args.output if "://" in args.output else os.path.abspath(args.output)
    raw = read_config(args.config, output)
    raw["checkpoint_config"]["run_name"] = run_name  # the same value reaches every worker
    cfg = load_config(raw)
    rl = dict(cfg.extra["rl"])
    _, answers = dataset(cfg.seed, rl)

    # working_dir ships rl_job.py (and this folder) to every node and puts it on sys.path.
    ray.init(address=args.address, runtime_env={"working_dir": str(HERE)})
    try:
        actor = RayGroup(ActorTrainWorker, int(rl["actor_world_size"]), raw)
        critic = RayGroup(CriticWorker, int(rl["critic_world_size"]), raw)

        np.random.seed(cfg.seed)
        driver = DriverState(step=0, epoch=0, epoch_pos=0, epoch_order=[], consumed_samples=0, history=[])
        manager = CheckpointManager(cfg, component="pipeline")
        # Each component loads its own part of the newest step that all of them committed.
        replies = ray.get(actor.call("resume") + critic.call("resume"))
        start = manager.resume({"driver": driver})
        if {r["step"] for r in replies} != {start}:
            raise RuntimeError(f"components resumed from different steps: {replies}, driver {start}")
        print(f"run {run_name}: starting at step {start + 1}", flush=True)

        for step in range(start + 1, cfg.max_steps + 1):
            idx = next_batch(driver, int(rl["prompts"]), int(rl["batch_size"]))
            generated = ray.get(actor.call("generate", idx))
            values = np.array(unshard(ray.get(critic.call("values", idx))), dtype=np.float64)
            arms = unshard([a for a, _ in generated])
            old_logp = unshard([lp for _, lp in generated])
            rewards = (np.array(arms) == answers[idx]).astype(np.float64)
            adv = rewards - values
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            losses = ray.get(actor.call("train", idx, arms, old_logp, adv.tolist())
                             + critic.call("train", idx, rewards.tolist()))
            actor_loss, critic_loss = losses[0], losses[-1]
            driver["step"] = step
            driver["history"].append({"step": step, "reward": float(rewards.mean()),
                                      "actor_loss": actor_loss, "critic_loss": critic_loss})
            print(f"step {step:3d}  reward={rewards.mean():.4f}  actor_loss={actor_loss:+.6f}  "
                  f"critic_loss={critic_loss:.6f}", flush=True)
            # The groups save their parts (maybe_save in each rank), then the driver its own;
            # whichever part commits last commits the step.
            ray.get(actor.call("save", step) + critic.call("save", step))
            manager.maybe_save(step, {"driver": driver})

        final = cfg.max_steps if start < cfg.max_steps else None
        ray.get(actor.call("finish", final) + critic.call("finish", final))  # final save, close
        if final is not None:
            manager.save(final, {"driver": driver}, final=True)
        manager.close()
        return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
