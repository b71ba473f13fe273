"""Ranks of jobs with the fast recovery tier (``checkpoint_config.local``), run under torchrun
by ``test_local_tier.py``. Each rank plays node ``node<rank * 2 // world>`` (two simulated
nodes, ``ROLL_CKPT_NODE``).

``python -m torch.distributed.run --standalone --nproc_per_node N local_tier_workers.py OUT LOCAL STEPS DIE_AT
[OPTIONS]``

* trains ``STEPS`` steps (FSDP2 MLP, AdamW, LR scheduler, data drawn from the global RNGs),
  persistent async saves every 4 steps, local saves every step, resume ``latest``;
* ``DIE_AT`` > 0: after that step's saves the ranks of ``node1`` are killed (SIGKILL) and the
  others wait to be killed by the test;
* OPTIONS (comma-separated): ``sync`` (synchronous saves), ``offload`` (saves from the
  offload store, zero-copy), ``kill_in_local_save``/``kill_in_replication`` (node1 dies inside
  the local save of DIE_AT), ``full_local`` (node1's local writes fail with ENOSPC).

Every rank writes ``OUT/result-<rank>.json``: the step resumed, where from, the losses and a
digest of the full parameters and optimizer state after the last step.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from workers import build, full, optim_full, train_step  # noqa: E402

from roll_ckpt import CheckpointManager, load_config  # noqa: E402


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(out: str, local: str, steps: str, die_at: str, options: str = "") -> None:
    import random

    import numpy as np

    opts = set(filter(None, options.split(",")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = f"node{rank * 2 // world}"
    os.environ["ROLL_CKPT_NODE"] = node
    with open(os.path.join(out, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    steps_n, die_n = int(steps), int(die_at)
    model, opt, sched = build()
    torch.manual_seed(1 + rank)
    random.seed(2 + rank)
    np.random.seed(3 + rank)
    data = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(10)]
    cfg = {"exp_name": "lt", "save_steps": 4, "resume_from_checkpoint": "latest",
           "strategy_config": {"async_save_ckpt": "sync" not in opts},
           "checkpoint_config": {"output_dir": os.path.join(out, "persist"), "on_save_error": "warn",
                                 "local": {"dir": local, "save_steps": 1, "max_to_keep": 2, "replicas": 1}}}
    m = CheckpointManager.from_config(load_config(cfg), quiet=True)
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    start = m.resume(state)
    tier = m._local
    if "full_local" in opts and node == "node1":
        def full_disk(path: str):  # a tmpfs with no room left
            raise OSError(errno.ENOSPC, "No space left on device", path)

        tier.storage.open_write = full_disk
    if die_n and node == "node1" and opts & {"kill_in_local_save", "kill_in_replication"}:
        hook_name = "_write_unit" if "kill_in_local_save" in opts else "_keep"
        original = getattr(tier, hook_name)

        def dying(*args, **kwargs):
            if args[1 if hook_name == "_write_unit" else 0] == die_n:  # the step being saved
                if hook_name == "_write_unit":
                    original(*args, **kwargs)  # the unit is committed; the replica exchange never happens
                die()
            return original(*args, **kwargs)

        setattr(tier, hook_name, dying)
    losses = {}
    for step in range(start + 1, steps_n + 1):
        losses[step] = train_step(model, opt, sched, data).hex()
        if "offload" in opts:
            m.strategy.offload_states(state, optimizer=True)
        m.maybe_save(step, state)
        if "offload" in opts:
            m.strategy.load_states(state)
        if step == die_n:
            m.wait()
            open(os.path.join(out, f"waiting-{rank}"), "w").close()
            dist.barrier()
            if node == "node1":
                die()
            time.sleep(600)  # killed by the test
    m.wait()
    body = {"start": start, "resumed_from": m.resumed.path, "losses": losses,
            "params": digest(full(model)), "optim": digest(optim_full(model, opt)),
            "local_bytes": m.local.bytes_used, "local_last": m.local.last_save,
            "local_failed": m.local.failed_saves, "failed_saves": m.stats.failed,
            "persistent_last": m.stats.last.step if m.stats.last else None}
    m.close()
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(body, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
