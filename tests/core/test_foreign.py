"""``latest`` never starts over, or goes back, without saying why; other frameworks'
checkpoints, recognized by a format plugin, are resumed read-only.

A toy format stands in for a framework here (``toy.json`` in a ``checkpoint-<step>`` folder);
ROLL's real one is tested in tests/integration_roll/.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from helpers.training import config
from roll_ckpt import CheckpointManager, CheckpointNotFoundError, DriverState
from roll_ckpt.plugin import FormatRecord, hookimpl
from roll_ckpt.plugins import Plugins
from roll_ckpt.testing import tiny_state


class Toy:
    """A checkpoint of the toy format: ``toy.json`` = {"step", "values", "parts", "finished"}."""

    format = "toy"
    title = "toy checkpoint"

    def __init__(self, storage: Any, path: str, body: dict) -> None:
        self.path, self.body = path, body
        self.step = int(body["step"])
        self.problems = [] if body.get("finished", True) else ["toy.json: finished is false (the toy never ended)"]

    def components(self) -> list[str]:
        return list(self.body.get("parts", ["driver"]))

    def files(self) -> dict[str, int]:
        return {"toy.json": len(json.dumps(self.body))}

    def describe(self) -> list[str]:
        return [f"values: {self.body['values']}"]

    def resume(self, state: Any, strategy: Any, component: str | None) -> dict[str, Any]:
        state["driver"].clear()
        state["driver"].update(self.body["values"])
        return {"step": self.step}


def _recognize(storage: Any, path: str) -> Toy | None:
    try:
        with storage.open_read(storage.join(path, "toy.json")) as f:
            return Toy(storage, path, json.loads(f.read()))
    except FileNotFoundError:
        return None


class ToyPlugin:
    @hookimpl
    def roll_ckpt_formats(self) -> list[FormatRecord]:
        return [FormatRecord(name="toy", recognize=_recognize)]


@pytest.fixture
def plugins() -> Plugins:
    p = Plugins()
    p.register(ToyPlugin(), "toy", "toy-dist")
    return p


def _toy(folder: Path, step: int, finished: bool = True, **values: Any) -> Path:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "toy.json").write_text(json.dumps({"step": step, "values": values, "finished": finished}))
    return path


def _manager(root: Path, plugins: Plugins | None = None, **cc: Any) -> CheckpointManager:
    return CheckpointManager(config(root, resume_from_checkpoint="latest", **cc), plugins=plugins, quiet=True)


def _saved(root: Path, step: int) -> Path:
    with _manager(root) as m:
        return Path(m.save(step, tiny_state()))


def _unusable_folders(run: Path) -> dict[str, str]:
    """One folder of each kind ``latest`` passes over, newer than anything else in ``run``."""
    (run / "checkpoint-20").mkdir()
    (run / "checkpoint-20" / "trainer_state.json").write_text("{}")  # a roll-ckpt save that never committed
    (run / "checkpoint-30").mkdir()
    (run / "checkpoint-30" / "weights.bin").write_bytes(b"x")        # nothing reads it
    (run / "global_step_40").mkdir()                                  # another framework's, unknown here
    (run / "global_step_40" / "data.pt").write_bytes(b"x")
    return {"checkpoint-20": "a roll-ckpt save that never committed",
            "checkpoint-30": "no installed format recognizes it",
            "global_step_40": "no installed format recognizes it"}


def test_latest_names_every_newer_folder_it_passes_over(tmp_path: Path, caplog: Any) -> None:
    saved = _saved(tmp_path, 10)
    expected = _unusable_folders(saved.parent)
    state = tiny_state(seed=3)
    with caplog.at_level(logging.WARNING, "roll_ckpt"), _manager(tmp_path) as m:
        assert m.resume(state) == 10
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "resuming from an older checkpoint" in warning
    for name, why in expected.items():
        assert f"{saved.parent / name}: " in warning and why in warning, (name, warning)
    from roll_ckpt.plugins import get_plugins

    if "roll" not in get_plugins().formats():  # what reads ROLL's folders, when it is not installed
        assert "pip install \"roll-ckpt[roll]\"" in warning
    assert "installed formats:" in warning
    assert "checkpoint-10:" not in warning


def test_a_fresh_start_over_unusable_folders_is_a_warning_never_silent(tmp_path: Path, caplog: Any) -> None:
    run = tmp_path / "20260101-000000"
    run.mkdir()
    expected = _unusable_folders(run)
    with caplog.at_level(logging.WARNING, "roll_ckpt"), _manager(tmp_path) as m:
        assert m.resume(tiny_state()) == 0
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "starting fresh (step 0)" in warning and all(name in warning for name in expected)


def test_on_unusable_checkpoint_raise_stops_the_resume(tmp_path: Path) -> None:
    run = tmp_path / "20260101-000000"
    run.mkdir()
    expected = _unusable_folders(run)
    with _manager(tmp_path, on_unusable_checkpoint="raise") as m, pytest.raises(CheckpointNotFoundError) as err:
        m.resume(tiny_state())
    assert "would be starting fresh" in str(err.value) and all(name in str(err.value) for name in expected)


def test_an_empty_output_dir_starts_fresh_without_a_warning(tmp_path: Path, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, "roll_ckpt"), _manager(tmp_path, on_unusable_checkpoint="raise") as m:
        assert m.resume(tiny_state()) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_older_unusable_folders_are_not_named(tmp_path: Path, caplog: Any) -> None:
    run = tmp_path / "20260101-000000"
    run.mkdir()
    (run / "checkpoint-1").mkdir()  # older than what is resumed: not passed over
    _saved(tmp_path, 10)
    with caplog.at_level(logging.WARNING, "roll_ckpt"), _manager(tmp_path, on_unusable_checkpoint="raise") as m:
        assert m.resume(tiny_state()) == 10
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_newer_checkpoint_of_another_framework_is_resumed(tmp_path: Path, plugins: Plugins) -> None:
    _saved(tmp_path, 10)
    run = tmp_path / "29990101-000000"  # a later run folder: newer
    _toy(run, 7, seen=70)
    driver = DriverState()
    with _manager(tmp_path, plugins) as m:
        assert m.resume({"driver": driver}) == 7
        assert m.resumed.path == str(run / "checkpoint-7")
    assert driver == {"seen": 70}
    assert sorted(p.name for p in (run / "checkpoint-7").iterdir()) == ["toy.json"]  # read only


def test_an_unfinished_checkpoint_of_another_framework_is_passed_over(tmp_path: Path, plugins: Plugins,
                                                                      caplog: Any) -> None:
    run = tmp_path / "20260101-000000"
    _toy(run, 5, seen=50)
    _toy(run, 9, finished=False, seen=90)
    driver = DriverState()
    with caplog.at_level(logging.WARNING, "roll_ckpt"), _manager(tmp_path, plugins) as m:
        assert m.resume({"driver": driver}) == 5
    assert driver == {"seen": 50}
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "checkpoint-9: a toy checkpoint that was never finished: toy.json: finished is false" in warning


def test_an_explicit_path_says_what_the_folder_is(tmp_path: Path, plugins: Plugins) -> None:
    run = tmp_path / "20260101-000000"
    unfinished = _toy(run, 9, finished=False)
    expected = _unusable_folders(run)
    cases = {
        unfinished: "is a toy checkpoint that was never finished: toy.json: finished is false",
        run / "checkpoint-20": "is not a committed checkpoint: a roll-ckpt save that never committed",
        run / "checkpoint-30": "nor one another framework wrote that roll-ckpt can read",
        run / "global_step_40": "Install the format plugin of the framework that wrote it",
        run / "checkpoint-99": "the folder does not exist",
    }
    assert len(expected) == 3
    for path, message in cases.items():
        with _manager(tmp_path, plugins) as m, pytest.raises(CheckpointNotFoundError) as err:
            m.resume({"driver": DriverState()}, str(path))
        assert str(path) in str(err.value) and message in str(err.value), str(err.value)
    driver = DriverState()
    with _manager(tmp_path, plugins) as m:
        assert m.resume({"driver": driver}, str(_toy(run, 3, seen=3))) == 3
    assert driver == {"seen": 3}


def test_with_components_a_foreign_checkpoint_must_hold_every_one(tmp_path: Path, plugins: Plugins,
                                                                  caplog: Any) -> None:
    run = tmp_path / "20260101-000000"
    path = _toy(run, 4, seen=4)
    body = json.loads((path / "toy.json").read_text())
    (path / "toy.json").write_text(json.dumps({**body, "parts": ["driver"]}))
    from roll_ckpt import new_run_name

    cfg = config(tmp_path, resume_from_checkpoint="latest", components=["actor", "driver"], run_name=new_run_name())
    with caplog.at_level(logging.WARNING, "roll_ckpt"), \
            CheckpointManager(cfg, component="driver", plugins=plugins, quiet=True) as m:
        assert m.resume({"driver": DriverState()}) == 0
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "holds driver but not actor" in warning


def test_a_path_the_user_names_goes_first_to_the_formats_whose_folders_are_named_so(tmp_path: Path) -> None:
    """Two frameworks write the same files (ROLL's older per-rank layout and verl's): a folder
    named as one of them names it is that one's, whichever was registered first."""
    from roll_ckpt.format.layout import recognize
    from roll_ckpt_fs.storage import LocalStorage

    class Named(Toy):
        format = "named"

    class Both:
        @hookimpl
        def roll_ckpt_formats(self) -> list[FormatRecord]:
            return [FormatRecord(name="toy", recognize=_recognize),
                    FormatRecord(name="named", folder_pattern=r"^global_step_(\d+)$",
                                 recognize=lambda s, p: (t := _recognize(s, p)) and Named(s, p, t.body))]

    p = Plugins()
    p.register(Both(), "both", "both-dist")
    folder = tmp_path / "global_step_3"
    folder.mkdir()
    (folder / "toy.json").write_text(json.dumps({"step": 3, "values": {}}))
    storage = LocalStorage(str(tmp_path))
    assert recognize(storage, str(folder), p.formats(), any_name=True).format == "named"
    assert recognize(storage, str(folder), p.formats()).format == "named"
    other = tmp_path / "elsewhere"
    folder.rename(other)
    assert recognize(storage, str(other), p.formats(), any_name=True).format == "toy"  # no name matches: in order


