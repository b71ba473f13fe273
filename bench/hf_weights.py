"""T15: the Hugging Face files inside a checkpoint (checkpoint_config.hf_weights), against
the same save without them and against ROLL's way.

    python -m bench.hf_weights [--layers N] [--hidden H] [--reps R] [--out DIR]

One process, a transformers ``LlamaForCausalLM`` with AdamW (state: model + 2 moments),
saved asynchronously by one manager per case kept for the whole run (as a training job
keeps one: staging buffers reused; ``max_ckpt_to_keep: 1``), the cases alternating, medians
of ``reps`` after a warm-up round:

* ``rc_async``       roll-ckpt async save, no HF files: blocked (``save`` returns), committed.
* ``rc_async_hf``    the same with ``hf_weights: true``: blocked, and committed = the HF
                     files readable (they are published by the checkpoint's commit).
* ``roll_way``       ROLL's FSDP2 strategy: the full model state dict gathered
                     (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``) and
                     ``save_pretrained`` on rank 0 inside the save, then DCP's async save of
                     the training state: blocked = gather + save_pretrained + DCP's staging;
                     the HF folder readable when save_pretrained returns.

Target: rc_async_hf blocked <= 1.1 x rc_async blocked. Writes DIR/hf_weights.json and
DIR/hf_weights.md (default DIR: bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from .common import median
from .launch import RESULTS


def build(layers: int, hidden: int) -> tuple[Any, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 128), max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 8192, (1, 16))
    model(x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def rc_manager(root: str, hf: bool) -> Any:
    """One manager per case for the whole run, as a training job has (staging buffers reused)."""
    from roll_ckpt import CheckpointManager, load_config

    cc: dict[str, Any] = {"output_dir": root, "timestamp_subdir": False, "max_ckpt_to_keep": 1}
    if hf:
        cc["hf_weights"] = True
    cfg = load_config({"checkpoint_config": cc, "strategy_config": {"async_save_ckpt": True}})
    return CheckpointManager(cfg, quiet=True)


def rc_case(manager: Any, model: Any, opt: Any, hf: bool, step: int) -> dict[str, float]:
    t0 = time.perf_counter()
    manager.save(step, {"model": model, "optimizer": opt})
    blocked = time.perf_counter() - t0
    stats = manager.wait()
    committed = time.perf_counter() - t0
    assert stats is not None
    return {"blocked_s": blocked, "committed_s": committed, "readable_s": committed if hf else float("nan")}


def roll_case(root: str, model: Any, opt: Any, step: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    path = os.path.join(root, f"checkpoint-{step}")
    os.makedirs(path)
    t0 = time.perf_counter()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    model.save_pretrained(path, state_dict=full, safe_serialization=True)
    readable = time.perf_counter() - t0
    future = dcp.async_save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                            checkpoint_id=os.path.join(path, "dcp"))
    blocked = time.perf_counter() - t0
    future.result()
    return {"blocked_s": blocked, "committed_s": time.perf_counter() - t0, "readable_s": readable}


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m bench.hf_weights", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary folder)")
    args = p.parse_args(argv)
    model, opt = build(args.layers, args.hidden)
    params = sum(t.numel() for t in model.parameters())
    cases = ["rc_async", "rc_async_hf", "roll_way"]
    results: dict[str, list[dict[str, float]]] = {c: [] for c in cases}
    base = tempfile.mkdtemp(prefix="hfbench-", dir=args.dir)
    managers = {c: rc_manager(os.path.join(base, c), c == "rc_async_hf") for c in cases if c != "roll_way"}
    try:
        for rep in range(args.reps + 1):  # the first round warms up (not counted)
            order = cases if rep % 2 == 0 else cases[::-1]
            for case in order:
                if case == "roll_way":
                    root = os.path.join(base, f"{case}-{rep}")
                    got = roll_case(root, model, opt, rep + 1)
                    shutil.rmtree(root, ignore_errors=True)
                else:
                    got = rc_case(managers[case], model, opt, case == "rc_async_hf", rep + 1)
                if rep:
                    results[case].append(got)
                print(f"rep {rep} {case}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    finally:
        for manager in managers.values():
            manager.close()
        shutil.rmtree(base, ignore_errors=True)
    summary = {c: {k: median([r[k] for r in rs]) for k in rs[0]} for c, rs in results.items()}
    ratio = summary["rc_async_hf"]["blocked_s"] / summary["rc_async"]["blocked_s"]
    report = {"params": params, "model_bytes": params * 4, "layers": args.layers, "hidden": args.hidden,
              "reps": args.reps, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "median": summary, "blocked_ratio_hf": ratio, "target_blocked_ratio": 1.1,
              "target_met": ratio <= 1.1, "runs": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hf_weights.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"# T15: Hugging Face files in the checkpoint ({params / 1e6:.1f} M params, "
             f"{params * 4 / 2**20:.0f} MiB fp32 model, AdamW; 1 process, medians of {args.reps})", "",
             "| case | blocked s | committed s | HF folder readable s |", "|---|---:|---:|---:|"]
    for c in cases:
        s = summary[c]
        readable = "-" if s["readable_s"] != s["readable_s"] else f"{s['readable_s']:.3f}"
        lines.append(f"| {c} | {s['blocked_s']:.3f} | {s['committed_s']:.3f} | {readable} |")
    lines += ["", f"blocked with HF / without: {ratio:.3f} (target <= 1.1: {'met' if ratio <= 1.1 else 'NOT met'})"]
    with open(os.path.join(args.out, "hf_weights.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ratio <= 1.1 else 1


if __name__ == "__main__":
    sys.exit(main())
