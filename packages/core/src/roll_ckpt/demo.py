"""``roll-ckpt demo``: a small but real RL job that saves, "crashes" and resumes exactly.

A policy network (an MLP with dropout and a learned value baseline) is trained with
REINFORCE on a synthetic contextual bandit with a *verifiable* reward: each context has
one correct arm, and the reward is 1 when the sampled arm is that one (the RLVR setting
of the guide, in miniature). Batches are drawn at random from a fixed synthetic dataset
by a small stateful sampler; AdamW and a cosine LR schedule do the updates.

Everything that decides the next step is in the checkpoint: weights, optimizer moments,
the scheduler, the sampler's position and generator, a plain counter dict and every
RNG (dropout, action sampling). So a run stopped at step 30 and resumed from its step-20
checkpoint prints, from step 21 on, the very losses an uninterrupted run prints.

It uses only the public API, exactly as DESIGN §4 shows it::

    manager = CheckpointManager.from_config(load_config(...))
    start = manager.resume(state)
    for step in range(start + 1, max_steps + 1): ...; manager.maybe_save(step, state)
    manager.save(max_steps, state, final=True); manager.close()

With ``--nproc N`` it relaunches itself under ``torch.distributed.run``: the model is
sharded with FSDP2 (gloo on CPU, nccl on GPU) and each step simulates the RL cycle of
ROLL: the training states are offloaded during a rollout phase and loaded back to train
(when the strategy offers ``offload_states``/``load_states``).

This module imports torch only when the demo runs, so ``roll-ckpt --help`` stays fast.
"""

from __future__ import annotations

import copy
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

from .errors import RollCkptError

__all__ = ["DEFAULT_CONFIG", "add_demo_arguments", "build_config", "run", "main"]

DEFAULT_CONFIG: dict[str, Any] = {
    "exp_name": "rlvr-demo",
    "seed": 42,
    "logging_dir": "${output_dir}/logs",
    "output_dir": "./output/demo",
    "checkpoint_config": {
        "type": "file_system",
        "output_dir": "${output_dir}/checkpoints/${exp_name}",
    },
    "resume_from_checkpoint": False,
    "max_steps": 80,
    "save_steps": 20,
    "logging_steps": 5,
    "eval_steps": 20,
    "strategy_config": {"async_save_ckpt": True},
    "offload_backend": "local",
    "demo": {
        "contexts": 4096,
        "eval_contexts": 1024,
        "features": 16,
        "arms": 8,
        "hidden": 128,
        "dropout": 0.1,
        "batch_size": 128,
        "lr": 0.01,
        "weight_decay": 0.01,
        "value_coef": 0.5,
        "entropy_coef": 0.01,
    },
}
"""The demo's configuration when no ``--config`` is given; ``examples/rlvr_demo.yaml`` holds the same."""

LAUNCH_TIMEOUT_S = 600.0


# --------------------------------------------------------------------------- arguments

