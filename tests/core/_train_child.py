"""A small training job used by test_exact_resume.py (run as a child process).

It trains a model with dropout on randomly sampled, randomly perturbed batches (torch,
python ``random`` and numpy RNGs, plus a sampler with its own generator), AdamW and a LR
scheduler, saves every ``--save-every`` steps and, with ``--die-after S``, dies abruptly
(``os._exit``) right after the save of step S. It prints ``loss <step> <float.hex>`` for
every step and, when it finishes, saves the final state with ``torch.save``.
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np
import torch

from roll_ckpt import CheckpointManager, load_config

N, DIM, BATCH = 96, 12, 8


class Sampler:
    """A stateful sampler: its own generator, a shuffled epoch and a position in it."""

    def __init__(self, n: int, batch: int, seed: int) -> None:
        self.n, self.batch = n, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.perm: list[int] | None = None
        self.pos = 0
        self.epoch = 0

    def next(self) -> list[int]:
        if self.perm is None or self.pos + self.batch > self.n:
            self.perm = torch.randperm(self.n, generator=self.gen).tolist()
            self.pos = 0
            self.epoch += 1
        idx = self.perm[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return idx

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "perm": self.perm, "pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, sd: dict) -> None:
        self.gen.set_state(sd["gen"])
        self.perm = None if sd["perm"] is None else list(sd["perm"])
        self.pos = int(sd["pos"])
        self.epoch = int(sd["epoch"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--die-after", type=int, default=0)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--result", default="")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    seed = 1234
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    data_gen = torch.Generator().manual_seed(7)  # the data set itself is fixed
    xs = torch.randn(N, DIM, generator=data_gen)
    ys = (xs @ torch.randn(DIM, 1, generator=data_gen)).squeeze(1)

    model = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.GELU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.6)
    sampler = Sampler(N, BATCH, seed=99)
    counter = {"samples": 0, "flips": 0}
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
             "sampler": sampler, "counter": counter}

    cfg = load_config({
        "checkpoint_config": {"type": "file_system", "output_dir": args.out},
        "resume_from_checkpoint": "latest" if args.resume else False,
        "max_steps": args.steps,
        "save_steps": args.save_every,
        "strategy_config": {"async_save_ckpt": args.async_save},
    })
    manager = CheckpointManager.from_config(cfg, quiet=True)
    start = manager.resume(state)
    print(f"start {start}", flush=True)
    model.train()
    for step in range(start + 1, cfg.max_steps + 1):
        idx = sampler.next()
        extra = random.sample(range(N), 2)                    # python RNG
        idx = idx + extra
        x = xs[idx] + torch.from_numpy(np.random.normal(0, 0.05, size=(len(idx), DIM))).float()  # numpy RNG
        if random.random() < 0.5:
            x = -x
            counter["flips"] += 1
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), ys[idx])   # dropout: torch RNG
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        counter["samples"] += len(idx)
        print(f"loss {step} {loss.item().hex()}", flush=True)
        saved = manager.maybe_save(step, state)
        if saved and step == args.die_after:
            print(f"died {step}", flush=True)
            os._exit(17)
    manager.save(cfg.max_steps, state, final=True)
    manager.close()
    print(f"blocked {manager.stats.last.blocked_s:.4f}", flush=True)
    if args.result:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(),
                    "counter": dict(counter), "torch_rng": torch.get_rng_state(),
                    "py_rng": random.getstate(), "np_rng": np.random.get_state()[1].tolist()},
                   args.result)


if __name__ == "__main__":
    main()
