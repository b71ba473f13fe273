"""A training job for the preemption tests: resume ``latest``, train, ``maybe_save`` every
step, log what it did. An unchanged loop: :class:`roll_ckpt.Preempted` ends it.

``python _preempt_child.py OUT LOG MAX_STEPS SIGNAL_AT`` where ``SIGNAL_AT`` is when the
job sends itself SIGTERM: ``none``, ``during_resume``, ``after_resume`` or ``in_flight``
(right after an asynchronous save returned, while it still writes). Lines of LOG:
``resumed S``, ``trained N INFLIGHT``, ``preempted N``, ``done``.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from roll_ckpt import CheckpointManager, Preempted, load_config
from roll_ckpt.plugin import hookimpl
from roll_ckpt.plugins import get_plugins

EXIT_CODE = 7


def log(fd: int, *words: object) -> None:
    os.write(fd, (" ".join(map(str, words)) + "\n").encode())


def build() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(1024, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optimizer": optimizer, "progress": {"samples": 0}}


def train(state: dict, step: int) -> None:
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(step))
    state["model"](x).pow(2).mean().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    state["progress"]["samples"] += 16


class _SignalDuringResume:
    @hookimpl
    def roll_ckpt_load(self, path: str, state: dict) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives before resume returns


def main(out: str, log_path: str, max_steps: int, signal_at: str) -> int:
    torch.set_num_threads(1)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if signal_at == "during_resume":
        get_plugins().register(_SignalDuringResume(), name="signal-during-resume")
    cfg = load_config({"checkpoint_config": {"output_dir": out, "preemption": {"exit_code": EXIT_CODE}},
                       "save_steps": 3, "max_steps": max_steps, "resume_from_checkpoint": "latest",
                       "strategy_config": {"async_save_ckpt": True}})
    state = build()
    manager = CheckpointManager(cfg, quiet=True)
    start = manager.resume(state)
    log(fd, "resumed", start)
    if signal_at == "after_resume":
        os.kill(os.getpid(), signal.SIGTERM)
    sent = False
    try:
        for step in range(start + 1, max_steps + 1):
            train(state, step)
            log(fd, "trained", step, int(manager.stats.in_flight))
            if signal_at == "in_flight" and manager.stats.in_flight and not sent:
                os.kill(os.getpid(), signal.SIGTERM)
                sent = True
            manager.maybe_save(step, state)
    except Preempted as exc:
        log(fd, "preempted", exc.step)
        raise
    manager.save(max_steps, state, final=True)
    manager.close()
    torch.save(state["model"].state_dict(), os.path.join(out, "final.pt"))
    log(fd, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
