"""One side of a cross-version resume (``test_cross_version.py``), run by any leg's Python.

    python _cross_job.py write single OUT       one process: train, save at step 3, digest what was saved
    python _cross_job.py write fsdp2 OUT        the same on each of 2 FSDP2 ranks (RANK/WORLD_SIZE set)
    python _cross_job.py read single OUT        resume OUT/ckpt into a fresh job, digest what came back
    python _cross_job.py read fsdp2 OUT         the same on 2 FSDP2 ranks
    python _cross_job.py read reshard OUT       a 2-rank FSDP2 checkpoint into one plain process

Each process writes ``OUT/<write|read>-<mode>-<rank>.json``: the versions it ran on, the names
of the values a fresh job has on its torch (``known``: releases add and drop hyperparameters
and scheduler fields), and a digest of every value of the job's state: the model's and the optimizer's tensors (whole,
gathered from the shards, so any world size compares), the optimizer's hyperparameters, the
scheduler, the sampler (its own generator), a counter, the step, and this process's Python,
NumPy and torch RNG states. The reader starts from other values (another seed) everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import sys

import numpy as np
import torch

from helpers import training
from roll_ckpt import CheckpointManager, load_config

STEP = 3


class Sampler:
    """A data position with a generator of its own (a stateful dataloader's part)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.pos = 0

    def next(self) -> int:
        self.pos += 1
        return int(torch.randint(0, 1000, (1,), generator=self.gen))

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.gen.set_state(sd["gen"])
        self.pos = int(sd["pos"])


def _tensor(t: torch.Tensor) -> str:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    full = full.detach().cpu().contiguous()
    h = hashlib.sha256(f"{full.dtype}|{tuple(full.shape)}|".encode())
    h.update(full.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _value(v: object) -> object:
    """A JSON form of ``v`` that two equal values share and two different ones do not."""
    if isinstance(v, torch.Tensor):
        return {"tensor": _tensor(v)}
    if isinstance(v, np.ndarray):
        return {"array": str(v.dtype), "bytes": hashlib.sha256(v.tobytes()).hexdigest()}
    if isinstance(v, dict):
        return {str(k): _value(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    if isinstance(v, float):
        return {"float": v.hex()}
    return v if isinstance(v, (int, str, bool, type(None))) else repr(v)


def digest(model, opt, sched, sampler, counter: dict, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = {f"model.{k}": _tensor(v) for k, v in model.state_dict().items()}
    osd = get_optimizer_state_dict(model, opt)
    for fqn, st in sorted(osd["state"].items()):
        out.update({f"optimizer.state.{fqn}.{k}": _value(v) for k, v in sorted(st.items())})
    for i, group in enumerate(osd["param_groups"]):
        out.update({f"optimizer.group{i}.{k}": _value(v) for k, v in group.items()})
    out.update({f"scheduler.{k}": _value(v) for k, v in sched.state_dict().items()})
    out["sampler"] = _value(sampler.state_dict())
    out["counter"] = _value(counter)
    out["step"] = step
    out["rng.python"] = _value(random.getstate())
    out["rng.numpy"] = _value(np.random.get_state())
    out["rng.torch"] = _tensor(torch.get_rng_state())
    return out


def versions() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}


def job(mode: str, seed: int):
    """The model (plain, or FSDP2 over the ranks), AdamW, StepLR, a sampler and a counter."""
    model = training.mlp(width=32, depth=2, seed=seed)
    if mode == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        model = training.shard(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    opt, sched = training.optimizer_and_scheduler(model)
    return model, opt, sched, Sampler(seed + 100), {"seen": seed}


def main() -> None:
    role, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = int(os.environ.get("RANK", "0"))
    if mode == "fsdp2":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    seed = 0 if role == "write" else 7  # the reader starts from other values everywhere
    torch.manual_seed(seed + 10 * rank)
    random.seed(seed + 1 + rank)
    np.random.seed(seed + 2 + rank)
    model, opt, sched, sampler, counter = job(mode if mode != "reshard" else "single", seed)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler, "counter": counter}
    known = sorted(digest(model, opt, sched, sampler, counter, 0))  # the values this torch's job has
    ckpt = os.path.join(out, "ckpt")
    cfg = {"checkpoint_config": {"output_dir": ckpt, "timestamp_subdir": False},
           "resume_from_checkpoint": role == "read"}
    manager = CheckpointManager.from_config(load_config(cfg), quiet=True)
    if role == "write":
        for step in range(1, STEP + 1):
            training.train_step(state, torch.randn(4, 16) + sampler.next() * 1e-3, scheduler=True,
                                count=("counter", "seen", 1))
        result = digest(model, opt, sched, sampler, counter, STEP)  # what the save captures
        manager.save(STEP, state, final=True)
    else:
        step = manager.resume(state)
        result = digest(model, opt, sched, sampler, counter, step)
    manager.close()
    with open(os.path.join(out, f"{role}-{mode}-{rank}.json"), "w") as f:
        json.dump({"versions": versions(), "known": known, "digests": result}, f, indent=0, sort_keys=True)
    sys.stdout.flush()
    os._exit(0)  # helpers.launch.exit_worker's reason: a gloo worker thread at interpreter exit


if __name__ == "__main__":
    main()
