"""Typed, frozen records returned by the registration hooks.

A record names a thing a plugin provides and how to build it. ``factory`` is called
only when the thing is used, so registering a plugin stays cheap (no torch.distributed
import, no connection to a store).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from .storage import Storage
    from .strategy import Strategy

__all__ = ["BackendRecord", "StrategyRecord", "StagingPolicyRecord"]


@dataclass(frozen=True)
class BackendRecord:
    """A storage backend, selected by ``checkpoint_config.type``."""

    name: str
    """The value of ``checkpoint_config.type`` that selects this backend."""
    factory: Callable[[str, Mapping[str, Any]], "Storage"]
    """``factory(url, storage_options)`` returns a :class:`roll_ckpt.storage.Storage`."""
    install_hint: str = ""
    """What to ``pip install`` when this backend is missing (shown in errors)."""
    description: str = ""
    distribution: str = ""
    """Filled in by the plugin manager: the distribution that registered the record."""


@dataclass(frozen=True)
class StrategyRecord:
    """A way of turning a training state into a checkpoint (single process, FSDP2...)."""

    name: str
    factory: Callable[..., "Strategy"]
    """``factory(config, pluginmanager)`` returns a :class:`roll_ckpt.strategy.Strategy`."""
    applies: Callable[[Mapping[str, Any]], bool] = field(default=lambda state: False)
    """True when this strategy must handle ``state`` (e.g. it holds DTensors)."""
    priority: int = 0
    """Among strategies that apply, the highest priority wins."""
    install_hint: str = ""
    description: str = ""
    distribution: str = ""


@dataclass(frozen=True)
class StagingPolicyRecord:
    """A named staging policy (how a tensor is captured for an asynchronous save)."""

    name: str
    description: str = ""
    distribution: str = ""
