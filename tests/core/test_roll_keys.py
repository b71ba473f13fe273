"""ROLL's own checkpoint keys: each accepted with a defined meaning, conflicts named, keys
without effect logged in one line; a worker section's strategy_config for its component."""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from roll_ckpt import CheckpointManager, ConfigError, load_config
from roll_ckpt.testing.state import tiny_state

BACKUP = {"output_dir": "memory://roll-keys-backup"}


def _no_effect_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]


# --------------------------------------------------------------------------- max_ckpt_to_keep


@pytest.mark.parametrize("raw,keep", [
    ({"max_ckpt_to_keep": 2}, 2),                                                        # ROLL's place
    ({"checkpoint_config": {"max_ckpt_to_keep": 3}}, 3),                                 # roll-ckpt's
    ({"max_ckpt_to_keep": 4, "checkpoint_config": {"max_ckpt_to_keep": 4}}, 4),          # both, alike
    ({"max_ckpt_to_keep": None, "checkpoint_config": {"max_ckpt_to_keep": 1}}, 1),
    ({}, 0),
])
def test_max_ckpt_to_keep_at_either_place(raw, keep) -> None:
    cfg = load_config(raw)
    assert cfg.checkpoint_config.max_ckpt_to_keep == keep
    assert "max_ckpt_to_keep" not in cfg.extra


def test_max_ckpt_to_keep_set_twice_differently_names_both_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"max_ckpt_to_keep": 2, "checkpoint_config": {"max_ckpt_to_keep": 5}})
    msg = str(info.value)
    assert info.value.key == "max_ckpt_to_keep"
    assert "max_ckpt_to_keep: 2" in msg and "checkpoint_config.max_ckpt_to_keep: 5" in msg


@pytest.mark.parametrize("value", [-1, "2", True, 1.5])
def test_bad_top_level_max_ckpt_to_keep_is_named(value) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"max_ckpt_to_keep": value})
    assert info.value.key == "max_ckpt_to_keep"


# --------------------------------------------------------------------------- async_upload


def test_async_upload_true_makes_saves_asynchronous(caplog, tmp_path) -> None:
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path), "async_upload": True},
                       "strategy_config": {"async_save_ckpt": False}})
    assert cfg.async_save is True
    assert cfg.strategy_config.async_save_ckpt is False        # as written
    assert not _no_effect_lines(caplog)
    manager = CheckpointManager(cfg, quiet=True)
    try:
        manager.save(1, tiny_state())
        assert manager.wait().is_async
        manager.save(2, tiny_state(), final=True)              # final saves stay synchronous
        assert not manager.stats.last.is_async
    finally:
        manager.close()


def test_async_upload_false_has_no_effect_and_says_so_once(caplog) -> None:
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    cfg = load_config({"checkpoint_config": {"async_upload": False}, "strategy_config": {"async_save_ckpt": True}})
    assert cfg.async_save is True
    lines = _no_effect_lines(caplog)
    assert len(lines) == 1 and "checkpoint_config.async_upload: false" in lines[0]
    assert "strategy_config.async_save_ckpt" in lines[0]


def test_async_upload_must_be_a_bool() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"checkpoint_config": {"async_upload": "yes"}})
    assert info.value.key == "checkpoint_config.async_upload" and "true or false" in str(info.value)


# --------------------------------------------------------------------------- keep_local_file


@pytest.mark.parametrize("keep_local_file,keep_local", [(False, 1), (True, 0)])
def test_keep_local_file_with_a_backup_is_backup_keep_local(caplog, keep_local_file, keep_local) -> None:
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    cfg = load_config({"checkpoint_config": {"backup": BACKUP, "keep_local_file": keep_local_file}})
    assert cfg.checkpoint_config.backup.keep_local == keep_local
    assert cfg.checkpoint_config.keep_local_file is keep_local_file
    assert not _no_effect_lines(caplog)


def test_keep_local_file_agreeing_with_keep_local_is_accepted() -> None:
    cfg = load_config({"checkpoint_config": {"backup": {**BACKUP, "keep_local": 1}, "keep_local_file": False}})
    assert cfg.checkpoint_config.backup.keep_local == 1


@pytest.mark.parametrize("keep_local_file,keep_local", [(False, 3), (False, 0), (True, 2)])
def test_keep_local_file_against_keep_local_names_both_keys(keep_local_file, keep_local) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"checkpoint_config": {"backup": {**BACKUP, "keep_local": keep_local},
                                           "keep_local_file": keep_local_file}})
    msg = str(info.value)
    assert info.value.key == "checkpoint_config.keep_local_file"
    assert f"checkpoint_config.backup.keep_local is {keep_local}" in msg


