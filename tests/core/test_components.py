"""Steps made of several components, in one process: the commit rule, resume of each
part, retention of whole steps, the refusals, DriverState, and create-only writes.

Separate process groups, kills mid-save and S3 are in tests/reliability/test_components.py.
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers.launch import run_python
from helpers.training import config, train_step
from roll_ckpt import (CheckpointCorruptError, CheckpointManager, CheckpointNotFoundError, ConfigError,
                       DriverState, RollCkptError, load_config, new_run_name)
from roll_ckpt.plugin import hookimpl
from roll_ckpt.format import layout
from roll_ckpt.format.components import step_manifest, try_complete
from roll_ckpt.plugins import Plugins
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state

COMPONENTS = ["actor", "pipeline"]


def _later_run_name() -> str:
    """The run name of a later launch (``new_run_name()`` has millisecond resolution)."""
    time.sleep(0.002)
    return new_run_name()


def _config(root: Any, run: str, **keys: Any) -> Any:
    return config(root, components=COMPONENTS, run_name=run, **keys)


def _managers(root: Any, run: str, **cc: Any) -> tuple[CheckpointManager, CheckpointManager]:
    return (CheckpointManager(_config(root, run, **cc), component="actor", quiet=True),
            CheckpointManager(_config(root, run, **cc), component="pipeline", quiet=True))


def _save_steps(root: Any, run: str, steps: list[int], *, actor_only: tuple[int, ...] = (), seed: int = 1,
                **cc: Any) -> dict[str, Any]:
    """Save ``steps`` with both components (``actor_only``: the pipeline skips them); the actor's state."""
    actor, pipe = _managers(root, run, **cc)
    state = tiny_state(seed=seed)
    for step in steps:
        actor.save(step, state)
        if step not in actor_only:
            pipe.save(step, {"driver": DriverState(step=step)})
    actor.close()
    pipe.close()
    return state


def _steps(root: Path) -> list[int]:
    return [r.step for r in layout.committed(layout_storage(root), str(root))]


def layout_storage(root: Path) -> Any:
    from roll_ckpt_fs.storage import LocalStorage

    return LocalStorage(str(root))


# --------------------------------------------------------------------------- config


def test_components_need_a_component_a_listed_name_and_a_shared_run_name(tmp_path: Path) -> None:
    run = new_run_name()
    with pytest.raises(ConfigError, match="component=<one of them>"):
        CheckpointManager(_config(tmp_path, run), quiet=True)
    with pytest.raises(ConfigError, match="does not list component 'critic'"):
        CheckpointManager(_config(tmp_path, run), component="critic", quiet=True)
    plain = load_config({"checkpoint_config": {"output_dir": str(tmp_path)}})
    with pytest.raises(ConfigError, match="components.*is not set"):
        CheckpointManager(plain, component="actor", quiet=True)
    no_run = load_config({"checkpoint_config": {"output_dir": str(tmp_path), "components": COMPONENTS}})
    with pytest.raises(ConfigError, match="run_name.*same run folder"):
        CheckpointManager(no_run, component="actor", quiet=True)


def test_run_name_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run_name.*not a run folder name"):
        load_config({"checkpoint_config": {"output_dir": str(tmp_path), "run_name": "../elsewhere"}})
    with pytest.raises(ConfigError, match="timestamp_subdir is false"):
        load_config({"checkpoint_config": {"output_dir": str(tmp_path), "run_name": "20260101-000000",
                                           "timestamp_subdir": False}})
    os.environ["ROLL_CKPT_TEST_RUN"] = "20260101-000000-3"
    try:
        cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path),
                                                 "run_name": "${env:ROLL_CKPT_TEST_RUN}"}})
    finally:
        del os.environ["ROLL_CKPT_TEST_RUN"]
    assert cfg.checkpoint_config.run_name == "20260101-000000-3"
    assert layout.RUN_RE.match(new_run_name())


# --------------------------------------------------------------------------- commit and resume


