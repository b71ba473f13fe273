"""roll/distributed/strategy/fsdp2_strategy.py: FSDP2StrategyBase (checkpoint save/load,
RNG, load/offload), FSDP2InferStrategy (FSDP2 configuration and wrapping) and
FSDP2TrainStrategy (initialize: model, AdamW, scheduler; train_step). CPU and gloo only."""

import logging
import os
import random
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import optim
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grad_norm_
from transformers import get_scheduler, set_seed

from roll.distributed.strategy.strategy import InferenceStrategy, TrainStrategy
from roll.models.model_providers import default_tokenizer_provider
from roll.utils.checkpoint_manager import CheckpointManager

logger = logging.getLogger("roll")


class FSDP2StrategyBase(InferenceStrategy):
    def __init__(self, worker):
        super().__init__(worker)
        self.cpu_offload_enabled: bool = False
        # TrainStrategy.__init__ (later in the MRO, run by super() above) already built one.
        if not hasattr(self, "checkpoint_manager") or self.checkpoint_manager is None:
            self.checkpoint_manager = CheckpointManager(checkpoint_config=getattr(self.worker_config, "checkpoint_config", None))
        self._dcp_process_group: Optional[dist.ProcessGroup] = None

    def _get_dcp_process_group(self) -> Optional[dist.ProcessGroup]:
        """DCP saves and loads on a gloo group of their own (created on first use, by all ranks)."""
        if self._dcp_process_group is None:
            self._dcp_process_group = dist.new_group(backend="gloo", group_desc="roll_dcp_checkpoint_pg")
        return self._dcp_process_group

    @staticmethod
    def _get_dcp_checkpoint_dir(base_dir: str) -> str:
        return os.path.join(base_dir, "dcp")

    def _get_dcp_state_dict_options(self, full_state_dict: bool = False) -> StateDictOptions:
        return StateDictOptions(full_state_dict=full_state_dict, cpu_offload=True)

    def _save_checkpoint_with_dcp(self, checkpoint_dir: str, is_last_step: bool):
        # Keys: the model's parameters at the top level, then optimizer.*, scheduler.*, rng_state.*
        state_dict = {**self.model.state_dict()}
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            state_dict["optimizer"] = optimizer
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            state_dict["scheduler"] = scheduler
        state_dict["rng_state"] = self.get_rng_state()
        dcp_process_group = self._get_dcp_process_group()

        if not self.async_save_strategy or is_last_step:
            if self.checkpoint_future is not None:
                self.checkpoint_future.result()
                self.checkpoint_future = None
            dcp.save(state_dict=state_dict, checkpoint_id=checkpoint_dir, process_group=dcp_process_group)
        else:
            if self.checkpoint_future is not None:
                self.checkpoint_future.result()
            self.checkpoint_future = dcp.async_save(state_dict=state_dict, checkpoint_id=checkpoint_dir,
                                                    process_group=dcp_process_group)

    def _load_checkpoint_with_dcp(self, checkpoint_dir: str):
        # ROLL's templates: a fresh optimizer's state_dict (no Adam state yet, so DCP loads none
        # of optimizer.state.*: only param_groups come back) and {} for the RNG (nothing loaded).
        state_dict = {**self.model.state_dict()}
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            state_dict["optimizer"] = optimizer
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            state_dict["scheduler"] = scheduler
        state_dict["rng_state"] = {}
        dcp.load(state_dict=state_dict, checkpoint_id=checkpoint_dir, process_group=self._get_dcp_process_group())

        if "rng_state" in state_dict and state_dict["rng_state"]:
            self.load_rng_state(state_dict["rng_state"])

        info = self.model.load_state_dict(state_dict, strict=False)
        unexpected = [k for k in info.unexpected_keys if k not in ("optimizer", "scheduler", "rng_state")]
        if info.missing_keys:
            logger.warning(f"Missing keys: {info.missing_keys}")
        if unexpected:
            logger.warning(f"Unexpected keys: {unexpected}")

    def save_checkpoint(self, save_dir, global_step, ckpt_id, tag="checkpoint", local_state_path=None, **kwargs):
        """Rank 0 writes the HF model (full state dict) and the tokenizer into save_dir; every
        rank writes its DCP shard into save_dir/dcp; then each rank uploads local_state_path."""
        if local_state_path is None:
            local_state_path = save_dir
        is_last_step = kwargs.get("is_last_step", None)
        if is_last_step is None:
            if self.worker_config.training_args.max_steps is not None:
                is_last_step = global_step == self.worker_config.training_args.max_steps - 1
            else:
                is_last_step = True

        if self.async_save_strategy and self.checkpoint_future is not None:
            self.checkpoint_future.result()
            self.checkpoint_future = None

        os.makedirs(save_dir, exist_ok=True)

        t0 = time.perf_counter()
        self.load_states()
        load_time = time.perf_counter() - t0

        t0 = time.perf_counter()
        full_model_state = get_model_state_dict(model=self.model, options=self._get_dcp_state_dict_options(True))
        if dist.get_rank() == 0:
            self.unwrap_model().save_pretrained(save_dir, state_dict=full_model_state, safe_serialization=True)
            self.tokenizer.save_pretrained(save_dir)
            if getattr(self, "processor", None):
                self.processor.save_pretrained(save_dir)
        hf_time = time.perf_counter() - t0

        if self.save_only_model and dist.is_initialized():
            dist.barrier()

        dcp_save_time = 0
        dcp_save_future = None
        if not self.save_only_model:
            dcp_checkpoint_dir = self._get_dcp_checkpoint_dir(save_dir)
            os.makedirs(dcp_checkpoint_dir, exist_ok=True)
            t0 = time.perf_counter()
            self._save_checkpoint_with_dcp(checkpoint_dir=dcp_checkpoint_dir, is_last_step=is_last_step)
            dcp_save_time = time.perf_counter() - t0
            # The upload (which may copy and delete the local folder) waits for an async save.
            dcp_save_future = self.checkpoint_future if (self.async_save_strategy and not is_last_step) else None

        checkpoint_config = getattr(self.worker_config, "checkpoint_config", None) or {}
        async_upload = checkpoint_config.get("async_upload", True)
        keep_local_file = checkpoint_config.get("keep_local_file", False)
        if dcp_save_future is not None and async_upload:

            def _on_dcp_done(fut):
                try:
                    fut.result()
                except Exception:
                    logger.error(f"Async DCP save failed for ckpt_id={ckpt_id}, skip upload.")
                    return
                self.thread_executor.submit(self.checkpoint_manager.upload, ckpt_id=ckpt_id,
                                            local_state_path=local_state_path, keep_local_file=keep_local_file)

            dcp_save_future.add_done_callback(_on_dcp_done)
        else:
            if dcp_save_future is not None:
                dcp_save_future.result()
            if async_upload:
                self.thread_executor.submit(self.checkpoint_manager.upload, ckpt_id=ckpt_id,
                                            local_state_path=local_state_path, keep_local_file=keep_local_file)
            else:
                self.checkpoint_manager.upload(ckpt_id=ckpt_id, local_state_path=local_state_path,
                                               keep_local_file=keep_local_file)

        t0 = time.perf_counter()
        if self.cpu_offload_enabled:
            self.offload_states()
        offload_time = time.perf_counter() - t0
        return {"load": load_time, "offload": offload_time, "dcp_save": dcp_save_time, "hf_save": hf_time}

    def load_checkpoint(self, load_dir, tag="checkpoint", **kwargs):
        """Loads <load_dir>/dcp when it is a folder; otherwise nothing (ROLL has no other path)."""
        dcp_checkpoint_dir = self._get_dcp_checkpoint_dir(load_dir)
        if os.path.isdir(dcp_checkpoint_dir):
            if dist.is_initialized():
                dist.barrier()
            self._load_checkpoint_with_dcp(checkpoint_dir=dcp_checkpoint_dir)
            if dist.is_initialized():
                dist.barrier()
            return

    @staticmethod
    def get_rng_state():
        # ROLL: "device": current_platform.get_rng_state() (torch.cuda's on GPUs). On the CPU
        # platform that resolves to torch.cpu.get_rng_state, which torch does not have; the
        # double stores None, as the run of real ROLL on CPU did.
        return {
            "cpu": torch.get_rng_state(),
            "device": None,
            "numpy": np.random.get_state(),
            "random": random.getstate(),
        }

    @staticmethod
    def load_rng_state(rng_state):
        # Never reached through load_checkpoint: its template for "rng_state" is {}.
        torch.set_rng_state(rng_state["cpu"])
        np.random.set_state(rng_state["numpy"])
        random.setstate(rng_state["random"])

    def load_states(self, include=None, non_blocking=False):
        """ROLL moves the model (without CPU offload) and the optimizer states to the current
        device. The double's device is the CPU, where they already are: nothing to move."""

    def offload_states(self, include=None, non_blocking=False):
        """ROLL moves the model (without CPU offload) or the optimizer states (with it) to the
        CPU. They are there already: nothing to move."""


