"""Plugin discovery, selection, environment switches, broken and conflicting plugins.

Tests that look for a third-party plugin ask for the ``example_backend`` fixture: the
test-fixture backend ``example_dir`` is installed while they run (tests/conftest.py).
"""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest

from roll_ckpt import CheckpointManager, load_config
from roll_ckpt.plugin import BackendRecord, hookimpl
from roll_ckpt.errors import PluginError, UnknownPluginError
from roll_ckpt.plugins import KNOWN_EXTRAS, Plugins


def _cfg(tmp_path, type_):
    return load_config({"checkpoint_config": {"type": type_, "output_dir": str(tmp_path / "c")}})


def test_installed_plugins_are_found_through_entry_points(example_backend) -> None:
    p = Plugins()
    backends = p.backends()
    assert {"file_system", "example_dir"} <= set(backends)
    assert backends["file_system"].distribution == "roll-ckpt-fs"
    assert backends["example_dir"].distribution == "roll-ckpt-example-backend"
    strategies = p.strategies()
    assert strategies["dcp"].distribution == "roll-ckpt-core"
    assert "regular" in p.staging_policies()
    assert p.broken == []


def test_unknown_type_names_installed_suggests_and_says_what_to_install(tmp_path, example_backend) -> None:
    with pytest.raises(UnknownPluginError) as info:
        CheckpointManager.from_config(_cfg(tmp_path, "file_sytem"))
    msg = str(info.value)
    assert "checkpoint_config.type" in msg and "'file_sytem'" in msg
    assert "installed: example_dir, file_system" in msg
    assert "did you mean 'file_system'?" in msg
    assert 'pip install "roll-ckpt[fs]"' in msg
    assert isinstance(info.value, LookupError)


def test_missing_known_backend_says_which_extra(monkeypatch, tmp_path, example_backend) -> None:
    monkeypatch.setenv("ROLL_CKPT_BLOCKED_PLUGINS", "file_system")
    p = Plugins()
    assert "file_system" not in p.backends()
    with pytest.raises(UnknownPluginError) as info:
        p.backend("file_system")
    assert f"install it with: {KNOWN_EXTRAS['file_system']}" in str(info.value)
    assert "installed: example_dir" in str(info.value)


def test_unknown_strategy_name(tmp_path) -> None:
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path)},
                       "strategy_config": {"strategy_name": "fsdp3"}})
    m = CheckpointManager.from_config(cfg, quiet=True)
    with pytest.raises(UnknownPluginError, match=r"strategy_config.strategy_name.*did you mean 'fsdp2'"):
        m.bind({"x": 1})


def test_disable_autoload_keeps_only_core(monkeypatch) -> None:
    monkeypatch.setenv("ROLL_CKPT_DISABLE_PLUGIN_AUTOLOAD", "1")
    p = Plugins()
    assert p.backends() == {}
    assert set(p.strategies()) == {"dcp", "json"}
    assert p.distributions() == ["roll-ckpt-core"]


