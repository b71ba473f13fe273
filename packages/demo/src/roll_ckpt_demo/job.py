"""The demo's training job: REINFORCE on a contextual bandit, saved and resumed exactly
(see :mod:`roll_ckpt_demo.launch` for what it shows)."""

from __future__ import annotations

import os
import shlex
import sys
import time
from typing import Any

from roll_ckpt import RollCkptError

from .settings import build_config, distributed_child, params

__all__ = ["train", "BanditDataset", "BatchSampler"]


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


def train(args: Any) -> int:
    import random

    import numpy as np
    import torch
    import torch.nn.functional as F

    from roll_ckpt import CheckpointManager

    from roll_ckpt.plugin import committed_checkpoints, human_bytes, latest_checkpoint

    cfg = build_config(args)
    p = params(cfg)
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
            f"async_save_ckpt {str(cfg.async_save).lower()}",
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
            say(f"resumed from {manager.resumed.path} (step {start}); continuing at step {start + 1} "
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
            last = manager.stats.last
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
                mode = "writing in the background" if cfg.async_save else "committed"
                say(f"save {step:4d}  -> {path}  (the loop was blocked {_ms(pending[step])}; {mode})")
            report_commits()
            if args.stop_after is not None and step == args.stop_after:
                manager.wait()  # a real crash would lose the save in flight; the demo keeps it deterministic
                report_commits()
                manager.close()
                latest = latest_checkpoint(manager.storage, manager.storage.root)
                say("", f"*** stopped abruptly after step {step} (simulated crash): no final save ***")
                _say_resume(say, args, cfg, latest)
                return 0

        manager.wait()
        report_commits()
        done_already = manager.stats.last is not None and manager.stats.last.step == cfg.max_steps
        t0 = time.perf_counter()
        final = manager.save(cfg.max_steps, state, final=True,
                             metadata={"episodes": counters["episodes"], "rewarded": counters["rewarded"]})
        if done_already:
            say(f"final save -> {final}  (already committed by the periodic save of step {cfg.max_steps})")
        else:
            last = manager.stats.last
            say(f"final save -> {final}  (sync, durable before returning: "
                f"{human_bytes(last.bytes) if last else '?'} in {_ms(time.perf_counter() - t0)})")
        manager.close()
        elapsed = time.perf_counter() - t_loop
        say("", f"done: steps {start + 1}-{cfg.max_steps} in {elapsed:.1f}s; "
            f"{counters['episodes']} episodes, mean reward {counters['rewarded'] / max(counters['episodes'], 1):.4f}")
        refs = committed_checkpoints(manager.storage, manager.storage.root)
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

    if not distributed_child():
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
    from roll_ckpt.plugin import fsdp2_options

    mesh = init_device_mesh(device.type, (world,))
    for module in (policy.body[0], policy.body[3], policy.policy_head, policy.value_head):
        fully_shard(module, mesh=mesh, **fsdp2_options(mesh.device_type))
    fully_shard(policy, mesh=mesh, **fsdp2_options(mesh.device_type))
    return policy