def test_a_step_counts_once_every_part_is_committed_and_each_part_resumes_exactly(tmp_path: Path) -> None:
    run = new_run_name()
    announced: list[tuple[str | None, int]] = []

    class _Listener:
        @hookimpl
        def roll_ckpt_on_commit(self, info: Any) -> None:
            announced.append((info.component, info.step))

    plugins = Plugins()
    plugins.register(_Listener(), name="listener-components", distribution="test-listener")
    actor = CheckpointManager(_config(tmp_path, run), component="actor", plugins=plugins, quiet=True)
    pipe = CheckpointManager(_config(tmp_path, run), component="pipeline", plugins=plugins, quiet=True)
    state = tiny_state(seed=3)
    random.seed(11)
    np.random.seed(12)
    driver = DriverState(step=4, consumed=[0, 96], history=[{"reward": 0.5, "loss": float("nan")}],
                         note="ünïcode", big=2 ** 70, neg_zero=-0.0)
    actor.save(4, state)
    step_dir = tmp_path / run / "checkpoint-4"
    assert (step_dir / "actor" / "manifest.json").is_file()
    assert not (step_dir / "manifest.json").exists() and _steps(tmp_path) == []
    pipe.save(4, {"driver": driver})
    assert _steps(tmp_path) == [4]
    expected_actor, expected_driver = state_snapshot(state), json.dumps(dict(driver), sort_keys=True)
    expected_random = (random.random(), np.random.rand())
    actor.close()
    pipe.close()
    assert announced == [("actor", 4), ("pipeline", 4), (None, 4)]

    top = json.loads((step_dir / "manifest.json").read_text())
    assert top["component"] is None and set(components_of_body(top)) == set(COMPONENTS)
    assert {"actor/manifest.json", "pipeline/manifest.json", "pipeline/state/state.json",
            "actor/dcp/.metadata"} <= set(top["files"])
    saved = json.loads((step_dir / "pipeline" / "state" / "state.json").read_text())  # JSON, no pickle
    assert saved["state"]["driver"]["values"]["note"] == "ünïcode"

    # a new launch: another run folder, each component resumes its own part
    run2 = _later_run_name()
    actor2, pipe2 = _managers(tmp_path, run2, resume_from_checkpoint="latest")
    fresh = tiny_state(seed=99)
    train_step(fresh, (3, 8))
    driver2 = DriverState()
    random.seed(0)
    np.random.seed(0)
    assert actor2.resume(fresh) == 4 and pipe2.resume({"driver": driver2}) == 4
    assert_same_state(state_snapshot(fresh), expected_actor)
    assert json.dumps(dict(driver2), sort_keys=True) == expected_driver
    assert math.isnan(driver2["history"][0]["loss"]) and driver2["big"] == 2 ** 70
    assert math.copysign(1.0, driver2["neg_zero"]) == -1.0
    assert (random.random(), np.random.rand()) == expected_random  # the driver's RNG came back too
    assert actor2.resumed.trainer_state["component"] == "actor"
    actor2.close()
    pipe2.close()


def components_of_body(body: dict[str, Any]) -> dict[str, Any]:
    return body["extra"]["components"]


def test_latest_skips_a_step_a_component_never_committed(tmp_path: Path) -> None:
    _save_steps(tmp_path, new_run_name(), [2, 4, 6], actor_only=(6,))  # the pipeline never saves step 6
    assert _steps(tmp_path) == [2, 4]
    ref = layout.latest(layout_storage(tmp_path), str(tmp_path))
    assert ref is not None and ref.step == 4
    _, pipe2 = _managers(tmp_path, _later_run_name(), resume_from_checkpoint="latest")
    restored = DriverState()
    assert pipe2.resume({"driver": restored}) == 4 and restored["step"] == 4
    pipe2.close()


def test_a_step_whose_last_part_died_before_the_step_manifest_is_committed_at_resume(tmp_path: Path) -> None:
    run = new_run_name()
    _save_steps(tmp_path, run, [3])
    step_dir = tmp_path / run / "checkpoint-3"
    (step_dir / "manifest.json").unlink()  # as if the last part's process died right after its own commit
    assert _steps(tmp_path) == []
    actor2, _ = _managers(tmp_path, _later_run_name(), resume_from_checkpoint="latest")
    assert actor2.resume(tiny_state(seed=5)) == 3
    assert (step_dir / "manifest.json").is_file()
    actor2.close()


