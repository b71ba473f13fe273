"""roll/pipeline/base_worker.py: ActorWorker and CriticWorker (initialize with ROLL's resume
block, do_checkpoint), plus a toy train_step and a state digest for the tests. ROLL's
``train_step`` returns a plain dict ``{"metrics": {...}}``; ``do_checkpoint`` a ``DataProto``
whose ``meta_info["metrics"]`` the pipeline reduces, as ROLL's."""

import hashlib
import os
import random
import threading
import time
from concurrent import futures
from typing import Dict

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.factory import create_strategy
from roll.models.model_providers import default_actor_model_provider, default_value_model_provider
from roll.utils.checkpoint_manager import download_model, get_latest_ckpt


def _resume_dir(pipeline_config):
    """The load_dir of ROLL's resume block (inlined twice in ROLL, the same code)."""
    load_dir = None
    if pipeline_config.resume_from_checkpoint is True:
        latest_ckpt = get_latest_ckpt(pipeline_config.checkpoint_config)
        if latest_ckpt:
            load_dir = download_model(latest_ckpt)
    elif isinstance(pipeline_config.resume_from_checkpoint, str):
        load_dir = download_model(pipeline_config.resume_from_checkpoint)
    return load_dir


class _TrainWorkerHelpers:
    """Not in ROLL: a deterministic batch, the state digest the tests compare, a wait for uploads."""

    def make_batch(self, global_step: int):
        """Two rows of 12 tokens, from (pipeline seed, global_step, rank): each dp rank its own."""
        vocab = self.strategy.unwrap_model().config.vocab_size
        g = torch.Generator().manual_seed(self.pipeline_config.seed * 100003 + global_step * 101 + self.rank)
        input_ids = torch.randint(0, vocab, (2, 12), generator=g)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                "values_target": torch.randn(2, 12, generator=g)}

    @staticmethod
    def draw_rngs():
        """Stands in for dropout and sampling: every train step moves torch's, numpy's and
        Python's RNGs (the batch does not depend on them), so a restore of the RNG state, or
        its absence, shows in get_state_digest()["rng"]."""
        torch.rand(1)
        np.random.rand()
        random.random()

    def get_state_digest(self) -> Dict:
        """sha256 of every parameter's full tensor, of every optimizer state tensor (full),
        of the scheduler's state dict and of torch's CPU RNG ("rng"; numpy's and Python's
        apart), plus the number of optimizer state entries. Every rank must call it (DTensor.full_tensor() is a collective)."""

        def full(t):
            return t.full_tensor() if isinstance(t, DTensor) else t

        def tensor_bytes(t):
            return full(t).detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()

        strategy = self.strategy
        # Read only between load_states and offload_states, as ROLL's own code reads the state
        # (state_offload_manger): an offload store may hold the only copy meanwhile.
        strategy.load_states()
        params = hashlib.sha256()
        for name, p in strategy.model.named_parameters():
            params.update(name.encode() + tensor_bytes(p))
        opt = hashlib.sha256()
        entries = 0
        index = {id(p): i for i, p in enumerate(strategy.optimizer.param_groups[0]["params"])}
        for p in strategy.optimizer.param_groups[0]["params"]:
            state = strategy.optimizer.state.get(p, {})
            for key in sorted(state):
                entries += 1
                value = state[key]
                data = tensor_bytes(value) if torch.is_tensor(value) else repr(value).encode()
                opt.update(f"{index[id(p)]}.{key}".encode() + data)
        scheduler = repr(sorted(strategy.scheduler.state_dict().items())).encode()
        strategy.offload_states()
        dist.barrier()
        return {
            "params": params.hexdigest(),
            "optimizer": opt.hexdigest(),
            "optimizer_entries": entries,
            "scheduler": hashlib.sha256(scheduler).hexdigest(),
            "scheduler_last_epoch": strategy.scheduler.last_epoch,
            "lr": strategy.scheduler.get_last_lr()[0],
            "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
            "rng_numpy": hashlib.sha256(repr(np.random.get_state(legacy=False)).encode()).hexdigest(),
            "rng_random": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
        }

    def wait_for_checkpoint_uploads(self):
        """Wait for the pending async DCP save and every upload submitted so far. ROLL never
        waits for them: a job that ends right after its last save may cut its upload short."""
        strategy = self.strategy
        future = getattr(strategy, "checkpoint_future", None)
        if future is not None:
            done, already_done = threading.Event(), future.done()
            future.add_done_callback(lambda _: done.set())   # runs after save_checkpoint's callback
            done.wait()
            if already_done:
                time.sleep(0.1)     # that callback may still be submitting its upload in another thread
        strategy.thread_executor.shutdown(wait=True)
        strategy.thread_executor = futures.ThreadPoolExecutor(max_workers=5)
        return True