class CountingToy(ToyPlugin):
    """The toy format, counting how often its records are asked for."""

    def __init__(self) -> None:
        self.asked = 0

    @hookimpl
    def roll_ckpt_formats(self) -> list[FormatRecord]:
        self.asked += 1
        return super().roll_ckpt_formats()


def test_a_resume_among_roll_ckpt_checkpoints_asks_no_format_plugin(tmp_path: Path) -> None:
    """``latest`` asks the format plugins only about a folder that is neither a committed
    roll-ckpt checkpoint nor hidden (a temporary folder, a marker); a folder with another
    name (``logs/``: it might be another framework's checkpoint) makes it ask."""
    saved = _saved(tmp_path, 10)
    (saved.parent / ".tmp-checkpoint-11-0123456789ab").mkdir()  # a save a crash left
    counting = CountingToy()
    plugins = Plugins()
    plugins.register(counting, "toy", "toy-dist")
    with _manager(tmp_path, plugins) as m:
        assert m.resume(tiny_state(seed=3)) == 10
    assert counting.asked == 0
    (saved.parent / "logs").mkdir()
    plugins = Plugins()
    plugins.register(counting, "toy", "toy-dist")
    with _manager(tmp_path, plugins) as m:
        assert m.resume(tiny_state(seed=3)) == 10
    assert counting.asked == 1


