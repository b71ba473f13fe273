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

import os
import shlex
import signal
import subprocess
import sys
from typing import Any, Sequence

from roll_ckpt import RollCkptError

from .settings import DEFAULT_CONFIG, build_config, distributed_child, params

__all__ = ["add_demo_arguments", "run", "main"]

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


# --------------------------------------------------------------------------- entry

def run(args: Any) -> int:
    """Run the demo for parsed ``args`` (see :func:`add_demo_arguments`)."""
    from .job import train

    if distributed_child():
        args.nproc = int(os.environ["WORLD_SIZE"])
        return train(args)
    from roll_ckpt.plugin import get_plugins

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
    from roll_ckpt.plugin import cli_main

    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


def _remove_previous(cfg: Any) -> None:
    from roll_ckpt.plugin import get_plugins, open_storage

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