class ActorWorker(Worker, _TrainWorkerHelpers):
    def __init__(self, worker_config):
        super().__init__(worker_config=worker_config)
        self.tokenizer = None
        self.strategy = None

    def initialize(self, pipeline_config):
        super().initialize(pipeline_config)
        self.strategy = create_strategy(worker=self)
        self.strategy.initialize(model_provider=default_actor_model_provider)
        self.tokenizer = self.strategy.tokenizer
        if self.pipeline_config.resume_from_checkpoint:
            load_dir = _resume_dir(self.pipeline_config)
            if load_dir:
                self.strategy.load_checkpoint(load_dir=load_dir, tag="checkpoint")
        self.logger.info(f"{self.worker_name} initialized")
        self.strategy.offload_states()

    def train_step(self, data: Dict):
        """One optimizer step on a causal-LM loss. ``data``: ``{"global_step": N}`` (the batch is
        made from the seed, the step and the rank) or a batch with input_ids/attention_mask."""
        global_step = data.get("global_step", 0)
        batch = data if "input_ids" in data else self.make_batch(global_step)
        self.draw_rngs()
        self.strategy.load_states()

        def loss_func(batch, output):
            logits = output.logits[:, :-1].float()
            labels = batch["input_ids"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            return loss, {"actor/loss": loss.item()}

        metrics = self.strategy.train_step(batch=batch, loss_func=loss_func)
        metrics["actor/lr"] = self.strategy.scheduler.get_last_lr()[0]
        self.strategy.offload_states()
        return {"metrics": metrics}

    def do_checkpoint(self, global_step, is_last_step=None):
        t0 = time.perf_counter()
        ckpt_id = f"checkpoint-{global_step}"
        # The actor saves straight into its step folder; other roles below it, under their name.
        save_dir = os.path.join(self.pipeline_config.output_dir, self.worker_name, ckpt_id)
        self.logger.info(f"save checkpoint-{global_step} to {save_dir}")
        exec_metrics: Dict = self.strategy.save_checkpoint(save_dir, global_step, ckpt_id, is_last_step=is_last_step)
        prefix = f"time/{self.cluster_name}/do_checkpoint"
        metrics = {f"{prefix}/total": time.perf_counter() - t0}
        metrics.update({f"{prefix}/{k}": v for k, v in exec_metrics.items()})
        return DataProto(meta_info={"metrics": metrics})


class CriticWorker(Worker, _TrainWorkerHelpers):
    def __init__(self, worker_config):
        super().__init__(worker_config=worker_config)
        self.tokenizer = None
        self.strategy = None

    def initialize(self, pipeline_config):
        super().initialize(pipeline_config)
        self.strategy = create_strategy(worker=self)
        self.strategy.initialize(model_provider=default_value_model_provider)
        self.tokenizer = self.strategy.tokenizer
        if self.pipeline_config.resume_from_checkpoint:
            load_dir = _resume_dir(self.pipeline_config)
            # ROLL joins unconditionally: os.path.join(None, ...) raises TypeError when
            # resume_from_checkpoint is True and no checkpoint is found. The double skips.
            if load_dir is not None:
                load_dir = os.path.join(load_dir, self.cluster_name)
            if load_dir:
                self.strategy.load_checkpoint(load_dir=load_dir, tag="checkpoint")
        self.logger.info(f"{self.worker_name} initialized")
        self.strategy.offload_states()

    def train_step(self, data: Dict):
        """One optimizer step on a value loss (0.5 * MSE to a fixed random target)."""
        global_step = data.get("global_step", 0)
        batch = data if "input_ids" in data else self.make_batch(global_step)
        self.draw_rngs()
        self.strategy.load_states()

        def loss_func(batch, output):
            values = output.logits.squeeze(-1).float()
            loss = 0.5 * ((values - batch["values_target"]) ** 2).mean()
            return loss, {"critic/loss": loss.item()}

        metrics = self.strategy.train_step(batch=batch, loss_func=loss_func)
        metrics["critic/lr"] = self.strategy.scheduler.get_last_lr()[0]
        self.strategy.offload_states()
        return {"metrics": metrics}

    def do_checkpoint(self, global_step, is_last_step=None):
        t0 = time.perf_counter()
        ckpt_id = f"checkpoint-{global_step}"
        save_dir = os.path.join(self.pipeline_config.output_dir, self.worker_name, ckpt_id, self.cluster_name)
        critic_save_dir = os.path.join(self.pipeline_config.output_dir, self.worker_name, ckpt_id)
        self.logger.info(f"save checkpoint-{global_step} to {save_dir}")
        exec_metrics: Dict = self.strategy.save_checkpoint(save_dir, global_step, ckpt_id,
                                                           local_state_path=critic_save_dir, is_last_step=is_last_step)
        prefix = f"time/{self.cluster_name}/do_checkpoint"
        metrics = {f"{prefix}/total": time.perf_counter() - t0}
        metrics.update({f"{prefix}/{k}": v for k, v in exec_metrics.items()})
        return DataProto(meta_info={"metrics": metrics})
