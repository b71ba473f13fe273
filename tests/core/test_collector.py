"""The garbage collector held off while a save plans and gathers (roll_ckpt.runtime.collector)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_ckpt import CheckpointManager
from roll_ckpt.runtime.collector import CollectorPause
from roll_ckpt.testing import tiny_state
from tests.helpers.training import config


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_holds_nest_and_the_last_release_switches_it_back_on() -> None:
    a, b = CollectorPause(), CollectorPause()
    a.hold()
    assert not gc.isenabled()
    b.hold()
    a.release()
    assert not gc.isenabled(), "another save still holds it"
    a.release()  # a second release of the same hold changes nothing
    assert not gc.isenabled()
    b.release()
    assert gc.isenabled()


def test_a_collector_the_process_switched_off_stays_off() -> None:
    gc.disable()
    with CollectorPause():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_disabled_pause_touches_nothing() -> None:
    with CollectorPause(enabled=False):
        assert gc.isenabled()


def _watch(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[bool]]:
    """Records whether the collector runs while DCP plans, while the data is written and
    while .metadata is written."""
    import roll_ckpt.dcp.writer as dw

    import roll_ckpt.save.pipeline as saving

    seen: dict[str, list[bool]] = {"stage": [], "plan": [], "data": [], "metadata": []}
    plan, write, finish = dw.ReusingSavePlanner.set_up_planner, dw.write_tensor, dw.DigestingWriter.finish
    stage = saving.stage_state_dict

    def stage_state_dict(*a: Any, **k: Any) -> Any:
        seen["stage"].append(gc.isenabled())
        return stage(*a, **k)

    def set_up_planner(self: Any, *a: Any, **k: Any) -> None:
        seen["plan"].append(gc.isenabled())
        plan(self, *a, **k)

    def write_tensor(*a: Any) -> None:
        seen["data"].append(gc.isenabled())
        write(*a)

    def finish_(self: Any, *a: Any, **k: Any) -> None:
        seen["metadata"].append(gc.isenabled())
        finish(self, *a, **k)

    monkeypatch.setattr(dw.ReusingSavePlanner, "set_up_planner", set_up_planner)
    monkeypatch.setattr(dw, "write_tensor", write_tensor)
    monkeypatch.setattr(dw.DigestingWriter, "finish", finish_)
    monkeypatch.setattr(saving, "stage_state_dict", stage_state_dict)
    return seen


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_holds_it_off_while_it_stages_and_dcp_plans_not_while_it_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool) -> None:
    seen = _watch(monkeypatch)
    state = tiny_state()
    with CheckpointManager.from_config(config(tmp_path, async_save=async_save), quiet=True) as m:
        m.save(1, state)
        m.wait()
        assert gc.isenabled()
    assert seen["stage"] == [False] and seen["plan"] == [False] and seen["metadata"] == [False]
    assert seen["data"] and all(seen["data"])
    assert gc.isenabled()


def test_pause_gc_false_leaves_it_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _watch(monkeypatch)
    with CheckpointManager.from_config(config(tmp_path, pause_gc=False), quiet=True) as m:
        m.save(1, tiny_state())
    assert seen["stage"] == [True] and seen["plan"] == [True] and seen["metadata"] == [True]


def test_a_failed_save_switches_it_back_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import roll_ckpt.dcp.writer as dw

    def broken(*a: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dw, "write_tensor", broken)
    with CheckpointManager.from_config(config(tmp_path), quiet=True) as m:
        with pytest.raises(BaseException):
            m.save(1, {"model": torch.nn.Linear(2, 2)})
    assert gc.isenabled()
