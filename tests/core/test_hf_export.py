"""``roll-ckpt export --format hf`` and ``roll_ckpt.export_hf``: a tiny Llama trained under
roll-ckpt, exported, and read back by transformers' ``from_pretrained``; bad input gets
one line naming the problem."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from roll_ckpt import CheckpointManager, DriverState, export_hf, load_config, new_run_name
from roll_ckpt.errors import CheckpointNotFoundError, RollCkptError
from roll_ckpt.runtime.transformers_compat import as_saved

from ._hf_helpers import (assert_same_as_save_pretrained, expected_total_parameters, from_pretrained, logits,
                          tiny_llama, train, train_and_save)
from .test_cli import assert_one_line_error, run_cli

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(180)

SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


@pytest.fixture
def trained(tmp_path: Path):
    return train_and_save(tmp_path / "ckpt")


def _check_sharded(folder: Path, model: torch.nn.Module, tmp: Path, max_shard_size: str = "20KB") -> list[str]:
    """The folder is a sharded Hugging Face folder of ``model``, exactly as ``save_pretrained``
    writes it (a tied model's ``lm_head.weight`` once, under the embeddings' name); its shards."""
    index = assert_same_as_save_pretrained(folder, model, max_shard_size, tmp)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert index is not None and len(shards) > 1 and all(SHARD_RE.fullmatch(s) for s in shards), shards
    assert {int(SHARD_RE.fullmatch(s).group(2)) for s in shards} == {len(shards)}
    assert index["metadata"].get("total_parameters") == expected_total_parameters(model)
    return shards


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_float32_export_gives_the_trained_models_logits_exactly(capsys, tmp_path: Path, tied: bool) -> None:
    model, ckpt = train_and_save(tmp_path / "ckpt", tied=tied)
    config_dir = tmp_path / "config"
    model.config.save_pretrained(config_dir)
    (config_dir / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (config_dir / "notes.md").write_text("not a config file")
    out = tmp_path / "hf"
    rc, stdout, err = run_cli(capsys, "export", str(ckpt), "--format", "hf", "--out", str(out),
                              "--max-shard-size", "20KB", "--hf-config", str(config_dir))
    assert rc == 0, err
    shards = _check_sharded(out, model, tmp_path)
    assert f"({len(shards)} shards)" in stdout and "float32" in stdout
    assert {"config.json", "tokenizer_config.json"} <= set(os.listdir(out)) and "notes.md" not in os.listdir(out)
    # as save_pretrained writes it (transformers 4.51: without the attention flag config.save_pretrained set)
    assert json.loads((out / "config.json").read_text()) == as_saved(json.loads((config_dir / "config.json").read_text()))
    loaded = from_pretrained(out)
    assert loaded.dtype == torch.float32
    assert torch.equal(logits(loaded), logits(model))
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_bfloat16_export_in_one_file_is_within_bf16_tolerance(tmp_path: Path, trained) -> None:
    model, ckpt = trained
    config_dir = tmp_path / "config"
    model.config.save_pretrained(config_dir)
    report = export_hf(str(ckpt), tmp_path / "hf", dtype="bfloat16", hf_config=config_dir, quiet=True)
    assert report.shards == ["model.safetensors"] and report.dtype == "bfloat16"
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]  # no index for one file
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16  # from the config written beside the weights
    assert report.bytes == sum(t.numel() * 2 for t in model.state_dict().values())
    expected = logits(model)
    got = logits(loaded).float()
    assert not torch.equal(got, expected)  # it really went through bfloat16
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2)


def test_float16_export_converts_every_tensor(tmp_path: Path, trained) -> None:
    from safetensors.torch import load_file

    model, ckpt = trained
    export_hf(str(ckpt), tmp_path / "hf", dtype="float16", max_shard_size=30_000, quiet=True)
    tensors = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        tensors.update(load_file(shard))
    assert tensors.keys() == model.state_dict().keys()
    for name, t in model.state_dict().items():
        assert tensors[name].dtype == torch.float16 and torch.equal(tensors[name], t.half()), name
    assert all(os.path.getsize(p) <= 30_000 + 4096 for p in (tmp_path / "hf").glob("*.safetensors"))


def test_one_part_of_a_step_made_of_components(tmp_path: Path) -> None:
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path / "ckpt"), "run_name": new_run_name(),
                                             "components": ["actor_train", "pipeline"]}})
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(cfg, component="actor_train", quiet=True) as actor, \
            CheckpointManager(cfg, component="pipeline", quiet=True) as pipeline:
        train(model, opt, 2)
        actor.save(2, {"model": model, "optimizer": opt}, final=True)
        step = Path(pipeline.save(2, {"driver": DriverState(step=2)}, final=True)).parent
    with pytest.raises(RollCkptError, match="made of components.*--component"):
        export_hf(str(step), tmp_path / "hf", quiet=True)
    with pytest.raises(CheckpointNotFoundError, match="no part for component 'critic'"):
        export_hf(str(step), tmp_path / "hf", component="critic", quiet=True)
    with pytest.raises(RollCkptError, match="holds no tensors to export.*DriverState"):
        export_hf(str(step), tmp_path / "hf", component="pipeline", quiet=True)
    model.config.save_pretrained(tmp_path / "config")
    report = export_hf(str(step), tmp_path / "hf", component="actor_train", max_shard_size="30KB",
                       hf_config=tmp_path / "config", quiet=True)
    assert report.component == "actor_train" and report.step == 2 and len(report.shards) > 1
    loaded = from_pretrained(tmp_path / "hf")
    assert torch.equal(logits(loaded), logits(model))


# --------------------------------------------------------------------------- bad input


def test_a_state_key_that_is_not_a_module_is_named(capsys, tmp_path: Path, trained) -> None:
    _, ckpt = trained
    out = str(tmp_path / "hf")
    rc, _, err = run_cli(capsys, "export", str(ckpt), "--format", "hf", "--out", out, "--key", "critic")
    assert_one_line_error(rc, err, 1, "no module under the state key 'critic'", "model, optimizer", "--key")
    rc, _, err = run_cli(capsys, "export", str(ckpt), "--format", "hf", "--out", out, "--key", "optimizer")
    assert_one_line_error(rc, err, 1, "state key 'optimizer' holds nested values", "--key")
    assert not os.path.exists(out) and not list(tmp_path.glob("hf.tmp-*"))


def test_an_existing_folder_is_refused_unless_overwrite(capsys, tmp_path: Path, trained) -> None:
    model, ckpt = trained
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"stale")
    model.config.save_pretrained(tmp_path / "config")
    args = ["export", str(ckpt), "--format", "hf", "--out", str(out), "--hf-config", str(tmp_path / "config")]
    rc, _, err = run_cli(capsys, *args)
    assert_one_line_error(rc, err, 1, f"--out {out} already exists", "--overwrite")
    rc, _, err = run_cli(capsys, *args, "--overwrite")
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # the stale shard went with the old folder
    assert not [p for p in tmp_path.iterdir() if ".old-" in p.name or ".tmp-" in p.name]
    assert torch.equal(logits(from_pretrained(out)), logits(model))
    capsys.readouterr()  # transformers' own progress bar
    (out / "data").mkdir()  # not something a Hugging Face folder holds: never replaced
    rc, _, err = run_cli(capsys, *args, "--overwrite")
    assert_one_line_error(rc, err, 1, "holds 'data'", "remove it yourself")
    assert (out / "model.safetensors").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--only", "model"], "--only: only with --format safetensors"),
    (["--dtype", "bfloat16", "--format", "safetensors"], "--dtype: only with --format hf"),
    (["--max-shard-size", "5XB"], "'5XB' is not a size"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
])
def test_option_mistakes_are_usage_errors(capsys, tmp_path: Path, trained, argv: list[str], needle: str) -> None:
    _, ckpt = trained
    fmt = [] if "--format" in argv else ["--format", "hf"]
    rc, _, err = run_cli(capsys, "export", str(ckpt), *fmt, "--out", str(tmp_path / "hf"), *argv)
    assert_one_line_error(rc, err, 2, needle)


def test_hf_config_without_config_json_is_refused(capsys, tmp_path: Path, trained) -> None:
    _, ckpt = trained
    (tmp_path / "cfg").mkdir()
    rc, _, err = run_cli(capsys, "export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf"),
                         "--hf-config", str(tmp_path / "cfg"))
    assert_one_line_error(rc, err, 1, "no config.json")


def test_out_must_be_a_local_folder(capsys, trained) -> None:
    _, ckpt = trained
    rc, _, err = run_cli(capsys, "export", str(ckpt), "--format", "hf", "--out", "s3://bucket/model")
    assert_one_line_error(rc, err, 1, "--out s3://bucket/model", "writes a local folder")


def test_a_damaged_checkpoint_is_refused_before_anything_is_written(capsys, tmp_path: Path, trained) -> None:
    _, ckpt = trained
    data = next((ckpt / "dcp").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    rc, _, err = run_cli(capsys, "export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert_one_line_error(rc, err, 1, "is damaged", data.name, "checksum")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("hf")]


def test_a_disk_that_fills_mid_export_leaves_nothing(capsys, tmp_path: Path, tmpfs) -> None:
    model, ckpt = train_and_save(tmp_path / "ckpt", steps=1, hidden_size=64, intermediate_size=256,
                                  num_hidden_layers=4)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    disk = tmpfs("256k")  # room for a few 64 KB shards, not for the ~1 MB model
    assert nbytes > 2 * 256 * 1024
    out = disk / "hf"
    rc, _, err = run_cli(capsys, "export", str(ckpt), "--format", "hf", "--out", str(out), "--max-shard-size", "64KB")
    assert_one_line_error(rc, err, 1, "no space left", str(out), "nothing was left there")
    assert os.listdir(disk) == []  # the temporary folder (and its shards) removed
    rc, _, err = run_cli(capsys, "export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf"),
                         "--max-shard-size", "64KB")
    assert rc == 0, err  # the checkpoint itself is fine


# --------------------------------------------------------------------------- memory


_MEASURE = """
import json, sys, threading, time
import psutil
from roll_ckpt import export_hf
# imported before the base is taken
import roll_ckpt.hf.export, roll_ckpt.dcp.reader, roll_ckpt.format.manifest, roll_ckpt.cli._common
import huggingface_hub, safetensors.torch, torch.distributed.checkpoint.state_dict_loader
proc = psutil.Process()
base = peak = proc.memory_info().rss
done = threading.Event()

