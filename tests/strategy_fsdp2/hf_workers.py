"""Hugging Face round trip under torchrun with FSDP2 (run by ``test_hf_fsdp2.py``).

``python -m torch.distributed.run --standalone --nproc_per_node N hf_workers.py hf_roundtrip OUT NAME=FOLDER...``

For each ``save_pretrained`` folder: a model (Llama, or an MoE whose experts transformers
fuses and the folder holds one tensor each) built from its config with other
weights (for a ``NAME`` starting with ``refused``: from the config of the first folder, so
that the folder does not fit; each rank writes the error it raised), sharded with FSDP2 (each decoder layer, then the root; CPU offload), gets the
folder's weights through ``checkpoint_config.initial_load`` (``resume`` returns 0), is
trained 3 steps, saved (with the Hugging Face files in the checkpoint: hf_weights), and run once more. Each rank writes what it read; rank 0 writes
the parameters after the initial load, the trained parameters and the logits.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from roll_ckpt.runtime.torch_compat import fsdp2_options

from helpers.launch import exit_worker
from roll_ckpt import CheckpointManager, load_config


def full(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))


def roundtrip(out: str, name: str, folder: str, config_folder: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from roll_ckpt.errors import RollCkptError

    torch.manual_seed(123)  # not the folder's weights
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_folder))  # Llama, or an MoE
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    offload = CPUOffloadPolicy(pin_memory=False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=offload, **fsdp2_options(mesh.device_type))
    fully_shard(model, mesh=mesh, offload_policy=offload, **fsdp2_options(mesh.device_type))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": opt}
    cfg = load_config({"checkpoint_config": {"output_dir": os.path.join(out, f"ckpt-{name}"),
                                             "timestamp_subdir": False,
                                             "initial_load": {"path": folder, "format": "hf"},
                                             "hf_weights": {"max_shard_size": "20KB"}}})
    manager = CheckpointManager.from_config(cfg, quiet=True)
    rank = dist.get_rank()
    if name.startswith("refused"):
        before = full(model)
        try:
            manager.resume(state)
            error = None
        except RollCkptError as exc:  # every rank must raise it, none may wait for the others
            error = str(exc)
        untouched = all(torch.equal(v, before[k]) for k, v in full(model).items())
        with open(os.path.join(out, f"result-{name}-{rank}.json"), "w") as f:
            json.dump({"error": error, "untouched": untouched}, f)
        manager.close()
        return
    start = manager.resume(state)
    report = manager._resumer.initial_load
    loaded = full(model)
    for step in range(3):
        x = tokens(step)
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = manager.save(3, state, final=True)
    manager.close()
    model.eval()
    with torch.no_grad():
        logits = model(tokens(7)).logits
    trained = full(model)
    with open(os.path.join(out, f"result-{name}-{rank}.json"), "w") as f:
        json.dump({"start": start, "bytes_read": report.bytes_read, "tensors": report.tensors,
                   "checkpoint": path, "strategy": manager.strategy.name}, f)
    if rank == 0:
        torch.save({"loaded": loaded, "trained": trained, "logits": logits}, os.path.join(out, f"{name}.pt"))


def hf_roundtrip(out: str, *folders: str) -> None:
    first = folders[0].partition("=")[2]
    for item in folders:
        name, _, folder = item.partition("=")
        roundtrip(out, name, folder, first if name.startswith("refused") else folder)


SCENARIOS = {f.__name__: f for f in (hf_roundtrip,)}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        SCENARIOS[sys.argv[1]](*sys.argv[2:])
    finally:
        dist.destroy_process_group()
    exit_worker()