def test_concurrent_finishers_commit_the_step_exactly_once(tmp_path: Path) -> None:
    run = new_run_name()
    _save_steps(tmp_path, run, [1])
    step_dir = tmp_path / run / "checkpoint-1"
    first = (step_dir / "manifest.json").read_bytes()
    storage = layout_storage(tmp_path)
    for _ in range(3):
        (step_dir / "manifest.json").unlink()
        barrier = threading.Barrier(8)
        wins: list[bool] = []

        def finish() -> None:
            barrier.wait(10)
            wins.append(try_complete(storage, str(step_dir), 1, COMPONENTS) is not None)

        threads = [threading.Thread(target=finish) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(wins) == [False] * 7 + [True]
        # the step's manifest depends only on the parts': any writer writes the same bytes
        assert (step_dir / "manifest.json").read_bytes() == first
    assert not [p for p in (tmp_path / run).iterdir() if p.name.startswith(".tmp-")]


def test_step_manifest_refuses_a_part_that_names_another_component(tmp_path: Path) -> None:
    run = new_run_name()
    actor, _ = _managers(tmp_path, run)
    actor.save(1, tiny_state(seed=1))
    actor.close()
    data = (tmp_path / run / "checkpoint-1" / "actor" / "manifest.json").read_bytes()
    with pytest.raises(CheckpointCorruptError, match="pipeline/manifest.json.*belongs to component 'actor'"):
        step_manifest(1, {"actor": data, "pipeline": data})
    with pytest.raises(CheckpointCorruptError, match="at step 1, not 'actor' at step 2"):
        step_manifest(2, {"actor": data})


def test_async_parts_commit_the_step_in_the_background(tmp_path: Path) -> None:
    run = new_run_name()
    actor, pipe = _managers(tmp_path, run, strategy_config={"async_save_ckpt": True})
    state = tiny_state(seed=4)
    actor.save(8, state)
    pipe.save(8, {"driver": DriverState(step=8)})
    actor.wait()
    pipe.wait()
    assert _steps(tmp_path) == [8]
    actor.close()
    pipe.close()


# --------------------------------------------------------------------------- refusals


def test_resume_refuses_the_wrong_kind_of_checkpoint(tmp_path: Path) -> None:
    run = new_run_name()
    state = _save_steps(tmp_path, run, [1])
    step_dir = tmp_path / run / "checkpoint-1"

    plain = CheckpointManager(load_config({"checkpoint_config": {"output_dir": str(tmp_path / "other")}}), quiet=True)
    with pytest.raises(RollCkptError, match="made of components \\(actor, pipeline\\).*component="):
        plain.resume(tiny_state(seed=2), target=str(step_dir))
    with pytest.raises(RollCkptError, match="the part of component 'actor' of a step"):
        plain.resume(tiny_state(seed=2), target=str(step_dir / "actor"))
    plain_path = plain.save(1, tiny_state(seed=2))
    plain.close()

    actor2, pipe2 = _managers(tmp_path, _later_run_name())
    with pytest.raises(RollCkptError, match="saved without components"):
        actor2.resume(tiny_state(seed=2), target=plain_path)
    with pytest.raises(RollCkptError, match="the part of component 'pipeline', not of 'actor'"):
        actor2.resume(tiny_state(seed=2), target=str(step_dir / "pipeline"))
    # a part folder named explicitly is loaded as it is
    target = tiny_state(seed=7)
    assert actor2.resume(target, target=str(step_dir / "actor")) == 1
    assert_same_state(state_snapshot(target), state_snapshot(state))
    # a driver state into a tensor state (and back) is refused before anything loads
    with pytest.raises(RollCkptError, match="written by the 'json' strategy"):
        CheckpointManager(_config(tmp_path, _later_run_name()), component="pipeline", quiet=True).resume(
            tiny_state(seed=1), target=str(step_dir))
    with pytest.raises(CheckpointNotFoundError, match="no driver state for 'other'"):
        pipe2.resume({"other": DriverState()}, target=str(step_dir))
    actor2.close()
    pipe2.close()


def test_a_swapped_part_manifest_is_refused(tmp_path: Path) -> None:
    run = new_run_name()
    _save_steps(tmp_path, run, [1, 2])
    one, two = tmp_path / run / "checkpoint-1", tmp_path / run / "checkpoint-2"
    (two / "pipeline" / "manifest.json").write_bytes((one / "pipeline" / "manifest.json").read_bytes())
    _, pipe2 = _managers(tmp_path, _later_run_name())
    with pytest.raises(CheckpointCorruptError, match="pipeline/manifest.json.*not the part's manifest the step committed"):
        pipe2.resume({"driver": DriverState()}, target=str(two))
    pipe2.close()


def test_a_part_of_an_earlier_launch_is_not_overwritten(tmp_path: Path) -> None:
    run = new_run_name()
    _save_steps(tmp_path, run, [5], actor_only=(5,))
    again, _ = _managers(tmp_path, run)  # the same run_name reused by a new launch
    with pytest.raises(RollCkptError, match="already committed: by an earlier launch that used the same"):
        again.save(5, tiny_state(seed=1))
    again.close()


def test_driver_state_refuses_values_that_would_not_come_back(tmp_path: Path) -> None:
    _, pipe = _managers(tmp_path, new_run_name())
    for bad, where in [(DriverState(pos=(1, 2)), "DriverState\\['pos'\\] is a tuple"),
                       (DriverState(hist={1: "a"}), "has the key 1 \\(int\\)"),
                       (DriverState(x=[np.float32(1.0)]), "DriverState\\['x'\\]\\[0\\] is a float32"),
                       (DriverState(t=torch.ones(1)), "is a Tensor")]:
        with pytest.raises(RollCkptError, match=where):
            pipe.save(1, {"driver": bad})
    with pytest.raises(RollCkptError, match="DriverState values only"):
        pipe.strategy.state_dict({"driver": DriverState(), "model": torch.nn.Linear(1, 1)})
    pipe.close()
    assert _steps(tmp_path) == []


# --------------------------------------------------------------------------- retention


def test_retention_removes_whole_steps_and_steps_that_can_no_longer_complete(tmp_path: Path) -> None:
    run = new_run_name()
    # step 1: the pipeline's part never comes; step 5: newer than every whole step, it may still come
    _save_steps(tmp_path, run, [1, 2, 3, 4, 5], actor_only=(1, 5), max_ckpt_to_keep=2)
    present = sorted(p.name for p in (tmp_path / run).iterdir() if p.name.startswith("checkpoint-"))
    assert present == ["checkpoint-3", "checkpoint-4", "checkpoint-5"]
    assert _steps(tmp_path) == [3, 4]
    assert sorted(p.name for p in (tmp_path / run / "checkpoint-3").iterdir()) == ["actor", "manifest.json", "pipeline"]


def test_retention_judges_pending_steps_without_the_steps_it_just_removed(tmp_path: Path) -> None:
    """An earlier launch left whole step 4 and step 8 with the actor's part only. The next
    launch's first whole step makes retention remove step 4, then judge step 8 by what is
    left: no whole step of its launch any more, so the newest whole step decides (found by
    the Ray job test, where the driver of both launches is one process)."""
    run1, run2 = "20250101-000000", "20250101-000100"
    _save_steps(tmp_path, run1, [4, 8], actor_only=(8,))
    _save_steps(tmp_path, run2, [8], max_ckpt_to_keep=1)
    assert [(r.run, r.step) for r in layout.committed(layout_storage(tmp_path), str(tmp_path))] == [(run2, 8)]
    assert not (tmp_path / run1 / "checkpoint-4").exists() and not (tmp_path / run1 / "checkpoint-8").exists()


def test_removing_a_step_uncommits_its_parts_first(tmp_path: Path) -> None:
    from roll_ckpt.format.components import complete_pending
    from roll_ckpt.tiers.retention import remove_checkpoint

    run = new_run_name()
    _save_steps(tmp_path, run, [1])
    storage = layout_storage(tmp_path)
    step_dir = str(tmp_path / run / "checkpoint-1")
    real_remove_tree = storage.remove_tree

    def dies_halfway(path: str) -> None:
        raise KeyboardInterrupt  # the process stops right before the files go

    storage.remove_tree = dies_halfway  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        remove_checkpoint(storage, step_dir)
    storage.remove_tree = real_remove_tree  # type: ignore[method-assign]
    # nothing left that looks committed, and nothing that could be committed again
    assert complete_pending(storage, str(tmp_path), COMPONENTS) == []
    assert _steps(tmp_path) == []


# --------------------------------------------------------------------------- create-only on a disk


def test_local_write_create_is_whole_or_absent_and_leaves_nothing_behind(tmp_path: Path) -> None:
    from roll_ckpt.format.commit import clean_stale

    storage = layout_storage(tmp_path)
    target = tmp_path / "run" / "checkpoint-1" / "manifest.json"
    target.parent.mkdir(parents=True)
    storage.write_create(str(target), b"first")
    with pytest.raises(FileExistsError):
        storage.write_create(str(target), b"second")
    assert target.read_bytes() == b"first"
    assert sorted(p.name for p in target.parent.iterdir()) == ["manifest.json"]
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".tmp-")]
    # a temporary file left by a writer that died between link and unlink is cleaned up once old
    stale = tmp_path / ".tmp-manifest.json-1-2"
    stale.write_bytes(b"x")
    old = time.time() - 120
    os.utime(stale, (old, old))
    assert str(stale) in clean_stale(storage, str(tmp_path))
    assert not stale.exists()


