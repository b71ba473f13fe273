"""Checks the ROLL integration tests share: ROLL's tree and DCP keys, state digests."""

from __future__ import annotations

from pathlib import Path

N_PARAMS = 21       # the tiny Llama: embed, 2 x 9 per layer, norm, lm_head
HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
DCP_FILES = {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"}
PIPELINE_FILES = {"pipeline/worker_state_pipeline.json", "pipeline/rng_state_pipeline.pth"}


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def dcp_keys(folder: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def hf_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def rank0(digests: dict, cluster: str = "actor_train") -> dict:
    """Rank 0's digests, after checking that both ranks hold the same model and optimizer."""
    ranks = digests[cluster]
    assert len(ranks) == 2
    for key in ("params", "optimizer", "optimizer_entries", "scheduler"):
        assert ranks[0][key] == ranks[1][key], key
    return ranks[0]


def check_roll_keys(dcp: Path, hf: Path) -> None:
    """ROLL's DCP keys: the model's parameters at the top level (the HF names), torch's
    optimizer state dict under optimizer.*, the scheduler's, and the four RNG entries."""
    keys = dcp_keys(dcp)
    params = hf_keys(hf)
    assert params <= keys
    own = keys - params
    assert {k for k in own if k.startswith("optimizer.state.")} == {
        f"optimizer.state.{i}.{name}" for i in range(len(params)) for name in ("exp_avg", "exp_avg_sq", "step")}
    assert {"optimizer.param_groups.0.params", "optimizer.param_groups.0.lr", "scheduler.last_epoch",
            "scheduler.base_lrs"} <= own
    assert {k for k in own if k.startswith("rng_state.")} == {f"rng_state.{k}" for k in ("cpu", "device", "numpy", "random")}
    assert all(k.startswith(("optimizer.", "scheduler.", "rng_state.")) for k in own)


