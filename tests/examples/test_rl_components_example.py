"""examples/rl_components: an actor (2 ranks), a critic (1 rank) and a driver, one
checkpoint step made of three parts. A launch killed after step 8 -- the worker groups
saved it, the driver did not -- leaves step 8 uncommitted; the next launch resumes every
component from step 4 and ends exactly where an uninterrupted run ends (same rewards,
losses and final weights and optimizer state)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rl_components"
TIMEOUT = 150
STEP_RE = re.compile(r"^step +\d+ .*$", re.M)
RUN_RE = re.compile(r"^run (\S+): components actor_train, critic, pipeline", re.M)
DIGEST_RE = re.compile(r"^final (\S+) state digest (\w+)$", re.M)


def job(output: Path, *extra: str) -> list[str]:
    return [sys.executable, str(EXAMPLE / "rl_job.py"), "--output", str(output), *extra]


def finished(proc: subprocess.Popen, cmd: list[str]) -> str:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"{cmd}\n{out}\n{err}"
    assert "Traceback" not in err, err
    return out


def run(cmd: list[str]) -> str:
    return finished(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO), cmd)


def steps(out: str) -> list[str]:
    return STEP_RE.findall(out)


def test_killed_job_resumes_every_component_exactly(tmp_path: Path) -> None:
    full_dir, crash_dir = tmp_path / "full", tmp_path / "crash"
    ckpt = crash_dir / "checkpoints"
    # the uninterrupted run and the run that is killed go side by side
    full_cmd = job(full_dir)
    full = subprocess.Popen(full_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        first = run(job(crash_dir, "--stop-at", "8"))
    finally:
        full_out = finished(full, full_cmd)

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
