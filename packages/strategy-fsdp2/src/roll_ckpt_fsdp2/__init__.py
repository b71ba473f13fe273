"""roll-ckpt's FSDP2 strategy: DCP save/load of FSDP2 state, offload store, staging policies."""

from importlib.metadata import version

__all__ = ["__version__"]

__version__ = version("roll-ckpt-fsdp2")  # the one place: [tool.bumpversion] in the root pyproject.toml
