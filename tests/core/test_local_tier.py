"""The fast recovery tier in one process: config, the ring of replicas, unit transfer
checks, local saves and resume (newer than the persistent tier, bit-exact), retention, CLI.

The multi-rank behaviour (replicas, lost nodes, kills) is tested in
``tests/strategy_fsdp2/test_local_tier.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.damage import flip_byte
from roll_ckpt import CheckpointManager, ConfigError, load_config
from roll_ckpt.cli import main
from roll_ckpt.tiers.peer_replicas import pack, ring_targets, unpack_verified


def cfg(tmp_path: Path, *, resume: Any = False, async_save: bool = False, **local: Any) -> Any:
    return load_config({
        "exp_name": "lt", "save_steps": 4, "resume_from_checkpoint": resume,
        "strategy_config": {"async_save_ckpt": async_save},
        "checkpoint_config": {"output_dir": str(tmp_path / "persist"),
                              "local": {"dir": str(tmp_path / "local"), **local}}})


def test_config_defaults_and_errors() -> None:
    c = load_config({"exp_name": "run7", "checkpoint_config": {"local": {}}}).checkpoint_config.local
    assert (c.dir, c.save_steps, c.max_to_keep, c.replicas) == ("/dev/shm/roll-ckpt/run7", 1, 2, 1)
    c = load_config({"exp_name": "x", "checkpoint_config": {"local": {"dir": "/tmp/l/${exp_name}"}}})
    assert c.checkpoint_config.local.dir == "/tmp/l/x"
    assert load_config({}).checkpoint_config.local is None
    with pytest.raises(ConfigError, match="checkpoint_config.local.replica'.*did you mean 'replicas'"):
        load_config({"checkpoint_config": {"local": {"replica": 1}}})
    with pytest.raises(ConfigError, match="save_steps"):
        load_config({"checkpoint_config": {"local": {"save_steps": 0}}})
    with pytest.raises(ConfigError, match="node-local"):
        load_config({"checkpoint_config": {"local": {"dir": "s3://b/x"}}})


def test_ring_over_nodes() -> None:
    assert ring_targets(["a", "a", "b", "b"], 1) == {0: [2], 1: [3], 2: [0], 3: [1]}
    assert ring_targets(["a", "b", "c"], 2) == {0: [1, 2], 1: [2, 0], 2: [0, 1]}
    assert ring_targets(["a", "b", "c"], 5) == ring_targets(["a", "b", "c"], 2)  # at most the other nodes
    assert ring_targets(["a", "a"], 1) == {0: [], 1: []}  # never to a rank of the same node
    assert ring_targets(["a", "b"], 0) == {0: [], 1: []}


def _train(state: dict[str, Any], step: int) -> float:
    torch.manual_seed(1000 + step)
    x = torch.randn(8, 16)
    loss = state["model"](x).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    state["scheduler"].step()
    state["extra"]["step"] = step
    return loss.item()


def _state() -> dict[str, Any]:
    from helpers.training import mlp, optimizer_and_scheduler

    model = mlp(32, 2)
    opt, sched = optimizer_and_scheduler(model)
    return {"model": model, "optimizer": opt, "scheduler": sched, "extra": {"step": 0}}


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_from_a_local_step_newer_than_the_persistent_one_is_exact(tmp_path: Path, async_save: bool) -> None:
    ref = _state()
    ref_losses = [_train(ref, s) for s in range(1, 10)]
    state = _state()
    m = CheckpointManager(cfg(tmp_path, async_save=async_save), quiet=True)
    m.resume(state)
    for step in range(1, 7):
        _train(state, step)
        m.maybe_save(step, state)
    m.wait()
    assert m.local.last_save["step"] == 6 and m.local.last_save["ok"]
    assert m.stats.last.step == 4
    assert m.local.bytes_used > 0
    m.close()
    node = next((tmp_path / "local").iterdir())
    assert sorted(p.name for p in node.iterdir()) == ["checkpoint-5", "checkpoint-6"]  # max_to_keep: 2
    fresh = _state()
    m2 = CheckpointManager(cfg(tmp_path, resume="latest", async_save=async_save), quiet=True)
    assert m2.resume(fresh) == 6
    assert "checkpoint-6/rank-0" in m2.resumed.path
    assert m2.resumed.trainer_state["step"] == 6 and fresh["extra"] == {"step": 6}
    losses = [_train(fresh, s) for s in range(7, 10)]
    assert losses == ref_losses[6:]
    for k, v in ref["model"].state_dict().items():
        assert torch.equal(v, fresh["model"].state_dict()[k]), k
    m2.close()


def test_local_units_are_checked_and_the_persistent_tier_is_the_fallback(tmp_path: Path) -> None:
    state = _state()
    m = CheckpointManager(cfg(tmp_path, max_to_keep=1), quiet=True)
    for step in range(1, 6):
        _train(state, step)
        m.maybe_save(step, state)
    m.close()
    unit = next((tmp_path / "local").iterdir()) / "checkpoint-5" / "rank-0"
    flip_byte(unit / "dcp" / "__0_0.distcp", 100)
    m2 = CheckpointManager(cfg(tmp_path, resume="latest"), quiet=True)
    assert m2.resume(_state()) == 4  # the damaged unit refused; persistent step 4
    assert "persist" in m2.resumed.path
    # units newer than the resumed step are from a launch that went further: removed
    assert not unit.exists()
    m2.close()


def test_a_unit_in_transit_is_checked_against_its_manifest(tmp_path: Path) -> None:
    from roll_ckpt_fs import LocalStorage

    state = _state()
    m = CheckpointManager(cfg(tmp_path), quiet=True)
    _train(state, 1)
    m.maybe_save(1, state)
    m.close()
    unit = str(next((tmp_path / "local").iterdir()) / "checkpoint-1" / "rank-0")
    payload = pack(LocalStorage(unit), unit)
    manifest, files, _ = unpack_verified(payload)
    assert manifest.step == 1 and manifest.extra["tier"] == "local" and "dcp/.metadata" in files
    bad = bytearray(payload)
    bad[-5] ^= 1
    with pytest.raises(ValueError, match="checksum mismatch"):
        unpack_verified(bytes(bad))


def test_cli_lists_and_verifies_local_units(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _state()
    m = CheckpointManager(cfg(tmp_path), quiet=True)
    for step in range(1, 5):
        _train(state, step)
        m.maybe_save(step, state)
    m.close()
    local = tmp_path / "local"
    assert main(["ls", str(tmp_path / "persist"), "--local", str(local)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint-4" in out and "OWN RANKS" in out and "local tier: 2 step folder(s)" in out
    assert main(["ls", str(local)]) == 0
    assert "NODE" in capsys.readouterr().out
    unit = next(local.iterdir()) / "checkpoint-4" / "rank-0"
    assert main(["verify", str(unit)]) == 0
    assert "OK" in capsys.readouterr().out
    flip_byte(unit / "trainer_state.json", 3)
    assert main(["verify", str(local)]) == 1
    assert "DAMAGED" in capsys.readouterr().out
