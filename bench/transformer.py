"""T10/T11: the user's shape -- a Hugging Face Llama on FSDP2 + AdamW (run inside :mod:`bench.worker`).

A real ``transformers.LlamaForCausalLM`` (small widths, many layers: thousands of small and
large tensors per rank, as a transformer has them) with each decoder layer its own FSDP2
unit, trained by its own loss, in a process that has imported transformers (the heap, and
so the garbage collector's work, of a real job). Nothing is frozen or tuned for the
benchmark. Each method runs as in ``loop.py``: a step, the save, K training steps right after
the save returns, until both the steps are done and the save is durable, next to the same 1 + K steps
without a save; lost = (with) - (without). For the synchronous methods the loss is the
save itself. Reported per method: time per tensor of a save, blocked, durable, lost, CPU.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from . import peers
from .common import available
from .loop import NEEDS, TITLES as LOOP_TITLES, Loop, log

METHODS = ["dcp_save", "rc_sync", "dcp_thread", "rc_regular", "rc_zc", "tc_async"]
SYNC = {"dcp_save", "rc_sync"}
TITLES = {
    "dcp_save": "get_state_dict + dcp.save",
    "rc_sync": "roll-ckpt sync save",
    "dcp_thread": "get_state_dict + dcp.async_save, thread mode",
    "rc_regular": "roll-ckpt async, regular staging",
    "rc_zc": "roll-ckpt async, zero-copy (model + AdamW in the store; onload, then train)",
    "tc_async": LOOP_TITLES["tc_async"],
}


class TransformerLoop(Loop):
    MANAGERS = (("rc_sync", False, 10), ("rc_regular", True, 10), ("rc_zc", True, 10))

    def build(self, spec: dict[str, Any], mesh: Any) -> None:
        from torch.distributed.fsdp import fully_shard
        from roll_ckpt.runtime.torch_compat import fsdp2_options
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                          num_hidden_layers=spec["layers"], num_attention_heads=4, num_key_value_heads=4,
                          vocab_size=spec["vocab"], tie_word_embeddings=False)
        self.model = LlamaForCausalLM(cfg)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, **fsdp2_options(mesh.device_type))
        fully_shard(self.model, mesh=mesh, **fsdp2_options(mesh.device_type))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randint(0, spec["vocab"], (spec.get("batch", 2), spec.get("seq", 32)))

    def step(self) -> None:
        self.model(input_ids=self.x, labels=self.x).loss.backward()
        with self.guard():
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def run_group(spec: dict[str, Any], scratch: str, out: dict[str, Any]) -> None:
    t_build = time.perf_counter()
    lp = TransformerLoop(spec, scratch)
    log(f"{spec['name']}: {lp.tensors} tensors, {lp.state_bytes / 2**20:.0f} MiB/rank, "
        f"built in {time.perf_counter() - t_build:.1f} s")
    methods, unavailable = available(spec.get("methods", METHODS), NEEDS, lambda msg: log(f"{spec['name']}: {msg}"))
    lp.steps(2)
    t0 = time.perf_counter()
    lp.steps(3)
    step_s = (time.perf_counter() - t0) / 3
    slowest: dict[str, float] = {}
    fixed = spec.get("steps")  # the smoke run: a fixed K checks the harness end to end, it measures nothing
    for rnd in range(1 if fixed else 2):  # first calls, then the second saves (reused buffers, DCP's caches)
        for meth in methods:
            slowest[meth] = lp.once(meth, 1, True)["durable_s"]
    # K per method: a synchronous save's loss is the save itself (no steps needed); an
    # asynchronous one needs K steps that outlast it (2.5x its time alone, as in loop.py)
    want = {m: 0 if m in SYNC else int(fixed) if fixed
            else math.ceil(max(spec.get("window_s", 1.5), 2.5 * slowest[m]) / step_s) for m in methods}
    all_ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(all_ranks, want)
    k = {m: max(r[m] for r in all_ranks) for m in methods}
    log(f"{spec['name']}: step {step_s * 1e3:.0f} ms, K = {k}")
    reps: dict[str, list[Any]] = {m: [] for m in methods}
    for rep in range(spec["reps"]):
        order = methods if rep % 2 == 0 else methods[::-1]
        for meth in order:
            if rep % 2 == 0:  # the pair's order alternates too
                without = lp.once(meth, k[meth], False)
                with_ = lp.once(meth, k[meth], True)
            else:
                with_ = lp.once(meth, k[meth], True)
                without = lp.once(meth, k[meth], False)
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, {"without": without, "with": with_})
            reps[meth].append(everyone)
        log(f"{spec['name']}: repetition {rep + 1} done")
    lp.close()
    peers.close_all()
    out["groups"].append({"name": spec["name"], "kind": "transformer", "unavailable": unavailable, "world_size": dist.get_world_size(),
                          "tensors": lp.tensors, "state_bytes": lp.state_bytes, "threads": torch.get_num_threads(),
                          "k": k, "step_s": step_s, "titles": TITLES, "methods": reps,
                          "model": {k_: spec[k_] for k_ in ("layers", "hidden", "intermediate", "vocab")}})
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(lp.dir, ignore_errors=True)
    dist.barrier()
