"""Test-side shims that let alibaba/ROLL (8eb27cc2) run its FSDP2 workers on a CPU-only torch build.

Ours, not ROLL's: nothing in the ROLL checkout is edited; everything here is a runtime replacement
made in the process that imports it (the driver, each gloo rank, each Ray worker actor, which
imports this module when it unpickles the worker classes below). Only ``roll_source_check``
uses it; roll-ckpt-roll itself needs none of it.

What each shim is for:

``CpuPlatform.get_rng_state`` / ``set_rng_state``
    ``Platform.__getattr__`` forwards unknown names to ``torch.cpu``, which has neither: ROLL's
    ``FSDP2StrategyBase.get_rng_state``/``load_rng_state`` (its save and load) would call ``None``.
    Here they return/set torch's CPU generator state (the "device" RNG of a CPU process).
``CpuPlatform.empty_cache``, ``memory_*``, ``mem_get_info`` ...
    called by ROLL's ``offload_states`` and its memory logging (``state_offload_manger``,
    ``log_gpu_memory_usage``) around every worker call; ``torch.cpu`` lacks them. Zero stubs.
``CpuPlatform.random``
    ``WorkerState.save_rng_state`` (ROLL's driver, ``BasePipeline.do_checkpoint``) calls
    ``current_platform.random.get_rng_state_all()``; a namespace over torch's CPU generator.
``download_model`` (gloo ranks only, ``patch_download_model=True``)
    ROLL's is wrapped by ``@model_path_cache``, which creates a Ray ``SharedStorage`` actor (and so
    starts a Ray cluster) even for a local folder; outside Ray it is replaced by the identity on
    local folders. Under Ray (the pipeline) ROLL's own is kept.
``CPUOffloadPolicy(pin_memory=False)`` (only with ``strategy_config.offload_policy: true``)
    ROLL hard-codes ``pin_memory=True``, which needs an accelerator. Unused by the default scenarios.
``CPUActorWorker`` / ``CPUCriticWorker``
    ROLL's ``ActorWorker``/``CriticWorker`` unchanged, but the shims are applied in the actor's
    process before ROLL's ``__init__``, plus one extra ONE_TO_ALL method, ``state_summary``: the
    digests :func:`strategy_digests` takes (every rank must call it: it gathers DTensors).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import types

import torch

_PATCHED = False

_ZERO_STUBS = (
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "device_memory_used",
    "reset_max_memory_allocated",
    "reset_max_memory_cached",
    "reset_peak_memory_stats",
)


def apply_cpu_patches(patch_download_model: bool = True, offload_pin_memory_false: bool = True) -> None:
    global _PATCHED
    import roll.platforms as plat
    from roll.platforms.cpu import CpuPlatform

    assert plat.current_platform.device_type == "cpu", plat.current_platform
    if not _PATCHED:
        CpuPlatform.get_rng_state = staticmethod(lambda *a, **k: torch.get_rng_state())
        CpuPlatform.set_rng_state = staticmethod(lambda state, *a, **k: torch.set_rng_state(state))
        CpuPlatform.empty_cache = staticmethod(lambda *a, **k: None)
        for name in _ZERO_STUBS:
            setattr(CpuPlatform, name, staticmethod(lambda *a, **k: 0))
        CpuPlatform.mem_get_info = staticmethod(lambda *a, **k: (0, 1))
        CpuPlatform.random = types.SimpleNamespace(
            get_rng_state_all=lambda: torch.get_rng_state(),
            set_rng_state_all=lambda state: torch.set_rng_state(state),
        )
        if offload_pin_memory_false:
            import roll.distributed.strategy.fsdp2_strategy as fs
            from torch.distributed.fsdp import CPUOffloadPolicy

            fs.CPUOffloadPolicy = lambda pin_memory=True, **kw: CPUOffloadPolicy(pin_memory=False, **kw)
        _PATCHED = True

    if patch_download_model:
        def _local_download_model(model_name_or_path, local_dir=None):
            assert os.path.isdir(model_name_or_path), model_name_or_path
            return model_name_or_path

        import roll.distributed.strategy.fsdp2_strategy as fs
        import roll.models.model_providers as mp_
        import roll.utils.checkpoint_manager as cm

        for mod in (cm, mp_, fs):
            mod.download_model = _local_download_model


# ---------------------------------------------------------------------------------------------- digests


def _sha(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha1(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def rng_digests() -> dict:
    import numpy as np

    npst = np.random.get_state()
    return {
        "torch": _sha(torch.get_rng_state()),
        "numpy": hashlib.sha1(npst[1].tobytes() + repr((npst[0], npst[2], npst[3], npst[4])).encode()).hexdigest()[:16],
        "python": hashlib.sha1(repr(random.getstate()).encode()).hexdigest()[:16],
    }


def strategy_digests(strategy) -> dict:
    """Digests of a FSDP2 strategy's full (unsharded) state, comparable across world sizes: every
    parameter, every optimizer state tensor (by parameter name), the scheduler's state dict, the
    learning rates, this process's RNG. A collective (full_tensor) on every rank, in one order."""
    model = strategy.model
    names = [(n, p) for n, p in model.named_parameters()]
    params = {n: _sha(_full(p.data)) for n, p in names}
    opt = {}
    n_state = 0
    optimizer = getattr(strategy, "optimizer", None)
    if optimizer is not None:
        n_state = len(optimizer.state)
        for n, p in names:
            st = optimizer.state.get(p, {})
            for k in sorted(st):
                v = st[k]
                if torch.is_tensor(v):
                    opt[f"{n}::{k}"] = _sha(_full(v))
                else:
                    opt[f"{n}::{k}"] = repr(v)
    sched = None
    scheduler = getattr(strategy, "scheduler", None)
    if scheduler is not None:
        sd = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
        sched = json.loads(json.dumps(sd, default=repr))
    return {
        "pid": os.getpid(),
        "params": params,
        "opt": opt,
        "n_opt_state": n_state,
        "lr": [g["lr"] for g in optimizer.param_groups] if optimizer is not None else None,
        "sched": sched,
        "rng": rng_digests(),
    }


