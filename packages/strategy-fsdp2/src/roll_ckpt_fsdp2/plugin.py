"""Entry point ``fsdp2``: registers the FSDP2 strategy, its staging policies and its config
key without importing torch.distributed."""

from __future__ import annotations

from typing import Any, Mapping

from roll_ckpt.plugin import ConfigError, ConfigKeyRecord, StagingPolicyRecord, StrategyRecord, hookimpl

from .policies import LocalDedup, ZeroCopy

OFFLOAD_BACKENDS = ("local", "local_dedup")


def _holds_dtensors(state: Mapping[str, Any]) -> bool:
    """True when a module of ``state`` has a DTensor parameter (FSDP2 sharded it)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:  # no module can hold DTensors yet; a driver-only process never imports torch
        return False
    # any module of the state: an unsharded one (a reference or reward model) may come first
    return any(type(p).__name__ == "DTensor" for obj in state.values() if isinstance(obj, torch.nn.Module)
               for p in obj.parameters())


def _factory(config: Any, plugins: Any) -> Any:
    from .strategy import FSDP2Strategy

    return FSDP2Strategy(config, plugins)


def _offload_backend(key: str, value: Any) -> str:
    if value not in OFFLOAD_BACKENDS:
        raise ConfigError(key, "is not a known offload store", value, ", ".join(OFFLOAD_BACKENDS))
    return value


@hookimpl
def roll_ckpt_strategies() -> list[StrategyRecord]:
    return [StrategyRecord(
        name="fsdp2", factory=_factory, applies=_holds_dtensors, priority=10,
        install_hint='pip install "roll-ckpt[fsdp2]"',
        description="FSDP2 (DTensor) state through DCP on its own process group",
    )]


@hookimpl
def roll_ckpt_staging_policies() -> list[StagingPolicyRecord]:
    return [StagingPolicyRecord(ZeroCopy(), priority=10), StagingPolicyRecord(LocalDedup(), priority=10)]


@hookimpl
def roll_ckpt_config_keys() -> list[ConfigKeyRecord]:
    return [ConfigKeyRecord(
        key="offload_backend", default="local", validate=_offload_backend,
        description="FSDP2 offload store: 'local' (one flat CPU buffer per dtype) or 'local_dedup' "
                    "(one segment per rank of tensors replicated over a mesh dimension)")]
