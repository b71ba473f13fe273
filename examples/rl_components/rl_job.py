"""An RL job in three components, each saved by its own CheckpointManager.

::

    driver (this process, component "pipeline")
      |-- actor_train: 2 processes, their own gloo group (MASTER_PORT a)
      '-- critic:      1 process,   its own gloo group  (MASTER_PORT b)

PPO on a contextual bandit with a verifiable reward (each prompt has one correct arm).
Every step the driver draws a batch (its data position and shuffling RNG live in a
``DriverState``), the actor samples an arm per prompt, the critic estimates values, the
driver computes rewards and advantages, both groups train one update, then every
component saves the step with its own manager: the actor and critic groups first, the
driver last. A step counts once all three parts are committed.

``--stop-at N`` kills the job after step N, once the worker groups have saved it and
before the driver has: step N stays uncommitted. Running again (a new launch, so a new
run folder) resumes every component from the newest step all three committed, and the
job continues exactly as an uninterrupted one (same rewards, losses and final weights)::

    python examples/rl_components/rl_job.py --output /tmp/rl --stop-at 8
    python examples/rl_components/rl_job.py --output /tmp/rl

Preemption: a scheduler's SIGTERM reaches every process. Each component's manager notes
it; the driver decides the step the job stops at: once a component saved a step for a
preemption (or the driver got the signal itself), it asks every other component to save
that same step (``manager.preemption.request()``, then ``maybe_save``), saves its own part last and
exits with ``checkpoint_config.preemption.exit_code``: the step commits whole, and the
next launch resumes from it exactly. No component goes past that step, so none can have
saved a different one.

``ActorTrain`` and ``Critic`` are plain classes: here each rank runs one in a process
fed through a pipe; ``ray_job.py`` makes the same classes Ray actors and drives them with
the same :func:`rl_step`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "config.yaml"
RUN_NAME_ENV = "ROLL_CKPT_RUN_NAME"
CALL_TIMEOUT_S = 300.0
# Workers are forked on Linux: torch is imported once, by the driver, before any torch
# work or thread starts (as DataLoader workers are); elsewhere they are spawned.
START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"


# --------------------------------------------------------------------------- shared by all parts

def read_config(path: str | os.PathLike[str], output: str | None = None, **top: Any) -> dict[str, Any]:
    """The job's raw config (YAML), with ``--output`` and top-level overrides applied."""
    raw = yaml.safe_load(Path(path).read_text())
    if output is not None:
        raw["output_dir"] = str(output)
    raw.update({k: v for k, v in top.items() if v is not None})
    return raw


