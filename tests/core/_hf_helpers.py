"""Tiny Llama models (transformers' own ``LlamaForCausalLM``) trained under roll-ckpt, for
the Hugging Face export and initial-load tests. Built from a config in milliseconds; no
download."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from roll_ckpt import CheckpointManager, load_config

VOCAB = 96


def llama_config(tied: bool = False, **overrides: Any) -> Any:
    from transformers import LlamaConfig

    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    shape.update(overrides)
    return LlamaConfig(tie_word_embeddings=tied, **shape)


def tiny_llama(tied: bool = False, seed: int = 0, **overrides: Any) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(tied, **overrides)).eval()


def tokens(seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def train(model: Any, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    model.train()
    for step in range(steps):
        x = tokens(seed=step)
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def logits(model: Any, x: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens() if x is None else x).logits


def train_and_save(root: Path, tied: bool = False, steps: int = 3, **overrides: Any) -> tuple[Any, Path]:
    """A tiny Llama trained ``steps`` steps with AdamW and saved (state ``model`` +
    ``optimizer``) as ``root/checkpoint-<steps>``; returns the model and the checkpoint."""
    model = tiny_llama(tied, **overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = load_config({"checkpoint_config": {"output_dir": str(root), "timestamp_subdir": False}})
    with CheckpointManager.from_config(cfg, quiet=True) as manager:
        train(model, opt, steps)
        path = manager.save(steps, {"model": model, "optimizer": opt}, final=True)
    return model, Path(path)


def from_pretrained(folder: Path, **kwargs: Any) -> Any:
    """``from_pretrained`` in the dtype of the folder's config, as transformers 5 loads by default
    (transformers 4 loads float32 unless told ``torch_dtype="auto"``)."""
    from transformers import AutoModelForCausalLM

    from roll_ckpt.runtime.transformers_compat import dtype_argument

    kwargs.setdefault(dtype_argument(), "auto")
    return AutoModelForCausalLM.from_pretrained(str(folder), **kwargs).eval()


def assert_same_as_save_pretrained(folder: Path, model: Any, max_shard_size: Any, tmp: Path) -> dict[str, Any]:
    """``folder`` holds what ``model.save_pretrained(max_shard_size=...)`` writes: the same
    shard files, the same index (names, files, ``total_size``, ``total_parameters``), the
    same tensors bit for bit. Returns save_pretrained's index (``None`` for one file)."""
    import json
    import os

    from safetensors import safe_open

    ref = tmp / "save_pretrained"
    model.save_pretrained(ref, max_shard_size=max_shard_size)
    shards = sorted(p.name for p in Path(folder).glob("*.safetensors"))
    assert shards == sorted(p.name for p in ref.glob("*.safetensors"))
    index_name = "model.safetensors.index.json"
    assert os.path.exists(Path(folder) / index_name) == os.path.exists(ref / index_name)
    index = None
    if os.path.exists(ref / index_name):
        index = json.loads((ref / index_name).read_text())
        assert json.loads((Path(folder) / index_name).read_text()) == index
    for shard in shards:
        with safe_open(str(Path(folder) / shard), framework="pt") as mine, \
                safe_open(str(ref / shard), framework="pt") as theirs:
            assert mine.metadata() == theirs.metadata() == {"format": "pt"}
            assert sorted(mine.keys()) == sorted(theirs.keys()), shard
            for k in theirs.keys():
                a, b = mine.get_tensor(k), theirs.get_tensor(k)
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), k
    return index


def expected_total_parameters(model: Any) -> int | None:
    """What ``save_pretrained``'s index says in ``metadata.total_parameters`` (nothing before
    transformers 4.53)."""
    from roll_ckpt.runtime.transformers_compat import index_has_total_parameters

    return model.num_parameters() if index_has_total_parameters() else None


def moe_config(family: str) -> Any:
    """A tiny config of an MoE family whose experts transformers 5 fuses (the hub has one
    tensor per expert): ``qwen2_moe``, ``qwen3_moe``, ``mixtral``."""
    import transformers

    shape = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=16,
                                           shared_expert_intermediate_size=32, num_experts=4, **shape)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                           head_dim=8, **shape)
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, **shape)
    raise ValueError(family)


def tiny_moe(family: str, seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family)).eval()
    model.config.architectures = [type(model).__name__]
    return model
