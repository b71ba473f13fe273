"""Test-side shims that let torchtitan 0.3.0's ``Trainer`` run on CPU ranks with gloo.

None of this is roll-ckpt's: the integration (``roll_ckpt_torchtitan``) has nothing CPU-specific.
Each shim patches one module attribute of torch or torchtitan (no file edited), and only in the
processes the tests start (``tt_run.py`` applies them before torchtitan is imported). On a GPU
machine none is needed. What each is for:

1. :func:`cpu_device` -- torchtitan picks its device at import (``tools/utils.py``:
   ``_get_available_device_type() or "cuda"``): on a CPU-only machine it would use
   ``torch.cuda`` and fail at ``set_device``. torch is made to report ``cpu``, with a device
   module that has the few memory-monitor functions ``torch.cpu`` lacks.
2. :func:`no_triton` -- ``import torchtitan.trainer`` reaches ``distributed/minimal_async_ep/kernels.py``,
   which imports triton (an undeclared dependency; the CPU torch wheel has none). A stand-in
   for that one module (MoE expert-parallel kernels, never run here). A fake ``triton``
   package would not do: torch's inductor imports ``triton.backends`` as soon as it sees one.
3. :func:`eager_flex_attention` -- torch refuses flex attention's backward on CPU, and
   torchtitan compiles it with CUDA inductor options: torch's eager (dense) flex attention
   with the CPU refusal lifted. Same math.
4. :func:`gloo_sum_reduction` -- torchtitan sets FSDP's gradient divide factor to 1.0, so FSDP
   reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``, which gloo refuses: plain SUM on gloo
   groups (the same result: the factor is 1).
5. :func:`set_timeout_alias` -- torchtitan calls ``torch.distributed.set_timeout``, which torch
   2.13 has only as the private ``distributed_c10d._set_pg_timeout``.
"""

from __future__ import annotations

import sys
import types

__all__ = ["apply"]

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def cpu_device() -> None:
    import torch
    import torch._utils as tu

    class _Props:
        total_memory = 16 * 1024**3
        name = "cpu"

    cpu = types.ModuleType("torchtitan_test_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(cpu, name, getattr(torch.cpu, name))
    cpu.set_device = lambda *a, **k: None
    cpu.device_count = lambda: 1
    cpu.current_device = lambda: 0
    cpu.get_device_name = lambda *a, **k: "cpu"
    cpu.get_device_properties = lambda *a, **k: _Props()
    cpu.memory_stats = lambda *a, **k: {}
    cpu.reset_peak_memory_stats = lambda *a, **k: None
    cpu.empty_cache = lambda *a, **k: None
    cpu.manual_seed = torch.manual_seed
    cpu.manual_seed_all = torch.manual_seed
    original = tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda device_type=None: cpu if device_type in (None, "cpu") else original(device_type)


def no_triton() -> None:
    if _KERNELS in sys.modules:
        return
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    module = types.ModuleType(_KERNELS)

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*_a, **_k):
            raise RuntimeError(f"{_KERNELS}.{name} needs triton, which is not installed")

        return unavailable

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    sys.modules[_KERNELS] = module


def eager_flex_attention() -> None:
    import torch.nn.attention.flex_attention as fa
    from torchtitan.models.common import attention

    validate = fa._validate_device

    def _validate_device(q, k, v):
        if q.device.type != "cpu":
            validate(q, k, v)

    fa._validate_device = _validate_device
    attention.FlexAttention._compiled_flex_attn = fa.flex_attention
    attention._compiled_create_block_mask = fa.create_block_mask


def gloo_sum_reduction() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    original = fc._get_gradient_divide_factors

    def factors(rs_group, ar_group, reduce_dtype, device_type="", factor=None, force_sum_reduction_for_comms=False):
        group = rs_group if rs_group is not None else ar_group
        if group is not None and dist.get_backend(group) == "gloo":
            force_sum_reduction_for_comms = True
        return original(rs_group, ar_group, reduce_dtype, device_type, factor, force_sum_reduction_for_comms)

    fc._get_gradient_divide_factors = factors


def set_timeout_alias() -> None:
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout


def apply() -> None:
    """Every shim, in the order they must come (before ``torchtitan.train`` is imported)."""
    cpu_device()
    no_triton()
    set_timeout_alias()
    gloo_sum_reduction()
    eager_flex_attention()
