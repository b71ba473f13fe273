"""verl's own FSDP2 engine and ``CheckpointHandler`` (as verl's ``SFTTrainer`` drives them) on 2
gloo ranks under torchrun, with ``VERL_ENGINE_VENDOR=roll_ckpt``: a rank killed mid-save, the
resume (``resume_mode: auto``) of the step before, bit for bit, and the next losses as an
uninterrupted run's; the resume on 1 rank; a checkpoint verl's own manager wrote, resumed
through roll-ckpt at the same world size and another; verify, ls and inspect on both kinds.

The reference is verl's own run (no switch): the same job, uninterrupted.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import child_env

from ._common import cpu_env
from .conftest import Jobs, needs_verl, snapshot_file, tracker, tree_digest

pytestmark = [needs_verl, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: str) -> tuple[Jobs, Path, list[dict]]:
    """verl's own manager, no switch: the uninterrupted run (losses of steps 1-6, the state at
    steps 3 and 5) and the checkpoints verl wrote (steps 2 and 3, with hf_model)."""
    jobs = Jobs(tmp_path_factory.mktemp("sft"), tiny_model)
    ckpt = jobs.root / "verl-ckpt"
    results = jobs.sft("verl", ckpt, vendor=False, save=[2, 3], keep=2, snap=[3, 5], hf=True)
    assert results[0]["manager"] == "FSDPCheckpointManager"
    assert tracker(ckpt) == 3
    return jobs, ckpt, results


def _cli(*args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "roll_ckpt.cli", *args], capture_output=True, text=True, timeout=120,
                          env=child_env())
    return proc.returncode, proc.stdout + proc.stderr


def _committed(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[-1]) for p in root.glob("global_step_*") if (p / "manifest.json").exists())


def test_a_rank_killed_mid_save_resumes_the_step_before_bit_for_bit(verl_run: tuple) -> None:
    jobs, _, ref = verl_run
    ours = jobs.root / "ours"
    killed = jobs.sft("kill", ours, ok=False, save=[2, 3, 4], keep=2, hf=True, kill={"step": 4, "rank": 1})
    assert killed[0]["engine"] == "RollCkptFSDPEngineWithLMHead" and killed[0]["manager"] == "RollCkptCheckpointManager"
    assert "killed mid-save" in (jobs.out / "log-kill.txt").read_text()
    assert tracker(ours) == 3 and _committed(ours) == [2, 3]
    assert not (ours / "global_step_4").exists()  # what rank 0 and the dead rank wrote is in a temporary folder

    # resume_mode auto: the tracker's step, every tensor as saved; the next losses as uninterrupted
    resumed = jobs.sft("resume", ours, expect_start=3, compare=snapshot_file(jobs, "verl", 3), save=[5], keep=2,
                       hf=True, snap=[5])
    for r in resumed:
        assert r["mismatches"] == [], r["mismatches"][:10]
        assert r["losses"] == {k: v for k, v in ref[r["rank"]]["losses"].items() if int(k) > 3}
    # retention across the restart: 2 committed steps kept, whole folders removed, nothing half-written left
    assert tracker(ours) == 5 and _committed(ours) == [3, 5]
    assert sorted(p.name for p in ours.iterdir()) == [
        "global_step_3", "global_step_5", "latest_checkpointed_iteration.txt"]  # the killed save's leftovers cleaned
    step = ours / "global_step_5"
    assert {"data_0.pt", "data_1.pt"} <= {p.name for p in step.iterdir()}  # the handler's, after the commit
    code, out = _cli("verify", str(step))
    assert code == 0 and "OK" in out, out
    assert (step / "huggingface" / "model.safetensors").exists() and (step / "huggingface" / "tokenizer.json").exists()

    # the Hugging Face export: the weights of step 5 exactly
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(step / "huggingface" / "model.safetensors"))
    saved = torch.load(f"{snapshot_file(jobs, 'verl', 5)}-rank0.pt", weights_only=False)["model"]
    assert set(weights) == set(saved) and all(torch.equal(weights[k], saved[k]) for k in saved)

    # another world size: the same step on 1 rank, resharded (against the resumed run's own state at step 5: its
    # torch RNG is one draw ahead of the uninterrupted run's -- verl's loader draws a seed at the first iter() after
    # every resume, with verl's own manager too)
    one = jobs.sft("one-rank", ours, nproc=1, expect_start=5, compare=snapshot_file(jobs, "resume", 5),
                   compare_world=2, stop=5)
    assert one[0]["mismatches"] == [], one[0]["mismatches"][:10]


def test_a_checkpoint_verl_wrote_resumes_through_roll_ckpt(verl_run: tuple) -> None:
    jobs, ckpt, ref = verl_run
    before = tree_digest(ckpt)
    code, out = _cli("verify", str(ckpt / "global_step_3"))
    assert code == 0 and "verl checkpoint" in out, out
    code, out = _cli("inspect", str(ckpt / "global_step_3"))
    assert code == 0 and "FSDP version 2, saved by 2 rank(s)" in out and "data_0.pt" in out, out

    same_world = jobs.root / "migrate-2"
    shutil.copytree(ckpt, same_world)
    migrated = jobs.sft("migrate-2", same_world, expect_start=3, compare=snapshot_file(jobs, "verl", 3), save=[5],
                        keep=2)
    for r in migrated:
        assert r["mismatches"] == [], r["mismatches"][:10]
        assert r["losses"] == {k: v for k, v in ref[r["rank"]]["losses"].items() if int(k) > 3}
    # verl's own checkpoints stay as they were, beside roll-ckpt's; the tracker names the newest
    assert {k: v for k, v in tree_digest(same_world).items() if not k.startswith("global_step_5")
            and k != "latest_checkpointed_iteration.txt" and not k.startswith(".")} == \
        {k: v for k, v in before.items() if k != "latest_checkpointed_iteration.txt"}
    assert tracker(same_world) == 5 and _committed(same_world) == [5]
    code, out = _cli("ls", str(same_world))
    assert code == 0 and "verl checkpoint" in out and "global_step_5" in out, out

    other_world = jobs.root / "migrate-1"
    shutil.copytree(ckpt, other_world)
    one = jobs.sft("migrate-1", other_world, nproc=1, expect_start=3, compare=snapshot_file(jobs, "verl", 3),
                   compare_world=2, stop=3)
    assert one[0]["mismatches"] == [], one[0]["mismatches"][:10]
    assert tree_digest(ckpt) == before


def test_the_switch_is_one_variable_and_says_when_it_is_off() -> None:
    on = subprocess.run([sys.executable, "-m", "roll_ckpt_verl", "check"], capture_output=True, text=True, timeout=120,
                        env=child_env(cpu_env(vendor=True)))
    assert on.returncode == 0 and "roll_ckpt_verl.engine.RollCkptFSDPEngineWithLMHead" in on.stdout, on.stdout + on.stderr
    env = child_env(cpu_env(vendor=False), VERL_ENGINE_VENDOR="nvidia")
    off = subprocess.run([sys.executable, "-m", "roll_ckpt_verl", "check"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert off.returncode == 1 and "NOT roll-ckpt" in off.stdout and "VERL_ENGINE_VENDOR=roll_ckpt" in off.stdout
