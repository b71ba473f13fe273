"""roll-ckpt's demo job, as the ``roll-ckpt demo`` command (see :mod:`roll_ckpt_demo.launch`)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
