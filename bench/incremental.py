"""T16/T17: incremental saves (checkpoint_config.incremental) on a LoRA-shaped state and on
a full fine-tune, against the same saves writing every file ("today") and against DCP.

    python -m bench.incremental [--hidden H] [--layers L] [--rank R] [--reps N] [--out DIR]

One process, synchronous saves to a local disk (the bench folder), one manager per case kept
for the run, the cases in rotating order, medians of ``reps`` saves after a warm-up save each:

* LoRA-shaped: ``L`` frozen ``Linear(H, H)`` layers (the base) with a trainable rank-``R``
  adapter each (``A: H x R``, ``B: R x H``), AdamW over the adapters: about 95 % of the
  state's bytes never change. A training step between saves (real backward and AdamW step).
* Full fine-tune: the same layers, no adapter, every weight trained with AdamW.

Cases: ``incremental`` (the default), ``full_write`` (``incremental: false``, today's
save), ``dcp`` (``torch.distributed.checkpoint.save`` of the same state dicts into a fresh
folder). Bytes written per save (roll-ckpt: ``SaveStats.bytes_written``; DCP: the folder),
seconds per save.

Targets: T16, the LoRA save writes <= 1.1 x its trainable and optimizer bytes; T17, a full
fine-tune's save with incremental on takes <= 1.03 x the time of today's (full_write).
Writes DIR/incremental.json and DIR/incremental.md (default DIR: bench/results).
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

T16_LIMIT = 1.1
T17_LIMIT = 1.03


def build(hidden: int, layers: int, rank: int, lora: bool, seed: int = 0) -> tuple[Any, Any]:
    import torch

    class Adapted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = torch.nn.Linear(hidden, hidden)
            if lora:
                self.base.requires_grad_(False)
                self.a = torch.nn.Parameter(torch.randn(hidden, rank) * 0.01)
                self.b = torch.nn.Parameter(torch.zeros(rank, hidden))

        def forward(self, x: Any) -> Any:
            y = self.base(x)
            return y + x @ self.a @ self.b if lora else y

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[Adapted() for _ in range(layers)])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt


def train_step(model: Any, opt: Any, hidden: int) -> None:
    import torch

    model(torch.randn(2, hidden)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


class RollCase:
    def __init__(self, out: str, incremental: bool) -> None:
        from roll_ckpt import CheckpointManager, load_config

        cfg = {"checkpoint_config": {"output_dir": out, "timestamp_subdir": False, "max_ckpt_to_keep": 2,
                                     "incremental": incremental}}
        self.m = CheckpointManager.from_config(load_config(cfg), quiet=True)

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, int]:
        t0 = time.perf_counter()
        self.m.save(step, state)
        return time.perf_counter() - t0, self.m.stats.last.bytes_written

    def close(self) -> None:
        self.m.close()


class DCPCase:
    def __init__(self, out: str) -> None:
        self.out = out

    def save(self, step: int, state: dict[str, Any]) -> tuple[float, int]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        path = os.path.join(self.out, f"step-{step}")
        t0 = time.perf_counter()
        sd = {"model": get_model_state_dict(state["model"]),
              "optimizer": get_optimizer_state_dict(state["model"], state["optimizer"])}
        dcp.save(sd, checkpoint_id=path)  # one process, no group
        seconds = time.perf_counter() - t0
        written = folder_bytes(path)
        shutil.rmtree(os.path.join(self.out, f"step-{step - 2}"), ignore_errors=True)  # keeps 2, as the others
        return seconds, written

    def close(self) -> None:
        pass


def run_state(kind: str, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    lora = kind == "lora"
    states = {}
    cases: dict[str, Any] = {}
    for name in ("incremental", "full_write", "dcp"):
        model, opt = build(args.hidden, args.layers, args.rank, lora)
        states[name] = {"model": model, "optimizer": opt}
        out = os.path.join(scratch, f"{kind}-{name}")
        cases[name] = DCPCase(out) if name == "dcp" else RollCase(out, name == "incremental")
    model, opt = states["incremental"]["model"], states["incremental"]["optimizer"]
    train_step(model, opt, args.hidden)  # AdamW's moments exist from here on
    trainable = [p for p in model.parameters() if p.requires_grad]
    moments = [v for s in opt.state.values() for v in s.values() if hasattr(v, "numel") and v.dim() > 0]
    sizes = {"state": nbytes(model.state_dict().values()) + nbytes(moments),
             "trainable_and_optimizer": nbytes(trainable) + nbytes(moments)}
    seconds: dict[str, list[float]] = {n: [] for n in cases}
    written: dict[str, list[int]] = {n: [] for n in cases}
    try:
        names = list(cases)
        for step in range(1, args.reps + 2):  # step 1: the warm-up save (and the incremental base)
            # the order rotates: each case follows each other one (the disk's writeback of the
            # one before slows the next save down)
            for name in names[step % len(names):] + names[:step % len(names)]:
                case = cases[name]
                st = states[name]
                train_step(st["model"], st["optimizer"], args.hidden)
                s, w = case.save(step, st)
                if step > 1:
                    seconds[name].append(s)
                    written[name].append(w)
    finally:
        for case in cases.values():
            case.close()
    return {"sizes": sizes, "median": {n: {"seconds": median(seconds[n]), "written": median(written[n])}
                                       for n in cases}, "seconds": seconds, "written": written}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.incremental", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".scratch-incremental-", dir=args.out)
    try:
        lora = run_state("lora", args, scratch)
        full = run_state("full", args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    t16 = lora["median"]["incremental"]["written"] / lora["sizes"]["trainable_and_optimizer"]
    t17 = full["median"]["incremental"]["seconds"] / full["median"]["full_write"]["seconds"]
    report = {
        "args": vars(args), "lora": lora, "full": full,
        "frozen_share": 1 - lora["sizes"]["trainable_and_optimizer"] / lora["sizes"]["state"],
        "targets": {"T16": {"value": round(t16, 3), "limit": T16_LIMIT, "pass": t16 <= T16_LIMIT,
                            "what": "LoRA save: bytes written / trainable and optimizer bytes"},
                    "T17": {"value": round(t17, 3), "limit": T17_LIMIT, "pass": t17 <= T17_LIMIT,
                            "what": "full fine-tune: save time with incremental on / off"}},
    }
    with open(os.path.join(args.out, "incremental.json"), "w") as f:
        json.dump(report, f, indent=1)
    mib = 1 << 20
    lines = [f"State: {args.layers} x Linear({args.hidden}, {args.hidden}); LoRA rank {args.rank} "
             f"({report['frozen_share']:.1%} of the LoRA state frozen). Sync saves to local disk, median of "
             f"{args.reps}.", "",
             "| state | case | MiB written per save | s per save |", "|---|---|---:|---:|"]
    for kind, res in (("LoRA", lora), ("full fine-tune", full)):
        for name, m in res["median"].items():
            lines.append(f"| {kind} | {name} | {m['written'] / mib:.1f} | {m['seconds']:.3f} |")
    lines += ["", f"LoRA trainable + optimizer: {lora['sizes']['trainable_and_optimizer'] / mib:.1f} MiB of "
                  f"{lora['sizes']['state'] / mib:.1f} MiB.", ""]
    for name, t in report["targets"].items():
        lines.append(f"- {name} ({t['what']}): {t['value']} (limit {t['limit']}) {'PASS' if t['pass'] else 'FAIL'}")
    with open(os.path.join(args.out, "incremental.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(t["pass"] for t in report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
