"""The tests' small training jobs: config builders and one training step.

torch is imported when a step runs, so that config-only users stay light.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

# Config's own top-level keys; every other key given to config() belongs to checkpoint_config.
TOP_LEVEL = frozenset({"exp_name", "seed", "resume_from_checkpoint", "max_steps", "save_steps",
                       "strategy_config", "offload_backend"})


def config(output_dir: str | os.PathLike[str], /, *, async_save: bool | None = None, **keys: Any) -> Any:
    """A loaded :class:`roll_ckpt.Config` whose checkpoints go to ``output_dir``.

    ``keys`` named in :data:`TOP_LEVEL` are top-level keys, every other one (``type``,
    ``max_ckpt_to_keep``, ``components``, ``run_name``, ``backup``, ...) a key of
    ``checkpoint_config`` (``type`` is ``file_system`` unless given; an ``output_dir`` among them
    wins over the positional one). ``async_save`` sets ``strategy_config.async_save_ckpt``.
    """
    from roll_ckpt import load_config

    checkpoint: dict[str, Any] = {"type": "file_system", "output_dir": str(output_dir)}
    top: dict[str, Any] = {}
    for key, value in keys.items():
        (top if key in TOP_LEVEL else checkpoint)[key] = value
    if async_save is not None:
        top["strategy_config"] = {**top.get("strategy_config", {}), "async_save_ckpt": async_save}
    return load_config({"checkpoint_config": checkpoint, **top})


def backup_config(local: str | os.PathLike[str], backup: str | os.PathLike[str], /, *,
                  storage_options: Mapping[str, Any] | None = None, resume: Any = False,
                  async_save: bool = False, **bk: Any) -> Any:
    """:func:`config` writing to ``local``, replicated to ``backup`` (its ``storage_options``;
    ``bk``: the other ``checkpoint_config.backup`` keys)."""
    backup_cfg = {"type": "file_system", "output_dir": str(backup), **bk}
    if storage_options is not None:
        backup_cfg["storage_options"] = dict(storage_options)
    return config(local, backup=backup_cfg, resume_from_checkpoint=resume, async_save=async_save)


LOSSES: dict[str, Callable[[Any], Any]] = {
    "mean_square": lambda out: out.pow(2).mean(),
    "sum": lambda out: out.sum(),
}


def train_step(state: Mapping[str, Any], inputs: Any = (3, 8), *, loss: str = "mean_square", steps: int = 1,
               scheduler: bool = False, count: tuple[str, str, int] | None = None) -> Any:
    """``steps`` training steps of ``state["model"]`` with ``state["optimizer"]``: zero the
    gradients, ``loss`` of the model's output (:data:`LOSSES`) backward, optimizer step; then
    ``state["scheduler"].step()`` with ``scheduler``, and ``state[key][name] += n`` with
    ``count=(key, name, n)``.

    ``inputs`` is a tensor, or a shape drawn with ``torch.randn`` (torch's global generator,
    before the forward pass) at every step. Returns the last loss (a tensor).
    """
    import torch

    model, optimizer = state["model"], state["optimizer"]
    out = None
    for _ in range(steps):
        x = inputs if isinstance(inputs, torch.Tensor) else torch.randn(*inputs)
        out = LOSSES[loss](model(x))
        optimizer.zero_grad()
        out.backward()
        optimizer.step()
        if scheduler:
            state["scheduler"].step()
        if count is not None:
            key, name, n = count
            state[key][name] += n
    return out


def drift(state: Mapping[str, Any], step: int) -> None:
    """A training step without autograd (fast, deterministic): every parameter of
    ``state["model"]`` moves by ``0.01 * step``; ``state["counter"]["seen"]`` counts it."""
    import torch

    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(0.01 * step)
    state["counter"]["seen"] += 1


# --------------------------------------------------------------------------- FSDP2 jobs


def mlp(width: int = 64, depth: int = 3, *, seed: int = 0) -> Any:
    """The multi-rank jobs' model, drawn after ``torch.manual_seed(seed)``: ``depth`` times
    ``Linear(16 or width, width), Dropout(0.1), ReLU()``, then ``Linear(width, 4)``."""
    import torch

    torch.manual_seed(seed)
    layers: list[Any] = []
    for i in range(depth):
        layers += [torch.nn.Linear(width if i else 16, width), torch.nn.Dropout(0.1), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 4))
    return torch.nn.Sequential(*layers)


def shard(model: Any, mesh: Any) -> Any:
    """FSDP2 (``fully_shard`` over ``mesh``) on each ``Linear`` of ``model``, then on the model."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from roll_ckpt.runtime.torch_compat import fsdp2_options

    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, **fsdp2_options(mesh.device_type))
    fully_shard(model, mesh=mesh, **fsdp2_options(mesh.device_type))
    return model


GLOO_AVG_MISSING = ("torch 2.6's gloo has no ReduceOp.AVG, with which its HSDP averages gradients over the "
                    "replicas (torch 2.8's has it)")
"""Why an HSDP job with replicas cannot train on the CPU with torch 2.6 (``torch_compat.gloo_averages``)."""


def gloo_averages() -> bool:
    from roll_ckpt.runtime.torch_compat import gloo_averages as averages

    return averages()


def optimizer_and_scheduler(model: Any) -> tuple[Any, Any]:
    """The multi-rank jobs' ``AdamW(lr=1e-2)`` and ``StepLR(step_size=3, gamma=0.7)``."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