class FSDP2InferStrategy(FSDP2StrategyBase):
    strategy_name = "fsdp2_infer"

    def __init__(self, worker):
        super().__init__(worker)
        self.device_mesh = None
        self.fsdp_config = None

    def _prepare_fsdp2_model(self, model_provider, *, is_trainable: bool, default_model_dtype: torch.dtype,
                             warmup_collective: bool = False):
        set_seed(seed=self.worker.pipeline_config.seed)
        if not dist.is_initialized():
            dist.init_process_group(backend="gloo")     # env://: MASTER_ADDR/PORT, RANK, WORLD_SIZE
        if warmup_collective:
            dist.all_reduce(torch.zeros(1))
        world_size, global_rank = dist.get_world_size(), dist.get_rank()
        self.worker.rank_info.dp_rank = global_rank
        self.worker.rank_info.dp_size = world_size
        self.tokenizer = default_tokenizer_provider(model_args=self.worker_config.model_args)
        self.processor = None       # ROLL: AutoProcessor, None for a text-only model
        self.ep_enabled = False
        self.device_mesh = init_device_mesh("cpu", mesh_shape=(world_size,), mesh_dim_names=("fsdp",))
        model = model_provider(tokenizer=self.tokenizer, model_args=self.worker_config.model_args,
                               is_trainable=is_trainable)
        self.is_lora = self.worker_config.model_args.lora_target is not None
        return model, default_model_dtype, 1

    def setup_fsdp2_configuration(self):
        strategy_config = self.worker_config.strategy_args.strategy_config
        self.async_save_strategy = strategy_config.get("async_save_ckpt", True)
        # ROLL sets checkpoint_future only when async_save_ckpt is true, and save_checkpoint
        # then reads it anyway: with async_save_ckpt false ROLL raises AttributeError at the
        # first save. The double sets it in both cases.
        self.checkpoint_future = None
        self.save_only_model = strategy_config.get("save_only_model", False)
        self.cpu_offload_enabled = bool(strategy_config.get("offload_policy", False))
        # fp32 parameters: no MixedPrecisionPolicy (ROLL's default param_dtype is bf16).
        self.fsdp_config = {
            "mesh": self.device_mesh,
            "reshard_after_forward": strategy_config.get("reshard_after_forward", None),
            "offload_policy": CPUOffloadPolicy(pin_memory=False) if self.cpu_offload_enabled else None,
        }

    def _get_layers(self, model):
        return model.model.layers

    def initialize_fsdp2_model(self, model):
        # ROLL broadcasts rank 0's full state dict into the sharded model; the double
        # broadcasts before sharding (every rank built the same model from the same folder).
        for tensor in torch.nn.Module.state_dict(model).values():
            dist.broadcast(tensor, src=0)
        # Not in ROLL (which runs on GPUs): what FSDP2 needs to train on the CPU with this torch
        # (torch 2.6's CPU stream lacks no-op events; roll-ckpt's torch seam supplies them).
        from roll_ckpt.runtime.torch_compat import fsdp2_options

        kwargs = {"mesh": self.fsdp_config["mesh"], **fsdp2_options("cpu")}
        if self.fsdp_config["reshard_after_forward"] is not None:
            kwargs["reshard_after_forward"] = self.fsdp_config["reshard_after_forward"]
        if self.fsdp_config["offload_policy"] is not None:
            kwargs["offload_policy"] = self.fsdp_config["offload_policy"]
        for layer in self._get_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        self.model = model

    def unwrap_model(self):
        if hasattr(self.model, "module"):
            return self.model.module
        return self.model


