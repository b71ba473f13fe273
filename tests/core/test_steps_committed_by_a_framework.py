"""Steps laid out as verl lays them out (``global_step_N/{actor,critic}``, no run folders), which
the framework commits once it knows a step is whole (``commit_steps: false`` and
``manager.commit_step``), with its own files in the step (``data.pt``) covered, files it adds to
a committed checkpoint afterwards named, and Hugging Face files in a sub-folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from core._hf_helpers import from_pretrained, tiny_llama
from helpers.training import config
from roll_ckpt import CheckpointManager
from roll_ckpt.cli import main as cli
from roll_ckpt.format import layout
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state
from roll_ckpt_fs.storage import LocalStorage

VERL = dict(timestamp_subdir=False, name_format="global_step_{step}", commit_steps=False)


def _role(root: Path, role: str, **cc: Any) -> CheckpointManager:
    return CheckpointManager(config(root, components=[role], **VERL, **cc), component=role, quiet=True)


def _committed(root: Path) -> list[int]:
    return [r.step for r in layout.committed(LocalStorage(str(root)), str(root))]


def test_a_step_the_framework_commits_with_its_own_file(tmp_path: Path, capsys) -> None:
    actor, critic = _role(tmp_path, "actor", max_ckpt_to_keep=1), _role(tmp_path, "critic")
    for step in (1, 2):
        actor.save(step, tiny_state(1))
        critic.save(step, tiny_state(2))
        assert _committed(tmp_path) == ([] if step == 1 else [1])  # the parts alone do not commit it
        assert not actor.commit_step(step, ["actor", "critic"], ["data.pt"])  # no data.pt yet (logged)
        torch.save({"samples": step}, tmp_path / f"global_step_{step}" / "data.pt")  # verl's trainer
        assert actor.commit_step(step, ["actor", "critic"], ["data.pt"])
        assert not critic.commit_step(step, ["actor", "critic"], ["data.pt"])  # once
    assert _committed(tmp_path) == [2]  # retention (max_ckpt_to_keep: 1) after the framework's commit
    step = tmp_path / "global_step_2"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["extra"]["step_files"] == ["data.pt"] and "data.pt" in manifest["files"]
    assert cli(["verify", str(step)]) == 0
    (step / "data.pt").write_bytes(b"changed")
    assert cli(["verify", str(step)]) == 1
    assert "data.pt" in capsys.readouterr().out
    for m in (actor, critic):
        m.close()


def test_a_missing_part_keeps_the_step_uncommitted(tmp_path: Path) -> None:
    actor = _role(tmp_path, "actor")
    actor.save(3, tiny_state(1))
    torch.save({}, tmp_path / "global_step_3" / "data.pt")
    assert not actor.commit_step(3, ["actor", "critic"], ["data.pt"])
    assert _committed(tmp_path) == []
    actor.close()


def test_each_role_resumes_its_part_by_its_path(tmp_path: Path) -> None:
    actor, critic = _role(tmp_path, "actor"), _role(tmp_path, "critic")
    a, c = tiny_state(1), tiny_state(2)
    actor.save(4, a)
    critic.save(4, c)
    actor.commit_step(4, ["actor", "critic"])
    saved = state_snapshot(c)
    for m in (actor, critic):
        m.close()
    fresh = tiny_state(9)
    with _role(tmp_path, "critic") as m:
        assert m.resume(fresh, str(tmp_path / "global_step_4" / "critic")) == 4
    assert_same_state(state_snapshot(fresh), saved)


def test_files_another_program_adds_are_named_not_damage(tmp_path: Path, capsys) -> None:
    cfg = config(tmp_path, timestamp_subdir=False, name_format="global_step_{step}", beside=["data_*.pt"])
    with CheckpointManager(cfg, quiet=True) as m:
        path = Path(m.save(5, tiny_state()))
    (path / "data_0.pt").write_bytes(b"x")  # verl's CheckpointHandler, after the save returned
    capsys.readouterr()
    assert cli(["verify", str(path)]) == 0
    (path / "stray.bin").write_bytes(b"x")
    assert cli(["verify", str(path)]) == 1
    assert "stray.bin" in capsys.readouterr().out


def test_hugging_face_files_in_a_sub_folder(tmp_path: Path) -> None:
    from roll_ckpt.runtime.transformers_compat import dtype_argument

    model = tiny_llama()
    cfg = config(tmp_path, timestamp_subdir=False, hf_weights={"subdir": "huggingface"})
    with CheckpointManager(cfg, quiet=True) as m:
        path = Path(m.save(1, {"model": model}))
    assert (path / "huggingface" / "config.json").exists() and not (path / "config.json").exists()
    loaded = from_pretrained(str(path / "huggingface"), **{dtype_argument(): torch.float32})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert cli(["verify", str(path)]) == 0


@pytest.mark.parametrize("subdir", ["../x", "a/b"])
def test_a_sub_folder_that_is_not_a_plain_name_is_refused(tmp_path: Path, subdir: str) -> None:
    from roll_ckpt import ConfigError

    with pytest.raises(ConfigError, match="subdir"):
        config(tmp_path, hf_weights={"subdir": subdir})


def test_commit_step_is_refused_by_a_manager_that_saves_no_component(tmp_path: Path) -> None:
    """A step of components is committed by a manager of one of them; a plain manager's
    checkpoints are committed by their own save, so its commit_step says so instead of
    pretending it committed something."""
    from roll_ckpt import RollCkptError

    with CheckpointManager(config(tmp_path, **VERL), quiet=True) as m:
        m.save(1, tiny_state())
        with pytest.raises(RollCkptError, match="commits a step of components"):
            m.commit_step(1, ["actor"])
