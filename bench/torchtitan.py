"""The group ``torchtitan``: torchtitan's own checkpoint manager with its default asynchronous
mode against roll-ckpt's (``roll_ckpt_torchtitan``), on the same model and the same ranks.

    python -m bench.torchtitan [--quick|--smoke] [--out DIR] [--python PY]   (or python -m bench --groups torchtitan)

Both managers are built as torchtitan's ``Trainer`` builds one (``config.checkpoint.build(...)``)
over the same live objects, in the same 2 processes: an FSDP2 model (``width`` x ``depth``
``Linear`` layers, the ``target`` group's shape: 528 MiB of model and AdamW state over 2 ranks
in ``--quick``), torchtitan's ``OptimizersContainer`` (AdamW), ``LRSchedulersContainer``,
``ParallelAwareDataloader`` and a train state. The loop trains ``steps`` steps per round and
calls the round's manager's ``save(step)`` and ``maybe_wait_for_staging()`` every step, as the
Trainer does (``interval`` = ``steps``: one save per round); rounds alternate between the
managers (A B B A ...), each save is measured alone:

* **blocked** -- the seconds the loop spent in the saving step's ``save()`` and the next
  ``maybe_wait_for_staging()``;
* **durable** -- from the start of that ``save()`` until its ``save_future`` is done (a
  watcher polls it every millisecond while the loop goes on): the checkpoint is whole on disk;
* **per step** -- the median seconds of a ``save()`` that does not save (roll-ckpt's manager
  asks the ranks about a preemption signal every step: one small all-reduce).

Cases: ``tt_async`` (torchtitan ``CheckpointManager``, ``async_mode: async``), ``rc_async``
(``RollCkptCheckpointManager``, the same setting) and, for reference, both with ``disabled``.
torchtitan must be importable by the interpreter the workers run on: this one, or the
torchtitan leg's (``python -m matrix build torchtitan``: ``.matrix/torchtitan/bin/python``).
Writes DIR/torchtitan.json and DIR/torchtitan.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from .launch import RESULTS, ROOT, child_env

MB = 1 << 20
CASES = ("tt_async", "rc_async", "tt_sync", "rc_sync")
MODES = {
    "quick": {"width": 2048, "depth": 11, "saves": 4, "steps": 3, "cases": CASES},
    "smoke": {"width": 256, "depth": 2, "saves": 1, "steps": 2, "cases": CASES},
}
TARGET = 0.5
"""T18: roll-ckpt's blocked time per asynchronous save / torchtitan's (``async_mode: async``)."""


def interpreter(explicit: str | None = None) -> tuple[str | None, str]:
    """An interpreter that imports torchtitan and roll_ckpt_torchtitan, or None and why not."""
    found = [explicit] if explicit else [sys.executable, os.path.join(ROOT, ".matrix", "torchtitan", "bin", "python")]
    for exe in found:
        if exe and os.path.exists(exe) and subprocess.run(
                [exe, "-c", "import torchtitan, roll_ckpt_torchtitan"], capture_output=True, timeout=120).returncode == 0:
            return exe, ""
    return None, ("torchtitan is not installed for this interpreter nor in the torchtitan leg: build it with "
                  "`python -m matrix build torchtitan`")


# ----------------------------------------------------------------------------- worker (each rank)


def worker(spec: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import IterableDataset
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, default_adamw

    from roll_ckpt_torchtitan import RollCkptCheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width, depth = spec["width"], spec["depth"]

    class Batches(IterableDataset):
        def __init__(self) -> None:
            self.i = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            while True:
                self.i += 1
                yield torch.randn(width)

        def state_dict(self) -> dict:
            return {"i": self.i}

        def load_state_dict(self, sd: dict) -> None:
            self.i = sd["i"]

    class TrainState:
        step = 0

        def state_dict(self) -> dict:
            return {"step": self.step, "ntokens_seen": 0}

        def load_state_dict(self, sd: dict) -> None:
            self.step = sd["step"]

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer.Config(param_groups=default_adamw(lr=1e-4).param_groups,
                                            implementation="foreach").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10**6)
    loader = ParallelAwareDataloader(Batches(), dp_rank=rank, dp_world_size=world, batch_size=2)
    state = TrainState()
    managers = {}
    for case in spec["cases"]:
        cls = CheckpointManager if case.startswith("tt_") else RollCkptCheckpointManager
        config = cls.Config(enable=True, folder=f"{case}/checkpoint", interval=spec["steps"], keep_latest_k=2,
                            async_mode="async" if case.endswith("_async") else "disabled",
                            last_save_model_only=False)
        managers[case] = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                                      lr_schedulers=schedulers, states={"train_state": state}, sd_adapter=None,
                                      base_folder=spec["scratch"])
    it = iter(loader)
    samples: dict[str, list[dict[str, float]]] = {c: [] for c in spec["cases"]}
    per_step: dict[str, list[float]] = {c: [] for c in spec["cases"]}
    watcher: threading.Thread | None = None
    order = list(spec["cases"])
    rounds = [order if r % 2 == 0 else order[::-1] for r in range(spec["saves"] + 1)]
    for r, cases in enumerate(rounds):
        for case in cases:
            ckpt = managers[case]
            pending: dict[str, float] | None = None
            for _ in range(spec["steps"]):
                state.step += 1
                x = next(it)
                optimizers.zero_grad()
                model(x).square().mean().backward()
                t = time.perf_counter()
                ckpt.maybe_wait_for_staging()
                if pending is not None:
                    pending["blocked_s"] += time.perf_counter() - t
                    pending = None
                optimizers.step()
                schedulers.step()
                if watcher is not None and state.step % spec["steps"] == 0:
                    watcher.join()  # the previous save durable before this one starts: each alone
                t = time.perf_counter()
                saved = ckpt.save(state.step)
                blocked = time.perf_counter() - t
                if not saved:
                    per_step[case].append(blocked)
                    continue
                row = {"blocked_s": blocked, "durable_s": blocked}
                future = getattr(ckpt, "save_future", None)
                if future is not None:
                    def watch(future: Any = future, row: dict[str, float] = row, t0: float = t) -> None:
                        while not future.done():
                            time.sleep(0.001)
                        row["durable_s"] = time.perf_counter() - t0

                    watcher = threading.Thread(target=watch, daemon=True)
                    watcher.start()
                pending = row
                if r > 0:  # the first round warms up: staging buffers, process groups, DCP's caches
                    samples[case].append(row)
    if watcher is not None:
        watcher.join()
    for ckpt in managers.values():
        ckpt.maybe_wait_for_saving()
        ckpt.close()
    state_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) * 3  # this rank's
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"samples": samples, "per_step": per_step})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ranks": gathered, "state_bytes": state_bytes, "world_size": world}, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent


def summarise(raw: dict[str, Any], cases: tuple[str, ...]) -> dict[str, Any]:
    """Per case the median over saves of the slowest rank's blocked and durable seconds."""
    out: dict[str, Any] = {}
    for case in cases:
        per_rank = [r["samples"][case] for r in raw["ranks"]]
        n = min(len(s) for s in per_rank)
        if not n:
            continue
        blocked = [max(s[i]["blocked_s"] for s in per_rank) for i in range(n)]
        durable = [max(s[i]["durable_s"] for s in per_rank) for i in range(n)]
        steps = [x for r in raw["ranks"] for x in r["per_step"][case]]
        out[case] = {"saves": n, "blocked_s": statistics.median(blocked), "durable_s": statistics.median(durable),
                     "blocked_all_s": blocked, "durable_all_s": durable,
                     "per_step_s": statistics.median(steps) if steps else None}
    return out


