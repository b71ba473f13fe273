"""What the ROLL job (_job.py) and the gloo ranks (_ranks.py) share: the tiny model, ROLL's config
objects, the training batches. Imports ROLL inside functions (PYTHONPATH=ROLL_SOURCE)."""

from __future__ import annotations

import os

WORLD_SIZE = 2


def make_tiny_model(model_dir: str) -> None:
    """A tiny untied Llama (hidden 64, 2 layers, vocab 128) and a WordLevel tokenizer, built offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(model_dir, "config.json")):
        return
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, 128):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(model_dir)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)


def build_pipeline_config(model_dir: str, output_dir: str, ckpt_root: str, *, max_steps: int, save_steps: int,
                          resume_from=False, world_size: int = WORLD_SIZE, fsdp_size: int | None = None,
                          ray: bool = True):
    """ROLL's RLVRConfig with an actor_train and a critic cluster (FSDP2, fp32, AdamW, ROLL's
    schedulers); ``checkpoint_config`` as a ROLL user writes it (ROLL's __post_init__ appends the
    launch's timestamp to its output_dir, kept as it is)."""
    from roll.configs.generating_args import GeneratingArguments
    from roll.configs.model_args import ModelArguments
    from roll.configs.training_args import TrainingArguments
    from roll.configs.worker_config import StrategyArguments, WorkerConfig
    from roll.pipeline.rlvr.rlvr_config import RLVRConfig

    fsdp = fsdp_size or world_size

    def strategy(extra=None):
        return StrategyArguments(strategy_name="fsdp2_train", strategy_config={
            "fsdp_size": fsdp, "param_dtype": "fp32", "reduce_dtype": "fp32", "reshard_after_forward": True,
            "offload_policy": False, **(extra or {})})

    actor_train = WorkerConfig(
        name="actor_train",
        model_args=ModelArguments(model_name_or_path=model_dir, dtype="fp32", attn_implementation="sdpa",
                                  disable_gradient_checkpointing=True),
        training_args=TrainingArguments(learning_rate=1e-3, weight_decay=0.01, lr_scheduler_type="cosine",
                                        warmup_steps=1, max_steps=max_steps, per_device_train_batch_size=2,
                                        gradient_accumulation_steps=1),
        strategy_args=strategy(),
        device_mapping=f"list(range(0,{world_size}))",  # RLVRConfig.set_old_logprobs_status needs it
    )
    critic = WorkerConfig(
        name="critic",
        # model_type "trl" (ROLL's examples) crashes in FSDP2's _get_layers on this stack
        model_args=ModelArguments(model_name_or_path=model_dir, dtype="fp32", attn_implementation="sdpa",
                                  disable_gradient_checkpointing=True, model_type="auto_token_classification",
                                  num_labels=1),
        training_args=TrainingArguments(learning_rate=1e-3, weight_decay=0.0, lr_scheduler_type="constant",
                                        max_steps=max_steps, per_device_train_batch_size=2),
        strategy_args=strategy(),
    )
    cfg = RLVRConfig(
        exp_name="roll_source_check",
        pretrain=model_dir,
        reward_pretrain=model_dir,
        output_dir=output_dir,
        logging_dir=os.path.join(output_dir, "logs"),
        track_with="stdout",
        sequence_length=16,
        prompt_length=8,
        max_steps=max_steps,
        save_steps=save_steps,
        seed=42,
        rollout_batch_size=4,
        actor_train=actor_train,
        critic=critic,
        actor_infer=WorkerConfig(generating_args=GeneratingArguments()),
        checkpoint_config={"type": "file_system", "output_dir": ckpt_root},
        resume_from_checkpoint=resume_from,
    )
    if ray:  # CPU-only Ray: workers must not ask for GPUs
        for w in (cfg.actor_train, cfg.critic):
            w.device_mapping = None
            w.world_size = world_size
        cfg.num_gpus_per_node = 0
        cfg.num_nodes = 1  # RLVRConfig computes 2 from the device mappings
    return cfg


def make_ppo_batch(step: int, bsz: int = 4, seqlen: int = 16):
    """The step's batch for ActorWorker/CriticWorker.train_step, the same in every run."""
    import torch
    from roll.distributed.scheduler.protocol import DataProto

    g = torch.Generator().manual_seed(100 + step)
    input_ids = torch.randint(4, 128, (bsz, seqlen), generator=g)
    response_mask = torch.zeros(bsz, seqlen, dtype=torch.long)
    response_mask[:, seqlen // 2:] = 1
    batch = DataProto.from_single_dict({
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "position_ids": torch.arange(seqlen).unsqueeze(0).expand(bsz, -1).clone(),
        "response_mask": response_mask,
        "old_log_probs": -torch.rand(bsz, seqlen - 1, generator=g) - 4.0,
        "ref_log_probs": -torch.rand(bsz, seqlen - 1, generator=g) - 4.0,
        "advantages": torch.randn(bsz, seqlen - 1, generator=g),
        "values": torch.randn(bsz, seqlen - 1, generator=g),
        "returns": torch.randn(bsz, seqlen - 1, generator=g),
    })
    batch.meta_info = {"global_step": step, "loss_mask_keys": ["response_mask"], "is_offload_states": False}
    return batch
