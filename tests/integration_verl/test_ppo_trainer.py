"""verl's PPO trainer's own ``_save_checkpoint``/``_load_checkpoint`` on a Ray driver, with real
Ray worker groups of verl's ``TrainingWorker`` (FSDP2, 2 gloo ranks each: the actor and a
stand-in critic) and ``checkpoint.async_save: true`` through ``VERL_ENGINE_VENDOR=roll_ckpt``:

* the tracker names a step only once the step is committed -- checked while its save is in
  flight (the trainer's call has returned) and after; the last step (saved synchronously)
  gets it too;
* a checkpoint verl's own manager wrote resumes through roll-ckpt bit for bit, and is left as
  it was beside roll-ckpt's steps;
* an actor rank killed mid-save: the restart resumes the step before, bit for bit, with the
  next losses of the uninterrupted run; retention across the restart removes whole steps.

The reference is verl's own manager (no switch), uninterrupted.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import child_env

from .conftest import Jobs, needs_verl, tracker, tree_digest

pytestmark = [needs_verl, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: str) -> tuple[Jobs, Path, dict]:
    """verl's own manager, no switch, synchronous (verl's trainer writes the tracker): steps 2
    and 4 saved, the losses of steps 1-6, the actor's and critic's state and the loader's at 4."""
    jobs = Jobs(tmp_path_factory.mktemp("ppo"), tiny_model)
    ckpt = jobs.root / "verl-ckpt"
    result = jobs.ppo("verl", ckpt, vendor=False, save=[2, 4], keep=2, snap=[4])
    assert result["workers"]["manager"] == "FSDPCheckpointManager", result["workers"]
    assert tracker(ckpt) == 4
    return jobs, ckpt, result


def _committed(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[-1]) for p in root.glob("global_step_*") if (p / "manifest.json").exists())


def _cli(*args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "roll_ckpt.cli", *args], capture_output=True, text=True, timeout=120,
                          env=child_env())
    return proc.returncode, proc.stdout + proc.stderr


def _later(losses: dict, after: int) -> dict:
    return {k: v for k, v in losses.items() if int(k) > after}


def _async_saves_tracked_once_committed(result: dict, steps: list[int], before: int | None) -> None:
    for step in steps:
        save = result["saves"][str(step)]
        assert save["tracker_before"] == before and save["tracker_on_return"] == before, save  # in flight: not yet
        assert not save["committed_on_return"], save
        assert save["tracker_after"] == step and save["committed_after"], save
        before = step


def test_a_checkpoint_verl_wrote_resumes_and_the_tracker_follows_commits(verl_run: tuple) -> None:
    jobs, ckpt, ref = verl_run
    root = jobs.root / "migrate"
    shutil.copytree(ckpt, root)
    verl_files = tree_digest(root)
    result = jobs.ppo("migrate", root, vendor=True, expect_start=4, compare=str(jobs.out / "snap-verl-4.pt"),
                      save=[5, 6], keep=2, slow_s=1.0, **{"async": True})
    assert result["workers"]["manager"] == "RollCkptCheckpointManager", result["workers"]
    assert result["mismatches"] == [], result["mismatches"][:10]
    assert result["losses"] == _later(ref["losses"], 4)
    _async_saves_tracked_once_committed(result, [5], before=4)
    last = result["saves"]["6"]  # the last step: saved synchronously, committed once the trainer's data.pt is there
    assert last["tracker_after"] == 6 and last["committed_after"], last
    assert tracker(root) == 6 and _committed(root) == [5, 6]
    # verl's own steps: untouched (roll-ckpt's retention never counts nor removes them)
    assert {k: v for k, v in tree_digest(root).items() if k in verl_files and k != "latest_checkpointed_iteration.txt"} \
        == {k: v for k, v in verl_files.items() if k != "latest_checkpointed_iteration.txt"}
    step = root / "global_step_6"
    assert sorted(p.name for p in step.iterdir()) == ["actor", "critic", "data.pt", "manifest.json"]
    code, out = _cli("verify", str(step))
    assert code == 0 and "actor, critic" in out, out
    code, out = _cli("ls", str(root))
    assert code == 0 and "verl checkpoint" in out, out
    # the Hugging Face export of the actor's part: the model's config and weights, from_pretrained reads it
    code, out = _cli("export", str(step), "--component", "actor", "--format", "hf", "--key", "model",
                     "--hf-config", str(Path(jobs.model)), "--out", str(jobs.root / "hf"))
    assert code == 0, out
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(jobs.root / "hf"), dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 24_736


def test_an_actor_rank_killed_mid_save_resumes_the_step_before(verl_run: tuple) -> None:
    jobs, _, ref = verl_run
    root = jobs.root / "ours"
    killed = jobs.ppo("kill", root, vendor=True, save=[2, 4, 5], keep=2, slow_s=0.5, stop=5,
                      kill={"step": 5, "rank": 1}, **{"async": True})
    assert "died" in killed, killed["output"][-4000:]
    assert "killed mid-save" in killed["output"]
    _async_saves_tracked_once_committed(killed, [2, 4], before=None)
    assert tracker(root) == 4 and _committed(root) == [2, 4]

    resumed = jobs.ppo("restart", root, vendor=True, expect_start=4, compare=str(jobs.out / "snap-verl-4.pt"),
                       save=[5, 6], keep=2, **{"async": True})
    assert resumed["mismatches"] == [], resumed["mismatches"][:10]
    assert resumed["losses"] == _later(ref["losses"], 4)
    # retention across the restart: the two newest steps, whole; steps 2 and 4 gone with their data.pt
    assert tracker(root) == 6 and _committed(root) == [5, 6]
    assert sorted(p.name for p in root.iterdir()) == ["global_step_5", "global_step_6",
                                                      "latest_checkpointed_iteration.txt"]
    code, out = _cli("verify", str(root / "global_step_5"))
    assert code == 0, out