def dataset(seed: int, rl: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Prompts (feature vectors) and their correct arms: the same in every process."""
    g = np.random.default_rng([seed, 2024])
    x = g.standard_normal((rl["prompts"], rl["features"])).astype(np.float32)
    w = g.standard_normal((rl["features"], rl["arms"]))
    return x, (x @ w).argmax(axis=1)


def shard(values: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    return list(values[rank::world_size])


def unshard(parts: list[list[Any]]) -> list[Any]:
    out: list[Any] = [None] * sum(len(p) for p in parts)
    for rank, part in enumerate(parts):
        out[rank::len(parts)] = part
    return out


# --------------------------------------------------------------------------- worker groups

class TrainGroupRank:
    """One rank of a training group: its process group, model, optimizer and manager.

    The group's ranks find each other through the torchrun variables (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``); each group has its own port, so the actor
    and the critic are separate jobs as far as torch.distributed is concerned.
    """

    component = ""
    key = ""
    """This group's prefix in the ``rl`` settings (``actor_world_size``, ``actor_fsdp2``...)."""

    def __init__(self, raw_config: dict[str, Any], rank: int, world_size: int,
                 master_addr: str, master_port: int) -> None:
        import torch
        import torch.distributed as dist
        from roll_ckpt import CheckpointManager, load_config

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        self.torch, self.dist = torch, dist
        self.rank, self.world_size = rank, world_size
        # run_name comes from ${env:ROLL_CKPT_RUN_NAME}, set by the driver for this launch
        self.cfg = load_config(raw_config)
        self.rl = dict(self.cfg.extra["rl"])
        x, _ = dataset(self.cfg.seed, self.rl)
        self.x = torch.from_numpy(x)
        torch.manual_seed(self.cfg.seed)            # the same initial weights on every rank
        self.model = self.build()
        self.fsdp2 = bool(self.rl.get(f"{self.key}_fsdp2")) and world_size > 1
        if self.fsdp2:  # shard it over the group: the manager then picks the fsdp2 strategy
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            from roll_ckpt.runtime.torch_compat import fsdp2_options

            # fsdp2_options: what FSDP2 on the CPU needs on this torch (torch 2.6: see its doc)
            fully_shard(self.model, mesh=init_device_mesh("cpu", (world_size,)), **fsdp2_options("cpu"))
        torch.manual_seed(self.cfg.seed * 1000 + rank)  # then each rank its own sampling/dropout stream
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr())
        self.state: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer}
        self.manager = CheckpointManager(self.cfg, component=self.component, quiet=True)

    def build(self) -> Any:
        raise NotImplementedError

    def lr(self) -> float:
        raise NotImplementedError

    # -- checkpoint calls, the same for every component
    def resume(self) -> dict[str, Any]:
        step = self.manager.resume(self.state)   # 0: fresh start; this group's part of the step
        return {"step": step, "from": self.manager.resumed.path}

    def save(self, step: int) -> dict[str, Any]:
        """``maybe_save``; a preemption saves ``step`` and is reported, not raised: the driver
        decides when the job ends (and asks the other components for the same step)."""
        from roll_ckpt import Preempted

        if self.manager.preemption.committed:
            return {"path": None, "preempted": True}
        try:
            return {"path": self.manager.maybe_save(step, self.state), "preempted": False}
        except Preempted as exc:
            return {"path": exc.path, "preempted": True}

    def preempt(self, step: int) -> dict[str, Any]:
        """Save ``step`` for a preemption another component saw (a no-op if this one did)."""
        if not self.manager.preemption.committed:
            self.manager.preemption.request()
        return self.save(step)

    def finish(self, final_step: int | None) -> str:
        """Final save (a no-op when the periodic one took it), close, leave the group."""
        if final_step is not None and not self.manager.preemption.committed:
            self.manager.save(final_step, self.state, final=True)
        self.manager.close()
        digest = self.digest()
        self.dist.destroy_process_group()
        return digest

    # -- helpers
    def _average_grads(self) -> None:
        if self.world_size > 1 and not self.fsdp2:  # FSDP2 averages them itself
            for p in self.model.parameters():
                self.dist.all_reduce(p.grad)
                p.grad /= self.world_size

    def _mean(self, value: Any) -> float:
        value = value.detach().clone()
        if self.world_size > 1:
            self.dist.all_reduce(value)
            value /= self.world_size
        return float(value)

    def digest(self) -> str:
        """A hash of the weights and optimizer state: equal runs give equal digests."""
        def data(t: Any) -> bytes:
            if not hasattr(t, "numpy"):
                return repr(t).encode()
            if hasattr(t, "full_tensor"):      # a sharded (DTensor) value: gathered on every rank
                t = t.full_tensor()
            return t.detach().contiguous().numpy().tobytes()

        h = hashlib.sha256()
        for name, t in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(data(t))
        opt = self.optimizer.state_dict()["state"]
        for pid in sorted(opt):
            for key, value in sorted(opt[pid].items()):
                h.update(f"{pid}.{key}".encode())
                h.update(data(value))
        return h.hexdigest()[:16]


