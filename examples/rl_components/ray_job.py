"""rl_job.py on Ray: the actor and critic ranks are Ray actors, the driver is the Ray driver.

::

    python examples/rl_components/ray_job.py --output /shared/rl            # or s3://bucket/rl
    python examples/rl_components/ray_job.py --output /shared/rl            # after a failure: resumes
    python examples/rl_components/ray_job.py --output /tmp/rl --fsdp2 --num-cpus 2   # one small machine

The checkpoint calls are the same as in rl_job.py:

* the driver picks ``run_name`` once per launch (:class:`Launch`) and gives it to every
  worker as a config override (``runtime_env={"env_vars": {"ROLL_CKPT_RUN_NAME": ...}}``
  with ``run_name: ${env:ROLL_CKPT_RUN_NAME}`` in the YAML works as well);
* each rank of each group builds ``CheckpointManager(config, component=...)`` from the same
  config and calls ``resume`` once, ``maybe_save`` every step and ``close`` at the end
  (``TrainGroupRank`` in rl_job.py); a component's manager reads its ROLL worker section
  (``actor_train.strategy_args.strategy_config``) before the top-level ``strategy_config``;
* the driver saves its ``DriverState`` with a manager of its own (component ``pipeline``),
  after the groups have saved the step.

When a worker dies, end the launch (:meth:`Launch.end`) and start a new one: every
component then resumes from the newest step all of them committed.
``tests/examples/test_ray_job.py`` kills an actor rank in the middle of its write and
checks that the next launch ends exactly where an uninterrupted one does.

``checkpoint_config.output_dir`` must be a location every node sees (a shared file
system or an object store): each part is written by the processes that hold it.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rl_job import (CALL_TIMEOUT_S, DEFAULT_CONFIG, ActorTrain, Critic, dataset, free_port,  # noqa: E402
                    read_config, rl_step, step_line)


@ray.remote(num_cpus=0)
def master_address() -> tuple[str, int]:
    """Rank 0's node address and a free port there: the group's MASTER_ADDR/MASTER_PORT."""
    return ray.util.get_node_ip_address(), free_port()


class RayPending:
    """The replies of every rank to one call; ``get`` waits for them (``ray.get``)."""

    def __init__(self, refs: list[Any]) -> None:
        self.refs = refs

    def get(self) -> list[Any]:
        return ray.get(self.refs, timeout=CALL_TIMEOUT_S)


class RayGroup:
    """The ranks of one training group: Ray actors of ``worker_cls`` in one placement group.

    Each rank joins the group's own gloo process group in its constructor (rank 0's node
    address as ``MASTER_ADDR``), so the actor and the critic are separate jobs as far as
    torch.distributed is concerned. ``extra_args`` go to every rank's constructor.
    """

    def __init__(self, worker_cls: type, world_size: int, raw_config: dict[str, Any], *, cpus: float = 1.0,
                 extra_args: Sequence[Any] = ()) -> None:
        self.name = worker_cls.component
        self.pg = placement_group([{"CPU": cpus}] * world_size, strategy="PACK")
        ray.get(self.pg.ready(), timeout=CALL_TIMEOUT_S)
        addr, port = ray.get(master_address.options(scheduling_strategy=self._bundle(0)).remote())
        remote_cls = ray.remote(worker_cls)
        # Every rank's constructor waits in the rendezvous for the others: create them all, then wait.
        self.ranks = [remote_cls.options(num_cpus=cpus, scheduling_strategy=self._bundle(rank))
                      .remote(raw_config, rank, world_size, addr, port, *extra_args) for rank in range(world_size)]

    def _bundle(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=index)

    def call(self, method: str, *args: Any) -> RayPending:
        """Start ``method`` on every rank."""
        return RayPending([getattr(rank, method).remote(*args) for rank in self.ranks])

    def end(self) -> None:
        """Kill every rank (no close, no final save) and release the placement group."""
        for rank in self.ranks:
            ray.kill(rank)
        remove_placement_group(self.pg)


class Launch:
    """One launch of the job on a running Ray cluster: a new ``run_name``, the actor and
    critic groups, the driver's ``DriverState`` and its manager (component ``pipeline``).

    ``actor_cls`` and ``actor_args`` replace the actor ranks' class and add constructor
    arguments (the tests inject a fault into one rank this way).
    """

    def __init__(self, raw_config: dict[str, Any], *, cpus_per_worker: float = 1.0, actor_cls: type = ActorTrain,
                 actor_args: Sequence[Any] = ()) -> None:
        from roll_ckpt import CheckpointManager, DriverState, load_config, new_run_name

        self.run_name = new_run_name()                  # once per launch, by the driver
        raw = copy.deepcopy(raw_config)
        raw["checkpoint_config"]["run_name"] = self.run_name   # the same value reaches every worker
        self.cfg = load_config(raw)
        self.rl = dict(self.cfg.extra["rl"])
        _, self.answers = dataset(self.cfg.seed, self.rl)
        self.groups: list[RayGroup] = []
        self.manager = None
        try:
            self.actor = RayGroup(actor_cls, int(self.rl["actor_world_size"]), raw, cpus=cpus_per_worker,
                                  extra_args=actor_args)
            self.groups.append(self.actor)
            self.critic = RayGroup(Critic, int(self.rl["critic_world_size"]), raw, cpus=cpus_per_worker)
            self.groups.append(self.critic)
            np.random.seed(self.cfg.seed)               # the driver's RNG; resume restores it
            self.driver = DriverState(step=0, epoch=0, epoch_pos=0, epoch_order=[], consumed_samples=0, history=[])
            self.manager = CheckpointManager(self.cfg, component="pipeline", quiet=True)
        except BaseException:
            self.end()
            raise
        self.start = 0

    def resume(self) -> int:
        """Every component loads its own part of the newest step all of them committed."""
        pending = [g.call("resume") for g in self.groups]
        self.start = self.manager.resume({"driver": self.driver})
        steps = {g.name: sorted({r["step"] for r in p.get()}) for g, p in zip(self.groups, pending)}
        if any(s != [self.start] for s in steps.values()):
            raise RuntimeError(f"components resumed from different steps: {steps}, pipeline {self.start}")
        return self.start

    def step(self, step: int) -> dict[str, Any]:
        return rl_step(self.driver, step, self.rl, self.answers, self.actor, self.critic)

    def save(self, step: int) -> str | None:
        """The groups save their parts (``maybe_save`` in every rank), then the driver its
        own; whichever part commits last commits the step."""
        for pending in [g.call("save", step) for g in self.groups]:
            pending.get()
        return self.manager.maybe_save(step, {"driver": self.driver})

    def finish(self) -> dict[str, str]:
        """Final saves, close every manager; each group's state digest (equal on its ranks)."""
        final = self.cfg.max_steps if self.start < self.cfg.max_steps else None   # nothing new: no final save
        pending = [g.call("finish", final) for g in self.groups]
        if final is not None:
            self.manager.save(final, {"driver": self.driver}, final=True)
        self.manager.close()
        digests = {}
        for g, p in zip(self.groups, pending):
            ranks = p.get()
            if len(set(ranks)) != 1:
                raise RuntimeError(f"{g.name}'s ranks hold different states: {ranks}")
            digests[g.name] = ranks[0]
        return digests

    def run(self, log: Any = None) -> dict[str, str]:
        """Resume, train and save every step up to ``max_steps``, finish."""
        start = self.resume()
        if log:
            log(f"run {self.run_name}: starting at step {start + 1}")
        for step in range(start + 1, self.cfg.max_steps + 1):
            entry = self.step(step)
            if log:
                log(step_line(entry, self.driver))
            self.save(step)
        return self.finish()

    def end(self) -> None:
        """Kill this launch's workers (whatever they are doing) and close the driver's manager."""
        for g in self.groups:
            g.end()
        if self.manager is not None:
            self.manager.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--output", required=True, help="output_dir: a path every node sees, or a URL")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start or join a local one)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of a local cluster started here")
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--fsdp2", action="store_true",
                   help="shard the actor with FSDP2 and save it asynchronously (its worker section's "
                        "async_save_ckpt: the fsdp2 strategy saves on a gloo group of its own)")
    args = p.parse_args(argv)

    output = args.output if "://" in args.output else os.path.abspath(args.output)
    raw = read_config(args.config, output)
    if args.fsdp2:
        raw["rl"]["actor_fsdp2"] = True
        strategy_args = raw.setdefault("actor_train", {}).setdefault("strategy_args", {})
        strategy_args["strategy_config"] = dict(strategy_args.get("strategy_config") or {}, async_save_ckpt=True)

    # working_dir ships rl_job.py (and this folder) to every node and puts it on sys.path.
    ray.init(address=args.address, num_cpus=args.num_cpus, runtime_env={"working_dir": str(HERE)})
    launch = None
    try:
        launch = Launch(raw, cpus_per_worker=args.cpus_per_worker)
        for name, digest in launch.run(log=lambda line: print(line, flush=True)).items():
            print(f"final {name} state digest {digest}", flush=True)
        return 0
    finally:
        if launch is not None:
            launch.end()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
