"""Preemption under torchrun, 2 FSDP2 ranks on gloo: a SIGTERM that reaches one rank, the
agent only (as a scheduler signals it) or every process stops both ranks at the same step,
commits that step, and a relaunch continues bit-exactly."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers.launch import kill_group, start_torchrun

WORKER = Path(__file__).with_name("_preempt_worker.py")
MAX_STEPS = 14
GRACE_S = 30.0
pytestmark = pytest.mark.timeout(600)


def _log(out: Path, rank: int) -> list[list[str]]:
    p = out / f"rank{rank}.log"
    return [ln.split() for ln in p.read_text().splitlines()] if p.exists() else []


def _launch(out: Path, signal_at: str = "none", kill: str | None = None, after_step: int = 0) -> tuple[int, str]:
    """Run the job under torchrun; with ``kill`` the test plays the scheduler: SIGTERM to the
    agent alone (``agent``) or to every process (``all``) once rank 0 logged ``after_step``,
    then, if the job is still running when the grace period (``GRACE_S``) ends, SIGKILL to
    every process. Returns the job's exit status and the tail of its output."""
    for rank in (0, 1):
        (out / f"rank{rank}.log").unlink(missing_ok=True)
    proc = start_torchrun(WORKER, out, MAX_STEPS, signal_at, stdout=subprocess.PIPE, real=True)
    grace_ends = None
    killed = False
    deadline = time.monotonic() + 240  # (a job that hangs fails the test: not the scheduler's doing)
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if kill and grace_ends is None and any(w[0] == "trained" and int(w[1]) >= after_step
                                                   for w in _log(out, 0)):
                if kill == "agent":
                    proc.send_signal(signal.SIGTERM)
                else:
                    os.killpg(proc.pid, signal.SIGTERM)
                grace_ends = time.monotonic() + GRACE_S
            elif grace_ends is not None and time.monotonic() >= grace_ends:
                kill_group(proc)  # the grace period is over: SIGKILL to every process of the job
                killed = True
                break
            time.sleep(0.02)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        kill_group(proc)
        proc.wait()
    output = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    logs = [_log(out, r) for r in (0, 1)]
    assert all(logs), output[-4000:]
    if kill is None and signal_at == "none":
        assert proc.returncode == 0, output[-4000:]
    why = f"SIGKILLed by the scheduler {GRACE_S:.0f}s after SIGTERM\n" if killed else ""
    return proc.returncode, why + output[-4000:]


def _stopped(out: Path) -> int:
    steps = []
    for rank in (0, 1):
        lines = _log(out, rank)
        found = [int(w[1]) for w in lines if w[0] == "preempted"]
        assert found, f"rank {rank} did not stop for the preemption: {lines[-3:]}"
        assert found[0] == max(int(w[1]) for w in lines if w[0] == "trained")
        steps.append(found[0])
    assert steps[0] == steps[1], f"the ranks stopped at different steps: {steps}"
    return steps[0]


def _newest(out: Path) -> int:
    from roll_ckpt.format import layout
    from roll_ckpt_fs import LocalStorage

    return layout.latest(LocalStorage(str(out)), str(out)).step


def test_preemption_of_one_rank_the_agent_or_every_process(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    reference.mkdir()
    _launch(reference)
    job = tmp_path / "job"
    job.mkdir()
    rnd = random.Random(int(os.environ.get("ROLL_CKPT_PREEMPT_SEED", "14")))
    stopped = 0
    for signal_at, kill in [("rank1:3", None), ("none", "agent"), ("none", "all")]:
        after = stopped + rnd.randint(1, 3)
        rc, output = _launch(job, signal_at, kill, after)  # SIGKILLed if still running when the grace period ends
        # it ended on its own: the preempted workers with preemption.exit_code (0), and torchrun's
        # agent, when it was sent SIGTERM itself, with a failure status (not killed by a signal)
        assert rc == 0 if kill is None else rc > 0, f"{kill or signal_at}: the job exited {rc}:\n{output}"
        resumed = int(_log(job, 0)[0][1])
        assert resumed == stopped
        step = _stopped(job)
        assert step > stopped and _newest(job) == step, f"{kill or signal_at}: newest committed {_newest(job)}, stopped {step}"
        stopped = step
    _launch(job)
    assert int(_log(job, 0)[0][1]) == stopped and _log(job, 0)[-1] == ["done"]
    final, expected = (torch.load(p / "final.pt", weights_only=True) for p in (job, reference))
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)
