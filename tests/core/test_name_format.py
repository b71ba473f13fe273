"""Checkpoint folders named as verl and torchtitan name theirs (``checkpoint_config.name_format``):
saved, listed, resumed from as ``latest`` and kept by retention like ``checkpoint-<step>``."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.training import config
from roll_ckpt import CheckpointManager, ConfigError
from roll_ckpt.cli import main as cli
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state


@pytest.mark.parametrize("name_format,name", [("global_step_{step}", "global_step_{}"), ("step-{step}", "step-{}")])
def test_checkpoints_named_another_way_save_list_resume_and_retain(tmp_path: Path, capsys, name_format: str,
                                                                  name: str) -> None:
    cfg = config(tmp_path, timestamp_subdir=False, name_format=name_format, max_ckpt_to_keep=2,
                 resume_from_checkpoint="latest")
    state = tiny_state(seed=1)
    with CheckpointManager(cfg, quiet=True) as m:
        for step in (1, 2, 3):
            assert m.save(step, state) == str(tmp_path / name.format(step))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        [name.format(2), name.format(3)]  # retention, by step
    saved = state_snapshot(state)
    fresh = tiny_state(seed=9)
    with CheckpointManager(cfg, quiet=True) as m:
        assert m.resume(fresh) == 3
    assert_same_state(state_snapshot(fresh), saved)
    capsys.readouterr()
    assert cli(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 checkpoints (2 committed" in out and name.format(3) in out
    assert cli(["verify", str(tmp_path / name.format(3))]) == 0


def test_an_unknown_name_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="name_format"):
        config(tmp_path, name_format="ckpt_{step}")
