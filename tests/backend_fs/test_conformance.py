"""The file_system backend passes roll-ckpt's backend conformance suite on every target."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_ckpt.testing import BackendConformance
from roll_ckpt_fs import FsspecStorage, LocalStorage, open_storage


class TestLocalDisk(BackendConformance):
    """Plain paths: a POSIX disk, committed by renaming a fsynced temporary folder."""

    @pytest.fixture
    def storage(self, tmp_path: Path) -> LocalStorage:
        s = open_storage(str(tmp_path / "root"))
        assert isinstance(s, LocalStorage) and s.atomic_rename
        return s


class TestFileUrl(BackendConformance):
    """``file://`` URLs are the same local disk."""

    @pytest.fixture
    def storage(self, tmp_path: Path) -> LocalStorage:
        s = open_storage(f"file://{tmp_path / 'root'}")
        assert isinstance(s, LocalStorage)
        assert s.root == str(tmp_path / "root")
        return s


class TestMemory(BackendConformance):
    """``memory://``: an fsspec store without rename, committed by writing the manifest last."""

    @pytest.fixture
    def storage(self, memory_url: str) -> FsspecStorage:
        s = open_storage(memory_url)
        assert isinstance(s, FsspecStorage) and not s.atomic_rename
        return s