def sample():
    global peak
    while not done.is_set():
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.001)

t = threading.Thread(target=sample)
t.start()
report = export_hf(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3], quiet=True)
done.set()
t.join()
print(json.dumps({"extra": peak - base, "shards": len(report.shards), "bytes": report.bytes}))
"""


def test_memory_is_bounded_by_a_shard_not_the_model(tmp_path: Path, py) -> None:
    """Models of 96 and 288 MiB exported in 4 MiB shards, each in a fresh process: the export's
    extra peak RSS is a few shards plus a constant (plugins, DCP's first use: ~20 MiB on torch
    2.13, ~60 MiB on 2.8's CUDA build), so the larger model adds little to it; holding the
    model would add at least the 192 MiB between them."""
    pytest.importorskip("psutil")
    extra = {}
    for layers in (24, 72):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)])
        cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path / f"ckpt{layers}"),
                                                 "timestamp_subdir": False}})
        with CheckpointManager.from_config(cfg, quiet=True) as manager:
            ckpt = manager.save(1, {"model": model}, final=True)
        del model
        proc = py(["-c", _MEASURE, ckpt, str(tmp_path / f"hf{layers}"), "4MiB"], timeout=150)
        assert proc.returncode == 0, proc.stderr[-3000:]
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        assert r["shards"] == layers and r["bytes"] == layers * 1024 * 1024 * 4
        extra[layers] = r["extra"]
    print(f"\nexport in 4 MiB shards, extra peak RSS: 96 MiB model {extra[24] / 2**20:.1f} MiB, "
          f"288 MiB model {extra[72] / 2**20:.1f} MiB")
    assert extra[24] < 96 * 2**20, f"extra peak RSS {extra[24] / 2**20:.1f} MiB for a 96 MiB model"
    assert extra[72] - extra[24] < 48 * 2**20, f"the 192 MiB larger model took {(extra[72] - extra[24]) / 2**20:.1f} MiB more"
