"""Real ROLL-shaped configs (tests/core/roll_configs), loaded as they are: what each of
ROLL's checkpoint keys means for the manager, the other sections kept untouched in
``cfg.extra``, and a save/resume cycle driven by each file.

* ``rlvr_megatron_sglang.yaml`` - RLVR, Megatron actor_train + SGLang actor_infer; top-level
  ``max_ckpt_to_keep``, ``async_upload: true``, ``keep_local_file: false`` without a backup.
* ``agentic_fsdp2/agentic_fsdp2.yaml`` - agentic, FSDP2 actor with its own
  ``async_save_ckpt``/``offload_backend``; a Hydra defaults list (composed with Hydra), two
  components, a backup with ``keep_local_file: false``, ``resume_from_checkpoint: true``.
* ``sft_megatron.yaml`` - SFT, ``${oc.env:VAR,default}`` names and paths, the default root.
* ``dpo_megatron.yaml`` - DPO, an explicit resume path, an async actor_train worker.

A second launch changes one key the way a ROLL user does, with a Hydra command-line
override (``resume_from_checkpoint=true``), applied here with ``OmegaConf.from_dotlist``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from roll_ckpt import CheckpointManager, ConfigError, DriverState, load_config

from roll_ckpt.format import layout
from roll_ckpt.testing.state import assert_same_state, state_snapshot, tiny_state

CONFIGS = Path(__file__).resolve().parent / "roll_configs"
RLVR = CONFIGS / "rlvr_megatron_sglang.yaml"
AGENTIC = CONFIGS / "agentic_fsdp2"
SFT = CONFIGS / "sft_megatron.yaml"
DPO = CONFIGS / "dpo_megatron.yaml"
WORKER_SECTIONS = ("actor_train", "actor_infer", "reference", "critic", "rewards", "sft_train")


@pytest.fixture
def job_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A launch directory (the files' relative ./output, ./ckpt land here) and the
    environment ROLL jobs read."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", "wandb-key-from-env")
    monkeypatch.setenv("MODEL_PATH", "/models/qwen3")
    for name in ("ROLL_OUTPUT_DIR", "ROLL_EXPERIMENT_NAME", "ROLL_CKPT_RUN_NAME"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def overridden(path: Path, *dotlist: str) -> Any:
    """The file with Hydra-style command-line overrides (``key=value``) merged in."""
    return OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(dotlist)))


def composed(*overrides: str) -> Any:
    """agentic_fsdp2.yaml composed by Hydra, as ROLL's start_agentic_pipeline.py does."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(AGENTIC), version_base=None):
        return compose(config_name="agentic_fsdp2", overrides=list(overrides))


def resolved_sections(path: Path) -> dict[str, Any]:
    """What ``cfg.extra`` must hold: every section of the file, ``${...}`` resolved, hydra as written."""
    raw = yaml.safe_load(path.read_text())
    out = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    out["hydra"] = raw["hydra"]
    return out


def no_effect_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]


def train(state: dict[str, Any], seed: int) -> None:
    """One optimizer step, so that every checkpoint differs from the one before."""
    import torch

    model, optimizer = state["model"], state["optimizer"]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    state["counter"]["seen"] += 4


def committed_steps(manager: CheckpointManager) -> list[int]:
    return sorted(ref.step for ref in layout.committed(manager.storage, manager.storage.root))


# --------------------------------------------------------------------------- RLVR