class ActorTrain(TrainGroupRank):
    """The policy: samples one arm per prompt (generation) and trains with PPO's clipped loss."""

    component = "actor_train"
    key = "actor"

    def build(self) -> Any:
        nn, rl = self.torch.nn, self.rl
        return nn.Sequential(nn.Linear(rl["features"], rl["hidden"]), nn.Tanh(), nn.Dropout(rl["dropout"]),
                             nn.Linear(rl["hidden"], rl["arms"]))

    def lr(self) -> float:
        return float(self.rl["actor_lr"])

    def generate(self, idx: list[int]) -> tuple[list[int], list[float]]:
        """This rank's share of the batch: sampled arms and their log-probabilities."""
        torch = self.torch
        mine = shard(idx, self.rank, self.world_size)
        self.model.eval()
        with torch.no_grad():
            policy = torch.distributions.Categorical(logits=self.model(self.x[mine]))
            arms = policy.sample()                   # this rank's torch RNG, saved per process
            return arms.tolist(), policy.log_prob(arms).tolist()

    def train(self, idx: list[int], arms: list[int], old_logp: list[float], adv: list[float]) -> float:
        torch, r, w = self.torch, self.rank, self.world_size
        x = self.x[shard(idx, r, w)]
        a = torch.tensor(shard(arms, r, w))
        old = torch.tensor(shard(old_logp, r, w))
        advantage = torch.tensor(shard(adv, r, w), dtype=torch.float32)
        self.model.train()                           # dropout: the torch RNG again
        policy = torch.distributions.Categorical(logits=self.model(x))
        ratio = (policy.log_prob(a) - old).exp()
        clip = float(self.rl["clip"])
        loss = -torch.min(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage).mean()
        loss = loss - float(self.rl["entropy_coef"]) * policy.entropy().mean()
        self.optimizer.zero_grad()
        loss.backward()
        self._average_grads()
        self.optimizer.step()
        return self._mean(loss)


class Critic(TrainGroupRank):
    """The value model: a baseline for the advantages, trained on the rewards."""

    component = "critic"
    key = "critic"

    def build(self) -> Any:
        nn, rl = self.torch.nn, self.rl
        return nn.Sequential(nn.Linear(rl["features"], rl["hidden"]), nn.Tanh(), nn.Linear(rl["hidden"], 1))

    def lr(self) -> float:
        return float(self.rl["critic_lr"])

    def values(self, idx: list[int]) -> list[float]:
        self.model.eval()
        with self.torch.no_grad():
            return self.model(self.x[shard(idx, self.rank, self.world_size)]).squeeze(-1).tolist()

    def train(self, idx: list[int], returns: list[float]) -> float:
        torch, r, w = self.torch, self.rank, self.world_size
        self.model.train()
        v = self.model(self.x[shard(idx, r, w)]).squeeze(-1)
        loss = torch.nn.functional.mse_loss(v, torch.tensor(shard(returns, r, w), dtype=torch.float32))
        self.optimizer.zero_grad()
        loss.backward()
        self._average_grads()
        self.optimizer.step()
        return self._mean(loss)


# --------------------------------------------------------------------------- processes and pipes

def _serve(cls: type, conn: Any, *args: Any) -> None:
    """A worker process: build ``cls(*args)``, then run the methods the driver sends."""
    try:
        obj = cls(*args)
        conn.send(("ok", None))
        while True:
            method, call_args = conn.recv()
            conn.send(("ok", getattr(obj, method)(*call_args)))
            if method == "finish":
                return
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def free_port() -> int:
    """A TCP port free on this host, for a group's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Pending:
    """The replies of every rank to one call (``get`` waits for them, like ``ray.get``)."""

    def __init__(self, group: "Group", what: str) -> None:
        self.group, self.what = group, what

    def get(self) -> list[Any]:
        return [self.group.reply(rank, self.what) for rank in range(len(self.group.procs))]


class Group:
    """A training group's processes, one per rank, each with a pipe to the driver."""

    def __init__(self, cls: type, world_size: int, raw_config: dict[str, Any]) -> None:
        ctx = mp.get_context(START_METHOD)
        port = free_port()
        self.name = cls.component
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for rank in range(world_size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, name=f"{self.name}-{rank}", daemon=True,
                               args=(cls, theirs, raw_config, rank, world_size, "127.0.0.1", port))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
        self.started = Pending(self, "start-up")

    def call(self, method: str, *args: Any) -> Pending:
        for conn in self.conns:
            conn.send((method, args))
        return Pending(self, method)

    def reply(self, rank: int, what: str) -> Any:
        conn = self.conns[rank]
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not conn.poll(0.2):
            # a rank that died leaves the others waiting in a collective: give up on the group
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
            if dead and not conn.poll(0):
                r, code = dead[0]
                raise RuntimeError(f"{self.name} rank {r} died during {what} (exit code {code})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} rank {rank}: no reply to {what} in {CALL_TIMEOUT_S:.0f}s")
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name} rank {rank} failed during {what}:\n{value}")
        return value

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()                              # SIGKILL: no close, no final save
        for proc in self.procs:
            proc.join(10)