def test_components_on_memory_storage(memory_url: str) -> None:
    run = new_run_name()
    cc = {"type": "file_system"}
    actor = CheckpointManager(_config(memory_url, run, **cc), component="actor", quiet=True)
    pipe = CheckpointManager(_config(memory_url, run, **cc), component="pipeline", quiet=True)
    state = tiny_state(seed=6)
    actor.save(2, state)
    pipe.save(2, {"driver": DriverState(step=2)})
    assert [r.step for r in layout.committed(actor.storage, actor.storage.root)] == [2]
    actor.close()
    pipe.close()
    actor2 = CheckpointManager(_config(memory_url, _later_run_name(), resume_from_checkpoint="latest"),
                               component="actor", quiet=True)
    target = tiny_state(seed=8)
    assert actor2.resume(target) == 2
    assert_same_state(state_snapshot(target), state_snapshot(state))
    actor2.close()


def test_a_run_name_that_already_holds_a_whole_step_is_refused_at_resume(tmp_path: Path) -> None:
    run = new_run_name()
    _save_steps(tmp_path, run, [2, 4], actor_only=(4,))  # launch 1: step 2 whole, then the pipeline died
    actor, pipe = _managers(tmp_path, run, resume_from_checkpoint="latest")  # launch 2 reuses the name
    for manager, state in ((actor, tiny_state(seed=1)), (pipe, {"driver": DriverState()})):
        with pytest.raises(RollCkptError, match=f"run_name '{run}' was used by an earlier launch.*step 2"):
            manager.resume(state)
        manager.close()
    # nothing of step 4 was completed with the second launch's parts
    assert _steps(tmp_path) == [2]


