"""One rank of a 2-rank gloo job in which one rank stops itself (SIGSTOP) in one phase
(run by test_hangs.py): ``_hang_child.py OUT PHASE``; ``RANK``/``WORLD_SIZE``/``MASTER_*``
come from the test. ``OUT/ckpt`` holds the checkpoints; each rank that gets to report
writes ``OUT/<rank>.json`` (``{"error": type, "message": ..., "s": seconds it waited}``).

Phases (who stops, where):

* ``write``   rank 1, before its save of step 2 (rank 0 waits in the save's first agreement);
* ``commit``  rank 0, in the commit of step 2, before the manifest (rank 1 has written its
  part and waits in the agreement that the step was committed);
* ``choose``  rank 1, before resume (rank 0 waits for it to take the checkpoint chosen);
* ``load``    rank 1, in resume's DCP load of step 1 (rank 0 waits in the load's plan exchange).

``write-only`` (no rank stops) saves step 1, for the resume phases.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from helpers.launch import exit_worker
from helpers.training import config
from roll_ckpt import CheckpointManager, RollCkptError


def stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def main(out: str, phase: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(4, 4), "counter": {"n": 0}}
    cfg = config(f"{out}/ckpt", collective_timeout_s=3, timestamp_subdir=False,
                 resume_from_checkpoint="latest" if phase in ("choose", "load") else False)
    m = CheckpointManager.from_config(cfg, quiet=True)
    m.bind(state)
    t0 = time.monotonic()
    try:
        if phase == "write-only":  # the checkpoint the resume phases start from
            m.resume(state)
            m.save(1, state)
        elif phase in ("choose", "load"):
            if phase == "choose" and rank == 1:
                stop()
            if phase == "load" and rank == 1:
                import roll_ckpt.strategies.dcp as strategy_module  # the job's DCP read (dcp/reader.py's)

                real = strategy_module.read_dcp
                strategy_module.read_dcp = lambda *a, **k: (stop(), real(*a, **k))[1]  # type: ignore
            t0 = time.monotonic()
            m.resume(state)
        else:
            m.resume(state)
            m.save(1, state)
            if phase == "write" and rank == 1:
                stop()
            if phase == "commit" and rank == 0:
                from roll_ckpt.format.commit import PendingCheckpoint

                real = PendingCheckpoint.commit
                PendingCheckpoint.commit = lambda self, manifest: (stop(), real(self, manifest))[1]  # type: ignore
            t0 = time.monotonic()
            m.save(2, state)
            t0 = time.monotonic()
            m.maybe_save(3, state)
        result = {"error": None}
    except RollCkptError as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    result["s"] = time.monotonic() - t0
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(result, f)
    exit_worker(0)  # no close(), no destroy: the group has a stopped member


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
