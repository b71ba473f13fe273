"""``roll-ckpt demo``: a small but real RL job that saves, "crashes" and resumes exactly.

A policy network (an MLP with dropout and a learned value baseline) is trained with
REINFORCE on a synthetic contextual bandit with a *verifiable* reward: each context has
one correct arm, and the reward is 1 when the sampled arm is that one (the RLVR setting
of the guide, in miniature). Batches are drawn at random from a fixed synthetic dataset
by a small stateful sampler; AdamW and a cosine LR schedule do the updates.

Everything that decides the next step is in the checkpoint: weights, optimizer moments,
the scheduler, the sampler's position and generator, a plain counter dict and every
RNG (dropout, action sampling). So a run stopped at step 30 and resumed from its step-20
checkpoint prints, from step 21 on, the very losses an uninterrupted run prints.

It uses only the public API, exactly as DESIGN §4 shows it::

    manager = CheckpointManager.from_config(load_config(...))
    start = manager.resume(state)
    for step in range(start + 1, max_steps + 1): ...; manager.maybe_save(step, state)
    manager.save(max_steps, state, final=True); manager.close()

With ``--nproc N`` it relaunches itself under ``torch.distributed.run``: the model is
sharded with FSDP2 (gloo on CPU, nccl on GPU) and each step simulates the RL cycle of
ROLL: the training states are offloaded during a rollout phase and loaded back to train
(when the strategy offers ``offload_states``/``load_states``).

This distribution (``roll-ckpt-demo``) adds the ``demo`` command to ``roll-ckpt`` through
the ``roll_ckpt_commands`` hook; it is not part of the core library. This module imports
torch only when the demo runs, so ``roll-ckpt --help`` stays fast; the job itself is in
:mod:`roll_ckpt_demo.job`.
"""

from __future__ import annotations

import copy
import os
import shlex
import signal
import subprocess
import sys
from typing import Any, Sequence

from roll_ckpt import RollCkptError

__all__ = ["DEFAULT_CONFIG", "add_demo_arguments", "build_config", "params", "distributed_child", "run", "main"]

DEFAULT_CONFIG: dict[str, Any] = {
    "exp_name": "rlvr-demo",
    "seed": 42,
    "logging_dir": "${output_dir}/logs",
    "output_dir": "./output/demo",
    "checkpoint_config": {
        "type": "file_system",
        "output_dir": "${output_dir}/checkpoints/${exp_name}",
    },
    "resume_from_checkpoint": False,
    "max_steps": 80,
    "save_steps": 20,
    "logging_steps": 5,
    "eval_steps": 20,
    "strategy_config": {"async_save_ckpt": True},
    "offload_backend": "local",
    "demo": {
        "contexts": 4096,
        "eval_contexts": 1024,
        "features": 16,
        "arms": 8,
        "hidden": 128,
        "dropout": 0.1,
        "batch_size": 128,
        "lr": 0.01,
        "weight_decay": 0.01,
        "value_coef": 0.5,
        "entropy_coef": 0.01,
    },
}
"""The demo's configuration when no ``--config`` is given; ``examples/rlvr_demo.yaml`` holds the same."""

LAUNCH_TIMEOUT_S = 600.0


# --------------------------------------------------------------------------- arguments