def _positive(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_demo_arguments(p: Any) -> None:
    """The demo's options (shared by ``roll-ckpt demo`` and ``python -m roll_ckpt.demo``)."""
    p.add_argument("--config", metavar="FILE",
                   help="a YAML config like examples/rlvr_demo.yaml (default: the built-in one)")
    p.add_argument("--output", metavar="DIR", help="override output_dir (checkpoints go under it)")
    p.add_argument("--nproc", type=_positive, default=1, metavar="N",
                   help="processes; N > 1 runs FSDP2 under torch.distributed.run (default: 1)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="resume_from_checkpoint: latest (the newest committed checkpoint)")
    mode.add_argument("--fresh", action="store_true",
                      help="delete this demo's previous checkpoints first")
    p.add_argument("--stop-after", type=_positive, metavar="N",
                   help="stop abruptly after step N, like a crash: no final save")
    p.add_argument("--timeout", type=float, default=LAUNCH_TIMEOUT_S, metavar="S",
                   help=f"with --nproc > 1, stop the job after S seconds (default: {LAUNCH_TIMEOUT_S:.0f})")


def build_config(args: Any) -> Any:
    """The resolved :class:`~roll_ckpt.config.Config`, with the command-line overrides applied."""
    from pathlib import Path

    from .config import _read_file, load_config

    raw = _read_file(Path(args.config)) if args.config else copy.deepcopy(DEFAULT_CONFIG)
    if args.output:
        raw["output_dir"] = args.output
    if args.resume:
        raw["resume_from_checkpoint"] = "latest"
    return load_config(raw)


def _params(cfg: Any) -> dict[str, Any]:
    from .errors import ConfigError

    params = dict(DEFAULT_CONFIG["demo"])
    given = cfg.extra.get("demo") or {}
    if not isinstance(given, dict):
        raise ConfigError("demo", "must be a mapping of demo settings", given)
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise ConfigError(f"demo.{unknown[0]}", "is not a demo setting", None, ", ".join(sorted(params)))
    params.update(given)
    for key in ("logging_steps", "eval_steps"):
        value = cfg.extra.get(key, DEFAULT_CONFIG[key])
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(key, "must be a whole number >= 0", value)
        params[key] = value
    if cfg.max_steps < 1:
        raise ConfigError("max_steps", "the demo needs at least one step", cfg.max_steps)
    return params


# --------------------------------------------------------------------------- entry

def _distributed_child() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(args: Any) -> int:
    """Run the demo for parsed ``args`` (see :func:`add_demo_arguments`)."""
    if _distributed_child():
        args.nproc = int(os.environ["WORLD_SIZE"])
        return _train(args)
    from .plugins import get_plugins

    cfg = build_config(args)
    _params(cfg)  # fail on a bad config before anything is deleted or launched
    get_plugins().backend(cfg.checkpoint_config.type)
    if args.fresh:
        _remove_previous(cfg)
    if args.nproc > 1:
        return _launch(args)
    return _train(args)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m roll_ckpt.demo ARGS`` is ``roll-ckpt demo ARGS``."""
    from .cli import main as cli_main

    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


def _remove_previous(cfg: Any) -> None:
    from .manager import open_storage
    from .plugins import get_plugins

    cc = cfg.checkpoint_config
    storage = open_storage(get_plugins(), cc.type, cc.output_dir, cc.storage_options)
    if storage.exists(storage.root):
        storage.remove_tree(storage.root)
        print(f"--fresh: removed the previous checkpoints under {cc.output_dir}", flush=True)


def _child_args(args: Any) -> list[str]:
    out = []
    if args.config:
        out += ["--config", os.path.abspath(args.config)]
    if args.output:
        out += ["--output", args.output]
    if args.resume:
        out.append("--resume")
    if args.stop_after:
        out += ["--stop-after", str(args.stop_after)]
    return out  # never --nproc: torch.distributed.run would take it for its own --nproc-per-node


def _launch(args: Any) -> int:
    """Run the demo on ``args.nproc`` local processes with torch.distributed.run, bounded in time."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", "-m", "roll_ckpt.demo", *_child_args(args)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"launching {args.nproc} processes: {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise RollCkptError(f"the {args.nproc}-process demo did not finish within {args.timeout:.0f}s and "
                            "was stopped; raise --timeout or lower max_steps") from None
    except KeyboardInterrupt:
        _stop(proc)
        raise
    if rc != 0:
        raise RollCkptError(f"the {args.nproc}-process demo failed (exit status {rc}); "
                            "the first rank's message above says why")
    return 0


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# --------------------------------------------------------------------------- the job

class BanditDataset:
    """Fixed synthetic contexts; the correct arm of a context is ``argmax(x @ W)``.

    Built from its own generator, so every process and every run sees the same data.
    """

    def __init__(self, contexts: int, eval_contexts: int, features: int, arms: int, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        w = torch.randn(features, arms, generator=g)
        self.x = torch.randn(contexts, features, generator=g)
        self.answer = (self.x @ w).argmax(-1)
        self.eval_x = torch.randn(eval_contexts, features, generator=g)
        self.eval_answer = (self.eval_x @ w).argmax(-1)

    def __len__(self) -> int:
        return self.x.shape[0]


class BatchSampler:
    """Random batches without replacement, reshuffled every epoch.

    Stateful: its epoch, position, order and generator go into the checkpoint, so a
    resumed run draws exactly the batches the interrupted one would have drawn.
    """

    def __init__(self, size: int, batch_size: int, seed: int) -> None:
        import torch

        self.size = size
        self.batch_size = min(batch_size, size)
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.cursor = 0
        self.order = torch.randperm(size, generator=self.generator)

    def next_batch(self) -> Any:
        import torch

        if self.cursor + self.batch_size > self.size:
            self.epoch += 1
            self.cursor = 0
            self.order = torch.randperm(self.size, generator=self.generator)
        idx = self.order[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "order": self.order.clone(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["order"].numel() != self.size:
            raise RollCkptError(f"the sampler in the checkpoint walked {sd['order'].numel()} contexts, "
                                f"this run has {self.size}: demo.contexts changed; start with --fresh")
        self.epoch, self.cursor = int(sd["epoch"]), int(sd["cursor"])
        self.order = sd["order"].clone()
        self.generator.set_state(sd["generator"].to("cpu", dtype=self.generator.get_state().dtype))


def _policy(features: int, hidden: int, arms: int, dropout: float) -> Any:
    import torch
    from torch import nn

    class Policy(nn.Module):
        """An MLP body with a policy head (logits over arms) and a value head (the baseline)."""

        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Dropout(dropout),
                                      nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(dropout))
            self.policy_head = nn.Linear(hidden, arms)
            self.value_head = nn.Linear(hidden, 1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.body(x)
            return self.policy_head(h), self.value_head(h)  # [batch, 1]: FSDP2 wants no view as output

    return Policy()


class _Printer:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, *lines: str) -> None:
        if self.enabled:
            for line in lines:
                print(line, flush=True)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _train(args: Any) -> int:
    import random

    import numpy as np
    import torch
    import torch.nn.functional as F

    from . import layout
    from .inspection import human_bytes
    from .manager import CheckpointManager

    cfg = build_config(args)
    p = _params(cfg)
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and bitwise reproducible
    dist, rank, world, device = _init_distributed()
    say = _Printer(rank == 0)
    manager = None
    try:
        # Identical initial weights on every rank (FSDP2 shards them), then per-rank randomness.
        torch.manual_seed(cfg.seed)
        policy = _policy(p["features"], p["hidden"], p["arms"], p["dropout"]).to(device)
        if dist is not None:
            policy = _shard(policy, world, device)
        random.seed(cfg.seed + rank)
        np.random.seed(cfg.seed + rank)
        torch.manual_seed(cfg.seed + 1 + rank)
        data = BanditDataset(p["contexts"], p["eval_contexts"], p["features"], p["arms"], cfg.seed)
        sampler = BatchSampler(len(data), p["batch_size"], seed=cfg.seed + 7919 * (rank + 1))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.max_steps, eta_min=p["lr"] * 0.1)
        counters = {"episodes": 0, "rewarded": 0}
        state = {"model": policy, "optimizer": optimizer, "scheduler": scheduler,
                 "sampler": sampler, "counters": counters}

        manager = CheckpointManager.from_config(cfg)
        cc = cfg.checkpoint_config
        say(f"roll-ckpt demo: REINFORCE with a learned baseline on a contextual bandit "
            f"({p['arms']} arms, {len(data)} contexts, verifiable 0/1 reward)",
            f"  config       {args.config or '(built-in; same as examples/rlvr_demo.yaml)'}: exp_name {cfg.exp_name}, "
            f"max_steps {cfg.max_steps}, save_steps {cfg.save_steps}, "
            f"async_save_ckpt {str(cfg.strategy_config.async_save_ckpt).lower()}",
            f"  checkpoints  {cc.output_dir}  (type {cc.type})")
        t_resume = time.perf_counter()
        start = manager.resume(state)
        strategy = manager.strategy
        say(f"  processes    {world} ({'FSDP2 on ' + device.type + ', ' if dist is not None else ''}"
            f"strategy {strategy.name})")
        offload = hasattr(strategy, "offload_states") and hasattr(strategy, "load_states")
        if dist is not None:
            say("  RL cycle     " + (f"training states offloaded during each rollout (offload_backend "
                                      f"{cfg.offload_backend})" if offload else
                                      "no offload: this strategy has no offload_states/load_states"))
        counters = state["counters"]
        if start:
            say(f"resumed from {manager.resumed_from} (step {start}); continuing at step {start + 1} "
                f"[restore took {_ms(time.perf_counter() - t_resume)}; {counters['episodes']} episodes so far]")
        elif cfg.resume_target:
            say(f"no committed checkpoint under {cc.output_dir} yet: starting fresh at step 1")
        else:
            say("starting fresh at step 1")
        if args.stop_after is not None and args.stop_after <= start:
            say(f"--stop-after {args.stop_after}: the run is already at step {start}; nothing to do")
            manager.close()
            return 0
        if start >= cfg.max_steps:
            say(f"step {start} already reached max_steps {cfg.max_steps}: training is complete")
            manager.close()
            return 0

        pending: dict[int, float] = {}  # step -> seconds the loop was blocked by its save

        def report_commits() -> None:
            last = manager.last_save
            if last is not None and last.step in pending:
                blocked = pending.pop(last.step)
                how = "async" if last.is_async else "sync"
                say(f"      committed checkpoint-{last.step}: {human_bytes(last.bytes)} in {_ms(last.total_s)} "
                    f"({how}; the loop was blocked {_ms(last.blocked_s if last.is_async else blocked)}; "
                    f"{human_bytes(last.bytes_copied)} copied while staging)")

        logging_steps, eval_steps = p["logging_steps"], p["eval_steps"]
        t_loop = time.perf_counter()
        offloaded = False
        for step in range(start + 1, cfg.max_steps + 1):
            # Rollout phase: the inference engine owns the device while the training
            # states wait in the offload store (here: drawing the batch stands in for it).
            if offload and not offloaded:
                strategy.offload_states(state)
            idx = sampler.next_batch()
            x, answer = data.x[idx].to(device), data.answer[idx].to(device)
            if offload:
                strategy.load_states(state)
                offloaded = False
            # Training phase: one REINFORCE update with the learned value as baseline.
            policy.train()
            logits, value = policy(x)
            value = value.squeeze(-1)
            pi = torch.distributions.Categorical(logits=logits)
            action = pi.sample()
            reward = (action == answer).float()
            advantage = reward - value.detach()
            pg_loss = -(pi.log_prob(action) * advantage).mean()
            loss = pg_loss + p["value_coef"] * F.mse_loss(value, reward) - p["entropy_coef"] * pi.entropy().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            counters["episodes"] += len(idx)
            counters["rewarded"] += int(reward.sum().item())

            if logging_steps and (step % logging_steps == 0 or step == start + 1):
                mean_loss, mean_reward = _mean(dist, loss.detach(), reward.mean())
                say(f"step {step:4d}  loss={mean_loss:.10f}  reward={mean_reward:.4f}  lr={lr:.3e}")
            if eval_steps and step % eval_steps == 0:
                say(f"eval {step:4d}  greedy accuracy={_evaluate(policy, data, device):.4f}")
            if offload:  # the next rollout begins: offload now, so a save writes from the store
                strategy.offload_states(state)
                offloaded = True
            t0 = time.perf_counter()
            path = manager.maybe_save(step, state)
            if path is not None:
                pending[step] = time.perf_counter() - t0
                mode = "writing in the background" if cfg.strategy_config.async_save_ckpt else "committed"
                say(f"save {step:4d}  -> {path}  (the loop was blocked {_ms(pending[step])}; {mode})")
            report_commits()
            if args.stop_after is not None and step == args.stop_after:
                manager.wait()  # a real crash would lose the save in flight; the demo keeps it deterministic
                report_commits()
                manager.close()
                latest = layout.latest(manager.storage, manager.root)
                say("", f"*** stopped abruptly after step {step} (simulated crash): no final save ***")
                _say_resume(say, args, cfg, latest)
                return 0

        manager.wait()
        report_commits()
        done_already = manager.last_save is not None and manager.last_save.step == cfg.max_steps
        t0 = time.perf_counter()
        final = manager.save(cfg.max_steps, state, final=True,
                             metadata={"episodes": counters["episodes"], "rewarded": counters["rewarded"]})
        if done_already:
            say(f"final save -> {final}  (already committed by the periodic save of step {cfg.max_steps})")
        else:
            last = manager.last_save
            say(f"final save -> {final}  (sync, durable before returning: "
                f"{human_bytes(last.bytes) if last else '?'} in {_ms(time.perf_counter() - t0)})")
        manager.close()
        elapsed = time.perf_counter() - t_loop
        say("", f"done: steps {start + 1}-{cfg.max_steps} in {elapsed:.1f}s; "
            f"{counters['episodes']} episodes, mean reward {counters['rewarded'] / max(counters['episodes'], 1):.4f}")
        refs = layout.committed(manager.storage, manager.root)
        say(f"committed checkpoints under {cc.output_dir}:")
        for ref in refs:
            say(f"  step {ref.step:4d}  {ref.path}")
        say(f"see them with: roll-ckpt ls {shlex.quote(cc.output_dir)}",
            f"check one:     roll-ckpt verify {shlex.quote(refs[-1].path) if refs else '<checkpoint>'}")
        _say_resume(say, args, cfg, refs[-1] if refs else None)
        return 0
    finally:
        if manager is not None and sys.exc_info()[0] is not None:
            try:  # already failing: drain quietly, the first error is the one to report
                manager.close()
            except Exception:
                pass
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


def _say_resume(say: Any, args: Any, cfg: Any, latest: Any) -> None:
    if latest is None:
        say("no committed checkpoint yet: the next run starts fresh")
        return
    cmd = ["roll-ckpt", "demo"]
    if args.config:
        cmd += ["--config", args.config]
    if args.output:
        cmd += ["--output", args.output]
    if args.nproc > 1:
        cmd += ["--nproc", str(args.nproc)]
    say(f"newest committed checkpoint: {latest.path} (step {latest.step})",
        f"to resume:  {shlex.join(cmd + ['--resume'])}",
        f"or in the config:  resume_from_checkpoint: {latest.path}")


def _mean(dist: Any, *values: Any) -> list[float]:
    """Values averaged over the ranks (for logging only)."""
    import torch

    v = torch.stack([t.detach().float().reshape(()) for t in values])
    if dist is not None:
        dist.all_reduce(v)
        v /= dist.get_world_size()
    return [float(t) for t in v.cpu()]


def _evaluate(policy: Any, data: BanditDataset, device: Any) -> float:
    """Greedy accuracy on held-out contexts (no sampling: consumes no randomness)."""
    import torch

    policy.eval()
    with torch.no_grad():
        logits, _ = policy(data.eval_x.to(device))
    policy.train()
    return float((logits.argmax(-1).cpu() == data.eval_answer).float().mean())


def _init_distributed() -> tuple[Any, int, int, Any]:
    import torch

    if not _distributed_child():
        return None, 0, 1, torch.device("cpu")
    import torch.distributed as dist

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:  # one GPU per process
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist, dist.get_rank(), dist.get_world_size(), device


def _shard(policy: Any, world: int, device: Any) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for module in (policy.body[0], policy.body[3], policy.policy_head, policy.value_head):
        fully_shard(module, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    return policy


if __name__ == "__main__":
    sys.exit(main())