@pytest.mark.parametrize("value", [False, True])
def test_keep_local_file_without_a_backup_has_no_effect_and_says_so_once(caplog, value) -> None:
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    cfg = load_config({"checkpoint_config": {"keep_local_file": value}})
    assert cfg.checkpoint_config.backup is None and cfg.checkpoint_config.keep_local_file is value
    lines = _no_effect_lines(caplog)
    assert len(lines) == 1 and f"checkpoint_config.keep_local_file: {str(value).lower()}" in lines[0]


def test_keys_of_roll_that_take_effect_log_nothing(caplog) -> None:
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    load_config({"max_ckpt_to_keep": 2, "save_steps": 5, "max_steps": 10, "resume_from_checkpoint": True,
                 "checkpoint_config": {"async_upload": True, "keep_local_file": False, "backup": BACKUP}})
    assert not _no_effect_lines(caplog)


def test_unknown_checkpoint_keys_are_still_errors() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint_config\.async_uplod.*did you mean 'async_upload'"):
        load_config({"checkpoint_config": {"async_uplod": True}})


# --------------------------------------------------------------------------- Hydra


def test_a_defaults_list_asks_for_a_composed_config() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"defaults": ["../config/traj_envs@_here_"], "exp_name": "x"})
    msg = str(info.value)
    assert info.value.key == "defaults" and "Hydra" in msg and "compose" in msg and "DictConfig" in msg


def test_a_dictconfig_is_taken_as_hydra_gives_it() -> None:
    conf = OmegaConf.create({"exp_name": "e", "response_length": 64, "max_ckpt_to_keep": 2,
                             "actor_infer": {"generating_args": {"max_new_tokens": "${response_length}"}},
                             "checkpoint_config": {"output_dir": "/ckpt/${exp_name}"}})
    cfg = load_config(conf)
    assert cfg.checkpoint_config.output_dir == "/ckpt/e" and cfg.checkpoint_config.max_ckpt_to_keep == 2
    assert cfg.extra["actor_infer"] == {"generating_args": {"max_new_tokens": 64}}
    assert type(cfg.extra["actor_infer"]) is dict


# --------------------------------------------------------------------------- per-worker strategy config


def _worker(strategy_config) -> dict:
    return {"strategy_args": {"strategy_name": "fsdp2_train", "strategy_config": strategy_config},
            "device_mapping": "list(range(0,2))"}


def test_a_worker_strategy_config_wins_for_its_component() -> None:
    cfg = load_config({
        "strategy_config": {"async_save_ckpt": True},
        "offload_backend": "local",
        "actor_train": _worker({"fsdp_size": 2, "async_save_ckpt": False, "offload_backend": "local_dedup"}),
        "critic": _worker({"fsdp_size": 1}),
        "reference": _worker(None),                               # ROLL writes strategy_config: ~
    }, defaults="roll-ckpt")                                      # (ROLL's would make async_upload true)
    actor = cfg.for_component("actor_train")
    assert (actor.async_save, actor.offload_backend) == (False, "local_dedup")
    assert actor.strategy_config.strategy_name is None          # ROLL's strategy_name is not ours
    assert actor.extra == cfg.extra and actor.checkpoint_config == cfg.checkpoint_config
    for name in ("critic", "reference", "pipeline"):              # nothing of their own: the top level
        other = cfg.for_component(name)
        assert (other.async_save, other.offload_backend) == (True, "local"), name
    assert cfg.async_save is True and cfg.offload_backend == "local"  # the config itself is unchanged


@pytest.mark.parametrize("section,key", [
    (_worker({"async_save_ckpt": "yes"}), "actor_train.strategy_args.strategy_config.async_save_ckpt"),
    (_worker({"offload_backend": "gpu"}), "actor_train.strategy_args.strategy_config.offload_backend"),
    (_worker([1, 2]), "actor_train.strategy_args.strategy_config"),
    ({"strategy_args": "fsdp2_train"}, "actor_train.strategy_args"),
    (5, "actor_train"),
])
def test_a_bad_worker_value_names_its_key(section, key) -> None:
    cfg = load_config({"actor_train": section})
    with pytest.raises(ConfigError) as info:
        cfg.for_component("actor_train")
    assert info.value.key == key and str(info.value).startswith(f"config key '{key}'")


def test_a_manager_for_a_component_reads_its_worker_section(tmp_path) -> None:
    cfg = load_config({
        "checkpoint_config": {"output_dir": str(tmp_path), "components": ["actor_train", "pipeline"],
                              "run_name": "20250101-000000"},
        "actor_train": _worker({"async_save_ckpt": True}),
    }, defaults="roll-ckpt")                                      # (ROLL's would make every part async)
    actor = CheckpointManager(cfg, component="actor_train", quiet=True)
    pipeline = CheckpointManager(cfg, component="pipeline", quiet=True)
    try:
        assert actor.config.async_save and not pipeline.config.async_save
        actor.save(1, tiny_state())
        assert actor.wait().is_async
        pipeline.save(1, {"counter": {"seen": 1}})
        assert not pipeline.stats.last.is_async
    finally:
        actor.close()
        pipeline.close()