# --------------------------------------------------------------------------- the driver

def next_batch(driver: Any, prompts: int, size: int) -> list[int]:
    """The next ``size`` prompts; a new epoch is shuffled with the driver's NumPy RNG."""
    idx: list[int] = []
    while len(idx) < size:
        if driver["epoch_pos"] >= len(driver["epoch_order"]):
            driver["epoch_order"] = [int(i) for i in np.random.permutation(prompts)]
            driver["epoch"] += 1
            driver["epoch_pos"] = 0
        pos = driver["epoch_pos"]
        take = driver["epoch_order"][pos:pos + size - len(idx)]
        idx += take
        driver["epoch_pos"] += len(take)
        driver["consumed_samples"] += len(take)
    return idx


def rl_step(driver: Any, step: int, rl: dict[str, Any], answers: np.ndarray, actor: Any, critic: Any) -> dict[str, Any]:
    """One PPO step, driven from the driver: the actor generates, the critic estimates
    values, the driver scores and computes advantages, both groups train. ``actor`` and
    ``critic`` are groups whose ``call(method, *args)`` starts the method on every rank and
    returns a handle whose ``get()`` waits for the replies (a :class:`Group` here, a
    ``RayGroup`` in ray_job.py). Returns the step's entry of ``driver["history"]``."""
    idx = next_batch(driver, int(rl["prompts"]), int(rl["batch_size"]))
    gen, val = actor.call("generate", idx), critic.call("values", idx)
    parts = gen.get()
    arms = unshard([a for a, _ in parts])
    old_logp = unshard([lp for _, lp in parts])
    values = np.array(unshard(val.get()), dtype=np.float64)
    rewards = (np.array(arms) == answers[idx]).astype(np.float64)
    adv = rewards - values
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    a = actor.call("train", idx, arms, old_logp, adv.tolist())
    c = critic.call("train", idx, rewards.tolist())
    entry = {"step": step, "reward": float(rewards.mean()), "actor_loss": a.get()[0], "critic_loss": c.get()[0]}
    driver["step"] = step
    driver["history"].append(entry)
    return entry