def _positive(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_demo_arguments(p: Any) -> None:
    """The demo's options (shared by ``roll-ckpt demo`` and ``python -m roll_ckpt_demo``)."""
    p.add_argument("--config", metavar="FILE",
                   help="a YAML config like examples/rlvr_demo.yaml (default: the built-in one)")
    p.add_argument("--output", metavar="DIR", help="override output_dir (checkpoints go under it)")
    p.add_argument("--nproc", type=_positive, default=1, metavar="N",
                   help="processes; N > 1 runs FSDP2 under torch.distributed.run (default: 1)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="resume_from_checkpoint: latest (the newest committed checkpoint)")
    mode.add_argument("--fresh", action="store_true",
                      help="delete this demo's previous checkpoints first")
    p.add_argument("--stop-after", type=_positive, metavar="N",
                   help="stop abruptly after step N, like a crash: no final save")
    p.add_argument("--timeout", type=float, default=LAUNCH_TIMEOUT_S, metavar="S",
                   help=f"with --nproc > 1, stop the job after S seconds (default: {LAUNCH_TIMEOUT_S:.0f})")


def build_config(args: Any) -> Any:
    """The resolved :class:`~roll_ckpt.config.Config`, with the command-line overrides applied."""
    from pathlib import Path

    from roll_ckpt.config import load_config, read_yaml

    raw = read_yaml(Path(args.config)) if args.config else copy.deepcopy(DEFAULT_CONFIG)
    if args.output:
        raw["output_dir"] = args.output
    if args.resume:
        raw["resume_from_checkpoint"] = "latest"
    return load_config(raw)


def params(cfg: Any) -> dict[str, Any]:
    from roll_ckpt import ConfigError

    params = dict(DEFAULT_CONFIG["demo"])
    given = cfg.extra.get("demo") or {}
    if not isinstance(given, dict):
        raise ConfigError("demo", "must be a mapping of demo settings", given)
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise ConfigError(f"demo.{unknown[0]}", "is not a demo setting", None, ", ".join(sorted(params)))
    params.update(given)
    for key in ("logging_steps", "eval_steps"):
        value = cfg.extra.get(key, DEFAULT_CONFIG[key])
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(key, "must be a whole number >= 0", value)
        params[key] = value
    if cfg.max_steps < 1:
        raise ConfigError("max_steps", "the demo needs at least one step", cfg.max_steps)
    return params


# --------------------------------------------------------------------------- entry

def distributed_child() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(args: Any) -> int:
    """Run the demo for parsed ``args`` (see :func:`add_demo_arguments`)."""
    from .job import train

    if distributed_child():
        args.nproc = int(os.environ["WORLD_SIZE"])
        return train(args)
    from roll_ckpt.plugins import get_plugins

    cfg = build_config(args)
    params(cfg)  # fail on a bad config before anything is deleted or launched
    get_plugins().backend(cfg.checkpoint_config.type)
    if args.fresh:
        _remove_previous(cfg)
    if args.nproc > 1:
        return _launch(args)
    return train(args)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m roll_ckpt_demo ARGS`` is ``roll-ckpt demo ARGS``."""
    from roll_ckpt.cli import main as cli_main

    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


def _remove_previous(cfg: Any) -> None:
    from roll_ckpt.job import open_storage
    from roll_ckpt.plugins import get_plugins

    cc = cfg.checkpoint_config
    storage = open_storage(get_plugins(), cc.type, cc.output_dir, cc.storage_options)
    if storage.exists(storage.root):
        storage.remove_tree(storage.root)
        print(f"--fresh: removed the previous checkpoints under {cc.output_dir}", flush=True)


def _child_args(args: Any) -> list[str]:
    out = []
    if args.config:
        out += ["--config", os.path.abspath(args.config)]
    if args.output:
        out += ["--output", args.output]
    if args.resume:
        out.append("--resume")
    if args.stop_after:
        out += ["--stop-after", str(args.stop_after)]
    return out  # never --nproc: torch.distributed.run would take it for its own --nproc-per-node


def _launch(args: Any) -> int:
    """Run the demo on ``args.nproc`` local processes with torch.distributed.run, bounded in time."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", "-m", "roll_ckpt_demo", *_child_args(args)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"launching {args.nproc} processes: {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise RollCkptError(f"the {args.nproc}-process demo did not finish within {args.timeout:.0f}s and "
                            "was stopped; raise --timeout or lower max_steps") from None
    except KeyboardInterrupt:
        _stop(proc)
        raise
    if rc != 0:
        raise RollCkptError(f"the {args.nproc}-process demo failed (exit status {rc}); "
                            "the first rank's message above says why")
    return 0


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
