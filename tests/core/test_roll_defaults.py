"""ROLL's defaults for a ROLL pipeline config (roll_ckpt/config/roll_defaults.py), roll-ckpt's for
a plain one, and ``roll-ckpt config PATH`` (roll_ckpt/config/report.py): the resolved
settings per worker and where each came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_ckpt import CheckpointManager, ConfigError, load_config

from roll_ckpt.format import layout
from roll_ckpt.cli import main
from roll_ckpt.config.report import config_report
from roll_ckpt.config.roll_defaults import recognize
from roll_ckpt.testing.state import tiny_state

CONFIGS = Path(__file__).resolve().parent / "roll_configs"
FSDP2 = CONFIGS / "rlvr_fsdp2_defaults.yaml"
DEMO = Path(__file__).resolve().parents[2] / "examples" / "rlvr_demo.yaml"

pytestmark = pytest.mark.timeout(120)


def test_recognized_by_its_worker_sections() -> None:
    assert recognize({"actor_train": {"strategy_args": {"strategy_name": "fsdp2_train"}}}) == "roll"
    assert recognize({"critic": {"worker_cls": "roll.pipeline.rlvr.actor_worker.CriticWorker"}}) == "roll"
    assert recognize({"actor_train": {"lr": 1}, "save_steps": 3}) == "roll-ckpt"   # not a ROLL worker
    assert recognize({}, "roll") == "roll"
    with pytest.raises(ConfigError):
        recognize({}, "hydra")


def test_unset_keys_take_rolls_defaults(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(FSDP2)
    assert cfg.defaults == "roll"
    assert (cfg.save_steps, cfg.max_steps) == (50, 500)
    assert cfg.checkpoint_config.async_upload and cfg.async_save
    assert set(cfg.roll_defaults) == {"save_steps", "max_steps", "checkpoint_config.async_upload"}
    actor = cfg.for_component("actor_train")                            # an FSDP2 worker: async_save_ckpt true
    assert actor.strategy_config.async_save_ckpt and not cfg.for_component("actor_infer").strategy_config.async_save_ckpt
    ours = load_config(FSDP2, defaults="roll-ckpt")                     # the same file with roll-ckpt's
    assert (ours.save_steps, ours.max_steps, ours.async_save) == (0, 0, False)
    assert not ours.for_component("actor_train").strategy_config.async_save_ckpt


def test_set_keys_win_and_keep_local_file_only_with_a_backup(tmp_path: Path) -> None:
    worker = {"strategy_args": {"strategy_name": "fsdp2_train", "strategy_config": {"async_save_ckpt": False}}}
    cfg = load_config({"save_steps": 7, "checkpoint_config": {"async_upload": False}, "actor_train": worker})
    assert (cfg.save_steps, cfg.max_steps, cfg.async_save) == (7, 500, False)
    assert not cfg.for_component("actor_train").async_save
    assert cfg.checkpoint_config.keep_local_file is None                # no backup: nothing to keep
    backed = load_config({"actor_train": worker, "checkpoint_config": {
        "output_dir": str(tmp_path / "a"), "backup": {"output_dir": str(tmp_path / "b")}}})
    assert backed.checkpoint_config.keep_local_file is False and backed.checkpoint_config.backup.keep_local == 1


def test_plain_config_keeps_roll_ckpts_defaults() -> None:
    cfg = load_config(DEMO)
    assert cfg.defaults == "roll-ckpt" and not cfg.roll_defaults
    assert load_config({}).save_steps == 0 and not load_config({}).async_save


def test_saves_at_rolls_steps_asynchronously(tmp_path: Path, monkeypatch) -> None:
    """The FSDP2 example without save_steps saves at ROLL's steps (50, 100, ... 500), each
    asynchronously, as ROLL's actor_train does."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(FSDP2)
    state = tiny_state(seed=0)
    saved = []
    with CheckpointManager(cfg, component=None, quiet=True) as manager:
        for step in range(1, cfg.max_steps + 1):
            if manager.maybe_save(step, state) is not None:
                stats = manager.wait()
                saved.append((step, stats.is_async))
        steps = sorted(r.step for r in layout.committed(manager.storage, manager.storage.root))
    assert saved == [(s, True) for s in range(50, 501, 50)]
    assert steps == list(range(50, 501, 50))


def test_config_report_names_each_source(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    report = config_report(FSDP2)
    top = {s.key: s for s in report.groups["*"]}
    assert top["save_steps"].value == 50 and top["save_steps"].source.startswith("ROLL's default (roll/configs/")
    assert top["checkpoint_config.output_dir"].source == "the file"
    assert top["checkpoint_config.timestamp_subdir"].source == "roll-ckpt's default"
    assert top["offload_backend"].source == "roll-ckpt-fsdp2's default"
    actor = {s.key: s for s in report.groups["actor_train"]}
    assert actor["strategy_config.async_save_ckpt"].value is True
    assert "ROLL's default" in actor["strategy_config.async_save_ckpt"].source
    assert report.strategies == {"actor_train": "fsdp2_train", "actor_infer": "vllm"}


def test_config_command(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["config", str(FSDP2)]) == 0
    out = capsys.readouterr().out
    assert "a ROLL pipeline config" in out and "[worker actor_train (fsdp2_train)]" in out
    assert "ROLL's default (roll/configs/base_config.py: BaseConfig.save_steps)" in out
    assert main(["config", str(FSDP2), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["key"]: r for r in data["settings"]["*"]}
    assert rows["max_steps"]["value"] == 500 and data["defaults"] == "roll"
    assert main(["config", str(tmp_path / "missing.yaml")]) == 1
    assert "does not exist" in capsys.readouterr().err