def test_the_survey_orders_runs_by_time_then_attempt_and_steps_as_numbers(tmp_path: Path) -> None:
    """``survey`` lists the folders under ``output_dir`` oldest first: those directly under it,
    then each run folder by its timestamp and its suffix as a number (``-5`` before ``-123``,
    which a sort by name would invert), each run's steps as numbers (9 before 10). An owner
    marker marks its own folder only, not one whose name it starts with."""
    from roll_ckpt.format.layout import MARKER_PREFIX, survey
    from roll_ckpt_fs import LocalStorage

    for folder in ["checkpoint-3", "20260101-000000-123/checkpoint-1", "20260101-000000-5/checkpoint-10",
                   "20260101-000000-5/checkpoint-9", "20251231-235959/checkpoint-2"]:
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "20260101-000000-5" / f"{MARKER_PREFIX}checkpoint-1-owner").write_text("{}")
    found = survey(LocalStorage(str(tmp_path)), str(tmp_path), dict)
    assert [(f.run, f.step) for f in found] == [
        ("", 3), ("20251231-235959", 2), ("20260101-000000-5", 9), ("20260101-000000-5", 10),
        ("20260101-000000-123", 1)]
    assert not any("in progress" in f.reason for f in found), [f.reason for f in found]
    (tmp_path / "20260101-000000-5" / f"{MARKER_PREFIX}checkpoint-9-owner").write_text("{}")
    found = survey(LocalStorage(str(tmp_path)), str(tmp_path), dict)
    assert ["in progress" in f.reason for f in found] == [False, False, True, False, False]
