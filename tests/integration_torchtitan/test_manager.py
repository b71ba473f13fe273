"""RollCkptCheckpointManager's torchtitan semantics, on 2 gloo ranks, built from its Config as the
Trainer builds a manager (``config.checkpoint.build(...)``; ``_mgr_child.py``) with torchtitan's
own components -- an FSDP2 model, ``OptimizersContainer``, ``LRSchedulersContainer``,
``ParallelAwareDataloader`` -- and a train state: ``keep_latest_k``, ``exclude_from_loading``,
``initial_load_path`` (a roll-ckpt checkpoint, whole or the model only, and torchtitan's
model-only last step), ``last_save_model_only`` with ``export_dtype``, ``load(step=N)``,
asynchronous saves and ``save_future``, a dataloader state of another world size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers.launch import torchrun
from integration_torchtitan._tt import needs_torchtitan

pytestmark = [needs_torchtitan, pytest.mark.timeout(300)]

CHILD = Path(__file__).with_name("_mgr_child.py")


def run(tmp_path: Path, name: str, *, nproc: int = 2, check: bool = True, **spec: Any) -> list[dict[str, Any]]:
    """One launch of ``_mgr_child.py``; each rank's result."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = {"result": str(tmp_path / name), "out": str(tmp_path / "job"), **spec}
    output = torchrun(CHILD, json.dumps(spec), nproc=nproc, timeout=150, check=False)
    found = [tmp_path / f"{name}.rank{rank}.json" for rank in range(nproc)]
    results = [json.loads(p.read_text()) for p in found if p.exists()]
    errors = [r["traceback"] for r in results if "traceback" in r]
    assert len(results) == nproc or errors, output  # a rank that failed first ends the others
    if errors and check:
        raise AssertionError(errors[0])
    if check:
        errors = [r.get("traceback") for r in results if "error" in r]
        assert not errors, errors[0]
    return results


def _steps(folder: Path) -> dict[int, str]:
    """``step-<N>`` folders: ``roll-ckpt`` (a manifest), ``torchtitan`` (.metadata) or ``other``."""
    out = {}
    for p in folder.glob("step-*"):
        out[int(p.name[5:])] = "roll-ckpt" if (p / "manifest.json").exists() else \
            "torchtitan" if (p / ".metadata").exists() else "other"
    return out


def test_saves_resume_and_keep_latest_k(tmp_path: Path) -> None:
    ckpt = tmp_path / "job" / "checkpoint"
    first = run(tmp_path, "first", manager="torchtitan", config={"interval": 2}, to=2)  # torchtitan's step-2
    assert _steps(ckpt) == {2: "torchtitan"}
    second = run(tmp_path, "second", config={"interval": 2, "keep_latest_k": 2, "async_mode": "async"}, to=8,
                 digest_at=6)
    assert [r["start"] for r in second] == [2, 2], "resumed torchtitan's step 2"
    assert second[0]["model"] == first[0]["model_end"] and second[0]["optimizer"] != "", second[0]
    # every save of an asynchronous manager was staged (save_future set until it is waited for)
    assert [s for s in second[0]["saves"] if s[1]] == [[4, True, True], [6, True, True], [8, True, True]]
    assert second[0]["future_after_wait"] is False
    # retention: the newest 2 of roll-ckpt's, torchtitan's own step left alone
    assert _steps(ckpt) == {2: "torchtitan", 6: "roll-ckpt", 8: "roll-ckpt"}
    third = run(tmp_path, "third", config={"interval": 2}, load_step=6, to=7)
    assert [r["start"] for r in third] == [6, 6]
    assert third[0]["model"] == second[0]["digest_at"]["model"]
    assert third[0]["optimizer"] == second[0]["digest_at"]["optimizer"]
    assert third[0]["rng"] == second[0]["digest_at"]["rng"], "the RNG as it was at save(), not as staging found it"
    assert third[0]["last_epoch"] == 6 and third[0]["position"] == 6 * 4, third[0]


def test_exclude_from_loading_leaves_those_states_as_they_are(tmp_path: Path) -> None:
    saved = run(tmp_path, "saved", config={"interval": 2}, to=4)
    resumed = run(tmp_path, "resumed", config={"interval": 2, "exclude_from_loading": ["dataloader", "lr_scheduler"]},
                  to=5)
    assert [r["start"] for r in resumed] == [4, 4] and resumed[0]["model"] == saved[0]["model_end"]
    assert resumed[0]["last_epoch"] == 0 and resumed[0]["position"] == 0, "fresh, as excluded"
    with_all = run(tmp_path, "all", config={"interval": 2}, to=5)
    assert with_all[0]["last_epoch"] == 4 and with_all[0]["position"] == 16
    assert with_all[1]["position"] == 16


