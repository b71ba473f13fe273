"""torchtitan's own step folders as roll-ckpt's ``torchtitan`` format, without torchtitan: folders
laid out as torchtitan 0.3.0's ``CheckpointManager`` writes them (written here with plain
``dcp.save``) are recognized (whole, cut short, model-only, a seed), passed over by ``latest``
with the reason, resumed read-only into the state roll-ckpt-torchtitan builds, and shown by
``roll-ckpt verify/inspect``; the dataloader's pickle is vetted; the config mapping refuses
what torchtitan's own fields set. (The real torchtitan: test_trainer.py, test_manager.py.)"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.training import config
from roll_ckpt import CheckpointManager, GlobalState
from roll_ckpt.cli import main as cli_main
from roll_ckpt.plugin import ConfigError, RollCkptError, UnsafeCheckpointError, write_dcp
from roll_ckpt_fs.storage import LocalStorage
from roll_ckpt_torchtitan.settings import roll_config
from roll_ckpt_torchtitan.state_map import DataloaderState, roll_state, vet_pickle
from roll_ckpt_torchtitan.tt_format import recognize


class Holder:
    def __init__(self, sd: dict) -> None:
        self.sd = sd

    def state_dict(self) -> dict:
        return self.sd

    def load_state_dict(self, sd: dict) -> None:
        self.sd = dict(sd)


class Loader:
    """Stands in for torchtitan's ParallelAwareDataloader: ``{"dp_rank_<r>": pickle, "world_size"}``."""

    def __init__(self, position: int = 0, dp_world_size: int = 1) -> None:
        self.position, self.dp_world_size = position, dp_world_size

    def state_dict(self) -> dict:
        return {"dp_rank_0": pickle.dumps({"_num_yielded": self.position, "dataset_state": {"buf": [1, 2]}}),
                "world_size": self.dp_world_size}

    def load_state_dict(self, sd: dict) -> None:
        self.position = pickle.loads(sd["dp_rank_0"])["_num_yielded"]


def _model(scale: float = 1.0) -> dict:
    return {"tok_embeddings.weight": torch.arange(12.0).reshape(4, 3) * scale,
            "layers.0.attention.qkv_linear.wq.weight": torch.ones(3, 3) * scale, "norm.weight": torch.ones(3) * scale}


def _states(scale: float = 1.0, step: int = 4, position: int = 7) -> dict[str, Any]:
    """torchtitan's ``states`` of a job (the values its objects' state_dict() return)."""
    return {"model": Holder(_model(scale)),
            "optimizer": Holder({"state.tok_embeddings.weight.exp_avg": torch.full((4, 3), scale),
                                 "state.tok_embeddings.weight.step": torch.tensor(float(step)),
                                 "param_groups.tok_embeddings.weight.lr": 0.001 * scale,
                                 "param_groups.tok_embeddings.weight.betas": (0.9, 0.95)}),
            "lr_scheduler": Holder({"last_epoch": step}),
            "train_state": Holder({"step": step, "ntokens_seen": 256 * step}),
            "dataloader": Loader(position)}


def write_torchtitan_step(folder: Path, step: int, *, model_only: bool = False, **kw: Any) -> Path:
    """A ``step-<step>`` folder as torchtitan's manager writes it (its ``_flattened_model_states_sd``)."""
    states = _states(step=step, **kw)
    flat: dict[str, Any] = dict(states["model"].state_dict())
    if not model_only:
        flat.update({k: v.state_dict() for k, v in states.items() if k != "model"})
    path = folder / f"step-{step}"
    write_dcp(flat, str(path))  # dcp.save by this process alone, on every torch of the range
    return path


def test_a_whole_torchtitan_step_is_recognized(tmp_path: Path) -> None:
    path = write_torchtitan_step(tmp_path, 4)
    found = recognize(LocalStorage(str(tmp_path)), str(path))
    assert found is not None and found.step == 4 and found.kind == "full"
    assert found.problems == [] and found.not_resumable == "" and found.components() == []
    assert ".metadata" in found.files() and "__0_0.distcp" in found.files()


