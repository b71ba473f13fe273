"""A failed save whose cleanup fails too (the store still unreachable) is cleaned by the
next save of the process (``roll_ckpt.format.leftovers``), not left until the process exits."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from helpers.training import config, drift
from roll_ckpt import CheckpointManager
from roll_ckpt.format import layout
from roll_ckpt.testing import tiny_state
from roll_ckpt.format.manifest import verify


def test_the_next_save_removes_what_a_failed_cleanup_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "ckpt"
    state = tiny_state(seed=1)
    with CheckpointManager.from_config(config(out, on_save_error="warn", timestamp_subdir=False), quiet=True) as m:
        first = m.save(1, state)
        storage = m.storage
        real_open, real_remove_tree = storage.open_write, storage.remove_tree

        def failing_open(path: str) -> Any:
            if "/dcp/" in path:
                raise OSError(errno.EIO, "the store went away", path)
            return real_open(path)

        def failing_remove_tree(path: str) -> None:
            raise OSError(errno.EIO, "the store is still away", path)

        monkeypatch.setattr(storage, "open_write", failing_open)
        monkeypatch.setattr(storage, "remove_tree", failing_remove_tree)
        drift(state, 2)
        assert m.save(2, state) is None and m.stats.failed == 1
        left = [p for p in out.iterdir() if p.name.startswith((".tmp-checkpoint-2", ".inflight-checkpoint-2"))]
        assert left, "the failed cleanup left the save's folder and marker"
        monkeypatch.setattr(storage, "open_write", real_open)
        monkeypatch.setattr(storage, "remove_tree", real_remove_tree)
        drift(state, 3)
        assert m.save(3, state) is not None
        assert not [p for p in out.iterdir() if "checkpoint-2" in p.name], list(out.iterdir())
    verify(storage, first)
    assert [r.step for r in layout.scan(storage, storage.root)] == [1, 3]
