"""Turning the integration on, without Ray: what enable() checks before it changes anything,
the launcher, and how a ROLL pipeline config becomes each component's roll-ckpt config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import child_env
from roll_ckpt import ConfigError, RollCkptError

DOUBLE = Path(__file__).resolve().parent / "roll_double"


@pytest.fixture
def roll(monkeypatch: pytest.MonkeyPatch):
    """The ROLL test double importable as ``roll`` (this process only)."""
    monkeypatch.syspath_prepend(str(DOUBLE))
    import roll.configs as configs

    return configs


def _pipeline_config(roll, tmp_path: Path, **over):
    worker = roll.WorkerConfig(model_args=roll.ModelArguments(model_name_or_path=str(tmp_path)),
                               strategy_args=roll.StrategyArguments("fsdp2_train", {"async_save_ckpt": False,
                                                                                    "offload_backend": "local"}))
    keys = dict(exp_name="e", seed=1, output_dir=str(tmp_path / "out"), max_steps=10, save_steps=5,
                checkpoint_config={"type": "file_system", "output_dir": str(tmp_path / "ckpt")}, actor_train=worker)
    keys.update(over)
    return roll.PPOConfig(**keys)


def test_a_components_config_comes_from_rolls_pipeline_config(roll, tmp_path: Path) -> None:
    from roll_ckpt_roll.settings import checkpoint_root, config_for

    cfg = _pipeline_config(roll, tmp_path)
    root, run = checkpoint_root(cfg)
    assert root == str(tmp_path / "ckpt") and cfg.checkpoint_config["output_dir"] == f"{root}/{run}"
    mine = config_for(cfg, ["actor_train", "pipeline"], hf_step_root=True)
    cc = mine.checkpoint_config
    assert cc.output_dir == root and cc.run_name == run and cc.components == ("actor_train", "pipeline")
    assert cc.hf_weights.step_root is True
    actor = mine.for_component("actor_train")
    assert actor.options["offload_backend"] == "local"  # the worker's strategy_config
    assert actor.async_save is True  # ROLL's async_upload (default true): the write is the upload
    cfg.checkpoint_config["async_upload"] = False
    assert config_for(cfg, ["actor_train"]).for_component("actor_train").async_save is False  # async_save_ckpt
    assert config_for(cfg, ["pipeline"]).checkpoint_config.hf_weights is None


def test_a_config_without_rolls_timestamp_is_refused(roll, tmp_path: Path) -> None:
    from roll_ckpt_roll.settings import checkpoint_root

    cfg = _pipeline_config(roll, tmp_path)
    cfg.checkpoint_config["output_dir"] = str(tmp_path / "ckpt")  # as if not built by ROLL
    with pytest.raises(ConfigError, match="launch's timestamp folder"):
        checkpoint_root(cfg)
    assert checkpoint_root(_pipeline_config(roll, tmp_path, checkpoint_config={})) is None


def test_a_rolls_method_with_another_signature_changes_nothing(roll) -> None:
    from roll_ckpt_roll import patches

    class Strategy:
        def save_checkpoint(self, save_dir, step, ckpt_id, tag="checkpoint", **kwargs):  # "global_step" renamed
            pass

    with pytest.raises(RollCkptError, match=r"is not the method roll-ckpt-roll replaces .*8eb27cc2"):
        patches._check(Strategy, "save_checkpoint")
    with pytest.raises(RollCkptError, match="has no load_checkpoint"):
        patches._check(Strategy, "load_checkpoint")


def test_enable_replaces_rolls_methods_and_asks_ray_to_do_it_in_every_worker(roll) -> None:
    script = """
import ray
seen = {}
def recorder(*args, **kwargs):  # stands in for ray.init: what enable() hands it
    seen.update(kwargs)
ray.init = recorder
import roll_ckpt_roll
roll_ckpt_roll.enable()
roll_ckpt_roll.enable()  # idempotent
from roll.distributed.strategy.fsdp2_strategy import FSDP2StrategyBase
from roll.pipeline.base_pipeline import BasePipeline
assert FSDP2StrategyBase.save_checkpoint.__module__ == "roll_ckpt_roll.patches"
assert BasePipeline.do_checkpoint.__module__ == "roll_ckpt_roll.patches"
ray.init(namespace="roll", ignore_reinit_error=True, runtime_env={"env_vars": {"A": "1"}})  # as ROLL's init()
assert seen["runtime_env"] == {"env_vars": {"A": "1"}, "worker_process_setup_hook": "roll_ckpt_roll.in_worker"}, seen
assert seen["namespace"] == "roll"
print("OK")
"""
    env = child_env(PYTHONPATH=f"{DOUBLE}:{child_env()['PYTHONPATH']}")
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0 and ran.stdout.strip().endswith("OK"), ran.stderr[-3000:]


def test_enable_after_ray_init_is_refused(roll) -> None:
    script = """
import ray, roll_ckpt_roll
ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 * 2**20)
try:
    roll_ckpt_roll.enable()
except Exception as exc:
    print(type(exc).__name__, exc)
finally:
    ray.shutdown()
"""
    env = child_env(PYTHONPATH=f"{DOUBLE}:{child_env()['PYTHONPATH']}", RAY_AUTH_MODE="disabled")
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         start_new_session=True)
    assert "RollCkptError" in ran.stdout and "came after ray.init()" in ran.stdout, ran.stdout + ran.stderr[-2000:]


def test_the_launcher_runs_an_unchanged_entry_script_with_the_integration_on(roll, tmp_path: Path) -> None:
    script = tmp_path / "start_pipeline.py"
    script.write_text("import sys\nfrom roll.pipeline.base_pipeline import BasePipeline\n"
                      "print(BasePipeline.__init__.__module__, sys.argv[1:], __name__)\n")
    env = child_env(PYTHONPATH=f"{DOUBLE}:{child_env()['PYTHONPATH']}")
    ran = subprocess.run([sys.executable, "-m", "roll_ckpt_roll", str(script), "--config_name", "x"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip() == "roll_ckpt_roll.patches ['--config_name', 'x'] __main__"
    usage = subprocess.run([sys.executable, "-m", "roll_ckpt_roll"], capture_output=True, text=True, timeout=60,
                           env=env)
    assert usage.returncode == 2 and "SCRIPT" in usage.stdout