def test_a_step_cut_short_is_recognized_with_the_file_at_fault(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    no_md = write_torchtitan_step(tmp_path, 2)
    (no_md / ".metadata").unlink()
    assert recognize(storage, str(no_md)).problems == [  # type: ignore[union-attr]
        ".metadata is missing: torchtitan never finished writing this step (a save cut short)"]
    short = write_torchtitan_step(tmp_path, 4)
    data = short / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    (problem,) = recognize(storage, str(short)).problems  # type: ignore[union-attr]
    assert problem.startswith("__0_0.distcp is cut short: 100 B of at least")


def test_model_only_steps_and_seeds(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    last = recognize(storage, str(write_torchtitan_step(tmp_path, 6, model_only=True)))
    assert last.kind == "model" and last.problems == []  # type: ignore[union-attr]
    assert "holds the model only (torchtitan's last_save_model_only" in last.not_resumable  # type: ignore[union-attr]
    seed = recognize(storage, str(write_torchtitan_step(tmp_path, 0, model_only=True)))
    assert seed.kind == "model" and seed.not_resumable == ""  # type: ignore[union-attr]


def test_roll_ckpt_s_own_step_folders_are_not_torchtitan_s(tmp_path: Path) -> None:
    cfg = config(tmp_path, name_format="step-{step}", timestamp_subdir=False)
    with CheckpointManager(cfg, quiet=True) as m:
        path = m.save(2, {"model": torch.nn.Linear(2, 2)})
    assert path.endswith("step-2") and recognize(LocalStorage(str(tmp_path)), path) is None


def _resume_state() -> dict[str, Any]:
    return roll_state(_states(scale=0.0, step=0, position=0))


def test_latest_resumes_torchtitan_s_newest_full_step_passing_over_a_model_only_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_torchtitan_step(tmp_path, 2, scale=2.0, position=3)
    write_torchtitan_step(tmp_path, 4, scale=4.0, position=7)
    write_torchtitan_step(tmp_path, 6, model_only=True)
    state = _resume_state()
    cfg = config(tmp_path, name_format="step-{step}", timestamp_subdir=False)
    with caplog.at_level(logging.WARNING, logger="roll_ckpt"), CheckpointManager(cfg, quiet=True) as m:
        assert m.resume(state, "latest") == 4
        assert m.resumed.path == str(tmp_path / "step-4")
    warning = caplog.text
    assert "step-6: a torchtitan checkpoint that holds the model only (torchtitan's last_save_model_only" in warning
    assert torch.equal(state["model"].obj.sd["tok_embeddings.weight"], torch.arange(12.0).reshape(4, 3) * 4)
    opt = state["optimizer"].obj.sd
    assert torch.equal(opt["state.tok_embeddings.weight.exp_avg"], torch.full((4, 3), 4.0))
    assert opt["param_groups.tok_embeddings.weight.lr"] == 0.004 and \
        opt["param_groups.tok_embeddings.weight.betas"] == (0.9, 0.95)
    assert state["train_state"].obj.sd == {"step": 4, "ntokens_seen": 1024}
    assert state["lr_scheduler"].obj.sd == {"last_epoch": 4}
    assert state["dataloader"].loader.position == 7


def test_a_seed_loads_the_model_alone(tmp_path: Path) -> None:
    write_torchtitan_step(tmp_path, 0, model_only=True, scale=3.0)
    state = _resume_state()
    with CheckpointManager(config(tmp_path, name_format="step-{step}", timestamp_subdir=False), quiet=True) as m:
        assert m.resume(state, "latest") == 0 and m.resumed.path is not None
    assert torch.equal(state["model"].obj.sd["norm.weight"], torch.ones(3) * 3)
    assert state["train_state"].obj.sd == {"step": 0, "ntokens_seen": 0}, "a seed is the model only"


def test_a_state_the_checkpoint_lacks_is_named_with_the_way_out(tmp_path: Path) -> None:
    write_torchtitan_step(tmp_path, 4)
    state = _resume_state()
    state["ema"] = GlobalState(Holder({"decay": 0.9}))
    with CheckpointManager(config(tmp_path, name_format="step-{step}", timestamp_subdir=False), quiet=True) as m:
        with pytest.raises(RollCkptError, match=r"holds no ema.decay \(state 'ema'\); set --checkpoint."
                                                r"exclude_from_loading ema"):
            m.resume(state, "latest")


def test_the_dataloader_pickle_is_vetted_before_torchtitan_unpickles_it() -> None:
    vet_pickle(pickle.dumps({"a": [1, 2.0, "x", b"y", None, True, (1,), {3}, frozenset({4})]}), "ckpt", "k")

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (print, ("PWNED",))

    with pytest.raises(UnsafeCheckpointError, match="dataloader.dp_rank_0: its pickle asks for builtins.print"):
        DataloaderState(Loader()).load_state_dict({"dp_rank_0": pickle.dumps(Evil()), "world_size": 1})
    with pytest.raises(UnsafeCheckpointError, match="is not a readable pickle"):
        vet_pickle(b"\x80\x04garbage", "ckpt", "k")


def test_a_dataloader_state_of_another_data_parallel_degree_is_refused() -> None:
    loader = Loader(dp_world_size=2)
    with pytest.raises(RollCkptError, match="saved by 4 data-parallel ranks, this job has 2; torchtitan's dataloader "
                                            "cannot be resharded. Resume with --checkpoint.exclude_from_loading "
                                            "dataloader"):
        DataloaderState(loader).load_state_dict({"dp_rank_0": pickle.dumps({}), "world_size": 4})


def test_verify_and_inspect_read_torchtitan_s_folders(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    full = write_torchtitan_step(tmp_path, 4)
    last = write_torchtitan_step(tmp_path, 6, model_only=True)
    assert cli_main(["verify", str(full)]) == 0
    assert "torchtitan checkpoint, step 4" in capsys.readouterr().out
    assert cli_main(["verify", str(last)]) == 0
    assert "not a resume point: it holds the model only" in capsys.readouterr().out
    assert cli_main(["inspect", str(full)]) == 0
    out = capsys.readouterr().out
    assert "model: 3 entries" in out and "train_state: ntokens_seen 1024, step 4" in out
    assert "lr_scheduler: last_epoch 4" in out and "dataloader: dp_rank_0 (world_size 1;" in out


def test_the_config_comes_from_torchtitan_s_fields(tmp_path: Path) -> None:
    cfg = roll_config(str(tmp_path / "ckpt"), interval=5, keep_latest_k=3, async_mode="async")
    cc = cfg.checkpoint_config
    assert (cc.output_dir, cc.name_format, cc.timestamp_subdir, cc.max_ckpt_to_keep) == \
        (str(tmp_path / "ckpt"), "step-{step}", False, 3)
    assert cfg.save_steps == 5 and cfg.async_save and cfg.resume_from_checkpoint is False
    extra = tmp_path / "roll.yaml"
    extra.write_text("checkpoint_config:\n  on_unusable_checkpoint: raise\n  verify_before_load: false\n")
    cfg = roll_config(str(tmp_path / "ckpt"), interval=5, keep_latest_k=0, async_mode="disabled",
                      roll_config_file=str(extra))
    assert cfg.checkpoint_config.on_unusable_checkpoint == "raise" and not cfg.async_save
    extra.write_text("checkpoint_config:\n  max_ckpt_to_keep: 2\n")
    with pytest.raises(ConfigError, match="checkpoint_config.max_ckpt_to_keep.*torchtitan's config sets it: "
                                          "--checkpoint.keep_latest_k"):
        roll_config("x", interval=1, keep_latest_k=0, async_mode="disabled", roll_config_file=str(extra))
    extra.write_text("save_steps: 3\n")
    with pytest.raises(ConfigError, match="save_steps.*only checkpoint_config and strategy_config are read"):
        roll_config("x", interval=1, keep_latest_k=0, async_mode="disabled", roll_config_file=str(extra))


def test_export_writes_torchtitan_s_layout(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A checkpoint of the state roll-ckpt-torchtitan builds, exported: torchtitan's keys, read back whole."""
    cfg = config(tmp_path / "ckpt", name_format="step-{step}", timestamp_subdir=False)
    with CheckpointManager(cfg, quiet=True) as m:
        path = m.save(4, roll_state(_states(scale=4.0, step=4, position=7)))
    out = tmp_path / "tt" / "step-4"
    assert cli_main(["export", path, "--format", "torchtitan", "--out", str(out)]) == 0
    assert "exported step 4 in torchtitan's layout" in capsys.readouterr().out
    found = recognize(LocalStorage(str(tmp_path)), str(out))
    assert found is not None and found.kind == "full" and found.problems == []
    assert {"tok_embeddings.weight", "optimizer.state.tok_embeddings.weight.exp_avg", "lr_scheduler.last_epoch",
            "train_state.step", "dataloader.dp_rank_0", "dataloader.world_size"} <= set(found.keys)
    state = _resume_state()
    found.resume(state, None, None)
    assert torch.equal(state["model"].obj.sd["tok_embeddings.weight"], torch.arange(12.0).reshape(4, 3) * 4)
    assert state["train_state"].obj.sd == {"step": 4, "ntokens_seen": 1024} and state["dataloader"].loader.position == 7