def markdown(res: dict[str, Any]) -> str:
    c = res.get("cases", {})
    names = {"tt_async": "torchtitan `CheckpointManager`, `async_mode: async`",
             "rc_async": "roll-ckpt `RollCkptCheckpointManager`, `async_mode: async`",
             "tt_sync": "torchtitan `CheckpointManager`, `async_mode: disabled`",
             "rc_sync": "roll-ckpt `RollCkptCheckpointManager`, `async_mode: disabled`"}
    lines = [f"# torchtitan's checkpoint manager against roll-ckpt's ({res['mode']}; {res['world_size']} ranks, "
             f"{res['state_bytes'] * res['world_size'] / MB:.0f} MiB of model and AdamW state; torchtitan "
             f"{res.get('torchtitan')}, torch {res.get('torch')})", "",
             "| case | saves | blocked (median) | durable after (median) | a save() that does not save |",
             "|---|---:|---:|---:|---:|"]
    for case in CASES:
        if case in c:
            row = c[case]
            step = "—" if row["per_step_s"] is None else f"{row['per_step_s'] * 1e3:.2f} ms"
            lines.append(f"| {names[case]} | {row['saves']} | {row['blocked_s'] * 1e3:.1f} ms | "
                         f"{row['durable_s'] * 1e3:.0f} ms | {step} |")
    t = res.get("target") or {}
    if t:
        lines += ["", f"T18: roll-ckpt's blocked time / torchtitan's (async): **{t['value']:.3f}** "
                      f"({'PASS' if t['pass'] else 'FAIL'}, target <= {TARGET}); time to durable: "
                      f"{t['durable_ratio']:.2f}x torchtitan's."]
    return "\n".join(lines) + "\n"