# ---------------------------------------------------------------------------------------------- Ray workers

from roll.distributed.scheduler.decorator import Dispatch, register  # noqa: E402
from roll.pipeline.base_worker import ActorWorker, CriticWorker  # noqa: E402


class CPUActorWorker(ActorWorker):
    def __init__(self, worker_config):
        apply_cpu_patches(patch_download_model=False)
        super().__init__(worker_config=worker_config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state_summary(self):
        return strategy_digests(self.strategy)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def integration_facts(self):
        """Whether roll-ckpt's replacements are installed in this actor's process (the hook ran)."""
        from roll.distributed.strategy.fsdp2_strategy import FSDP2StrategyBase

        return {"pid": os.getpid(),
                "save_checkpoint": f"{FSDP2StrategyBase.save_checkpoint.__module__}."
                                   f"{FSDP2StrategyBase.save_checkpoint.__qualname__}",
                "manager": "_roll_ckpt" in getattr(self.strategy, "__dict__", {})}


class CPUCriticWorker(CriticWorker):
    def __init__(self, worker_config):
        apply_cpu_patches(patch_download_model=False)
        super().__init__(worker_config=worker_config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state_summary(self):
        return strategy_digests(self.strategy)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def integration_facts(self):
        from roll.distributed.strategy.fsdp2_strategy import FSDP2StrategyBase

        return {"pid": os.getpid(),
                "save_checkpoint": f"{FSDP2StrategyBase.save_checkpoint.__module__}."
                                   f"{FSDP2StrategyBase.save_checkpoint.__qualname__}",
                "manager": "_roll_ckpt" in getattr(self.strategy, "__dict__", {})}
