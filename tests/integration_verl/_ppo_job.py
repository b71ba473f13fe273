"""verl's PPO trainer's own checkpoint code on a Ray driver, against real Ray worker groups.

``RayPPOTrainer._save_checkpoint`` and ``_load_checkpoint`` (verl 0.9.1's, called as they
are) run on a stand-in trainer object holding just what they read: the config, the step,
the actor's and the critic's worker groups, the dataloader. Each group is verl's
``TrainingWorker`` (FSDP2 engine from verl's registry) on 2 gloo ranks. The critic is a
stand-in: a second ``language_model`` group saving into ``critic/`` (verl's value model
hard-codes flash-attn, so no critic runs on a CPU); the actor trains, as ``update_actor`` would.

    python _ppo_job.py SPEC.json

SPEC: ``model``, ``ckpt`` (trainer.default_local_dir), ``out``, ``tag``, ``async``
(checkpoint.async_save of both roles), ``save`` (steps), ``keep`` (max_actor/critic_ckpt_to_keep),
``snap`` (steps whose actor state, critic state and loader position are written to
``out/snap-<tag>-<step>.pt``), ``compare`` (that file the resumed state must equal),
``expect_start``, ``kill`` ({step, rank}: that actor rank dies mid-save of the step),
``slow_s`` (roll-ckpt's data files start that late: saves in flight), ``stop``.
Writes ``out/result-<tag>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial
from types import SimpleNamespace

import ray
import torch
from omegaconf import OmegaConf

spec = json.load(open(sys.argv[1]))
t0 = time.time()
ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True,
         runtime_env={"env_vars": {k: os.environ[k] for k in
                                   ("PYTHONPATH", "VERL_PLATFORM", "VERL_ENGINE_DEVICE", "VERL_ENGINE_VENDOR",
                                    "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM") if k in os.environ}})

import verl  # noqa: E402,F401
from tensordict.tensorclass import NonTensorData  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator  # noqa: E402
from verl.workers.engine_workers import TrainingWorker  # noqa: E402
from verl.workers.utils.losses import sft_loss  # noqa: E402

from integration_verl._common import (TOTAL_STEPS, Toy, install_kill, install_slow_writes, same,  # noqa: E402
                                      seed_everything, snapshot, worker_config, write_json)

TRACKER = os.path.join(spec["ckpt"], "latest_checkpointed_iteration.txt")


class CPUTrainingWorker(TrainingWorker):
    """Test-side: verl's Ray workers init their group with backend ``cpu:gloo,<device>:<backend>``,
    here ``cpu:gloo,cpu:gloo``, which torch refuses (one device type twice): the group is made
    plainly first (env:// from the RANK/MASTER_* verl sets). Also: the tests' faults, and the
    state snapshot."""

    def __init__(self, config, role: str = "actor", kill=None, slow_s: float = 0.0) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        seed_everything(dist.get_rank())
        vendor = os.environ.get("VERL_ENGINE_VENDOR") == "roll_ckpt"
        if kill and role == "actor" and dist.get_rank() == kill["rank"]:
            install_kill(kill["step"], dist.get_rank(), vendor)
        if slow_s and vendor:
            install_slow_writes(slow_s)
        super().__init__(config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def snapshot(self):
        return snapshot(self.engine)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self):
        return {"engine": type(self.engine).__name__, "manager": type(self.engine.checkpoint_manager).__name__}


def group(name: str) -> RayWorkerGroup:
    cfg = worker_config(spec["model"], async_save=bool(spec.get("async")))
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1, name_prefix=name)
    cls = RayClassWithInitArgs(ray.remote(CPUTrainingWorker), config=cfg, role=name, kill=spec.get("kill"),
                               slow_s=float(spec.get("slow_s", 0.0)))
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu", use_gpu=False, name_prefix=name)
    wg.set_loss_fn(loss_fn=partial(sft_loss, config=None))
    wg.reset()
    return wg


result: dict = {"tag": spec["tag"], "losses": {}, "saves": {}}
loader = StatefulDataLoader(Toy(), batch_size=8, shuffle=False, collate_fn=SFTTensorCollator(DatasetPadMode.NO_PADDING))
trainer = SimpleNamespace(  # exactly what _save_checkpoint / _load_checkpoint read
    config=OmegaConf.create({
        "trainer": {"default_local_dir": spec["ckpt"], "default_hdfs_dir": None,
                    "max_actor_ckpt_to_keep": spec.get("keep"), "max_critic_ckpt_to_keep": spec.get("keep"),
                    "resume_mode": "auto", "resume_from_path": None, "del_local_ckpt_after_load": False},
        "actor_rollout_ref": {"actor": {"checkpoint": {"async_save": bool(spec.get("async"))}}}}),
    global_steps=0, actor_rollout_wg=None, critic_wg=None, use_critic=True, train_dataloader=loader)


def tracker() -> int | None:
    try:
        with open(TRACKER) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def train_step(data: dict) -> float:
    meta = {"use_remove_padding": True, "use_dynamic_bsz": False, "max_token_len_per_gpu": None,
            "micro_batch_size_per_gpu": 2, "temperature": 1.0, "global_batch_size": 8,
            "pad_mode": DatasetPadMode.NO_PADDING, "pad_token_id": 0}
    td = tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta)
    tu.assign_non_tensor(td, update_lr_scheduler=True,
                         global_token_num=NonTensorData(td["input_ids"].offsets().diff().tolist()))
    return tu.get(trainer.actor_rollout_wg.train_batch(td).get(), "metrics")["loss"]


def state() -> dict:
    return {"actor": trainer.actor_rollout_wg.snapshot()[0], "critic": trainer.critic_wg.snapshot()[0],
            "loader": loader.state_dict()}


try:
    trainer.actor_rollout_wg, trainer.critic_wg = group("actor"), group("critic")
    result.update(workers=trainer.actor_rollout_wg.describe()[0], up_s=round(time.time() - t0, 1))
    t = time.time()
    RayPPOTrainer._load_checkpoint(trainer)
    result.update(start=trainer.global_steps, load_s=round(time.time() - t, 2))
    if "expect_start" in spec:
        assert trainer.global_steps == spec["expect_start"], f"resumed {trainer.global_steps}, not {spec['expect_start']}"
    if spec.get("compare"):
        ref = torch.load(spec["compare"], weights_only=False)
        result["mismatches"] = same(ref, state())
    it = iter(loader)
    for step in range(trainer.global_steps + 1, spec.get("stop", TOTAL_STEPS) + 1):
        result["losses"][step] = train_step(next(it))
        trainer.global_steps = step
        if step in spec.get("save", ()):
            before = tracker()
            t = time.time()
            RayPPOTrainer._save_checkpoint(trainer)
            returned = time.time() - t
            folder = os.path.join(spec["ckpt"], f"global_step_{step}")
            save = {"returned_s": round(returned, 3), "tracker_before": before, "tracker_on_return": tracker(),
                    "committed_on_return": os.path.exists(os.path.join(folder, "manifest.json"))}
            if spec.get("kill", {}).get("step") == step:
                result["saves"][step] = save
                deadline = time.time() + 120
                while time.time() < deadline:  # the rank dies in its writer thread: describe() then raises
                    trainer.actor_rollout_wg.describe()
                    time.sleep(0.2)
                raise AssertionError("the actor's rank was to die mid-save")
            if spec.get("async") and os.environ.get("VERL_ENGINE_VENDOR") == "roll_ckpt":
                deadline = time.time() + 120
                while tracker() != step and time.time() < deadline:
                    time.sleep(0.02)
                save.update(durable_s=round(time.time() - t, 3), tracker_after=tracker(),
                            committed_after=os.path.exists(os.path.join(folder, "manifest.json")))
            result["saves"][step] = save
        if step in spec.get("snap", ()):
            torch.save(state(), os.path.join(spec["out"], f"snap-{spec['tag']}-{step}.pt"))
        write_json(os.path.join(spec["out"], f"result-{spec['tag']}.json"), result)
except ray.exceptions.RayError as exc:
    result["died"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
finally:
    result["total_s"] = round(time.time() - t0, 1)
    write_json(os.path.join(spec["out"], f"result-{spec['tag']}.json"), result)
    ray.shutdown()
