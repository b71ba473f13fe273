"""``checkpoint_config.initial_load``: a ``save_pretrained`` folder (transformers' own
writer) loaded into a fresh model on a fresh start, checked as a resume is."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_ckpt import CheckpointManager, load_config
from roll_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError, RollCkptError

from ._hf_helpers import logits, tiny_llama, train

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)


def _manager(tmp_path: Path, folder: Path, **top: Any) -> CheckpointManager:
    cc = {"output_dir": str(tmp_path / "ckpt"), "initial_load": {"path": str(folder), "format": "hf"}}
    cc.update(top.pop("cc", {}))
    return CheckpointManager.from_config(load_config({"checkpoint_config": cc, **top}), quiet=True)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _pretrained(tmp_path: Path, name: str = "hf", shard: str = "20KB", **kwargs: Any) -> tuple[Any, Path]:
    model = tiny_llama(seed=0, **kwargs)
    folder = tmp_path / name
    model.save_pretrained(folder, max_shard_size=shard)
    return model, folder


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("shard", ["20KB", "5GB"], ids=["sharded", "single-file"])
def test_a_save_pretrained_folder_gives_identical_parameters(caplog, tmp_path: Path, tied: bool, shard: str) -> None:
    source, folder = _pretrained(tmp_path, shard=shard, tied=tied)
    assert (folder / "model.safetensors.index.json").exists() == (shard == "20KB")
    model = tiny_llama(seed=1, tied=tied)
    assert not _same(model, source)
    with caplog.at_level(logging.INFO, logger="roll_ckpt"), _manager(tmp_path, folder) as manager:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert manager.resume({"model": model, "optimizer": opt}) == 0
    assert _same(model, source)
    assert torch.equal(logits(model), logits(source))
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tensor
    assert f"loaded the initial weights of state['model'] from {folder}" in caplog.text


def test_dtypes_are_converted_to_the_models(tmp_path: Path) -> None:
    source = tiny_llama(seed=0).to(torch.bfloat16)
    source.save_pretrained(tmp_path / "hf")
    model = tiny_llama(seed=1)
    with _manager(tmp_path, tmp_path / "hf") as manager:
        assert manager.resume({"model": model}) == 0
        report = manager._resumer.initial_load
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())
    expected = {k: v.float() for k, v in source.state_dict().items()}
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert report.converted["lm_head.weight"] == "BF16 -> float32"


def test_a_checkpoint_to_resume_wins_over_the_initial_weights(tmp_path: Path) -> None:
    _, folder = _pretrained(tmp_path)
    trained = tiny_llama(seed=2)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    with _manager(tmp_path, folder) as manager:
        train(trained, opt, 1)
        manager.save(4, {"model": trained, "optimizer": opt}, final=True)
    model = tiny_llama(seed=3)
    with _manager(tmp_path, folder, resume_from_checkpoint="latest") as manager:
        assert manager.resume({"model": model, "optimizer": torch.optim.AdamW(model.parameters())}) == 4
        assert manager._resumer.initial_load is None
    assert _same(model, trained)


def test_another_state_key(tmp_path: Path) -> None:
    source, folder = _pretrained(tmp_path)
    model = tiny_llama(seed=1)
    with _manager(tmp_path, folder, cc={"initial_load": {"path": str(folder), "format": "hf", "key": "policy"}}) as m:
        assert m.resume({"policy": model}) == 0
    assert _same(model, source)
    with _manager(tmp_path, folder) as m, pytest.raises(RollCkptError, match=r"initial_load.key 'model'.*'policy'"):
        m.resume({"policy": model})


# --------------------------------------------------------------------------- bad folders


def _refused(tmp_path: Path, folder: Path, error: type, *needles: str, **kwargs: Any) -> None:
    """``resume`` raises ``error`` with one line holding every needle, and leaves the model untouched."""
    model = tiny_llama(seed=1, **kwargs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with _manager(tmp_path, folder) as manager, pytest.raises(error) as info:
        manager.resume({"model": model})
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    _, folder = _pretrained(tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    _refused(tmp_path, folder, CheckpointCorruptError, "model.safetensors.index.json",
             f"the folder does not have: {shard.name}")


def test_an_index_that_does_not_match_its_files_is_named(tmp_path: Path) -> None:
    _, folder = _pretrained(tmp_path)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    moved = "model.norm.weight"
    actual = index["weight_map"][moved]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != actual)
    index["weight_map"][moved] = other
    index_path.write_text(json.dumps(index))
    _refused(tmp_path, folder, CheckpointCorruptError, f"{other}: lacks {moved}, which the index maps to it",
             f"{actual}: holds {moved}, which the index does not map to it")


def test_a_folder_without_safetensors_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"a pickle")
    _refused(tmp_path, folder, CheckpointNotFoundError, "neither model.safetensors nor",
             "pickled weights (pytorch_model.bin)")
    _refused(tmp_path, tmp_path / "nowhere", CheckpointNotFoundError, "no such folder")


def test_a_damaged_shard_is_named(tmp_path: Path) -> None:
    _, folder = _pretrained(tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:40])
    _refused(tmp_path, folder, CheckpointCorruptError, shard.name, "not a readable safetensors file")


def test_a_shape_mismatch_is_named(tmp_path: Path) -> None:
    _, folder = _pretrained(tmp_path, intermediate_size=48)
    _refused(tmp_path, folder, RollCkptError, "shape mismatch",
             "'model.layers.0.mlp.gate_proj.weight' is [48, 32] in model-0000", "the module's is [64, 32]")


def test_missing_and_unexpected_keys_are_named(tmp_path: Path) -> None:
    _, folder = _pretrained(tmp_path, num_hidden_layers=1)
    _refused(tmp_path, folder, RollCkptError, "missing 9 key(s) (the module's, not in the folder): model.layers.1.self_attn.q_proj.weight")
    _, folder = _pretrained(tmp_path, name="hf3", num_hidden_layers=3)
    _refused(tmp_path, folder, RollCkptError, "unexpected 9 key(s) (the folder's, not in the module): model.layers.2.")


def test_an_untied_folder_into_a_tied_model_is_refused(tmp_path: Path) -> None:
    _, folder = _pretrained(tmp_path, name="untied")  # lm_head differs from the embeddings
    _refused(tmp_path, folder, RollCkptError, "'model.embed_tokens.weight' and 'lm_head.weight' are one tensor",
             "saved from an untied model", tied=True)
    tied = tiny_llama(seed=0, tied=True)  # an export of a tied model writes both names, equal: accepted
    from safetensors.torch import save_file

    (tmp_path / "both").mkdir()
    save_file({k: v.clone() for k, v in tied.state_dict().items()}, str(tmp_path / "both" / "model.safetensors"))
    model = tiny_llama(seed=1, tied=True)
    with _manager(tmp_path, tmp_path / "both") as manager:
        assert manager.resume({"model": model}) == 0
    assert _same(model, tied)