def test_disable_autoload_with_explicit_list(monkeypatch) -> None:
    monkeypatch.setenv("ROLL_CKPT_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("ROLL_CKPT_PLUGINS", "file_system")
    p = Plugins()
    assert set(p.backends()) == {"file_system"}
    assert set(p.strategies()) == {"dcp", "json"}


@pytest.mark.parametrize("blocked", ["example_dir", "roll-ckpt-example-backend"])
def test_blocked_plugins(monkeypatch, blocked, example_backend) -> None:
    monkeypatch.setenv("ROLL_CKPT_BLOCKED_PLUGINS", blocked)
    p = Plugins()
    assert set(p.backends()) == {"file_system"}


def test_environment_switches_in_a_fresh_process(py, example_backend) -> None:
    code = "from roll_ckpt.plugins import get_plugins; print(sorted(get_plugins().backends()))"
    assert py(code).stdout.strip() == "['example_dir', 'file_system']"
    assert py(code, env={"ROLL_CKPT_DISABLE_PLUGIN_AUTOLOAD": "1"}).stdout.strip() == "[]"
    assert py(code, env={"ROLL_CKPT_DISABLE_PLUGIN_AUTOLOAD": "1",
                         "ROLL_CKPT_PLUGINS": "file_system"}).stdout.strip() == "['file_system']"
    assert py(code, env={"ROLL_CKPT_BLOCKED_PLUGINS": "example_dir"}).stdout.strip() == "['file_system']"


class _RaisingPlugin:
    @hookimpl
    def roll_ckpt_backends(self):
        raise RuntimeError("kaboom while registering")


class _WrongRecordPlugin:
    @hookimpl
    def roll_ckpt_backends(self):
        return ["not a record"]


def test_plugin_whose_hook_raises_is_reported_and_others_still_list(example_backend) -> None:
    p = Plugins()
    p.register(_RaisingPlugin(), name="raiser", distribution="roll-ckpt-raiser")
    p.register(_WrongRecordPlugin(), name="wrong", distribution="roll-ckpt-wrong")
    backends = p.backends()
    assert {"file_system", "example_dir"} <= set(backends)
    broken = {b.name: b for b in p.broken}
    assert broken["raiser"].distribution == "roll-ckpt-raiser"
    assert "RuntimeError: kaboom while registering" in broken["raiser"].error
    assert broken["wrong"].distribution == "roll-ckpt-wrong"
    assert "not BackendRecord" in broken["wrong"].error


class _FakeEntryPoint:
    group = "roll_ckpt"

    def __init__(self, name: str, dist: str, error: Exception) -> None:
        self.name = name
        self.value = f"{name}_pkg.plugin"
        self.dist = SimpleNamespace(name=dist)
        self._error = error

    def load(self):
        raise self._error


def test_broken_entry_point_is_reported_with_its_distribution(monkeypatch, tmp_path, example_backend) -> None:
    from importlib import metadata

    real = metadata.entry_points

    def fake(**kw):
        eps = list(real(**kw))
        if kw.get("group") == "roll_ckpt":
            eps.append(_FakeEntryPoint("s3_turbo", "roll-ckpt-s3-turbo",
                                       ModuleNotFoundError("No module named 'turbo_sdk'")))
        return eps

    monkeypatch.setattr(metadata, "entry_points", fake)
    p = Plugins()
    assert [(b.name, b.distribution) for b in p.broken] == [("s3_turbo", "roll-ckpt-s3-turbo")]
    assert "turbo_sdk" in p.broken[0].error
    # unrelated backends still work
    assert {"file_system", "example_dir"} <= set(p.backends())
    m = CheckpointManager(_cfg(tmp_path, "file_system"), plugins=p, quiet=True)
    assert m.storage.root == str(tmp_path / "c")
    # asking for the broken one says why it is missing
    with pytest.raises(UnknownPluginError) as info:
        p.backend("s3_turbo")
    msg = str(info.value)
    assert "roll-ckpt-s3-turbo failed to load" in msg and "turbo_sdk" in msg


def _dup(dist_name: str, backend: str = "dupstore"):
    class _Plugin:
        @hookimpl
        def roll_ckpt_backends(self):
            return [BackendRecord(name=backend, factory=lambda url, opts: None)]

    return _Plugin()


def test_two_plugins_with_the_same_backend_name() -> None:
    p = Plugins()
    p.register(_dup("a"), name="dup_a", distribution="roll-ckpt-dup-a")
    p.register(_dup("b"), name="dup_b", distribution="roll-ckpt-dup-b")
    with pytest.raises(PluginError) as info:
        p.backends()
    msg = str(info.value)
    assert "'dupstore'" in msg
    assert "roll-ckpt-dup-a" in msg and "roll-ckpt-dup-b" in msg
    assert "ROLL_CKPT_BLOCKED_PLUGINS=" in msg


def test_third_party_shadowing_a_builtin_backend_names_both() -> None:
    p = Plugins()
    p.register(_dup("x", backend="file_system"), name="impostor", distribution="roll-ckpt-impostor")
    with pytest.raises(PluginError, match=r"roll-ckpt-fs and roll-ckpt-impostor|roll-ckpt-impostor and roll-ckpt-fs"):
        p.backend("file_system")


def test_import_and_entry_points_do_not_import_torch_distributed(py, example_backend) -> None:
    code = textwrap.dedent("""
        import sys
        import roll_ckpt
        from roll_ckpt.plugins import Plugins
        p = Plugins()
        names = (sorted(p.backends()), sorted(p.strategies()), sorted(p.staging_policies()))
        assert not p.broken, p.broken
        heavy = [m for m in ("torch.distributed", "torch", "numpy", "fsspec", "pytest", "roll_ckpt.testing",
                             "roll_ckpt.manager", "roll_ckpt_fsdp2.strategy") if m in sys.modules]
        print(names)
        print("HEAVY", heavy)
    """)
    res = py(code)
    assert res.returncode == 0, res.stderr
    assert "'file_system'" in res.stdout and "'fsdp2'" in res.stdout and "'dcp'" in res.stdout
    heavy = res.stdout.split("HEAVY", 1)[1].strip()
    assert heavy == "[]", f"importing roll_ckpt and its entry points imported {heavy}"


def test_same_entry_point_name_from_another_distribution_is_not_silently_dropped(monkeypatch, tmp_path) -> None:
    """A third party whose entry point is also called ``file_system`` must not silently win or lose."""
    import sys
    import types
    from importlib import metadata

    module = types.ModuleType("roll_ckpt_test_impostor_plugin")

    @hookimpl
    def roll_ckpt_backends():
        return [BackendRecord(name="file_system", factory=lambda url, opts: None)]

    module.roll_ckpt_backends = roll_ckpt_backends
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class _EP:
        name = "file_system"
        group = "roll_ckpt"
        value = module.__name__
        dist = SimpleNamespace(name="roll-ckpt-impostor")

        def load(self):
            return module

    real = metadata.entry_points

    def fake(**kw):
        eps = list(real(**kw))
        return eps + [_EP()] if kw.get("group") == "roll_ckpt" else eps

    monkeypatch.setattr(metadata, "entry_points", fake)
    p = Plugins()
    assert "roll-ckpt-impostor" in p.distributions()
    with pytest.raises(PluginError) as info:
        p.backend("file_system")
    msg = str(info.value)
    assert "roll-ckpt-fs" in msg and "roll-ckpt-impostor" in msg
    # the hint works: blocking the impostor's distribution resolves the conflict
    blocked = msg.split("ROLL_CKPT_BLOCKED_PLUGINS=", 1)[1].split()[0]
    monkeypatch.setenv("ROLL_CKPT_BLOCKED_PLUGINS", blocked)
    assert blocked == "roll-ckpt-impostor"  # found last, so named in the hint
    assert Plugins().backend("file_system").distribution == "roll-ckpt-fs"


def test_same_distribution_seen_twice_is_loaded_once(monkeypatch, example_backend) -> None:
    from importlib import metadata

    real = metadata.entry_points

    def doubled(**kw):
        eps = list(real(**kw))
        return eps + eps if kw.get("group") == "roll_ckpt" else eps

    monkeypatch.setattr(metadata, "entry_points", doubled)
    p = Plugins()
    assert {"file_system", "example_dir"} <= set(p.backends()) and p.broken == []


def test_the_fixture_backend_is_installed_only_for_the_tests_that_ask_for_it(py) -> None:
    """``make venv`` does not install tests/plugins/example_backend; a test that had it (the
    one above, which also patched discovery) leaves nothing behind, here or in children."""
    from roll_ckpt.plugins import get_plugins

    assert "example_dir" not in Plugins().backends()
    shared = get_plugins()
    assert "example_dir" not in shared.backends() and shared.broken == []
    code = "from roll_ckpt.plugins import get_plugins; print(sorted(get_plugins().backends()))"
    assert py(code).stdout.strip() == "['file_system']"
