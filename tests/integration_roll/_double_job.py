"""A driver of the ROLL test double (tests/integration_roll/roll_double, on PYTHONPATH): a
ToyPipeline on a local Ray cluster, as a ROLL launch would run it.

    python _double_job.py --model DIR --output DIR --ckpt-root DIR --result FILE
        [--max-steps N] [--save-steps N] [--resume PATH|true] [--critic] [--world-size N]
        [--roll-ckpt] [--offload-backend local] [--max-ckpt-to-keep N]

Builds the tiny Llama folder (model + offline tokenizer) at --model if it has none, runs the
pipeline (resuming from --resume, a checkpoint folder, or ``true``: ROLL's own value) and
writes --result (JSON): the launch's checkpoint folder, the pipeline state after __init__,
and every cluster's state digests (all ranks) after __init__ and after each step.

``--roll-ckpt``: ``roll_ckpt_roll.enable()`` first, as a ROLL user's entry script would call
it (before ROLL's ``init()``); then also each step's staging policies of every actor rank
(from its roll-ckpt manager). Prints ``PIDS <cluster> <pid>...`` once the pipeline is built
and ``STEP <n>`` after each step's do_checkpoint (the preemption tests signal on them). The
result is written even when the run ends early (a preemption), with ``"ended"`` saying how.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

VOCAB = 96
t0 = time.monotonic()


def make_model_folder(folder: Path) -> None:
    """A tiny untied Llama (hidden 32, 2 layers, 4 heads, 2 kv heads, vocab 96) and a WordLevel
    tokenizer built offline, saved with save_pretrained."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder)
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(VOCAB - len(specials))])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)


def _policies(worker) -> dict:
    """In an actor rank (``__ray_call__``): how its roll-ckpt manager staged the last save (its
    policies, and the staging memory it allocated in the call)."""
    part = worker.strategy.__dict__.get("_roll_ckpt")
    if part is None:
        return {}
    last = part.manager.wait() or part.manager.stats.last  # an asynchronous save: once it has finished
    return {**last.policies, "bytes_allocated": last.bytes_allocated} if last is not None else {}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--resume", default=None)
    p.add_argument("--critic", action="store_true")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--roll-ckpt", action="store_true")
    p.add_argument("--offload-backend", default=None)
    p.add_argument("--max-ckpt-to-keep", type=int, default=0)
    args = p.parse_args()

    if args.roll_ckpt:  # the one line at the top of a ROLL entry script
        import roll_ckpt_roll

        roll_ckpt_roll.enable()
    import os

    import ray

    from roll.configs import ModelArguments, PPOConfig, StrategyArguments, TrainingArguments, WorkerConfig
    from roll.distributed.scheduler.initialize import init
    from roll.pipeline.toy_pipeline import ToyPipeline

    make_model_folder(Path(args.model))

    # ROLL's own async save (dcp.async_save) stages with tensor.to("cpu"), which on torch 2.6 copies
    # nothing of a CPU tensor: its writer thread then writes the live state while the next step
    # changes it (on a GPU the staging copies). So on a CPU before torch 2.8, ROLL's own runs save
    # synchronously, and the checkpoint holds the step it names; roll-ckpt's runs stay async.
    import torch

    roll_async = args.roll_ckpt or tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)

    def worker_config(actor: bool) -> WorkerConfig:
        strategy_config = {"async_save_ckpt": roll_async}
        if actor and args.offload_backend:
            strategy_config["offload_backend"] = args.offload_backend
        return WorkerConfig(model_args=ModelArguments(model_name_or_path=args.model),
                            training_args=TrainingArguments(learning_rate=1e-3, lr_scheduler_type="linear"),
                            strategy_args=StrategyArguments("fsdp2_train", strategy_config),
                            world_size=args.world_size)

    resume = True if args.resume == "true" else (args.resume or False)
    cfg = PPOConfig(exp_name="roll_double", seed=42, output_dir=args.output, max_steps=args.max_steps,
                    save_steps=args.save_steps, resume_from_checkpoint=resume, max_ckpt_to_keep=args.max_ckpt_to_keep,
                    checkpoint_config={"type": "file_system", "output_dir": args.ckpt_root},
                    actor_train=worker_config(True), critic=worker_config(False) if args.critic else None)
    result: dict = {"checkpoint_output_dir": cfg.checkpoint_config["output_dir"], "digests": {}}

    class RecordingPipeline(ToyPipeline):
        """Records every cluster's digests at each step's do_checkpoint (before it saves)."""

        def digests(self) -> dict:
            return {c.cluster_name: c.execute_all_sync("get_state_digest") for c in self.clusters}

        def do_checkpoint(self, global_step, is_last_step=None):
            result["digests"][str(global_step)] = self.digests()  # the state this step's checkpoint holds
            super().do_checkpoint(global_step, is_last_step)
            if args.roll_ckpt:
                refs = [w.__ray_call__.remote(_policies) for w in self.actor_train.workers]
                result.setdefault("policies", {})[str(global_step)] = ray.get(refs)
            print(f"STEP {global_step}", flush=True)

    phases = result["phases"] = {"imports_and_model": time.monotonic() - t0}
    init()
    phases["ray_init"] = time.monotonic() - t0
    pipeline = None
    try:
        pipeline = RecordingPipeline(cfg)
        phases["pipeline_init"] = time.monotonic() - t0
        for cluster in pipeline.clusters:
            pids = ray.get([w.__ray_call__.remote(lambda w: os.getpid()) for w in cluster.workers])
            print(f"PIDS {cluster.cluster_name} {' '.join(map(str, pids))}", flush=True)
        result["resume_from_checkpoint"] = str(cfg.resume_from_checkpoint)
        result["after_init"] = pipeline.digests()
        result["state_after_init"] = {"step": pipeline.state.step, "log_history": len(pipeline.state.log_history),
                                      "kv": copy.deepcopy(pipeline.state.kv)}
        result["ended"] = "running"
        try:
            pipeline.run()
        except SystemExit as exc:  # roll_ckpt.Preempted, or the handler it held back (Ray's sys.exit)
            result["ended"] = f"{type(exc).__name__}({exc.code})"
            raise
        finally:
            if result["ended"] == "running":
                result["ended"] = "done"
                pipeline.wait_for_checkpoint_uploads()
            phases["run"] = time.monotonic() - t0
            result["seconds"] = time.monotonic() - t0
            Path(args.result).write_text(json.dumps(result, indent=1))
    finally:
        if pipeline is not None:
            pipeline.shutdown()
        ray.shutdown()
    print(f"phases (s since start): {json.dumps({k: round(v, 1) for k, v in phases.items()})}, "
          f"shutdown {time.monotonic() - t0:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