def test_rlvr_keys_mean_what_roll_means(job_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    cfg = load_config(RLVR)
    cc = cfg.checkpoint_config
    assert cc.output_dir == "./output/checkpoints/qwen3-8B-rlvr-llmjudge"
    assert cc.max_ckpt_to_keep == 2                                   # ROLL's top-level key
    assert (cfg.save_steps, cfg.max_steps, cfg.resume_target) == (100, 500, None)
    assert cfg.async_save and not cfg.strategy_config.async_save_ckpt  # async_upload: true
    assert cc.backup is None and cc.keep_local_file is False
    lines = no_effect_lines(caplog)                                   # keep_local_file, without a backup
    assert len(lines) == 1 and "checkpoint_config.keep_local_file: false" in lines[0]
    actor = cfg.for_component("actor_train")                          # Megatron's keys are not ours
    assert actor.async_save and actor.options == cfg.options

    expected = resolved_sections(RLVR)
    for name in ("hydra", "validation", "system_envs", "tracker_kwargs", *WORKER_SECTIONS):
        assert cfg.extra.get(name) == expected.get(name), name
    assert cfg.extra["hydra"] == {"run": {"dir": "."}, "output_subdir": None}
    assert cfg.extra["actor_infer"]["generating_args"]["max_new_tokens"] == 1024    # ${response_length}
    assert cfg.extra["actor_infer"]["generating_args"]["num_return_sequences"] == 8
    assert cfg.extra["tracker_kwargs"]["api_key"] == "wandb-key-from-env"          # ${oc.env:...}
    assert cfg.extra["actor_train"]["device_mapping"] == "list(range(0,4))"         # ROLL evaluates it, not us
    assert cfg.extra["rewards"]["llm_judge"]["strategy_args"]["strategy_config"] is None
    assert not {"max_ckpt_to_keep", "checkpoint_config", "save_steps"} & set(cfg.extra)


def test_rlvr_without_its_environment_variable_names_the_key(job_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY")
    with pytest.raises(ConfigError) as info:
        load_config(RLVR)
    assert info.value.key == "tracker_kwargs.api_key" and "WANDB_API_KEY" in str(info.value)


def test_rlvr_save_and_resume_cycle(job_dir: Path) -> None:
    cfg = load_config(RLVR)
    state = tiny_state(seed=0)
    manager = CheckpointManager(cfg, quiet=True)
    try:
        assert manager.resume(state) == 0
        for step in range(1, cfg.max_steps + 1):
            if step % cfg.save_steps == 0:
                train(state, step)
            if manager.maybe_save(step, state) is not None:
                assert manager.wait().is_async                         # async_upload: true
        expected = state_snapshot(state)
        manager.save(cfg.max_steps, state, final=True)                 # the periodic save took it
        assert committed_steps(manager) == [400, 500]                  # max_ckpt_to_keep: 2
    finally:
        manager.close()

    # the next launch: `... resume_from_checkpoint=true` on the command line
    resumed_cfg = load_config(overridden(RLVR, "resume_from_checkpoint=true"))
    assert resumed_cfg.resume_target == "latest"
    fresh = tiny_state(seed=1)
    manager = CheckpointManager(resumed_cfg, quiet=True)
    try:
        assert manager.resume(fresh) == 500
        assert_same_state(state_snapshot(fresh), expected)
    finally:
        manager.close()


# --------------------------------------------------------------------------- agentic


@pytest.mark.filterwarnings("ignore:In 'agentic_fsdp2'. Defaults list is missing `_self_`")  # as in ROLL's files
def test_agentic_keys_mean_what_roll_means(job_dir: Path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    monkeypatch.setenv("ROLL_CKPT_RUN_NAME", "20250101-000000")
    cfg = load_config(composed())
    assert load_config(AGENTIC / "agentic_fsdp2.yaml") == cfg         # the file itself: composed by Hydra too
    cc = cfg.checkpoint_config
    assert cc.max_ckpt_to_keep == 3                                   # set alike in both places
    assert cc.components == ("actor_train", "pipeline") and cc.run_name == "20250101-000000"
    assert cc.backup is not None and cc.backup.keep_local == 1       # keep_local_file: false
    assert cfg.resume_target == "latest"
    assert cfg.defaults == "roll" and cfg.offload_backend == "local"  # no top-level strategy_config
    assert cfg.async_save and cfg.checkpoint_config.async_upload      # ROLL's default async_upload: true
    assert not cfg.strategy_config.async_save_ckpt
    actor, pipeline = cfg.for_component("actor_train"), cfg.for_component("pipeline")
    assert (actor.strategy_config.async_save_ckpt, actor.offload_backend) == (True, "local_dedup")  # the worker's own
    assert (pipeline.async_save, pipeline.offload_backend) == (True, "local")
    assert not no_effect_lines(caplog)

    env = cfg.extra["custom_envs"]["FrozenLake"]                      # from the defaults list, resolved
    assert env["max_steps"] == 10 and env["env_config"]["format_penalty"] == -0.01
    assert cfg.extra["actor_infer"]["generating_args"]["max_new_tokens"] == 128
    assert cfg.extra["actor_train"]["strategy_args"]["strategy_config"]["fsdp_size"] == 4
    assert cfg.extra["reference"]["strategy_args"]["strategy_config"] is None
    assert "hydra" not in cfg.extra and "defaults" not in cfg.extra  # Hydra consumed them


@pytest.mark.filterwarnings("ignore:In 'agentic_fsdp2'. Defaults list is missing `_self_`")
def test_agentic_save_and_resume_cycle_with_two_components(job_dir: Path, monkeypatch) -> None:
    def launch(run_name: str) -> tuple[Any, CheckpointManager, CheckpointManager]:
        monkeypatch.setenv("ROLL_CKPT_RUN_NAME", run_name)            # the driver's pick, once per launch
        cfg = load_config(composed())
        return (cfg, CheckpointManager(cfg, component="actor_train", quiet=True),
                CheckpointManager(cfg, component="pipeline", quiet=True))

    cfg, actor, pipeline = launch("20250101-000000")
    state, driver = tiny_state(seed=0), DriverState(step=0, episodes=0)
    try:
        assert actor.resume(state) == 0 and pipeline.resume({"driver": driver}) == 0
        for step in range(1, 9):
            train(state, step)
            driver.update(step=step, episodes=driver["episodes"] + 8)
            if actor.maybe_save(step, state) is not None:
                assert actor.wait().is_async                           # the actor's own async_save_ckpt
                pipeline.maybe_save(step, {"driver": driver})
                assert pipeline.wait().is_async                        # ROLL's async_upload: true
        expected, expected_driver = state_snapshot(state), dict(driver)
    finally:
        actor.close()
        pipeline.close()                                              # waits for replication (max_wait_s)
    root = job_dir / "output"
    local = sorted(p.parent.name for p in (root / "checkpoints").glob("*/*/*/manifest.json"))
    backup = sorted(p.parent.name for p in (root / "backup").glob("*/*/*/manifest.json"))
    assert backup == ["checkpoint-4", "checkpoint-8"]
    assert local == ["checkpoint-8"]                                  # keep_local_file: false -> keep_local: 1

    _, actor, pipeline = launch("20250101-000100")                   # a new launch, a new run folder
    fresh, fresh_driver = tiny_state(seed=1), DriverState(step=0, episodes=0)
    try:
        assert actor.resume(fresh) == 8 and pipeline.resume({"driver": fresh_driver}) == 8
        assert_same_state(state_snapshot(fresh), expected)
        assert dict(fresh_driver) == expected_driver
    finally:
        actor.close()
        pipeline.close()


# --------------------------------------------------------------------------- SFT and DPO


def test_sft_names_and_paths_from_the_environment(job_dir: Path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    cfg = load_config(SFT)                                            # the defaults of ${oc.env:VAR,default}
    assert cfg.exp_name == "qwen3-sft-smoke" and cfg.output_dir == "./output/qwen3-sft-smoke"
    assert cfg.checkpoint_config.output_dir == "./output/qwen3-sft-smoke/checkpoints/qwen3-sft-smoke"
    assert (cfg.save_steps, cfg.checkpoint_config.max_ckpt_to_keep, cfg.async_save) == (1, 0, True)  # ROLL's async_upload
    worker = cfg.for_component("sft_train")                           # its strategy_config's save_only_model: true
    assert worker.strategy_config.save_only_model and not cfg.strategy_config.save_only_model
    assert dataclasses.replace(worker, strategy_config=cfg.strategy_config) == cfg  # nothing else of ours there
    assert cfg.extra["pretrain"] == "/models/qwen3"
    assert cfg.extra["sft_train"] == resolved_sections(SFT)["sft_train"]
    assert not no_effect_lines(caplog)

    monkeypatch.setenv("ROLL_EXPERIMENT_NAME", "sft-run-7")
    monkeypatch.setenv("ROLL_OUTPUT_DIR", "/data/sft")
    cfg = load_config(SFT)
    assert cfg.checkpoint_config.output_dir == "/data/sft/checkpoints/sft-run-7"
    monkeypatch.delenv("MODEL_PATH")                                  # ${oc.env:MODEL_PATH}: no default
    with pytest.raises(ConfigError) as info:
        load_config(SFT)
    assert info.value.key == "pretrain" and "MODEL_PATH" in str(info.value)


def test_sft_save_and_resume_cycle(job_dir: Path) -> None:
    cfg = load_config(SFT)
    state = tiny_state(seed=0)
    manager = CheckpointManager(cfg, quiet=True)
    try:
        for step in range(1, 6):                                      # stopped after step 5
            train(state, step)
            manager.maybe_save(step, state)
            assert manager.wait().is_async                             # ROLL's default async_upload: true
        expected = state_snapshot(state)
        assert committed_steps(manager) == [1, 2, 3, 4, 5]           # max_ckpt_to_keep 0: all kept
    finally:
        manager.close()
    fresh = tiny_state(seed=1)
    manager = CheckpointManager(load_config(overridden(SFT, "resume_from_checkpoint=latest")), quiet=True)
    try:
        assert manager.resume(fresh) == 5
        assert_same_state(state_snapshot(fresh), expected)
    finally:
        manager.close()


def test_dpo_explicit_resume_path_and_async_worker(job_dir: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    cfg = load_config(DPO)
    cc = cfg.checkpoint_config
    assert (cc.output_dir, cc.timestamp_subdir, cc.max_ckpt_to_keep) == ("./ckpt/qwen3-4B-dpo-config", False, 2)
    assert cfg.resume_target == "./ckpt/qwen3-4B-dpo-config/checkpoint-250"
    assert cfg.async_save and cfg.for_component("actor_train").strategy_config.async_save_ckpt  # ROLL's async_upload
    assert not cfg.for_component("reference").strategy_config.async_save_ckpt
    assert cfg.extra["track_name"] == "None" and cfg.extra["reference"] == resolved_sections(DPO)["reference"]
    assert not no_effect_lines(caplog)

    # The first run (resume_from_checkpoint=false on the command line), as its actor_train worker.
    first = load_config(overridden(DPO, "resume_from_checkpoint=false")).for_component("actor_train")
    state = tiny_state(seed=0)
    manager = CheckpointManager(first, quiet=True)
    try:
        assert manager.resume(state) == 0
        for step in range(1, first.max_steps + 1):
            if step % first.save_steps == 0:
                train(state, step)
                manager.maybe_save(step, state)
                assert manager.wait().is_async
            if step == 250:
                at_250 = state_snapshot(state)
        assert committed_steps(manager) == [250, 500]
    finally:
        manager.close()

    # The file as it is: resume from its explicit checkpoint-250.
    fresh = tiny_state(seed=1)
    manager = CheckpointManager(cfg.for_component("actor_train"), quiet=True)
    try:
        assert manager.resume(fresh) == 250
        assert_same_state(state_snapshot(fresh), at_250)
    finally:
        manager.close()
