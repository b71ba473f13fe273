"""MoE models in the hub's layout both ways (roll_ckpt/format/hub_layout.py): transformers 5 fuses
an MoE layer's experts, the hub (save_pretrained, published checkpoints) has one tensor per
expert, as transformers 4's modules do. ``export --format hf`` writes exactly what ``save_pretrained`` writes (names, shapes,
shards, the index with ``total_parameters``, the tensors bit for bit) and ``from_pretrained``
gives the exact float32 logits; ``initial_load`` reads a ``save_pretrained`` folder of the
hub's layout into the module. An architecture whose rules cannot be applied tensor by tensor
is refused with its name and the keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roll_ckpt import CheckpointManager, export_hf, load_config
from roll_ckpt.errors import RollCkptError

pytest.importorskip("transformers")

from roll_ckpt.runtime.transformers_compat import converts_weights  # noqa: E402

from ._hf_helpers import (assert_same_as_save_pretrained, expected_total_parameters, from_pretrained,  # noqa: E402
                          logits, tiny_llama, tiny_moe, train)
pytestmark = pytest.mark.timeout(180)

FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")


def _saved(root: Path, model: torch.nn.Module) -> Path:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = load_config({"checkpoint_config": {"output_dir": str(root), "timestamp_subdir": False}})
    with CheckpointManager.from_config(cfg, quiet=True) as manager:
        train(model, opt, 2)
        return Path(manager.save(2, {"model": model, "optimizer": opt}, final=True))


@pytest.mark.parametrize("family", [*FAMILIES, "llama_tied"])
@pytest.mark.parametrize("shard", ["20KB", "5GB"])
def test_export_writes_what_save_pretrained_writes(tmp_path: Path, family: str, shard: str) -> None:
    model = tiny_llama(tied=True) if family == "llama_tied" else tiny_moe(family)
    ckpt = _saved(tmp_path / "ckpt", model)
    config_dir = tmp_path / "config"
    model.config.save_pretrained(config_dir)
    report = export_hf(str(ckpt), tmp_path / "hf", hf_config=config_dir, max_shard_size=shard, quiet=True)
    index = assert_same_as_save_pretrained(tmp_path / "hf", model, shard, tmp_path)
    if shard == "20KB":
        assert index["metadata"].get("total_parameters") == expected_total_parameters(model)
        assert len(report.shards) > 1
    if family != "llama_tied":
        assert any(".experts.0." in name for name in report_names(tmp_path / "hf"))  # one tensor per expert
    assert torch.equal(logits(from_pretrained(tmp_path / "hf")), logits(model))


def report_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            names |= set(f.keys())
    return names


@pytest.mark.parametrize("family", FAMILIES)
def test_initial_load_reads_a_hub_layout_folder(tmp_path: Path, family: str) -> None:
    source = tiny_moe(family, seed=0)
    source.save_pretrained(tmp_path / "hub", max_shard_size="20KB")
    assert not any("gate_up_proj" in n for n in report_names(tmp_path / "hub"))  # the hub's layout
    model = tiny_moe(family, seed=1)
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path / "ckpt"),
                                             "initial_load": {"path": str(tmp_path / "hub"), "format": "hf"}}})
    with CheckpointManager.from_config(cfg, quiet=True) as manager:
        assert manager.resume({"model": model}) == 0
    expected = source.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())
    assert torch.equal(logits(model), logits(source))


def test_a_wrong_expert_count_is_named(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from ._hf_helpers import moe_config

    tiny_moe("qwen2_moe").save_pretrained(tmp_path / "hub")
    config = moe_config("qwen2_moe")
    config.num_experts = 2
    model = AutoModelForCausalLM.from_config(config)
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path / "ckpt"),
                                             "initial_load": {"path": str(tmp_path / "hub"), "format": "hf"}}})
    with CheckpointManager.from_config(cfg, quiet=True) as manager, pytest.raises(RollCkptError) as info:
        manager.resume({"model": model})
    assert "Qwen2MoeForCausalLM" in str(info.value) and "experts.2." in str(info.value)


@pytest.mark.skipif(not converts_weights(), reason="transformers 4.x has no weight-conversion rules "
                    "(transformers.conversion_mapping and core_model_loading came with 5.0)")
def test_an_architecture_that_cannot_be_converted_is_named(tmp_path: Path) -> None:
    """Rules that make one hub tensor of several (q, k, v into qkv) cannot be applied tensor
    by tensor: refused with the architecture and the keys."""
    from transformers import LlamaForCausalLM
    from transformers import conversion_mapping as cm
    from transformers.core_model_loading import Chunk, WeightConverter

    from roll_ckpt.format.hub_layout import hub_layout, meta_model

    class FusedQKVLlamaForCausalLM(LlamaForCausalLM):
        pass

    if not hasattr(cm, "USER_REGISTERED_MAPPINGS"):
        pytest.skip("this transformers (5.2) looks conversion rules up by model_type only: a rule for one "
                    "architecture cannot be registered without changing every Llama")

    cm.register_checkpoint_conversion_mapping("FusedQKVLlamaForCausalLM", [WeightConverter(
        source_patterns=["self_attn.qkv_proj.weight"],
        target_patterns=["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        operations=[Chunk(dim=0)])])
    try:
        model = FusedQKVLlamaForCausalLM(tiny_llama(num_key_value_heads=4).config)
        sizes = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}
        with pytest.raises(RollCkptError) as info:
            hub_layout(meta_model(model), sizes, 1 << 30)
        msg = str(info.value)
        assert "FusedQKVLlamaForCausalLM" in msg and "self_attn" in msg and "save_pretrained" in msg
    finally:
        cm._checkpoint_conversion_mapping_cache.pop("FusedQKVLlamaForCausalLM", None)
        cm.USER_REGISTERED_MAPPINGS.discard("FusedQKVLlamaForCausalLM")
