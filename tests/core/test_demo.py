"""``roll-ckpt demo``: a run stopped abruptly and resumed prints, from the resumed step
on, exactly the losses of an uninterrupted run (weights, optimizer, scheduler, sampler
and every RNG come back)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from helpers.launch import REPO, finish, run_ok, start
from roll_ckpt.cli import main
from roll_ckpt_demo.settings import DEFAULT_CONFIG

TIMEOUT = 120
STEP_RE = re.compile(r"^step +(\d+)  loss=(\S+)  reward=(\S+)", re.M)
RESUMED_RE = re.compile(r"^resumed from (\S+) \(step (\d+)\); continuing at step (\d+)", re.M)


def small_config(tmp_path: Path, **overrides: object) -> Path:
    """The example config, shorter: 24 steps, a save every 8, a log line every step."""
    cfg = yaml.safe_load((REPO / "examples" / "rlvr_demo.yaml").read_text())
    cfg.update(max_steps=24, save_steps=8, logging_steps=1, eval_steps=8)
    cfg["demo"].update(contexts=1024, eval_contexts=256, hidden=32, batch_size=64)
    cfg.update(overrides)
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def demo_cmd(config: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "roll_ckpt.cli", "--quiet", "demo", "--config", str(config),
            "--output", str(output), *extra]


def run(cmd: list[str], timeout: float = TIMEOUT) -> str:
    return run_ok(cmd, timeout, warm=True)


def losses(out: str) -> dict[int, tuple[str, str]]:
    return {int(step): (loss, reward) for step, loss, reward in STEP_RE.findall(out)}


def test_example_config_is_the_built_in_default() -> None:
    assert yaml.safe_load((REPO / "examples" / "rlvr_demo.yaml").read_text()) == DEFAULT_CONFIG


def test_stop_then_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    config = small_config(tmp_path)
    full_dir, crash_dir = tmp_path / "full", tmp_path / "crash"
    stale = crash_dir / "checkpoints" / "rlvr-demo" / "old-run"
    stale.mkdir(parents=True)
    # the uninterrupted run and the run that "crashes" go side by side (two cores)
    full_cmd = demo_cmd(config, full_dir, "--fresh")
    full = start(full_cmd, warm=True)
    try:
        first = run(demo_cmd(config, crash_dir, "--fresh", "--stop-after", "13"))
    finally:
        full_out = finish(full, full_cmd, TIMEOUT)

    assert "--fresh: removed the previous checkpoints" in first and not stale.exists()
    assert "stopped abruptly after step 13" in first
    assert "final save ->" not in first
    assert max(losses(first)) == 13
    assert f"--output {crash_dir} --resume" in first  # the exact command to resume

    second = run(demo_cmd(config, crash_dir, "--resume"))
    m = RESUMED_RE.search(second)
    assert m, second
    assert m.group(1).endswith("checkpoint-8") and (m.group(2), m.group(3)) == ("8", "9")
    resumed = losses(second)
    assert min(resumed) == 9 and max(resumed) == 24
    expected = losses(full_out)
    assert sorted(expected) == list(range(1, 25))
    # bit-for-bit the same training from step 9 on
    assert resumed == {s: expected[s] for s in range(9, 25)}
    # and the interrupted run agreed with the full one up to its crash
    assert losses(first) == {s: expected[s] for s in range(1, 14)}
    assert "final save ->" in second and "committed checkpoint-24" in second

    # nothing left to do once max_steps is reached
    third = run(demo_cmd(config, crash_dir, "--resume"))
    assert "already reached max_steps 24" in third and not STEP_RE.search(third)


def test_resume_without_checkpoint_starts_fresh(tmp_path: Path) -> None:
    config = small_config(tmp_path, max_steps=3, save_steps=0, eval_steps=0)
    out = run(demo_cmd(config, tmp_path / "out", "--resume"))
    assert "no committed checkpoint" in out and "starting fresh at step 1" in out
    assert sorted(losses(out)) == [1, 2, 3]
    assert "final save ->" in out and "sync, durable" in out


@pytest.mark.parametrize("content, needle", [
    ("max_steps: [1]", "max_steps"),
    ("demo: {arms: 4, colour: red}", "demo.colour"),
    ("max_steps: 0", "max_steps"),
    ("{max_steps: 5, checkpoint_config: {type: file_sytem}}", "file_sytem"),
])
def test_demo_config_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                         content: str, needle: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(content + "\n")
    rc = main(["demo", "--config", str(bad), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1 and needle in err, err
    rc = main(["demo", "--config", str(tmp_path / "missing.yaml")])
    err = capsys.readouterr().err
    assert rc == 1 and "does not exist" in err and len(err.strip().splitlines()) == 1


def _fsdp2_offload_missing() -> str | None:
    try:
        from roll_ckpt_fsdp2.strategy import FSDP2Strategy
    except ImportError as exc:  # pragma: no cover
        return f"roll_ckpt_fsdp2 is not installed ({exc})"
    if not (hasattr(FSDP2Strategy, "offload_states") and hasattr(FSDP2Strategy, "load_states")):
        return "FSDP2Strategy has no offload_states/load_states yet"
    return None


@pytest.mark.timeout(420)
@pytest.mark.skipif(_fsdp2_offload_missing() is not None, reason=str(_fsdp2_offload_missing()))
def test_two_processes_fsdp2_stop_and_resume(tmp_path: Path) -> None:
    """FSDP2 on two CPU processes (gloo) with the offload cycle; resumes bit-for-bit too."""
    config = small_config(tmp_path, max_steps=12, save_steps=4, eval_steps=4)
    full_dir, crash_dir = tmp_path / "full", tmp_path / "crash"
    full_cmd = demo_cmd(config, full_dir, "--nproc", "2", "--timeout", "300")
    full = start(full_cmd, env={"OMP_NUM_THREADS": "1"}, warm=True)
    try:
        first = run(demo_cmd(config, crash_dir, "--nproc", "2", "--stop-after", "6", "--timeout", "300"), timeout=330)
    finally:
        full_out = finish(full, full_cmd, 330)
    assert "processes    2 (FSDP2 on cpu, strategy fsdp2)" in first
    assert "training states offloaded during each rollout" in first
    assert "stopped abruptly after step 6" in first and "--nproc 2 --resume" in first
    second = run(demo_cmd(config, crash_dir, "--nproc", "2", "--resume", "--timeout", "300"), timeout=330)
    m = RESUMED_RE.search(second)
    assert m and (m.group(2), m.group(3)) == ("4", "5"), second
    expected = losses(full_out)
    assert sorted(expected) == list(range(1, 13))
    assert losses(second) == {s: expected[s] for s in range(5, 13)}

    # the sharded (world size 2) checkpoint exports as full tensors a plain model loads
    import torch
    from safetensors.torch import load_file

    from roll_ckpt.format import layout
    from roll_ckpt_demo.job import _policy
    from roll_ckpt_fs.storage import LocalStorage

    storage = LocalStorage(str(crash_dir / "checkpoints" / "rlvr-demo"))
    latest = layout.latest(storage, storage.root)
    assert latest is not None and latest.step == 12
    out_file = tmp_path / "policy.safetensors"
    rc = main(["export", latest.path, "--out", str(out_file), "--only", "model", "--strip-prefix"])
    assert rc == 0
    policy = _policy(16, 32, 8, 0.1)
    policy.load_state_dict(load_file(str(out_file)), strict=True)
    assert policy.body[3].weight.shape == torch.Size([32, 32])
