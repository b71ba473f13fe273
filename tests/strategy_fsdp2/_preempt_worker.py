"""One rank of the FSDP2 preemption job (run under torchrun): resume ``latest``, train with the
offload cycle, ``maybe_save`` every step; :class:`roll_ckpt.Preempted` ends it.

``_preempt_worker.py OUT MAX_STEPS SIGNAL_AT`` where ``SIGNAL_AT`` is ``none`` or
``rank1:<step>`` (only rank 1 sends itself SIGTERM after that step). Each rank appends to
``OUT/rank<r>.log``: ``resumed S``, ``trained N``, ``preempted N``, ``done``.
"""

from __future__ import annotations

import os
import random
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workers import build, exit_worker, full, manager, train_step  # noqa: E402

from roll_ckpt import Preempted  # noqa: E402


def main(out: str, max_steps: int, signal_at: str) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fd = os.open(os.path.join(out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(*words: object) -> None:
        os.write(fd, (" ".join(map(str, words)) + "\n").encode())

    model, opt, sched = build()
    torch.manual_seed(1 + rank)
    random.seed(2 + rank)
    np.random.seed(3 + rank)
    data = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(10)]
    m = manager(out, save_steps=4, resume_from_checkpoint="latest", checkpoint_config={"output_dir": out})
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    start = m.resume(state)
    log("resumed", start)
    kill_rank, _, kill_step = signal_at.partition(":")
    try:
        for step in range(start + 1, max_steps + 1):
            train_step(model, opt, sched, data)
            log("trained", step)
            if kill_rank == f"rank{rank}" and step == int(kill_step):
                os.kill(os.getpid(), signal.SIGTERM)  # this rank only: the other learns of it from the agreement
            m.strategy.offload_states(state, optimizer=True)  # rollout phase: the store holds the state
            m.maybe_save(step, state)
            m.strategy.load_states(state)
    except Preempted as exc:
        log("preempted", exc.step)
        raise
    m.save(max_steps, state, final=True)
    m.close()
    params = full(model)
    if rank == 0:
        torch.save(params, os.path.join(out, "final.pt"))
    log("done")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_worker(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