def run(mode: str, out_dir: str, python: str | None = None, timeout: float = 1800) -> dict[str, Any]:
    """The group: the workers on 2 ranks; the summary (also DIR/torchtitan.{json,md})."""
    exe, why = interpreter(python)
    if exe is None:
        return {"error": why, "unavailable": {"torchtitan": why}}
    cfg = MODES[mode]
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".scratch-torchtitan-", dir=out_dir) as scratch:
        spec = {**cfg, "scratch": scratch, "cases": list(cfg["cases"])}
        spec_path, raw_path = os.path.join(scratch, "spec.json"), os.path.join(scratch, "raw.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [exe, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "bench.torchtitan",
               "worker", spec_path, raw_path]
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=child_env(ROLL_CKPT_QUIET="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
        if proc.returncode != 0 or not os.path.exists(raw_path):
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
            return {"error": f"bench.torchtitan failed (exit {proc.returncode})"}
        with open(raw_path) as f:
            raw = json.load(f)
    versions = subprocess.run([exe, "-c", "import json, torch, importlib.metadata as m; print(json.dumps("
                               "[m.version('torchtitan'), torch.__version__]))"],
                              capture_output=True, text=True, timeout=120).stdout.strip().splitlines()[-1]
    tt, torch_version = json.loads(versions)
    cases = summarise(raw, tuple(cfg["cases"]))
    res: dict[str, Any] = {"mode": mode, "duration_s": round(time.perf_counter() - started, 1), "cases": cases,
                           "world_size": raw["world_size"], "state_bytes": raw["state_bytes"], "torchtitan": tt,
                           "torch": torch_version, "spec": {k: v for k, v in spec.items() if k != "scratch"}}
    tt_async, rc_async = cases.get("tt_async"), cases.get("rc_async")
    if tt_async and rc_async:
        value = rc_async["blocked_s"] / tt_async["blocked_s"]
        res["target"] = {"value": value, "limit": TARGET, "op": "<=", "pass": value <= TARGET,
                         "durable_ratio": rc_async["durable_s"] / tt_async["durable_s"],
                         "what": "blocked time per async save: roll-ckpt's torchtitan manager / torchtitan's "
                                 "CheckpointManager (async_mode: async), same model and ranks",
                         "ours_s": rc_async["blocked_s"], "torchtitan_s": tt_async["blocked_s"]}
    with open(os.path.join(out_dir, "torchtitan.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out_dir, "torchtitan.md"), "w") as f:
        f.write(markdown(res))
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        with open(argv[1]) as f:
            worker(json.load(f), argv[2])
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.torchtitan", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_const", dest="mode", const="quick", default="quick")
    p.add_argument("--smoke", action="store_const", dest="mode", const="smoke")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--python", default=None, help="the workers' interpreter (default: this one, else the leg's)")
    args = p.parse_args(argv)
    res = run(args.mode, os.path.abspath(args.out), args.python)
    if "error" in res:
        print(f"[torchtitan] {res['error']}", file=sys.stderr)
        return 1
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
