"""One rank of an SFT job as verl's ``SFTTrainer`` runs it: verl's ``TrainingWorker`` (its engine
from verl's engine registry: roll-ckpt's with ``VERL_ENGINE_VENDOR=roll_ckpt``, verl's own
without), ``train_batch`` as ``SFTTrainer.fit`` calls it, and verl's ``CheckpointHandler``
saving and resuming (``resume_mode: auto``: the tracker). Started by torchrun.

    torchrun --standalone --nproc_per_node=N _sft_job.py SPEC.json

SPEC: ``model``, ``ckpt`` (default_local_dir), ``out`` (results), ``tag``, ``save`` (steps),
``keep`` (max_ckpt_to_keep), ``snap`` (steps whose state is written to
``out/snap-<tag>-<step>-rank<r>.pt``), ``compare`` (the snapshot file prefix the resumed
state must equal, bit for bit), ``expect_start``, ``kill`` ({step, rank}: that rank dies
mid-save), ``hf`` (hf_model in save_contents), ``stop`` (the last step trained).
Writes ``out/result-<tag>-rank<r>.json``: the step resumed, losses, mismatches.
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

from integration_verl._common import (TOTAL_STEPS, Toy, install_kill, same, seed_everything, snapshot, worker_config,
                                      write_json)

spec = json.load(open(sys.argv[1]))
t0 = time.time()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
seed_everything(rank)
vendor = os.environ.get("VERL_ENGINE_VENDOR") == "roll_ckpt"
if spec.get("kill") and rank == spec["kill"]["rank"]:
    install_kill(spec["kill"]["step"], rank, vendor)

import verl  # noqa: E402,F401  (its verl.plugins: the CPU platform, and roll-ckpt-verl's engines)
from tensordict.tensorclass import NonTensorData  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.checkpoint import CheckpointHandler  # noqa: E402
from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator  # noqa: E402
from verl.workers.engine_workers import TrainingWorker  # noqa: E402
from verl.workers.utils.losses import sft_loss  # noqa: E402

contents = ("model", "optimizer", "extra") + (("hf_model",) if spec.get("hf") else ())
client = TrainingWorker(config=worker_config(spec["model"], contents=contents))
client.set_loss_fn(loss_fn=partial(sft_loss, config=None))
client.reset()  # engine.initialize(): model, optimizer, scheduler, checkpoint manager
engine = client.engine
ds = Toy()
sampler = DistributedSampler(ds, shuffle=True, num_replicas=engine.get_data_parallel_size(),
                             rank=engine.get_data_parallel_rank(), drop_last=True, seed=5)
loader = StatefulDataLoader(ds, batch_size=4, sampler=sampler, num_workers=0, drop_last=True,
                            collate_fn=SFTTensorCollator(DatasetPadMode.NO_PADDING))
handler = CheckpointHandler(engine=engine, train_dataloader=loader, default_local_dir=spec["ckpt"],
                            max_ckpt_to_keep=spec.get("keep"), resume_mode=spec.get("resume_mode", "auto"),
                            resume_from_path=spec.get("resume_path"))
pad_id = client.model_config.tokenizer.pad_token_id


def train_step(data: dict) -> float:
    meta = {"use_remove_padding": True, "use_dynamic_bsz": False, "max_token_len_per_gpu": None,
            "micro_batch_size_per_gpu": 2, "temperature": 1.0, "global_batch_size": 4 * world,
            "pad_mode": DatasetPadMode.NO_PADDING, "pad_token_id": pad_id}
    td = tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta)
    seqlens = td["input_ids"].offsets().diff()
    every = [torch.zeros_like(seqlens) for _ in range(world)]
    dist.all_gather(every, seqlens)
    tu.assign_non_tensor(td, update_lr_scheduler=True, global_token_num=NonTensorData(torch.cat(every).tolist()))
    return tu.get(client.train_batch(data=td), "metrics")["loss"]


result: dict = {"rank": rank, "world": world, "engine": type(engine).__name__,
                "manager": type(engine.checkpoint_manager).__name__, "losses": {}, "save_s": {}}
t = time.time()
start = handler.load_checkpoint()
result.update(start=start, load_s=round(time.time() - t, 3))
if "expect_start" in spec:
    assert start == spec["expect_start"], f"resumed step {start}, expected {spec['expect_start']}"
if spec.get("compare"):
    got = snapshot(engine, loader)
    ref = torch.load(f"{spec['compare']}-rank{rank if world == spec.get('compare_world', world) else 0}.pt",
                     weights_only=False)
    if world != spec.get("compare_world", world):  # another world size: this rank's RNG and data are its own
        for key in ("rng", "dataloader") if rank else ():
            ref.pop(key), got.pop(key)
    result["mismatches"] = same(ref, got)
it = iter(loader)
for step in range(start + 1, spec.get("stop", TOTAL_STEPS) + 1):
    result["losses"][step] = train_step(next(it))
    if step in spec.get("save", ()):
        t = time.time()
        handler.save_checkpoint(step)
        result["save_s"][step] = round(time.time() - t, 3)
    if step in spec.get("snap", ()):
        torch.save(snapshot(engine, loader), os.path.join(spec["out"], f"snap-{spec['tag']}-{step}-rank{rank}.pt"))
    write_json(os.path.join(spec["out"], f"result-{spec['tag']}-rank{rank}.json"), result)
result["total_s"] = round(time.time() - t0, 1)
write_json(os.path.join(spec["out"], f"result-{spec['tag']}-rank{rank}.json"), result)
manager = engine.checkpoint_manager
if hasattr(manager, "close"):
    manager.close()
dist.barrier()
dist.destroy_process_group()
