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
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), **kwargs).eval()
