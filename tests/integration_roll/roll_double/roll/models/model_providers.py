"""roll/models/model_providers.py, reduced: the tokenizer and the two model providers the
FSDP2 workers use (the actor's causal LM, the critic's value model). No LoRA, no remote
code, no meta-device init (ROLL builds on the meta device and broadcasts rank 0's weights)."""

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from roll.utils.checkpoint_manager import download_model
from roll_ckpt.runtime.transformers_compat import dtype_argument  # dtype= since transformers 4.56, torch_dtype= before


def default_tokenizer_provider(model_args, model_name_or_path: str = None):
    model_name_or_path = download_model(model_name_or_path or model_args.model_name_or_path)
    return AutoTokenizer.from_pretrained(model_name_or_path, use_fast=True, split_special_tokens=False,
                                         padding_side="left")


def default_actor_model_provider(tokenizer, model_args, is_trainable: bool = False, **kwargs):
    path = download_model(model_args.model_name_or_path)
    return AutoModelForCausalLM.from_pretrained(path, **{dtype_argument(): torch.float32}, **model_args.model_config_kwargs)


def default_value_model_provider(tokenizer, model_args, is_trainable: bool = False, **kwargs):
    """ROLL's value model: AutoModelForTokenClassification with num_labels (1)."""
    path = download_model(model_args.model_name_or_path)
    return AutoModelForTokenClassification.from_pretrained(path, num_labels=model_args.num_labels,
                                                           **{dtype_argument(): torch.float32}, **model_args.model_config_kwargs)
