"""The model as Hugging Face files inside every checkpoint (checkpoint_config.hf_weights,
roll_ckpt/hf/export.py: HFPart), written in the background from the dcp/ shards just written;
``save_only_model``: the weights and the trainer state only, a resume starting the optimizer
fresh with a warning."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from roll_ckpt import CheckpointManager, load_config
from roll_ckpt.cli import main
from roll_ckpt.testing.state import tiny_state

from ._hf_helpers import assert_same_as_save_pretrained, from_pretrained, logits, tiny_llama, tiny_moe, train

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(180)


def _config(root: Path, **extra) -> object:
    cc = {"output_dir": str(root), "timestamp_subdir": False, "hf_weights": {"max_shard_size": "20KB"}}
    cc.update(extra.pop("checkpoint_config", {}))
    return load_config({"checkpoint_config": cc, "strategy_config": {"async_save_ckpt": True}, **extra})


def _manifest(path: str | Path) -> dict:
    return json.loads((Path(path) / "manifest.json").read_text())


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.mark.parametrize("family", ["llama_tied", "qwen2_moe", "mixtral"])
def test_every_checkpoint_carries_what_save_pretrained_writes(tmp_path: Path, family: str, capsys,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_ckpt.hf.export import HFPart

    write, delay = HFPart.write, 0.2

    def slow_write(*args, **kwargs):  # the HF files take 0.2 s more to write
        time.sleep(delay)
        return write(*args, **kwargs)

    monkeypatch.setattr(HFPart, "write", slow_write)
    model = tiny_llama(tied=True) if family == "llama_tied" else tiny_moe(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(_config(tmp_path / "ckpt"), quiet=True) as manager:
        manager.hf_files(_tokenizer())
        for step in (1, 2):
            train(model, opt, 1)
            path = manager.save(step, {"model": model, "optimizer": opt})
            stats = manager.wait()
            # blocked: the save() call alone; the HF files are written after it returned
            assert stats.is_async and stats.total_s - stats.blocked_s >= delay, stats
            folder = Path(path)
            assert_same_as_save_pretrained(folder, model, "20KB", tmp_path / f"ref-{step}")
            assert torch.equal(logits(from_pretrained(folder)), logits(model))     # vLLM/transformers open it
    manifest = _manifest(path)
    hf_names = [n for n in manifest["files"] if not n.startswith("dcp/") and n != "trainer_state.json"]
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= set(hf_names)
    assert set(hf_names) | {"manifest.json", "trainer_state.json", "dcp"} == set(os.listdir(path))  # all listed
    assert manifest["extra"]["hf"]["status"] == "written"
    assert json.loads((folder / "config.json").read_text())["architectures"] == [type(model).__name__]
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(folder))("hello world")["input_ids"] == [1, 2]
    assert main(["verify", path]) == 0 and "Hugging Face files" in capsys.readouterr().out
    assert main(["ls", str(tmp_path / "ckpt")]) == 0 and "written" in capsys.readouterr().out
    assert main(["inspect", path]) == 0 and f"hf files     written ({len(hf_names)} files" in capsys.readouterr().out


def test_a_resume_reads_dcp_as_always(tmp_path: Path) -> None:
    model = tiny_moe("qwen3_moe")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    with CheckpointManager(_config(tmp_path / "ckpt"), quiet=True) as manager:
        manager.save(1, {"model": model, "optimizer": opt}, final=True)
    fresh = tiny_moe("qwen3_moe", seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    cfg = _config(tmp_path / "ckpt", resume_from_checkpoint="latest")
    with CheckpointManager(cfg, quiet=True) as manager:
        assert manager.resume({"model": fresh, "optimizer": fresh_opt}) == 1
    assert torch.equal(logits(fresh), logits(model)) and fresh_opt.state_dict()["state"]


def test_a_failed_hf_part_commits_the_checkpoint_without_it(tmp_path: Path, capsys, caplog) -> None:
    state = tiny_state()                                                  # not a transformers model: no config.json
    with CheckpointManager(_config(tmp_path / "ckpt"), quiet=True) as manager:
        path = manager.save(1, state)
        manager.wait()
    manifest = _manifest(path)
    assert manifest["extra"]["hf"]["status"] == "failed" and "config_dir" in manifest["extra"]["hf"]["error"]
    assert sorted(os.listdir(path)) == ["dcp", "manifest.json", "trainer_state.json"]  # nothing half-written
    assert any("could not be written" in r.getMessage() for r in caplog.records)
    assert main(["verify", path]) == 0 and "NOTE: its Hugging Face files could not be written" in capsys.readouterr().out
    assert main(["ls", str(tmp_path / "ckpt")]) == 0 and "failed" in capsys.readouterr().out
    fresh = tiny_state(seed=3)
    with CheckpointManager(_config(tmp_path / "ckpt", resume_from_checkpoint=True), quiet=True) as manager:
        assert manager.resume(fresh) == 1


def test_backup_copy_and_retention_carry_the_hf_files(tmp_path: Path) -> None:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(_config(tmp_path / "kept", checkpoint_config={"max_ckpt_to_keep": 1}),
                           quiet=True) as manager:
        for step in (1, 2):
            manager.save(step, {"model": model, "optimizer": opt}, final=True)
    assert sorted(os.listdir(tmp_path / "kept")) == ["checkpoint-2"]   # retention: whole folders
    cfg = _config(tmp_path / "ckpt", checkpoint_config={"backup": {"output_dir": str(tmp_path / "backup")}})
    with CheckpointManager(cfg, quiet=True) as manager:
        for step in (1, 2):
            train(model, opt, 1)
            manager.save(step, {"model": model, "optimizer": opt}, final=True)
    replica = tmp_path / "backup" / "checkpoint-2"
    assert torch.equal(logits(from_pretrained(replica)), logits(model))
    assert main(["--quiet", "copy", str(tmp_path / "ckpt" / "checkpoint-2"), str(tmp_path / "copy")]) == 0
    copied = tmp_path / "copy" / "checkpoint-2"
    assert (copied / "model.safetensors.index.json").exists() and main(["--quiet", "verify", str(copied)]) == 0


def test_save_only_model_holds_the_weights_and_resumes_the_optimizer_fresh(tmp_path: Path, capsys) -> None:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path / "ckpt"), "timestamp_subdir": False},
                       "strategy_config": {"save_only_model": True}})
    with CheckpointManager(cfg, quiet=True) as manager:
        path = manager.save(2, {"model": model, "optimizer": opt}, final=True)
    manifest = _manifest(path)
    assert manifest["extra"]["save_only_model"] == "model" and manifest["extra"]["hf"]["status"] == "written"
    from roll_ckpt.dcp.reader import SafeReader
    from roll_ckpt_fs import LocalStorage

    md = SafeReader(LocalStorage(path), os.path.join(path, "dcp")).read_metadata()
    assert {k.split(".", 1)[0] for k in md.state_dict_metadata} == {"model", "per_rank"}  # no optimizer
    assert torch.equal(logits(from_pretrained(Path(path))), logits(model))
    assert main(["ls", str(tmp_path / "ckpt")]) == 0 and "(model only)" in capsys.readouterr().out

    fresh = tiny_llama(seed=4)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with CheckpointManager(load_config({"checkpoint_config": {"output_dir": str(tmp_path / "ckpt"),
                                                              "timestamp_subdir": False},
                                        "resume_from_checkpoint": "latest"}), quiet=True) as manager:
        with pytest.warns(UserWarning, match=r"save_only_model.*state\['optimizer'\] starts fresh"):
            assert manager.resume({"model": fresh, "optimizer": fresh_opt}) == 2
    assert torch.equal(logits(fresh), logits(model)) and not fresh_opt.state_dict()["state"]


def test_megatrons_save_hf_model_means_the_same(tmp_path: Path) -> None:
    worker = {"strategy_args": {"strategy_name": "megatron_train", "strategy_config": {}},
              "training_args": {"save_hf_model": True}}
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path), "timestamp_subdir": False},
                       "actor_train": worker}).for_component("actor_train")
    assert cfg.strategy_config.save_only_model
    model = tiny_llama()
    with CheckpointManager(cfg, quiet=True) as manager:
        path = manager.save(1, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
        manager.wait()
    assert _manifest(path)["extra"]["save_only_model"] == "model"
    assert torch.equal(logits(from_pretrained(Path(path))), logits(model))


def test_hf_files_without_hf_weights_is_an_error(tmp_path: Path) -> None:
    from roll_ckpt.errors import RollCkptError

    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path)}})
    with CheckpointManager(cfg, quiet=True) as manager, pytest.raises(RollCkptError, match="hf_weights"):
        manager.hf_files(_tokenizer())


def test_with_components_the_part_holding_the_model_carries_them(tmp_path: Path) -> None:
    from roll_ckpt import DriverState, new_run_name

    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path), "run_name": new_run_name(),
                                             "components": ["actor_train", "pipeline"], "hf_weights": True}})
    model = tiny_llama()
    with CheckpointManager(cfg, component="actor_train", quiet=True) as actor, \
            CheckpointManager(cfg, component="pipeline", quiet=True) as pipeline:
        part = actor.save(1, {"model": model}, final=True)
        driver = pipeline.save(1, {"driver": DriverState(step=1)}, final=True)
    assert _manifest(part)["extra"]["hf"]["status"] == "written"
    assert torch.equal(logits(from_pretrained(Path(part))), logits(model))
    assert "hf" not in _manifest(driver)["extra"]                         # the driver holds no model
