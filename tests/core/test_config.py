"""Config loading: interpolation, validation, clear errors, ROLL-compatible keys."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from roll_ckpt import ConfigError, load_config


def _yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_guide_example_loads(tmp_path: Path) -> None:
    cfg = load_config(_yaml(tmp_path, """
        exp_name: "qwen2.5-7B-rlvr-config"
        seed: 42
        logging_dir: ./output/logs
        output_dir: ./output
        checkpoint_config:
          type: file_system
          output_dir: /data/cpfs_0/rl_examples/models/${exp_name}
        resume_from_checkpoint: false
        max_steps: 500
        save_steps: 100
        logging_steps: 1
        eval_steps: 10
    """))
    assert cfg.checkpoint_config.type == "file_system"
    assert cfg.checkpoint_config.output_dir == "/data/cpfs_0/rl_examples/models/qwen2.5-7B-rlvr-config"
    assert cfg.checkpoint_config.timestamp_subdir is True
    assert cfg.checkpoint_config.max_ckpt_to_keep == 0
    assert (cfg.max_steps, cfg.save_steps, cfg.seed) == (500, 100, 42)
    assert cfg.resume_from_checkpoint is False and cfg.resume_target is None
    assert cfg.strategy_config.async_save_ckpt is False
    assert cfg.offload_backend == "local"
    # keys roll-ckpt does not own are kept, untouched
    assert cfg.extra == {"logging_dir": "./output/logs", "logging_steps": 1, "eval_steps": 10}


def test_interpolation_forms(monkeypatch) -> None:
    monkeypatch.setenv("RC_TEST_ROOT", "/mnt/ckpt")
    monkeypatch.delenv("RC_TEST_UNSET", raising=False)
    cfg = load_config({
        "exp_name": "exp",
        "max_steps": 300,
        "save_steps": "${max_steps}",                          # lone reference keeps the int type
        "checkpoint_config": {"type": "file_system",
                              "output_dir": "${env:RC_TEST_ROOT}/${exp_name}/s${max_steps}"},
        "copy_of_type": "${checkpoint_config.type}",          # dotted key
        "where": "${env:RC_TEST_UNSET,/tmp/default}",          # env with default
        "nested": {"inner": {"value": 7}},
        "deep": "${nested.inner.value}",
        "in_list": ["${exp_name}-a", "${nested.inner}"],
        "strategy_config": {"async_save_ckpt": True, "engine_option": "${exp_name}"},
    })
    assert cfg.save_steps == 300 and isinstance(cfg.save_steps, int)
    assert cfg.checkpoint_config.output_dir == "/mnt/ckpt/exp/s300"
    assert cfg.extra["copy_of_type"] == "file_system"
    assert cfg.extra["where"] == "/tmp/default"
    assert cfg.extra["deep"] == 7
    assert cfg.extra["in_list"] == ["exp-a", {"value": 7}]
    assert cfg.strategy_config.async_save_ckpt is True
    assert cfg.strategy_config.extra == {"engine_option": "exp"}


def test_env_set_wins_over_default(monkeypatch) -> None:
    monkeypatch.setenv("RC_TEST_ROOT", "/from/env")
    cfg = load_config({"checkpoint_config": {"output_dir": "${env:RC_TEST_ROOT,/fallback}"}})
    assert cfg.checkpoint_config.output_dir == "/from/env"


def test_missing_env_var_names_key_and_variable(monkeypatch) -> None:
    monkeypatch.delenv("RC_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config({"checkpoint_config": {"output_dir": "${env:RC_TEST_UNSET}/x"}})
    msg = str(info.value)
    assert info.value.key == "checkpoint_config.output_dir"
    assert "RC_TEST_UNSET" in msg and "${env:VAR,default}" in msg


def test_unknown_reference_names_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"output_dir": "/x/${exp_nam}"})
    assert info.value.key == "output_dir"
    assert "${exp_nam}" in str(info.value)


@pytest.mark.parametrize("raw", [
    {"a": "${a}"},
    {"a": "${b}", "b": "x-${a}"},
    {"a": "${b.c}", "b": {"c": "${a}"}},
])
def test_self_reference_cycles(raw) -> None:
    with pytest.raises(ConfigError, match="refers to itself"):
        load_config(raw)


def test_default_checkpoint_dir_follows_output_dir_and_exp_name() -> None:
    cfg = load_config({"exp_name": "e1", "output_dir": "/o/"})
    assert cfg.checkpoint_config.output_dir == "/o/checkpoints/e1"


@pytest.mark.parametrize("value,expected,target", [
    (False, False, None), (None, False, None), ("false", False, None),
    (True, True, "latest"), ("latest", "latest", "latest"), ("true", True, "latest"),
    ("/data/x/checkpoint-300", "/data/x/checkpoint-300", "/data/x/checkpoint-300"),
    ("s3://b/run/checkpoint-5", "s3://b/run/checkpoint-5", "s3://b/run/checkpoint-5"),
])
def test_resume_from_checkpoint_values(value, expected, target) -> None:
    cfg = load_config({"resume_from_checkpoint": value})
    assert cfg.resume_from_checkpoint == expected
    assert cfg.resume_target == target


# ------------------------------------------------------------------------- file errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(info.value) and "does not exist" in str(info.value)


def test_unreadable_file(tmp_path: Path) -> None:
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"dir\.yaml cannot be read"):
        load_config(tmp_path / "dir.yaml")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"exp_name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1\.yaml cannot be read"):
        load_config(bad)


def test_invalid_yaml(tmp_path: Path) -> None:
    p = _yaml(tmp_path, "checkpoint_config:\n  type: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    msg = str(info.value)
    assert "run.yaml" in msg and "not valid YAML" in msg and "\n" not in msg


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"must hold a mapping at top level.*list"):
        load_config(_yaml(tmp_path, "- a\n- b\n"))


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    cfg = load_config(_yaml(tmp_path, ""))
    assert cfg.checkpoint_config.type == "file_system" and cfg.save_steps == 0


def test_source_of_wrong_kind() -> None:
    with pytest.raises(ConfigError, match="path to a YAML file or a mapping"):
        load_config(42)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- value errors


@pytest.mark.parametrize("raw,key,fragment", [
    ({"save_steps": -1}, "save_steps", "must not be negative"),
    ({"save_steps": "ten"}, "save_steps", "wrong type"),
    ({"save_steps": True}, "save_steps", "wrong type"),
    ({"max_steps": 1.5}, "max_steps", "wrong type"),
    ({"seed": "x"}, "seed", "wrong type"),
    ({"output_dir": ""}, "output_dir", "must not be empty"),
    ({"checkpoint_config": {"max_ckpt_to_keep": -2}}, "checkpoint_config.max_ckpt_to_keep", "must not be negative"),
    ({"checkpoint_config": {"timestamp_subdir": "yes"}}, "checkpoint_config.timestamp_subdir", "wrong type"),
    ({"checkpoint_config": {"type": 3}}, "checkpoint_config.type", "wrong type"),
    ({"checkpoint_config": {"storage_options": [1]}}, "checkpoint_config.storage_options", "wrong type"),
    ({"checkpoint_config": "fs"}, "checkpoint_config", "wrong type"),
    ({"strategy_config": {"async_save_ckpt": "yes"}}, "strategy_config.async_save_ckpt", "wrong type"),
    ({"checkpoint_config": {"components": ["a", "a"]}}, "checkpoint_config.components", "twice"),
    ({"checkpoint_config": {"components": ["../x"]}}, "checkpoint_config.components", "not a plain folder"),
    ({"checkpoint_config": {"backup": {"type": "file_system"}}}, "checkpoint_config.backup.output_dir", "required"),
])
def test_bad_values_name_key_value_and_allowed(raw, key, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert info.value.key == key
    msg = str(info.value)
    assert msg.startswith(f"config key '{key}'") and fragment in msg


def test_wrong_type_message_shows_value_and_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"save_steps": -5})
    assert str(info.value) == "config key 'save_steps': must not be negative (got -5); allowed: an integer >= 0"


def test_unknown_checkpoint_key_with_did_you_mean() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"checkpoint_config": {"type": "file_system", "max_ckpt_to_kep": 3}})
    msg = str(info.value)
    assert info.value.key == "checkpoint_config.max_ckpt_to_kep"
    assert "unknown key" in msg and "did you mean 'max_ckpt_to_keep'?" in msg
    assert "output_dir" in msg  # lists the known keys


def test_unknown_backup_key() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint_config\.backup\.keeplocal.*did you mean 'keep_local'"):
        load_config({"checkpoint_config": {"backup": {"output_dir": "/b", "keeplocal": 1}}})


def test_bad_offload_backend() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"offload_backend": "gpu"})
    msg = str(info.value)
    assert info.value.key == "offload_backend" and "'gpu'" in msg and "local, local_dedup" in msg


@pytest.mark.parametrize("value", [5, 1.0, ["a"], {"path": "x"}, "  "])
def test_bad_resume_from_checkpoint(value) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"resume_from_checkpoint": value})
    assert info.value.key == "resume_from_checkpoint"
    assert '"latest"' in str(info.value)


def test_backup_and_components_parse() -> None:
    cfg = load_config({"checkpoint_config": {
        "backup": {"output_dir": "memory://bk", "keep_local": 2},
        "components": ["actor_train", "critic"], "storage_options": {"anon": True}}})
    cc = cfg.checkpoint_config
    assert cc.backup is not None and cc.backup.output_dir == "memory://bk" and cc.backup.keep_local == 2
    assert cc.components == ("actor_train", "critic")
    assert cc.storage_options == {"anon": True}


def test_config_is_frozen() -> None:
    cfg = load_config({})
    with pytest.raises(Exception):
        cfg.save_steps = 3  # type: ignore[misc]


def test_initial_load_parses_with_its_defaults() -> None:
    from roll_ckpt.config import InitialLoadConfig

    cc = load_config({"checkpoint_config": {"initial_load": {"path": "file:///models/base", "format": "hf"}}})
    assert cc.checkpoint_config.initial_load == InitialLoadConfig(path="/models/base", format="hf", key="model")
    assert load_config({}).checkpoint_config.initial_load is None


@pytest.mark.parametrize("value,key,fragment", [
    ({"format": "hf"}, "initial_load.path", "is required"),
    ({"path": "/m"}, "initial_load.format", "is required; allowed: hf"),
    ({"path": "/m", "format": "dcp"}, "initial_load.format", "(got 'dcp'); allowed: hf"),
    ({"path": "s3://bucket/m", "format": "hf"}, "initial_load.path", "must be a local folder"),
    ({"path": "/m", "format": "hf", "keys": "model"}, "initial_load.keys", "did you mean 'key'?"),
    ({"path": "/m", "format": "hf", "key": ""}, "initial_load.key", "must not be empty"),
    ("/m", "initial_load", "a mapping with path, format (hf)"),
])
def test_bad_initial_load_names_the_key(value, key, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"checkpoint_config": {"initial_load": value}})
    assert f"'checkpoint_config.{key}'" in str(info.value) and fragment in str(info.value), str(info.value)