def step_line(entry: dict[str, Any], driver: Any) -> str:
    return (f"step {entry['step']:3d}  reward={entry['reward']:.4f}  actor_loss={entry['actor_loss']:+.6f}  "
            f"critic_loss={entry['critic_loss']:.6f}  consumed={driver['consumed_samples']}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="An actor + critic + driver RL job saved as one checkpoint per step.")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the job's YAML (default: config.yaml here)")
    p.add_argument("--output", help="output_dir (checkpoints go to <output>/checkpoints)")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--save-steps", type=int)
    p.add_argument("--fsdp2", action="store_true", help="shard the actor with FSDP2 (rl.actor_fsdp2: true)")
    p.add_argument("--stop-at", type=int, metavar="N",
                   help="kill every process after step N, once the worker groups saved it and before the driver did")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from roll_ckpt import CheckpointManager, DriverState, Preempted, load_config, new_run_name
    from roll_ckpt.format import layout

    if START_METHOD == "fork":  # import once here, not in every worker (seconds each)
        import torch._dynamo  # noqa: F401  (the first optimizer imports it)
        import torch.distributed.checkpoint  # noqa: F401
        import roll_ckpt.manager  # noqa: F401

    # One run folder per launch, shared by every component: picked here, once.
    run_name = new_run_name()
    os.environ[RUN_NAME_ENV] = run_name                  # the workers inherit it
    raw = read_config(args.config, args.output, max_steps=args.max_steps, save_steps=args.save_steps)
    if args.fsdp2:
        raw["rl"]["actor_fsdp2"] = True
    cfg = load_config(raw)
    rl = dict(cfg.extra["rl"])
    cc = cfg.checkpoint_config
    _, answers = dataset(cfg.seed, rl)

    print(f"run {run_name}: components {', '.join(cc.components or ())}; checkpoints under {cc.output_dir}",
          flush=True)
    groups = {cls.component: Group(cls, int(rl[f"{cls.key}_world_size"]), raw) for cls in (ActorTrain, Critic)}
    actor, critic = groups["actor_train"], groups["critic"]
    try:
        for g in groups.values():
            g.started.get()
        np.random.seed(cfg.seed)                         # the driver's RNG; resume restores it
        driver = DriverState(step=0, epoch=0, epoch_pos=0, epoch_order=[], consumed_samples=0, history=[])
        manager = CheckpointManager(cfg, component="pipeline", quiet=True)
        pending = {name: g.call("resume") for name, g in groups.items()}
        start = manager.resume({"driver": driver})
        resumed = {"pipeline": start}
        for name, p in pending.items():
            replies = p.get()
            resumed[name] = replies[0]["step"]
            if len({r["step"] for r in replies}) != 1:
                raise RuntimeError(f"{name}'s ranks resumed from different steps: {replies}")
        if len(set(resumed.values())) != 1:
            raise RuntimeError(f"the components resumed from different steps: {resumed}")
        if start:
            print(f"resumed from step {start} ({manager.resumed.path}): "
                  + ", ".join(f"{name} at {step}" for name, step in sorted(resumed.items()))
                  + f"; {driver['consumed_samples']} samples consumed, {len(driver['history'])} steps logged",
                  flush=True)
        else:
            print("fresh start (no step committed by every component yet)", flush=True)

        for step in range(start + 1, cfg.max_steps + 1):
            print(step_line(rl_step(driver, step, rl, answers, actor, critic), driver), flush=True)

            saves = [actor.call("save", step), critic.call("save", step)]
            replies = [s.get() for s in saves]
            saved = [r[0]["path"] for r in replies]
            if args.stop_at == step:
                for g in groups.values():
                    g.kill()
                what = "the actor and critic saved it, the driver did not" if any(saved) else "not a save step"
                print(f"*** killed after step {step} ({what}) ***", flush=True)
                newest = layout.latest(manager.storage, manager.storage.root)
                print(f"newest committed step: {newest.step if newest else 'none'}; run the same command "
                      "without --stop-at to resume", flush=True)
                return 0
            if any(r["preempted"] for rs in replies for r in rs):
                manager.preemption.request()             # a worker saw the signal: the driver follows
            try:
                path = manager.maybe_save(step, {"driver": driver})
            except Preempted as exc:
                # every component saves this very step (the workers are still at it): it commits whole
                for p in [actor.call("preempt", step), critic.call("preempt", step)]:
                    p.get()
                for g in groups.values():
                    g.call("finish", None).get()
                newest = layout.latest(manager.storage, manager.storage.root)
                print(f"*** preempted at step {step}: every component saved it; newest committed step: "
                      f"{newest.step if newest else 'none'} ***", flush=True)
                raise SystemExit(exc.exit_code) from None
            if path is not None:
                newest = layout.latest(manager.storage, manager.storage.root)
                done = newest is not None and newest.step == step and newest.run == run_name
                print(f"save {step:3d}  -> {path.rsplit('/', 1)[0]}  "
                      f"({'committed: every part is in' if done else 'NOT committed'})", flush=True)

        final = cfg.max_steps if start < cfg.max_steps else None   # nothing new: no final save
        digests = {name: g.call("finish", final) for name, g in groups.items()}
        if final is not None:
            manager.save(final, {"driver": driver}, final=True)
        manager.close()
        for name, p in digests.items():
            d = p.get()
            if len(set(d)) != 1:
                raise RuntimeError(f"{name}'s ranks hold different states: {d}")
            print(f"final {name} state digest {d[0]}", flush=True)
        history_file = Path(cfg.output_dir) / "history.json"
        history_file.parent.mkdir(parents=True, exist_ok=True)
        history_file.write_text(json.dumps(driver["history"], indent=1, sort_keys=True))
        print(f"done at step {cfg.max_steps}; history -> {history_file}", flush=True)
        print("committed steps:", flush=True)
        for ref in layout.committed(manager.storage, manager.storage.root):
            print(f"  {ref.run}/checkpoint-{ref.step}", flush=True)
        return 0
    finally:
        for g in groups.values():
            g.kill()


if __name__ == "__main__":
    sys.exit(main())
