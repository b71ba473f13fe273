"""roll-ckpt's ``file_system`` backend: local disks and every fsspec target."""

from ._version import __version__
from .storage import FsspecStorage, LocalStorage, open_storage

__all__ = ["FsspecStorage", "LocalStorage", "open_storage", "__version__"]