def test_driver_state_keeps_insertion_order_and_a_driver_never_imports_torch(tmp_path: Path) -> None:
    _, pipe = _managers(tmp_path, new_run_name())
    pipe.save(1, {"driver": DriverState(zeta=1, alpha={"b": 1, "a": 2})})
    pipe.close()
    restored = DriverState()
    _, pipe2 = _managers(tmp_path, _later_run_name())
    step_dir = next(tmp_path.glob("*/checkpoint-1"))
    pipe2.resume({"driver": restored}, target=str(step_dir / "pipeline"))
    pipe2.close()
    assert list(restored) == ["zeta", "alpha"] and list(restored["alpha"]) == ["b", "a"]

    code = ("import sys, roll_ckpt\n"
            f"cfg = roll_ckpt.load_config({{'checkpoint_config': {{'output_dir': {str(tmp_path / 'd')!r}, "
            "'components': ['actor', 'pipeline'], 'run_name': roll_ckpt.new_run_name()}})\n"
            "m = roll_ckpt.CheckpointManager(cfg, component='pipeline', quiet=True)\n"
            "m.save(1, {'driver': roll_ckpt.DriverState(step=1, rng=False)})\n"
            "m.close()\n"
            "print('torch' in sys.modules)\n")
    out = run_python(code, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_retention_drops_run_folders_that_hold_only_a_dead_launchs_record(tmp_path: Path) -> None:
    import socket

    from roll_ckpt.tiers.retention import apply_retention

    dead = tmp_path / "20200101-000000"
    dead.mkdir()
    (dead / ".run.json").write_text(json.dumps({"host": socket.gethostname(), "pid": 2 ** 22 + 12345, "started": 0}))
    alive = tmp_path / "20200101-000001"
    alive.mkdir()
    (alive / ".run.json").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                                 "started": time.time()}))
    _save_steps(tmp_path, new_run_name(), [1, 2], max_ckpt_to_keep=1)
    apply_retention(layout_storage(tmp_path), str(tmp_path), 1)
    assert not dead.exists()
    assert alive.exists()  # its owner runs: a launch that has not saved yet


