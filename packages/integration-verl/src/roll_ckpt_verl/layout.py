"""verl's names for what its FSDP checkpoint manager, ``CheckpointHandler`` and PPO trainer
write (verl 0.9.1): shared by the format (:mod:`roll_ckpt_verl.verl_format`), the loader
(:mod:`roll_ckpt_verl.migrate`) and the steps (:mod:`roll_ckpt_verl.steps`)."""

from __future__ import annotations

__all__ = ["FOLDER_PATTERN", "KINDS", "FSDP_CONFIG", "HF_DIR", "TRACKER", "DATA", "rank_file"]

FOLDER_PATTERN = r"^global_step_(\d+)$"
"""verl's step folders (``global_step_{step}``; verl takes the step from the name)."""
KINDS = ("model", "optim", "extra_state")
"""The per-rank files of a verl FSDP checkpoint, by the prefix of their names."""
FSDP_CONFIG = "fsdp_config.json"
"""``{"FSDP_version", "world_size"}``, written by rank 0 after its files."""
HF_DIR = "huggingface"
"""A part's Hugging Face folder: config and tokenizer (and the weights, with ``hf_model``)."""
TRACKER = "latest_checkpointed_iteration.txt"
"""The step verl resumes from (``resume_mode: auto``), at the checkpoint folder's root."""
DATA = "data.pt"
"""The PPO trainer's dataloader state at the step's folder (``data_<dp>.pt`` for the SFT handler)."""


def rank_file(kind: str, world_size: int, rank: int) -> str:
    """verl's name for rank ``rank``'s file of ``kind`` (:data:`KINDS`) at world size ``world_size``."""
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"
