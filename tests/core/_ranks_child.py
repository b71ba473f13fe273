"""One rank of a 2-rank gloo group (started by helpers.launch.torchrun) for test_components_ranks.py.

    _ranks_child.py OUT RUN_NAME first|second

``first`` saves step 2 of component ``actor`` (the pipeline never does). ``second`` is a
launch that reuses the run name: its save of step 2 is refused on rank 0 (the part is
already committed) and must be refused on every rank, quickly, not after a collective
times out. Each rank writes ``OUT/<mode>-<rank>.json``.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from helpers.launch import exit_worker
from helpers.training import config
from roll_ckpt import CheckpointManager, RollCkptError


def main(out: str, run: str, mode: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(4, 4)}
    cfg = config(f"{out}/ckpt", components=["actor", "pipeline"], run_name=run)
    manager = CheckpointManager(cfg, component="actor", quiet=True)
    result: dict = {"rank": rank}
    t0 = time.monotonic()
    try:
        manager.save(2, state)
        result["saved"] = True
    except RollCkptError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = time.monotonic() - t0
    manager.close()
    with open(f"{out}/{mode}-{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    exit_worker()
