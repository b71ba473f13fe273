"""torchtitan's own ``Trainer`` (llama3 debug model, FSDP2 over 2 gloo ranks, its tokenizer,
dataloader, AdamW, LR schedule) with roll-ckpt as its checkpoint manager through the one
switch (``--override.imports roll_ckpt_torchtitan.use_roll_ckpt``):

* a rank SIGKILLed in the middle of a save (sync and ``async_mode: async``): the relaunch
  resumes the step before, every restored byte (model, optimizer, LR scheduler, dataloader,
  train state) equal to what was saved, the next steps' losses equal to an uninterrupted
  run's, and so is the state at the end;
* checkpoints torchtitan's own manager wrote resume through roll-ckpt bit for bit, a torchtitan
  save cut short newer than them is passed over (named) and replaced by roll-ckpt's save of
  that step.

The uninterrupted run is torchtitan's own manager's (the same seed): the reference.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from integration_torchtitan._tt import Launch, differences, launch, needs_torchtitan

pytestmark = [needs_torchtitan, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def reference(tt_assets: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """Steps 1-6 with torchtitan's own manager, a checkpoint at 2, 4 and 6 (the last one whole)."""
    root = tmp_path_factory.mktemp("torchtitan-default")
    run = launch(root / "run", root / "job", tt_assets, roll=False)
    assert run.rc == 0, run.log[-5000:]
    assert sorted(run.losses()) == [1, 2, 3, 4, 5, 6]
    return run


def _same_dumps(a: Launch, tag_a: str, b: Launch, tag_b: str, skip: tuple[str, ...] = ()) -> None:
    for rank in (0, 1):
        x, y = a.dump(tag_a, rank), b.dump(tag_b, rank)
        assert len(x) > 700, f"{len(x)} values only"  # 737: 192 tensors, the optimizer's param groups...
        wrong = differences(x, y, skip)
        assert not wrong, f"rank {rank}: {tag_a} vs {tag_b}: {wrong[:10]}"


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_rank_killed_mid_save_resumes_exactly(reference: Launch, tt_assets: dict[str, str], tmp_path: Path,
                                                mode: str) -> None:
    job, flags = tmp_path / "job", ("--checkpoint.async_mode", mode)
    killed = launch(tmp_path / "killed", job, tt_assets, *flags, kill="1:4:300000")
    assert killed.rc != 0, "rank 1 was to be killed while it wrote its file of step 4"
    ckpt = job / "checkpoint"
    assert (ckpt / "step-2" / "manifest.json").is_file() and not (ckpt / "step-4").exists()
    assert "roll-ckpt: torchtitan's checkpoints are saved and resumed by roll-ckpt" in killed.log

    resumed = launch(tmp_path / "resumed", job, tt_assets, *flags)
    assert resumed.rc == 0, resumed.log[-5000:]
    assert "roll-ckpt: loaded " in resumed.log and "Training starts at step 3" in resumed.log
    _same_dumps(killed, "save-2", resumed, "load-2")  # every restored byte is what was saved
    assert {s: resumed.losses()[s] for s in (3, 4, 5, 6)} == {s: reference.losses()[s] for s in (3, 4, 5, 6)}
    # the end state of an interrupted run is an uninterrupted run's (the dataloader's buffers
    # may legitimately differ after a resume: torchtitan's text dataset refills them first)
    _same_dumps(reference, "save-6", resumed, "save-6", skip=("dataloader.",))
    assert all((ckpt / f"step-{s}" / "manifest.json").is_file() for s in (2, 4, 6))


def test_torchtitan_s_own_checkpoints_resume_through_roll_ckpt(reference: Launch, tt_assets: dict[str, str],
                                                               tmp_path: Path) -> None:
    job = tmp_path / "job"
    theirs = reference.out.parent / "job" / "checkpoint"
    for step in (2, 4, 6):
        shutil.copytree(theirs / f"step-{step}", job / "checkpoint" / f"step-{step}")
    (job / "checkpoint" / "step-6" / ".metadata").unlink()  # a torchtitan save of step 6 cut short

    run = launch(tmp_path / "run", job, tt_assets)
    assert run.rc == 0, run.log[-5000:]
    assert "step-6: a torchtitan checkpoint that was never finished: .metadata is missing" in run.log
    assert "Training starts at step 5" in run.log
    _same_dumps(reference, "save-4", run, "load-4")  # bit for bit, dataloader and train state included
    assert {s: run.losses()[s] for s in (5, 6)} == {s: reference.losses()[s] for s in (5, 6)}
    _same_dumps(reference, "save-6", run, "save-6", skip=("dataloader.",))
    assert "the save of step 6 replaces it" in run.log
    assert (job / "checkpoint" / "step-6" / "manifest.json").is_file()
    for step in (2, 4):  # read only: torchtitan's folders are as they were
        assert sorted(p.name for p in (job / "checkpoint" / f"step-{step}").iterdir()) == \
            [".metadata", "__0_0.distcp", "__1_0.distcp"]