def test_initial_load_path_the_model_only_or_everything(tmp_path: Path) -> None:
    source = tmp_path / "source"
    saved = run(source, "saved", config={"interval": 2}, to=4)
    path = str(source / "job" / "checkpoint" / "step-4")
    model_only = run(tmp_path / "a", "run", config={"interval": 2, "initial_load_path": path}, to=1)
    assert [r["loaded"] for r in model_only] == [True, True] and model_only[0]["start"] == 0
    assert model_only[0]["model"] == saved[0]["model_end"] and model_only[0]["last_epoch"] == 0
    everything = run(tmp_path / "b", "run", config={"interval": 2, "initial_load_path": path,
                                                    "initial_load_model_only": False}, to=6)
    assert everything[0]["start"] == 4 and everything[0]["last_epoch"] == 4
    assert everything[0]["model"] == saved[0]["model_end"] and everything[0]["position"] == 16
    # a later launch in that folder resumes its own checkpoint, not initial_load_path (torchtitan's rule)
    again = run(tmp_path / "b", "again", config={"interval": 2, "initial_load_path": path}, to=6)
    assert again[0]["start"] == 6 and again[0]["model"] == everything[0]["model_end"]


def test_last_save_model_only_is_torchtitan_s_export_passed_over_by_resume(tmp_path: Path) -> None:
    from roll_ckpt_fs.storage import LocalStorage
    from roll_ckpt_torchtitan.tt_format import recognize

    ckpt = tmp_path / "job" / "checkpoint"
    run(tmp_path, "finished", config={"interval": 2, "last_save_model_only": True, "export_dtype": "bfloat16"},
        to=3, last=True)
    assert _steps(ckpt) == {2: "roll-ckpt", 3: "torchtitan"}
    found = recognize(LocalStorage(str(ckpt)), str(ckpt / "step-3"))
    assert found is not None and found.kind == "model" and "(bfloat16)" in found.describe()[0]
    # the export loads as initial weights (torchtitan's folder, read by the format plugin)
    fresh = run(tmp_path / "other", "fresh", config={"interval": 2, "initial_load_path": str(ckpt / "step-3")}, to=0)
    assert [r["loaded"] for r in fresh] == [True, True] and fresh[0]["start"] == 0
    # more steps later: step 3 (the model only) is passed over, step 2 resumed
    more = run(tmp_path, "more", config={"interval": 3}, to=3)
    assert [r["start"] for r in more] == [2, 2]
    assert _steps(ckpt) == {2: "roll-ckpt", 3: "roll-ckpt"}, "the save of step 3 replaced the export"


def test_another_world_size_reshards_the_model_but_not_torchtitan_s_dataloader(tmp_path: Path) -> None:
    run(tmp_path, "two", config={"interval": 2}, to=2)
    (refused,) = run(tmp_path, "one", nproc=1, check=False, config={"interval": 2}, to=2)
    assert "saved by 2 data-parallel ranks, this job has 1; torchtitan's dataloader cannot be resharded" in \
        refused.get("error", ""), refused
    (alone,) = run(tmp_path, "alone", nproc=1, config={"interval": 2, "exclude_from_loading": ["dataloader"]}, to=3)
    assert alone["start"] == 2 and alone["position"] == 0


def test_a_preemption_signal_saves_the_next_step_on_every_rank_and_ends_the_job(tmp_path: Path) -> None:
    """SIGTERM to rank 1 alone at step 3 (interval 10): every rank saves step 4 durably (the ranks
    agree at the step after the signal, without waiting on each other every step), the job ends
    with ``Preempted``; the next launch resumes step 4."""
    cfg = {"interval": 10, "async_mode": "async"}
    stopped = run(tmp_path, "stopped", config=cfg, to=9, sigterm_at=3, sigterm_rank=1)
    assert [r.get("preempted", {}).get("step") for r in stopped] == [4, 4], stopped
    assert all(r["preempted"]["exit_code"] == 0 for r in stopped) and sorted(stopped[0]["losses"]) == ["1", "2", "3", "4"]
    assert _steps(tmp_path / "job" / "checkpoint") == {4: "roll-ckpt"}
    resumed = run(tmp_path, "resumed", config=cfg, to=5)
    assert [r["start"] for r in resumed] == [4, 4]


def test_export_is_read_by_torchtitan_s_own_manager(tmp_path: Path) -> None:
    """``roll-ckpt export --format torchtitan`` of a step roll-ckpt saved: torchtitan's own
    CheckpointManager resumes it (model, optimizer, LR scheduler, dataloader, train state)."""
    from roll_ckpt.cli import main as cli

    saved = run(tmp_path, "saved", config={"interval": 2}, to=4)
    out = tmp_path / "theirs" / "job" / "checkpoint" / "step-4"
    assert cli(["export", str(tmp_path / "job" / "checkpoint" / "step-4"), "--format", "torchtitan",
                "--out", str(out)]) == 0
    loaded = run(tmp_path / "theirs", "loaded", manager="torchtitan", config={"interval": 2}, to=5)
    for mine, theirs in zip(saved, loaded):
        assert theirs["start"] == 4 and theirs["last_epoch"] == 4 and theirs["position"] == 16, theirs
        assert theirs["model"] == mine["model_end"] and theirs["optimizer"] == mine["optimizer_end"]
