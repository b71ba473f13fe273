"""``checkpoint_config.on_save_error: warn``: a failed periodic save (read-only folder, full
disk, S3 down) is logged and counted, commits nothing, does not stop training, and the next
save tries again; final saves always raise. ``raise`` (the default) keeps raising."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_ckpt import CheckpointManager, StorageError, load_config

from roll_ckpt.format import layout
from roll_ckpt.testing import tiny_state


def _manager(out: str, policy: str = "warn", async_save: bool = False, **cc: Any) -> CheckpointManager:
    cfg = load_config({"checkpoint_config": {"output_dir": out, "on_save_error": policy, **cc}, "save_steps": 1,
                       "strategy_config": {"async_save_ckpt": async_save}})
    return CheckpointManager(cfg, quiet=True)


def _committed(m: CheckpointManager) -> list[int]:
    return [r.step for r in layout.committed(m.storage, m.storage.root)]


def _remount(path: Path, mode: str) -> None:
    proc = subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_a_read_only_folder_is_counted_and_training_goes_on(tmpfs, caplog) -> None:
    disk = tmpfs("16m", readonly=True)
    m = _manager(str(disk / "ckpt"))
    state = tiny_state()
    with caplog.at_level("WARNING", logger="roll_ckpt"):
        assert m.maybe_save(1, state) is None
    assert m.stats.failed == 1
    warned = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert warned and "checkpoint-1" in warned[0] and "on_save_error: warn" in warned[0]
    assert "Read-only" in warned[0] or "read-only" in warned[0].lower(), warned[0]
    _remount(disk, "rw")
    assert m.maybe_save(2, state).endswith("checkpoint-2"), "the next save tries again"
    _remount(disk, "ro")
    with pytest.raises(StorageError):  # a final save always raises
        m.save(3, state, final=True)
    m.close()
    assert _committed(m) == [2] and m.stats.failed == 1


def test_a_full_disk_is_counted_and_the_next_save_succeeds_once_space_is_freed(tmpfs) -> None:
    disk = tmpfs("3m")
    big = {"weights": torch.nn.Linear(600, 600)}  # ~1.4 MiB a checkpoint
    m = _manager(str(disk / "ckpt"))
    assert m.maybe_save(1, big)
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (1 << 20))
    assert m.maybe_save(2, big) is None and m.stats.failed == 1  # refused before writing: no space
    filler.unlink()
    assert m.maybe_save(3, big).endswith("checkpoint-3")
    m.close()
    assert _committed(m) == [1, 3]
    assert not [p for p in (disk / "ckpt").rglob(".tmp-*")], "nothing half-written is left"


def test_a_background_save_that_fails_is_counted_where_it_surfaces(tmpfs) -> None:
    disk = tmpfs("16m")
    m = _manager(str(disk / "ckpt"), async_save=True)
    state = tiny_state()
    m.maybe_save(1, state)
    m.wait()
    _remount(disk, "ro")  # the next save's write fails in the background
    assert m.maybe_save(2, state)
    assert m.wait() is None and m.stats.failed == 1 and not m.stats.in_flight
    _remount(disk, "rw")
    m.maybe_save(3, state)
    m.close()
    assert _committed(m) == [1, 3]


def test_raise_is_the_default(tmpfs) -> None:
    disk = tmpfs("16m", readonly=True)
    m = _manager(str(disk / "ckpt"), policy="raise")
    with pytest.raises(StorageError, match="cannot write under"):
        m.maybe_save(1, tiny_state())
    m.close()


def test_a_stopped_s3_server_is_counted_and_the_next_save_succeeds(s3, offline_aws) -> None:
    from reliability._support import restart_seaweed

    url = f"s3://{s3.bucket}/warn-{uuid.uuid4().hex[:8]}"
    options = dict(s3.storage_options,  # bounded retries: a dead server is reported in seconds
                   config_kwargs={"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 2}})
    m = _manager(url, storage_options=options)
    state = tiny_state()
    assert m.maybe_save(1, state)
    s3.proc.kill()
    s3.proc.wait(30)
    try:
        assert m.maybe_save(2, state) is None and m.stats.failed == 1
    finally:
        restart_seaweed(s3)
    assert m.maybe_save(3, state).endswith("checkpoint-3")
    m.close()
    assert _committed(m) == [1, 3]
