"""A save before an optimizer's first step changes nothing of training: torch's state-dict
helpers make a never-stepped optimizer's state by stepping it with zero gradients (Adam's
``step`` then 1), which would change the bias correction of the first real step. The save
leaves it as it was, and a resume gives back a fresh optimizer (its learning rate and other
hyperparameters loaded), so the run goes on exactly as one that never saved."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.training import config
from roll_ckpt import CheckpointManager


def _state(lr: float = 0.1) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=lr)}


def _step(state: dict) -> None:
    x = torch.ones(3, 8)
    state["model"](x).pow(2).mean().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()


def test_a_save_before_the_first_step_changes_nothing(tmp_path: Path) -> None:
    saved, unsaved = _state(), _state()
    with CheckpointManager(config(tmp_path), quiet=True) as m:
        m.save(0, saved)
    assert len(saved["optimizer"].state) == 0  # fresh, as before the save
    _step(saved)
    _step(unsaved)
    assert all(torch.equal(a, b) for a, b in zip(saved["model"].parameters(), unsaved["model"].parameters()))


def test_a_checkpoint_of_a_fresh_optimizer_resumes_fresh(tmp_path: Path) -> None:
    with CheckpointManager(config(tmp_path), quiet=True) as m:
        m.save(0, _state(lr=0.25))
    resumed, unsaved = _state(lr=0.9), _state(lr=0.25)
    _step(resumed)  # a state of its own first: the resume must take it back to fresh
    with CheckpointManager(config(tmp_path, resume_from_checkpoint="latest"), quiet=True) as m:
        m.resume(resumed)
        assert m.resumed.path is not None
    assert len(resumed["optimizer"].state) == 0 and resumed["optimizer"].param_groups[0]["lr"] == 0.25
    assert all(torch.equal(a, b) for a, b in zip(resumed["model"].parameters(), unsaved["model"].parameters()))
    _step(resumed)
    _step(unsaved)
    assert all(torch.equal(a, b) for a, b in zip(resumed["model"].parameters(), unsaved["model"].parameters()))