def test_a_failed_step_commit_keeps_the_part_and_the_next_resume_commits_the_step(tmp_path: Path, caplog) -> None:
    run = new_run_name()
    actor, pipe = _managers(tmp_path, run, max_ckpt_to_keep=5)
    state = tiny_state(seed=1)
    real = pipe.storage.write_create
    failures = []

    def flaky(path: str, data: bytes) -> None:
        if path.endswith("checkpoint-10/manifest.json") and not failures:
            failures.append(path)
            raise OSError(5, "injected I/O error")
        real(path, data)

    pipe.storage.write_create = flaky  # type: ignore[method-assign]
    actor.save(10, state)
    with caplog.at_level("WARNING", logger="roll_ckpt"):
        pipe.save(10, {"driver": DriverState(step=10)})  # its part commits; the step's manifest fails
    assert failures and "the next resume commits the step" in caplog.text
    assert _steps(tmp_path) == []
    for manager, value in ((actor, state), (pipe, {"driver": DriverState(step=20)})):
        manager.save(20, value)
    actor.close()
    pipe.close()
    # retention leaves a step whose parts are all there: only its own manifest is missing
    assert _steps(tmp_path) == [20] and (tmp_path / run / "checkpoint-10" / "pipeline" / "manifest.json").is_file()
    actor2, _ = _managers(tmp_path, _later_run_name(), resume_from_checkpoint="latest")
    assert actor2.resume(tiny_state(seed=2)) == 20
    assert _steps(tmp_path) == [10, 20]
    actor2.close()


def test_a_damaged_part_of_a_pending_step_does_not_stop_the_resume(tmp_path: Path) -> None:
    run = new_run_name()
    _save_steps(tmp_path, run, [10, 20])
    step20 = tmp_path / run / "checkpoint-20"
    (step20 / "manifest.json").unlink()
    (step20 / "actor" / "manifest.json").write_text("{not json")
    actor2, _ = _managers(tmp_path, _later_run_name(), resume_from_checkpoint="latest")
    assert actor2.resume(tiny_state(seed=2)) == 10
    assert not (step20 / "manifest.json").exists()
    actor2.close()


def test_every_component_of_a_launch_resumes_from_the_step_the_first_one_chose(tmp_path: Path) -> None:
    old = new_run_name()
    _save_steps(tmp_path, old, [10, 20], actor_only=(20,))  # step 20 waits for the pipeline's part
    run = _later_run_name()
    actor, pipe = _managers(tmp_path, run, resume_from_checkpoint="latest")
    assert actor.resume(tiny_state(seed=3)) == 10
    # a straggler of the earlier launch commits its part of step 20 now: the step is whole
    from roll_ckpt.tiers.run import Run

    straggler = CheckpointManager(_config(tmp_path, old), component="pipeline", quiet=True)
    state = {"driver": DriverState(step=20)}
    straggler.bind(state)
    straggler._run = Run(straggler.storage, straggler._token, str(tmp_path / old))  # a process of that launch
    straggler.save(20, state)
    straggler.close()
    assert 20 in _steps(tmp_path)
    restored = DriverState()
    assert pipe.resume({"driver": restored}) == 10 and restored["step"] == 10  # the same step as the actor
    record = json.loads((tmp_path / run / ".resume.json").read_text())
    assert record["component"] == "actor" and record["candidates"][0][0].endswith(f"{old}/checkpoint-10")
    actor.close()
    pipe.close()


def test_driver_state_refuses_subclasses_and_cycles(tmp_path: Path) -> None:
    import collections
    import enum

    class Phase(enum.IntEnum):
        ROLLOUT = 1

    loop: list[Any] = []
    loop.append(loop)
    _, pipe = _managers(tmp_path, new_run_name())
    for bad, where in [(DriverState(r=np.float64(0.5)), "is a float64"),
                       (DriverState(p=Phase.ROLLOUT), "is a Phase"),
                       (DriverState(o=collections.OrderedDict(a=1)), "is a OrderedDict"),
                       (DriverState(l=loop), "contains itself")]:
        with pytest.raises(RollCkptError, match=where):
            pipe.save(1, {"driver": bad})
    pipe.close()


def test_a_launch_restarted_within_the_second_gets_a_newer_run_name() -> None:
    from roll_ckpt.format import layout

    first = new_run_name()
    time.sleep(0.002)
    second = new_run_name()
    assert first != second and layout.run_key(second) > layout.run_key(first)
    assert layout.RUN_RE.match(second)
