"""examples/rl_components: an actor (2 ranks), a critic (1 rank) and a driver, one
checkpoint step made of three parts. A launch killed after step 8 -- the worker groups
saved it, the driver did not -- leaves step 8 uncommitted; the next launch resumes every
component from step 4 and ends exactly where an uninterrupted run ends (same rewards,
losses and final weights and optimizer state)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from helpers import warm
from helpers.launch import REPO, finish, run_ok, start

pytestmark = pytest.mark.timeout(400)

EXAMPLE = REPO / "examples" / "rl_components"
TIMEOUT = 150
STEP_RE = re.compile(r"^step +\d+ .*$", re.M)
RUN_RE = re.compile(r"^run (\S+): components actor_train, critic, pipeline", re.M)
DIGEST_RE = re.compile(r"^final (\S+) state digest (\w+)$", re.M)


def job(output: Path, *extra: str) -> list[str]:
    return [sys.executable, str(EXAMPLE / "rl_job.py"), "--output", str(output), *extra]


def run(cmd: list[str]) -> str:
    return run_ok(cmd, TIMEOUT, warm=True)


def steps(out: str) -> list[str]:
    return STEP_RE.findall(out)


def test_killed_job_resumes_every_component_exactly(tmp_path: Path) -> None:
    full_dir, crash_dir = tmp_path / "full", tmp_path / "crash"
    ckpt = crash_dir / "checkpoints"
    # the uninterrupted run and the run that is killed go side by side
    full_cmd = job(full_dir)
    full = start(full_cmd, warm=True)
    try:
        first = run(job(crash_dir, "--stop-at", "8"))
    finally:
        full_out = finish(full, full_cmd, TIMEOUT)

    assert len(steps(full_out)) == 12
    assert steps(first) == steps(full_out)[:8]
    assert "*** killed after step 8 (the actor and critic saved it, the driver did not) ***" in first
    assert "newest committed step: 4" in first
    assert not (crash_dir / "history.json").exists()
    run1 = RUN_RE.search(first).group(1)
    step8 = ckpt / run1 / "checkpoint-8"
    assert (step8 / "actor_train" / "manifest.json").is_file()
    assert (step8 / "critic" / "manifest.json").is_file()
    assert not (step8 / "pipeline").exists()
    assert not (step8 / "manifest.json").exists()          # so step 8 does not count
    assert (ckpt / run1 / "checkpoint-4" / "manifest.json").is_file()

    second = run(job(crash_dir))
    run2 = RUN_RE.search(second).group(1)
    assert run2 != run1                                     # a new run folder per launch
    assert (f"resumed from step 4 ({ckpt / run1 / 'checkpoint-4'}): "
            "actor_train at 4, critic at 4, pipeline at 4; 256 samples consumed, 4 steps logged") in second
    assert steps(second) == steps(full_out)[4:]
    assert DIGEST_RE.findall(second) == DIGEST_RE.findall(full_out)
    assert len(DIGEST_RE.findall(second)) == 2
    history = json.loads((crash_dir / "history.json").read_text())
    assert history == json.loads((full_dir / "history.json").read_text())
    assert [h["step"] for h in history] == list(range(1, 13))

    # max_ckpt_to_keep: 2 keeps whole steps 8 and 12 of the second launch; the first
    # launch's step 4 and its never-committed step 8 are gone.
    committed = sorted(p.parent.relative_to(ckpt).as_posix() for p in ckpt.glob("*/checkpoint-*/manifest.json"))
    assert committed == [f"{run2}/checkpoint-12", f"{run2}/checkpoint-8"]
    assert not step8.exists() and not (ckpt / run1 / "checkpoint-4").exists()
    for step in (8, 12):
        parts = sorted(p.name for p in (ckpt / run2 / f"checkpoint-{step}").iterdir() if p.is_dir())
        assert parts == ["actor_train", "critic", "pipeline"]


def test_fsdp2_actor_resumes_exactly(tmp_path: Path) -> None:
    """The actor sharded with FSDP2: one step holds an fsdp2, a dcp and a json part."""
    out, ckpt = tmp_path / "fsdp2", tmp_path / "fsdp2" / "checkpoints"
    short = ("--fsdp2", "--max-steps", "5", "--save-steps", "2")
    first = run(job(out, *short, "--stop-at", "4"))
    assert "newest committed step: 2" in first
    second = run(job(out, *short))
    assert "actor_train at 2, critic at 2, pipeline at 2; 128 samples consumed" in second
    assert steps(second)[:2] == steps(first)[2:4]           # steps 3 and 4 again, exactly
    run2 = RUN_RE.search(second).group(1)
    manifest = json.loads((ckpt / run2 / "checkpoint-4" / "manifest.json").read_text())
    parts = manifest["extra"]["components"]
    assert {name: (p["strategy"], p["world_size"]) for name, p in parts.items()} == {
        "actor_train": ("fsdp2", 2), "critic": ("dcp", 1), "pipeline": ("json", 1)}


def test_sigterm_to_every_process_stops_the_job_at_one_whole_step(tmp_path: Path) -> None:
    """A scheduler's SIGTERM reaches the driver and every worker at once: the driver has every
    component save the step it is at, the step commits whole, and the next launch resumes
    from it exactly."""
    import os
    import signal
    import subprocess
    import time

    from helpers.launch import child_env
    from roll_ckpt.format import layout
    from roll_ckpt_fs import LocalStorage

    full_dir, job_dir = tmp_path / "full", tmp_path / "job"
    full_cmd = job(full_dir)
    full = start(full_cmd, warm=True)
    proc = warm.popen(job(job_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      env=child_env(), start_new_session=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("step   6 "):  # between steps 6 and 7, or during 7: wherever it lands
                os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        full_out = finish(full, full_cmd, TIMEOUT)
    out = "".join(lines)
    assert rc == 0, out
    found = re.search(r"\*\*\* preempted at step (\d+): every component saved it; newest committed step: (\d+)", out)
    assert found, out
    stopped = int(found.group(1))
    assert stopped >= 6 and int(found.group(2)) == stopped
    ckpt = job_dir / "checkpoints"
    newest = layout.latest(LocalStorage(str(ckpt)), str(ckpt))
    assert newest.step == stopped
    assert sorted(p.name for p in Path(newest.path).iterdir() if p.is_dir()) == ["actor_train", "critic", "pipeline"]
    assert steps(out) == steps(full_out)[:stopped]
    second = run(job(job_dir))
    assert f"actor_train at {stopped}, critic at {stopped}, pipeline at {stopped}" in second
    assert steps(second) == steps(full_out)[stopped:]
    assert DIGEST_RE.findall(second) == DIGEST_RE.findall(full_out)
