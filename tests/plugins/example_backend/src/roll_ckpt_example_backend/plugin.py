from __future__ import annotations

from typing import Any, Mapping

from roll_ckpt.plugin import BackendRecord, hookimpl


def _factory(url: str, options: Mapping[str, Any]) -> Any:
    from .store import DirStore

    return DirStore(url, **dict(options))


@hookimpl
def roll_ckpt_backends() -> list[BackendRecord]:
    return [BackendRecord(name="example_dir", factory=_factory,
                          install_hint="pip install -e tests/plugins/example_backend",
                          description="test fixture: a folder used like an object store")]