class FSDP2TrainStrategy(FSDP2InferStrategy, TrainStrategy):
    strategy_name = "fsdp2_train"

    def initialize(self, model_provider):
        model, _, _ = self._prepare_fsdp2_model(model_provider, is_trainable=True,
                                                default_model_dtype=torch.float32, warmup_collective=True)
        training_args = self.worker_config.training_args
        training_args.max_steps = training_args.max_steps // self.worker.rank_info.dp_size
        self.setup_fsdp2_configuration()
        self.scaler = None
        self.initialize_fsdp2_model(model)

        trainable_params = (param for param in self.model.parameters() if param.requires_grad)
        self.optimizer = optim.AdamW(trainable_params, lr=training_args.learning_rate,
                                     betas=(training_args.adam_beta1, training_args.adam_beta2),
                                     weight_decay=training_args.weight_decay)
        self.scheduler = get_scheduler(training_args.lr_scheduler_type, self.optimizer,
                                       num_warmup_steps=training_args.get_warmup_steps(training_args.max_steps),
                                       num_training_steps=training_args.max_steps)
        dist.barrier()

    def train_step(self, batch, loss_func):
        """One backward batch: forward, ``loss_func(batch, output)``, backward, clip, optimizer
        and scheduler step (ROLL's order; no micro-batches, no grad scaler)."""
        self.model.train()
        output = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss, metrics = loss_func(batch, output)
        loss.backward()
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm=self.worker.pipeline_config.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics[f"{self.worker.cluster_name}/grad_norm"] = float(grad_norm)
        return metrics
