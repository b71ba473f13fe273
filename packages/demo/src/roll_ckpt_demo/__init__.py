"""roll-ckpt's demo job, as the ``roll-ckpt demo`` command (see :mod:`roll_ckpt_demo.launch`)."""

from importlib.metadata import version

__all__ = ["__version__"]

__version__ = version("roll-ckpt-demo")  # the one place: [tool.bumpversion] in the root pyproject.toml
