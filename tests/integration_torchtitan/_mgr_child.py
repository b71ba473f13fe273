"""One rank of test_manager.py: a checkpoint manager built from its Config as torchtitan's
``Trainer`` builds it (``config.checkpoint.build(...)``), with torchtitan's own components --
an FSDP2 model, ``OptimizersContainer``, ``LRSchedulersContainer``, ``ParallelAwareDataloader``
(a ``StatefulDataLoader``: its state is torchtitan's pickle) -- and a train state; no Trainer, so
no CPU shim is needed. It loads, trains and saves as the Trainer does, and reports.

    _mgr_child.py SPEC_JSON

SPEC: ``out`` (the dump folder), ``manager`` (``roll``: RollCkptCheckpointManager; ``torchtitan``:
torchtitan's CheckpointManager), ``config`` (the manager's Config fields), ``load_step``,
``to`` (train until this step), ``last`` (the save of ``to`` is the last step's), ``sigterm_at`` and
``sigterm_rank`` (that rank sends itself SIGTERM at that step), ``result`` (a JSON file per rank:
``<result>.rank<r>.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, default_adamw

from helpers.launch import exit_worker
from roll_ckpt import Preempted
from roll_ckpt_torchtitan import RollCkptCheckpointManager


class Samples(IterableDataset):
    """A stateful stream of (x, y) batches of this data-parallel rank (its state: a position)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.i = rank, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.i)
            self.i += 1
            yield torch.randn(32, generator=g), torch.randn(32, generator=g)

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, sd: dict) -> None:
        self.i = sd["i"]


class TrainState:
    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def digest(sd: dict) -> str:
    """sha256 of every tensor's full bytes (DTensors gathered), by key."""
    h = hashlib.sha256()
    for k in sorted(sd):
        v = sd[k]
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if isinstance(v, torch.Tensor):
            h.update(k.encode())
            h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(spec: dict) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"rank": rank}
    losses: dict = {}
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizers = OptimizersContainer.Config(param_groups=default_adamw(lr=1e-2).param_groups,
                                                implementation="foreach").build(model_parts=[model])
        lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)
        loader = ParallelAwareDataloader(Samples(rank), dp_rank=rank, dp_world_size=world, batch_size=4)
        train_state = TrainState()
        cls = RollCkptCheckpointManager if spec.get("manager", "roll") == "roll" else CheckpointManager
        config = cls.Config(**{"enable": True, "keep_latest_k": 0, "last_save_model_only": False,
                               **spec.get("config", {})})
        ckpt = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
                            states={"train_state": train_state}, sd_adapter=None, base_folder=spec["out"])
        result["loaded"] = ckpt.load(step=spec.get("load_step", -1))
        result["start"] = train_state.step
        result["model"] = digest(ckpt.states["model"].state_dict())
        result["optimizer"] = digest(optimizers.state_dict())
        result["last_epoch"] = lr_schedulers.state_dict()["last_epoch"]
        result["rng"] = digest({"rng": torch.get_rng_state()})
        it = iter(loader)
        futures = []
        while train_state.step < spec["to"]:
            train_state.step += 1
            x, y = next(it)
            if "position" not in result:  # the dataset's position once the first batch is out (4 samples)
                result["position"] = loader.dataset.i - 4
            optimizers.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            ckpt.maybe_wait_for_staging()
            optimizers.step()
            lr_schedulers.step()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses[train_state.step] = t.item()
            last = spec.get("last", False) and train_state.step == spec["to"]
            if train_state.step == spec.get("sigterm_at") and rank == spec.get("sigterm_rank", rank):
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption notice (held by roll-ckpt)
            saved = ckpt.save(train_state.step, last_step=last)
            futures.append([train_state.step, saved, getattr(ckpt, "save_future", None) is not None])
            if train_state.step == spec.get("digest_at"):
                result["digest_at"] = {"model": digest(ckpt.states["model"].state_dict()),
                                       "optimizer": digest(optimizers.state_dict()),
                                       "rng": digest({"rng": torch.get_rng_state()})}
            torch.rand(4096)  # the next step draws from the RNG (dropout) while an async save stages
        result["losses"] = losses
        result["saves"] = futures
        ckpt.maybe_wait_for_saving()
        result["future_after_wait"] = getattr(ckpt, "save_future", None) is not None
        result["model_end"] = digest(ckpt.states["model"].state_dict())
        result["optimizer_end"] = digest(optimizers.state_dict())
        ckpt.close()
        ckpt.close()  # twice, as torchtitan's CheckpointManager.__del__ does
    except Preempted as exc:  # the preemption checkpoint is committed: the process ends (status 0)
        result["preempted"] = {"step": exc.step, "path": exc.path, "exit_code": exc.exit_code}
        result["losses"] = losses
    except BaseException as exc:  # reported, then the launch fails
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    with open(f"{spec['result']}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    if "error" not in result and "preempted" not in result:
        dist.barrier()
    exit_worker(1 if "error" in result else 0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
