from __future__ import annotations

import os
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
        with open(path, "xb") as f:
            f.write(data)

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
