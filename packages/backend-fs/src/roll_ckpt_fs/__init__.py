"""roll-ckpt's ``file_system`` backend: local disks and every fsspec target."""

from importlib.metadata import version

from .storage import FsspecStorage, LocalStorage, open_storage

__all__ = ["FsspecStorage", "LocalStorage", "open_storage", "__version__"]

__version__ = version("roll-ckpt-fs")  # the one place: [tool.bumpversion] in the root pyproject.toml
