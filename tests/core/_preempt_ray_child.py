"""A Ray job for the preemption tests: a local cluster, a manager with preemption on (the
default: SIGTERM), a loop calling ``maybe_save`` every step. The test sends SIGTERM.

``python _preempt_ray_child.py MODE OUT LOG TEMP``, Ray's files under ``TEMP``:

* ``driver``: the loop runs in the Ray driver (after ``ray.init``, whose SIGTERM handler
  calls ``sys.exit(15)``); the test signals this process.
* ``actor``: the loop runs in a Ray actor whose ``__init__`` builds the manager (a sync
  actor: its methods run on the worker's main thread, where Ray's handler raises
  ``SystemExit`` "The process receives a SIGTERM."); the test signals the actor's pid. The
  driver logs how the loop's call ended and whether the actor's process is gone.

Lines of LOG: ``ray-ready``, ``actor PID``, ``trained N``, ``preempted N CODE``,
``loop-error TYPE DETAIL``, ``actor-gone BOOL``.
"""

from __future__ import annotations

import os
import sys
import time

import ray

STEP_S = 0.05
MAX_STEPS = 100_000


def log(path: str, *words: object) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (" ".join(str(w).replace("\n", " ") for w in words) + "\n").encode())
    finally:
        os.close(fd)


def train_loop(out: str, log_path: str, manager: object = None) -> None:
    """``maybe_save`` every step; only a preemption saves (``save_steps`` is never reached)."""
    import torch

    from roll_ckpt import CheckpointManager, Preempted, load_config
    from roll_ckpt.testing import tiny_state

    torch.set_num_threads(1)
    if manager is None:
        manager = CheckpointManager(load_config({"checkpoint_config": {"output_dir": out},
                                                 "save_steps": MAX_STEPS}), quiet=True)
    state = tiny_state()
    try:
        for step in range(1, MAX_STEPS):
            state["counter"]["seen"] += 1
            time.sleep(STEP_S)
            log(log_path, "trained", step)
            manager.maybe_save(step, state)
    except Preempted as exc:
        log(log_path, "preempted", exc.step, int(exc.code))  # Ray 2.48 exits with signal.Signals.SIGTERM
        raise


@ray.remote(num_cpus=1)
class Trainer:
    def __init__(self, out: str, log_path: str) -> None:
        from roll_ckpt import CheckpointManager, load_config

        self.out, self.log_path = out, log_path
        # on the worker's main thread: the manager's handler goes over Ray's
        self.manager = CheckpointManager(load_config({"checkpoint_config": {"output_dir": out},
                                                      "save_steps": MAX_STEPS}), quiet=True)

    def pid(self) -> int:
        return os.getpid()

    def train(self) -> str:
        train_loop(self.out, self.log_path, self.manager)
        return "done"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def main(mode: str, out: str, log_path: str, temp: str) -> int:
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, _temp_dir=temp,
             _plasma_directory=temp, log_to_driver=False)
    log(log_path, "ray-ready")
    if mode == "driver":
        train_loop(out, log_path)
        return 0
    try:
        trainer = Trainer.remote(out, log_path)
        pid = ray.get(trainer.pid.remote(), timeout=120)
        log(log_path, "actor", pid)
        try:
            result = ray.get(trainer.train.remote(), timeout=120)
            log(log_path, "loop-result", result)
        except Exception as exc:  # the actor died: how, as Ray reports it
            log(log_path, "loop-error", type(exc).__name__, str(exc))
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        log(log_path, "actor-gone", not alive(pid))
        return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
