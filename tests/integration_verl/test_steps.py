"""The rules roll-ckpt-verl commits verl's PPO steps by, and its verl format, on folders made
here (no verl needed: these run in every leg). A PPO step commits once every role that began
its save has committed its part and the trainer's ``data.pt`` is whole; the tracker names a
step only once it is committed, and a step committed late never takes it back; what an
earlier launch left in a step folder is moved aside or removed before a save; verl's own
folders are recognized, their problems named."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.training import config
from roll_ckpt import CheckpointManager
from roll_ckpt.testing import tiny_state
from roll_ckpt_fs.storage import LocalStorage
from roll_ckpt_verl.migrate import _assemble, _chunk
from roll_ckpt_verl.steps import RoleSteps, clear_for_save, marker_name, write_tracker
from roll_ckpt_verl.verl_format import recognize

VERL = dict(timestamp_subdir=False, name_format="global_step_{step}", commit_steps=False, preemption={"signals": []})


def _role(root: Path, role: str, *, async_save: bool = False, **cc: Any) -> tuple[CheckpointManager, RoleSteps]:
    manager = CheckpointManager(config(root, components=[role], async_save=async_save, **VERL, **cc), component=role,
                                quiet=True)
    manager.bind(tiny_state())
    return manager, RoleSteps(manager, role, tracker=True, timeout_s=30)


def _tracker(root: Path) -> int | None:
    f = root / "latest_checkpointed_iteration.txt"
    return int(f.read_text()) if f.exists() else None


def _data(root: Path, step: int) -> None:
    torch.save({"samples": step}, root / f"global_step_{step}" / "data.pt")  # the trainer's, after every role's save


def _save(manager: CheckpointManager, steps: RoleSteps, step: int, *, asynchronous: bool = False) -> None:
    steps.begin(step)
    steps.wait_in_writer = asynchronous
    manager.save(step, tiny_state(step), final=not asynchronous)


def test_a_step_commits_once_every_role_and_the_trainers_data_are_there(tmp_path: Path) -> None:
    (actor, a), (critic, c) = _role(tmp_path, "actor"), _role(tmp_path, "critic")
    _save(actor, a, 1)
    assert not (tmp_path / "global_step_1" / marker_name("actor")).exists()  # its part is committed
    _save(critic, c, 1)
    assert not a.try_commit(1) and _tracker(tmp_path) is None  # no data.pt yet
    (tmp_path / "global_step_1" / "data.pt").write_bytes(b"PK\x03\x04 torn")  # being written
    assert not a.try_commit(1)
    _data(tmp_path, 1)
    assert a.try_commit(1) and not c.try_commit(1)  # once
    assert _tracker(tmp_path) == 1
    manifest = json.loads((tmp_path / "global_step_1" / "manifest.json").read_text())
    assert manifest["extra"]["step_files"] == ["data.pt"] and set(manifest["extra"]["components"]) == {"actor", "critic"}
    for m, s in ((actor, a), (critic, c)):
        s.close()
        m.close()


def test_a_role_that_began_and_never_committed_keeps_the_step_open(tmp_path: Path) -> None:
    (actor, a), (critic, c) = _role(tmp_path, "actor"), _role(tmp_path, "critic")
    _save(actor, a, 2)
    c.begin(2)  # the critic's save began, then its process died
    _data(tmp_path, 2)
    assert not a.try_commit(2) and a.look_again(3) == [] and _tracker(tmp_path) is None
    for m, s in ((actor, a), (critic, c)):
        s.close()
        m.close()


def test_an_async_part_waits_for_the_data_then_commits_and_tracks(tmp_path: Path) -> None:
    actor, a = _role(tmp_path, "actor", async_save=True)
    _save(actor, a, 3, asynchronous=True)
    assert actor.stats.in_flight or not (tmp_path / "global_step_3" / "manifest.json").exists()
    assert _tracker(tmp_path) is None  # not before the step is committed
    threading.Timer(0.5, _data, (tmp_path, 3)).start()
    actor.wait()  # the writer: the part, then the trainer's data.pt, then the step
    assert (tmp_path / "global_step_3" / "manifest.json").exists() and _tracker(tmp_path) == 3
    a.close()
    actor.close()


def test_the_tracker_is_never_taken_back_by_a_step_committed_late(tmp_path: Path) -> None:
    actor, a = _role(tmp_path, "actor")
    for step in (4, 5):
        _save(actor, a, step)
        _data(tmp_path, step)
    assert a.try_commit(5) and _tracker(tmp_path) == 5
    assert a.look_again(5) == [4]  # committed late (its synchronous part returned before data.pt)
    assert _tracker(tmp_path) == 5
    assert write_tracker(LocalStorage(str(tmp_path)), str(tmp_path), 4) is False
    a.close()
    actor.close()


def test_look_again_leaves_steps_from_the_one_saved_on_alone(tmp_path: Path) -> None:
    actor, a = _role(tmp_path, "actor")
    for step in (6, 7):
        _save(actor, a, step)
        _data(tmp_path, step)
    assert a.look_again(7) == [6] and not (tmp_path / "global_step_7" / "manifest.json").exists()
    a.close()
    actor.close()


def test_what_an_earlier_launch_left_makes_room(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    step = tmp_path / "global_step_8"
    (step / "actor").mkdir(parents=True)  # verl wrote it: moved aside, whole
    (step / "actor" / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    aside = clear_for_save(storage, str(step), "actor")
    assert aside and Path(aside).name.startswith("global_step_8.replaced-") and not step.exists()
    assert (Path(aside) / "actor" / "fsdp_config.json").exists()

    actor, a = _role(tmp_path, "actor")
    critic, c = _role(tmp_path, "critic")
    _save(actor, a, 9)
    c.begin(9)
    assert clear_for_save(storage, str(tmp_path / "global_step_9"), "actor") is None  # its own stale part goes
    assert not (tmp_path / "global_step_9" / "actor").exists() and (tmp_path / "global_step_9" / ".verl-critic.pending").exists()
    _save(actor, a, 10)
    _data(tmp_path, 10)
    c.begin(10)  # every role had begun (data.pt), one never committed: nothing can resume it
    assert clear_for_save(storage, str(tmp_path / "global_step_10"), "critic") is None
    assert not (tmp_path / "global_step_10").exists()
    for m, s in ((actor, a), (critic, c)):
        s.close()
        m.close()


def _verl_part(folder: Path, world: int, fsdp: int = 2, ranks: range | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": fsdp, "world_size": world}))
    for r in ranks if ranks is not None else range(world):
        for kind in ("model", "optim", "extra_state"):
            torch.save({"w": torch.full((2, 2), float(r))}, folder / f"{kind}_world_size_{world}_rank_{r}.pt")


def test_verl_folders_are_recognized_and_their_problems_named(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    _verl_part(tmp_path / "global_step_3" / "actor", 2)
    _verl_part(tmp_path / "global_step_3" / "critic", 2)
    whole = recognize(storage, str(tmp_path / "global_step_3"))
    assert whole is not None and whole.components() == ["actor", "critic"] and whole.problems == [] and whole.step == 3

    _verl_part(tmp_path / "global_step_4", 2, ranks=range(1))  # SFT: rank 1's files missing
    torn = tmp_path / "global_step_4" / "optim_world_size_2_rank_0.pt"
    torn.write_bytes(torn.read_bytes()[:40])
    found = recognize(storage, str(tmp_path / "global_step_4"))
    assert found is not None and found.components() == []
    assert any("model_world_size_2_rank_1.pt is missing" in p for p in found.problems), found.problems
    assert any("optim_world_size_2_rank_0.pt is not a whole torch.save file" in p for p in found.problems)

    _verl_part(tmp_path / "global_step_5", 1, fsdp=1)
    assert any("FSDP1" in p for p in recognize(storage, str(tmp_path / "global_step_5")).problems)

    ours = tmp_path / "global_step_6"
    (ours / "actor").mkdir(parents=True)
    (ours / marker_name("actor")).write_text("")
    assert recognize(storage, str(ours)) is None  # roll-ckpt's own step, being written


@pytest.mark.parametrize("saved,now", [(2, 1), (2, 3), (3, 2), (4, 4), (5, 2)])
def test_shards_of_one_world_size_make_those_of_another(saved: int, now: int) -> None:
    """``torch.chunk``'s pieces (uneven, empty ones included) of rows saved by ``saved`` ranks,
    assembled into each of ``now`` ranks' rows: every element where it was."""
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    pieces = []
    for r in range(saved):
        start, length = _chunk(7, saved, r)
        pieces.append((((start, 0), (length, 3)), full[start:start + length]))
    assert torch.equal(_assemble(full.clone(), pieces, "here", "w"), full)
    chunks = full.chunk(now)
    for r in range(now):
        start, length = _chunk(7, now, r)
        expected = chunks[r] if r < len(chunks) else full[7:]
        assert torch.equal(full[start:start + length], expected)


def test_the_steps_hooks_live_as_long_as_their_role_steps(tmp_path: Path) -> None:
    """A process without verl's steps runs none of their code at its saves: each role's
    RoleSteps registers its two commit hooks when it is made and takes them back at close."""
    from roll_ckpt.plugin import get_plugins

    hooks = get_plugins().pm.hook

    def steps_hooks() -> list[str]:
        impls = hooks.roll_ckpt_save_finished.get_hookimpls() + hooks.roll_ckpt_on_commit.get_hookimpls()
        return sorted(i.plugin_name for i in impls if "verl" in i.plugin_name)

    assert steps_hooks() == []
    (actor, a), (critic, c) = _role(tmp_path, "actor"), _role(tmp_path, "critic")
    try:
        assert len(steps_hooks()) == 4 and len(set(steps_hooks())) == 2  # two hooks of each role's steps
        _save(actor, a, 1)  # the actor's hook takes its own marker only
        assert not (tmp_path / "global_step_1" / marker_name("actor")).exists()
        c.begin(1)
        assert (tmp_path / "global_step_1" / marker_name("critic")).exists()
    finally:
        for steps, manager in ((a, actor), (c, critic)):
            steps.close()
            manager.close()
    assert steps_hooks() == []
