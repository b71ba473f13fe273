"""Entry point ``file_system``: registers the backend without importing fsspec."""

from __future__ import annotations

from typing import Any, Mapping

from roll_ckpt.plugin import BackendRecord, hookimpl


def _factory(url: str, storage_options: Mapping[str, Any]) -> Any:
    from .storage import open_storage

    return open_storage(url, storage_options)


@hookimpl
def roll_ckpt_backends() -> list[BackendRecord]:
    return [BackendRecord(
        name="file_system",
        factory=_factory,
        install_hint='pip install "roll-ckpt[fs]"  (s3://: "roll-ckpt[s3]")',
        description="local paths, file://, memory://, s3:// and any fsspec URL",
        storage_classes=("roll_ckpt_fs.storage:LocalStorage", "roll_ckpt_fs.storage:FsspecStorage"),
    )]
