"""The public surface (issue 37 item 5): ``roll_ckpt`` exports what a training script uses,
the manager has its calls plus four views, and every name that moved still works, with a
``RollCkptDeprecationWarning`` naming its new home, giving what its home gives."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import roll_ckpt
from roll_ckpt import CheckpointManager, load_config
from roll_ckpt.errors import RollCkptDeprecationWarning
from roll_ckpt.testing import tiny_state
from roll_ckpt.views import moved

# What a training script imports (the errors it catches most; all of them: roll_ckpt.errors).
PACKAGE_API = {"__version__", "CheckpointManager", "SaveStats", "Preempted", "load_config", "Config", "DriverState",
               "GlobalState", "new_run_name", "export_hf", "RollCkptError", "ConfigError", "StorageError", "SaveError",
               "CheckpointNotFoundError", "CheckpointCorruptError"}
MANAGER_CALLS = {"from_config", "bind", "resume", "maybe_save", "save", "prepare_save", "wait", "commit_step",
                 "hf_files", "close"}
MANAGER_VALUES = {"config", "storage", "strategy", "io", "run_dir"}
MANAGER_VIEWS = {"stats", "resumed", "backup", "local", "preemption"}
DEPRECATED_CALLS = {"wait_for_backup", "request_preemption"}  # each forwards to a view, with a warning


def test_the_package_exports_what_a_training_script_uses() -> None:
    assert set(roll_ckpt.__all__) == PACKAGE_API
    for name in roll_ckpt.__all__:
        getattr(roll_ckpt, name)  # each resolves (the lazy ones import the manager / the export)


@pytest.mark.parametrize("name", sorted(roll_ckpt._MOVED))
def test_a_name_that_moved_still_imports_with_a_warning_naming_its_home(name: str) -> None:
    import importlib

    home = roll_ckpt._MOVED[name]
    with pytest.warns(RollCkptDeprecationWarning, match=rf"roll_ckpt\.{name} moved to {home}\.{name}"):
        old = getattr(roll_ckpt, name)
    assert old is getattr(importlib.import_module(home), name)


def _manager(tmp_path: Path, resume: str | bool = False, **sections) -> CheckpointManager:
    return CheckpointManager(load_config({"resume_from_checkpoint": resume, "checkpoint_config": {
        "output_dir": str(tmp_path / "ckpt"), **sections}}), quiet=True)


def test_the_manager_has_its_calls_its_values_and_five_views(tmp_path: Path) -> None:
    public = {n for n in dir(CheckpointManager) if not n.startswith("_")
              and not isinstance(inspect.getattr_static(CheckpointManager, n), moved) and n not in DEPRECATED_CALLS}
    with _manager(tmp_path) as m:
        public |= {n for n in vars(m) if not n.startswith("_")}
        assert public == MANAGER_CALLS | MANAGER_VALUES | MANAGER_VIEWS
        assert m.backup is None and m.local is None  # neither configured
        assert m.stats.last is None and m.resumed.path is None and m.resumed.trainer_state == {}
        assert not m.preemption.requested and not m.preemption.committed


def test_every_moved_manager_name_warns_and_reads_its_new_home(tmp_path: Path) -> None:
    """Each old name gives what ``manager.<new>`` gives, on a manager with a backup and a local
    tier that saved and resumed; the old setter of the backup storage sets the new one."""
    sections = {"backup": {"output_dir": str(tmp_path / "backup")}}
    with _manager(tmp_path, **sections) as m:
        m.save(1, tiny_state())
        m.wait()
    with _manager(tmp_path, resume="latest", **sections) as m:
        assert m.resume(tiny_state()) == 1
        names = {n: v.new for n, v in vars(CheckpointManager).items() if isinstance(v, moved)}
        assert {"last_save", "trainer_state", "resumed_from", "backup_storage", "local_tier_bytes", "root"} <= set(names)
        for old, new in names.items():
            with pytest.warns(RollCkptDeprecationWarning, match=rf"CheckpointManager\.{old} is deprecated"):
                got = getattr(m, old)
            want = m
            for part in new.split("."):
                want = None if want is None else getattr(want, part)
            if new.startswith("local."):  # no local tier here: the old names' values without one
                want = 0 if old in ("local_tier_bytes", "local_failed_saves") else None
            assert got == want or (callable(got) and got.__func__ is want.__func__), (old, new, got, want)
        m.save(2, tiny_state())
        replica = m.backup.storage
        with pytest.warns(RollCkptDeprecationWarning, match="backup_storage"):
            m.backup_storage = replica
        with pytest.warns(RollCkptDeprecationWarning, match=r"wait_for_backup is deprecated: use manager\.backup\.wait"):
            status = m.wait_for_backup(timeout=30)
        assert status is m.backup.status or status == m.backup.status
        assert 2 in [c.step for c in status.committed]
        with pytest.warns(RollCkptDeprecationWarning, match=r"request_preemption is deprecated: use manager\.preemption\.request"):
            m.request_preemption()
        assert m.preemption.requested


def test_a_moved_setter_says_when_its_home_is_not_configured(tmp_path: Path) -> None:
    from roll_ckpt import RollCkptError

    with _manager(tmp_path) as m:
        with pytest.warns(RollCkptDeprecationWarning), pytest.raises(RollCkptError, match="checkpoint_config.backup"):
            m.backup_storage = m.storage
        with pytest.warns(RollCkptDeprecationWarning):
            assert m.wait_for_backup() is None  # without a backup: waits for the save in flight, as before


def test_a_strategy_of_the_old_protocol_still_saves_and_resumes_with_a_warning(tmp_path: Path) -> None:
    """A strategy that does not subclass ``roll_ckpt.plugin.Strategy`` (written against the
    protocol it replaced, without the optional members) is used with a deprecation warning and
    the defaults it lacks; the deprecated ``StrategyDefaults`` / ``strategy_member`` still resolve."""
    import roll_ckpt.plugin as api
    from roll_ckpt import DriverState
    from roll_ckpt.format.driver_state import JSONIO, JSONStrategy, holds_driver_state
    from roll_ckpt.plugin import StrategyRecord, hookimpl
    from roll_ckpt.plugins import Plugins

    class OldStrategy:  # every member the protocol required, none of its optional ones, no base class
        name, data_dir, rank, world_size, is_coordinator = "old", "state", 0, 1, True

        def __init__(self, config):
            self._inner = JSONIO(JSONStrategy(config))  # (the old JSONStrategy's write and load are its I/O's now)

        def broadcast(self, obj):
            return obj

        def any_true(self, flag, step=None):
            return flag

        def state_dict(self, state):
            return self._inner.strategy.state_dict(state)

        def estimate(self, sd, user=None):
            return self._inner.estimate(sd, user)

        def write(self, sd, storage, path, on_bytes=None, **kw):
            return self._inner.write(sd, storage, path, on_bytes, **kw)

        def load(self, state, storage, path, on_bytes=None, **kw):
            return self._inner.load(state, storage, path, on_bytes, **kw)

        def close(self):
            pass

    class Plugin:
        @hookimpl
        def roll_ckpt_strategies(self):
            return [StrategyRecord(name="old", factory=lambda config, plugins: OldStrategy(config),
                                   applies=holds_driver_state, priority=50, description="the old protocol")]

    plugins = Plugins()
    plugins.register(Plugin(), name="old", distribution="roll-ckpt-old")
    cfg = load_config({"resume_from_checkpoint": "latest", "checkpoint_config": {"output_dir": str(tmp_path)},
                       "strategy_config": {"strategy_name": "old"}}, plugins=plugins)
    with CheckpointManager(cfg, plugins=plugins, quiet=True) as m:
        with pytest.warns(RollCkptDeprecationWarning, match="strategy 'old' .*does not subclass"):
            m.save(3, {"driver": DriverState({"step": 3})})
        assert isinstance(m.strategy, OldStrategy) and m.io.increments is None  # its writes go through OwnIO
        assert m.strategy.collective_timeout_s == 0.0
    with CheckpointManager(cfg, plugins=plugins, quiet=True) as m, pytest.warns(RollCkptDeprecationWarning):
        state = {"driver": DriverState({"step": 0})}
        assert m.resume(state) == 3 and dict(state["driver"]) == {"step": 3}
    with pytest.warns(RollCkptDeprecationWarning, match="StrategyDefaults is deprecated"):
        defaults = api.StrategyDefaults

    class Gathered:  # a strategy's own members, from another base than the defaults
        def broadcast(self, obj):
            return ("rank 0's", obj)

    class Mixed(defaults, Gathered):
        pass

    assert Mixed().broadcast(1) == ("rank 0's", 1)  # the old defaults held three members only
    assert Mixed().collective_timeout_s == 0.0 and Mixed().increments is None
    assert not isinstance(Mixed(), api.Strategy)  # adapted, with the warning, as any old strategy
    with pytest.warns(RollCkptDeprecationWarning, match="strategy_member is deprecated"):
        member = api.strategy_member
    assert member(OldStrategy(cfg), "collective_timeout_s") == 0.0


def test_a_strategy_may_set_is_coordinator_and_must_name_itself() -> None:
    from roll_ckpt.plugin import Strategy

    class Mine(Strategy):
        name, data_dir = "mine", "mine"

        def __init__(self, rank: int) -> None:
            self.rank = rank
            self.is_coordinator = rank == 1  # its own choice of coordinator

    assert Mine(1).is_coordinator and not Mine(0).is_coordinator

    class Plain(Strategy):
        name, data_dir = "plain", "plain"

    assert Plain().is_coordinator  # rank 0 of one process

    class Unnamed(Strategy):
        pass

    with pytest.raises(AttributeError):
        Unnamed().data_dir  # no default that would write a folder named ""


def test_moved_names_are_read_only_but_the_backup_storage_and_say_where_to_go(tmp_path: Path) -> None:
    from roll_ckpt import RollCkptError

    with _manager(tmp_path) as m:
        with pytest.raises(AttributeError, match="root cannot be set"):
            m.root = str(tmp_path / "elsewhere")  # (it moved the storage's root)
        assert m.storage.root == str(tmp_path / "ckpt")
        with pytest.warns(RollCkptDeprecationWarning, match=r"use manager\.strategy\.is_coordinator"):
            assert m.is_coordinator
        with pytest.raises(RollCkptError, match="step must be an integer"):
            m.save(-1, tiny_state())
        with pytest.raises(RollCkptError, match="the strategy is chosen from the state"):
            m.strategy  # the bad step was refused before a strategy was chosen


def test_a_strategy_that_writes_its_own_files_works_through_its_io_with_a_warning(tmp_path: Path) -> None:
    """A ``Strategy`` subclass of the contract before ``StrategyIO`` (its own ``write``/``load``/
    ``estimate``, no ``io_class``) saves and resumes through an I/O that forwards to it, with a
    deprecation warning; one with an ``io_class`` that also defines ``load`` is refused, as
    core would not call it; one with neither is refused with what to set."""
    from roll_ckpt import DriverState, RollCkptError
    from roll_ckpt.format.driver_state import JSONIO, JSONStrategy, holds_driver_state
    from roll_ckpt.plugin import Strategy, StrategyRecord, hookimpl
    from roll_ckpt.plugins import Plugins
    from roll_ckpt.tiers.run import OwnIO

    calls = []

    class Writes(Strategy):  # the old contract: the strategy does its own I/O
        name, data_dir = "writes", "state"

        def __init__(self, config):
            self._io = JSONIO(JSONStrategy(config))

        def state_dict(self, state):
            return self._io.strategy.state_dict(state)

        def estimate(self, sd, user=None):
            return self._io.estimate(sd, user)

        def write(self, sd, storage, path, on_bytes=None, **kw):
            calls.append("write")
            return self._io.write(sd, storage, path, on_bytes, **kw)

        def load(self, state, storage, path, on_bytes=None, **kw):
            calls.append("load")
            return self._io.load(state, storage, path, on_bytes, **kw)

    class Overrides(JSONStrategy):  # has an io_class, and a load core would not call
        name = "overrides"

        def load(self, *args, **kwargs):
            raise AssertionError("never called")

    class Neither(Strategy):
        name, data_dir = "neither", "state"

    made = {"writes": Writes, "overrides": Overrides, "neither": Neither}

    class Plugin:
        @hookimpl
        def roll_ckpt_strategies(self):
            return [StrategyRecord(name=n, factory=lambda config, plugins, c=c: c(config) if c is not Neither else c(),
                                   applies=holds_driver_state, priority=-1) for n, c in made.items()]

    plugins = Plugins()
    plugins.register(Plugin(), name="mine", distribution="roll-ckpt-mine")

    def manager(name):
        cfg = load_config({"resume_from_checkpoint": "latest", "checkpoint_config": {"output_dir": str(tmp_path / name)},
                           "strategy_config": {"strategy_name": name}}, plugins=plugins)
        return CheckpointManager(cfg, plugins=plugins, quiet=True)

    with manager("writes") as m, pytest.warns(RollCkptDeprecationWarning, match="writes and loads its files itself"):
        m.save(3, {"driver": DriverState({"step": 3})})
        assert isinstance(m.io, OwnIO)
    with manager("writes") as m, pytest.warns(RollCkptDeprecationWarning):
        state = {"driver": DriverState({"step": 0})}
        assert m.resume(state) == 3 and dict(state["driver"]) == {"step": 3}
    assert calls == ["write", "load"]
    for name, match in (("overrides", r"defines load\(\), which roll-ckpt no longer calls"),
                        ("neither", "has no io_class")):
        with manager(name) as m, pytest.raises(RollCkptError, match=match):
            m.save(1, {"driver": DriverState({"step": 1})})
