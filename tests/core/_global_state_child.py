"""One rank of test_global_state.py's 2-rank save: a GlobalState holding a DTensor sharded
over both ranks (Shard(0): rank r holds rows 4r..4r+3) and a value both share.

    _global_state_child.py OUT
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from helpers.launch import exit_worker
from helpers.training import config
from roll_ckpt import CheckpointManager, GlobalState


class Holder:
    def __init__(self, sd: dict) -> None:
        self.sd = sd

    def state_dict(self) -> dict:
        return self.sd

    def load_state_dict(self, sd: dict) -> None:
        self.sd = sd


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    w = distribute_tensor(torch.arange(16.0).reshape(8, 2), mesh, [Shard(0)])
    assert w.to_local().shape == (4, 2)
    with CheckpointManager(config(f"{out}/ckpt"), quiet=True) as m:
        m.save(3, {"wrapped": GlobalState(Holder({"w": w, "count": 5}))})
    # every rank, resumed on 2 ranks again: its own rows back
    fresh = Holder({"w": distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0)]), "count": 0})
    with CheckpointManager(config(f"{out}/ckpt", resume_from_checkpoint="latest"), quiet=True) as m:
        m.resume({"wrapped": GlobalState(fresh)})
    ok = torch.equal(fresh.sd["w"].to_local(), torch.arange(16.0).reshape(8, 2)[4 * rank:4 * rank + 4]) \
        and fresh.sd["count"] == 5
    got = [None, None]
    dist.all_gather_object(got, "ok" if ok else "wrong")
    if rank == 0:
        with open(f"{out}/saved.json", "w") as f:
            json.dump({str(r): v for r, v in enumerate(got)}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_worker()
