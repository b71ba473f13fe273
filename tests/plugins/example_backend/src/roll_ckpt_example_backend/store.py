from __future__ import annotations

import os
import threading
import shutil
from typing import BinaryIO

from roll_ckpt.plugin import Entry


class DirStore:
    atomic_rename = False

    def __init__(self, url: str, *, prefix: str = "") -> None:
        self.url = url
        path = url.split("://", 1)[1] if "://" in url else url
        self.root = os.path.abspath(os.path.join(path, prefix) if prefix else path)

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def list(self, path: str) -> list[Entry]:
        if not os.path.isdir(path):
            return []
        out = []
        for name in sorted(os.listdir(path)):
            p = os.path.join(path, name)
            st = os.stat(p)
            out.append(Entry(name, p, os.path.isdir(p), st.st_size, st.st_mtime))
        return out

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

    def open_write(self, path: str) -> BinaryIO:
        return open(path, "wb")

    def write_create(self, path: str, data: bytes) -> None:
        # Whole or not at all, as the protocol promises: the bytes go to a temporary file one
        # folder up (within the root; clean_stale removes a ".tmp-" one left by a crash), then
        # linked into place, which fails when the name exists. No reader sees a part of it,
        # and no stray file appears inside a checkpoint.
        folder = os.path.dirname(path)
        above = os.path.dirname(folder)
        tmp_dir = above if os.path.commonpath([above, self.root]) == self.root else folder
        tmp = os.path.join(tmp_dir, f".tmp-{os.path.basename(path)}-{os.getpid()}-{threading.get_ident()}")
        with open(tmp, "xb") as f:
            f.write(data)
        try:
            os.link(tmp, path)
        finally:
            os.remove(tmp)

    def rename_dir(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def rename_file(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def sync_dir(self, path: str) -> None:
        pass

    def remove(self, path: str) -> None:
        if os.path.exists(path):
            os.remove(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def free_bytes(self, path: str) -> int | None:
        return None
