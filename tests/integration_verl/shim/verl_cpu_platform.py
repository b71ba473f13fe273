"""Test-side CPU platform for verl (``VERL_PLATFORM=cpu``): verl 0.9.1 knows CUDA and NPU
platforms only, and these tests run its own FSDP2 engine on gloo ranks without a GPU.

Registered through verl's own ``verl.plugins`` entry point (``verl_cpu_shim-0.0.dist-info``
beside this file, found on ``PYTHONPATH``: nothing is installed). Nothing in roll-ckpt-verl
depends on it. What it answers is what verl asks a platform on this path: the device is
``cpu``, one of it, collectives on ``gloo``, Ray's resource ``CPU``; RNG, seeds and memory
queries go to torch's CPU equivalents or return 0; the profiler does nothing. Also needed,
set by the tests: ``VERL_ENGINE_DEVICE=cuda`` (verl registers its FSDP engines for cuda and
npu only), ``attn_implementation: sdpa`` (verl's default needs flash-attn), fp32 mixed
precision (bit-exact losses).
"""

from contextlib import contextmanager
from types import SimpleNamespace

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

_noop = lambda *a, **k: None  # noqa: E731
_CPU = SimpleNamespace(  # what verl calls on get_torch_device()
    is_available=lambda: True, current_device=lambda: "cpu", device_count=lambda: 1, set_device=_noop,
    synchronize=_noop, empty_cache=_noop, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
    get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
    memory_allocated=lambda *a, **k: 0, memory_reserved=lambda *a, **k: 0, max_memory_allocated=lambda *a, **k: 0,
    max_memory_reserved=lambda *a, **k: 0, reset_peak_memory_stats=_noop, mem_get_info=lambda *a, **k: (0, 0),
    get_device_name=lambda *a, **k: "cpu",
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CPU
    is_available = staticmethod(lambda: True)
    is_platform_available = lambda self, use_smi_check=False: False  # never auto-detected  # noqa: E731
    current_device = staticmethod(lambda: "cpu")
    device_count = staticmethod(lambda: 1)
    set_device = synchronize = set_allocator_settings = empty_cache = profiler_start = profiler_stop = _noop
    manual_seed = manual_seed_all = staticmethod(torch.manual_seed)
    get_device_capability = lambda self, device_index=0: (None, None)  # noqa: E731
    communication_backend_name = staticmethod(lambda: "gloo")
    visible_devices_envvar = staticmethod(lambda: "CUDA_VISIBLE_DEVICES")
    ray_resource_name = staticmethod(lambda: "CPU")
    ray_noset_envvars = staticmethod(lambda: [])
    is_ipc_supported = staticmethod(lambda: False)
    cudart = staticmethod(lambda: None)

    @contextmanager
    def nvtx_range(self, msg):
        yield
