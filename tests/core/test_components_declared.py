"""Steps whose parts declare what the step needs, and files a part publishes at the step's root.

A driver that knows every component lists them all; each worker lists itself and the driver
(as the ROLL integration's workers do, which cannot know the pipeline's checkpoint clusters
when they start). The step still waits for every part. The actor's Hugging Face files are
published at ``checkpoint-<step>/`` too, where ROLL keeps them for rollout engines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from core._hf_helpers import from_pretrained, tiny_llama, train
from helpers.training import config
from roll_ckpt import CheckpointManager, DriverState, new_run_name
from roll_ckpt.cli import main as cli
from roll_ckpt.format import layout
from roll_ckpt.testing import tiny_state
from roll_ckpt_fs.storage import LocalStorage

ALL = ["actor", "critic", "pipeline"]


def _manager(root: Path, run: str, component: str, components: list[str], **cc: Any) -> CheckpointManager:
    return CheckpointManager(config(root, components=components, run_name=run, **cc), component=component, quiet=True)


def _committed(root: Path) -> list[int]:
    return [r.step for r in layout.committed(LocalStorage(str(root)), str(root))]


@pytest.mark.parametrize("order", [("actor", "pipeline", "critic"), ("pipeline", "actor", "critic"),
                                   ("critic", "actor", "pipeline")])
def test_the_step_waits_for_every_part_any_part_declared(tmp_path: Path, order: tuple[str, ...]) -> None:
    run = new_run_name()
    managers = {"actor": _manager(tmp_path, run, "actor", ["actor", "pipeline"]),
                "critic": _manager(tmp_path, run, "critic", ["critic", "pipeline"]),
                "pipeline": _manager(tmp_path, run, "pipeline", ALL)}
    states = {"actor": tiny_state(1), "critic": tiny_state(2), "pipeline": {"driver": DriverState(step=3)}}
    for i, name in enumerate(order):
        managers[name].save(3, states[name])
        # the step counts only once the pipeline (which lists the critic) and the critic are in
        assert _committed(tmp_path) == ([3] if i == len(order) - 1 else []), (name, i)
    step = tmp_path / run / "checkpoint-3"
    manifest = json.loads((step / "manifest.json").read_text())
    assert sorted(manifest["extra"]["components"]) == ALL
    assert json.loads((step / "actor" / "manifest.json").read_text())["extra"]["expects"] == ["actor", "pipeline"]
    for m in managers.values():
        m.close()


def _hf_actor(root: Path, run: str, step_root: bool = True) -> CheckpointManager:
    m = _manager(root, run, "actor", ["actor", "pipeline"], hf_weights={"step_root": step_root})
    return m


def test_a_part_publishes_its_hugging_face_files_at_the_step_root(tmp_path: Path) -> None:
    from roll_ckpt.runtime.transformers_compat import dtype_argument

    run = new_run_name()
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    actor, driver = _hf_actor(tmp_path, run), _manager(tmp_path, run, "pipeline", ["actor", "pipeline"])
    actor.save(2, {"model": model, "optimizer": opt})
    step = tmp_path / run / "checkpoint-2"
    assert not (step / "config.json").exists()  # not before the step commits
    driver.save(2, {"driver": DriverState(step=2)})
    actor.close()
    driver.close()
    manifest = json.loads((step / "manifest.json").read_text())
    published = json.loads((step / "actor" / "manifest.json").read_text())["extra"]["step_root"]
    assert "config.json" in published and any(n.endswith(".safetensors") for n in published)
    for name in published:
        assert (step / name).read_bytes() == (step / "actor" / name).read_bytes()
        assert manifest["files"][name] == manifest["files"][f"actor/{name}"]
        assert (step / name).stat().st_ino == (step / "actor" / name).stat().st_ino  # a hard link, no copy
    loaded = from_pretrained(str(step), **{dtype_argument(): torch.float32})
    for (name, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    assert cli(["verify", str(step)]) == 0
    (step / "config.json").unlink()
    (step / "config.json").write_text("{}")  # damaged at the root only
    assert cli(["verify", str(step)]) == 1


def test_without_step_root_nothing_is_published(tmp_path: Path) -> None:
    run = new_run_name()
    model = tiny_llama()
    actor, driver = _hf_actor(tmp_path, run, step_root=False), _manager(tmp_path, run, "pipeline",
                                                                         ["actor", "pipeline"])
    actor.save(1, {"model": model})
    driver.save(1, {"driver": DriverState(step=1)})
    actor.close()
    driver.close()
    step = tmp_path / run / "checkpoint-1"
    assert (step / "manifest.json").exists() and (step / "actor" / "config.json").exists()
    assert sorted(p.name for p in step.iterdir()) == ["actor", "manifest.json", "pipeline"]
