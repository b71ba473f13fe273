"""roll-ckpt's FSDP2 strategy: DCP save/load of FSDP2 state, offload store, staging policies."""

from ._version import __version__

__all__ = ["__version__"]
