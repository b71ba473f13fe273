"""Replication to checkpoint_config.backup (local disk and memory:// here; S3 in
test_replication_s3.py): end to end with keep_local, retries, a bounded close(), a kill
during replication, resume from the replica when the local copy is gone or damaged."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path

import pytest

from helpers.damage import flip_byte
from helpers.training import backup_config
from roll_ckpt import CheckpointCorruptError, CheckpointManager, ConfigError, load_config
from roll_ckpt.errors import BackupError
from roll_ckpt.format import layout
from roll_ckpt.tiers import replication
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state
from roll_ckpt.format.manifest import verify

from ._backup_helpers import (REPLICATING_CHILD, FailingWrites, SlowWrites, committed_steps, kill_when_busy, leftovers,
                              manager, save_steps)


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replication, "BACKOFF_S", 0.01)


@pytest.fixture(params=["disk", "memory"])
def backup_url(request, tmp_path: Path, memory_url: str) -> str:
    return str(tmp_path / "backup") if request.param == "disk" else memory_url


# --------------------------------------------------------------------------- end to end


def test_replication_end_to_end_with_keep_local(tmp_path: Path, backup_url: str) -> None:
    local = tmp_path / "local"
    state = tiny_state(1)
    m = manager(backup_config(local, backup_url, async_save=True, keep_local=1))
    snaps = save_steps(m, state, (1, 2, 3))
    status = m.backup.wait(timeout=30)
    assert [c.state for c in status.checkpoints] == ["committed"] * 3, status
    assert [c.local_removed for c in status.checkpoints] == [True, True, False]
    bk = m.backup.storage
    run = Path(m.run_dir).name
    # the replica mirrors <run>/checkpoint-<step>, every checkpoint is whole and committed
    assert committed_steps(bk, bk.root) == [1, 2, 3]
    assert {r.run for r in layout.committed(bk, bk.root)} == {run}
    for ref in layout.committed(bk, bk.root):
        verify(bk, ref.path)
    assert leftovers(bk, bk.root) == []
    # keep_local: 1 -> only the newest local copy is left, the others live on at the replica
    assert committed_steps(m.storage, m.storage.root) == [3]
    from roll_ckpt.tiers.transfer import committed_manifest

    assert committed_manifest(m.storage, str(Path(m.run_dir) / "checkpoint-3")) == \
        committed_manifest(bk, bk.join(bk.root, run, "checkpoint-3"))  # the manifest is copied unchanged
    m.close()
    assert "3 committed" in str(m.backup.status)

    # every replica resumes exactly, e.g. step 2 whose local copy is gone
    fresh = tiny_state(9)
    target = replication.replica_url(bk, bk.join(bk.root, run, "checkpoint-2"))
    with manager(load_config({"checkpoint_config": {"output_dir": backup_url}, "resume_from_checkpoint": target})) as r:
        assert r.resume(fresh) == 2
    assert_same_state(state_snapshot(fresh), snaps[2])


def test_saves_do_not_wait_for_replication(tmp_path: Path, monkeypatch) -> None:
    """Both saves return while no byte of any replica can be written (the backup's writes are
    held at a gate the test opens only afterwards): a save that waited would never return."""
    import roll_ckpt.tiers.transfer as transfer

    monkeypatch.setattr(transfer, "CHUNK_BYTES", 4096)
    m = manager(backup_config(tmp_path / "local", tmp_path / "backup", max_wait_s=0))
    gate = threading.Event()
    m.backup.storage = held = SlowWrites(m.backup.storage, delay=0.2, gate=gate)  # then ~4 s a replica
    state = tiny_state()
    m.save(1, state)
    m.save(2, state)
    status = m.backup.status
    assert held.writes == 0  # the saves returned with nothing replicated
    gate.set()
    m.close()  # max_wait_s: 0 -> does not wait; the copies are interrupted
    assert status.pending and not status.committed, "replication runs in the background"
    assert [c.state for c in m.backup.status.checkpoints] == ["interrupted", "interrupted"]


# --------------------------------------------------------------------------- failures


def test_a_failed_copy_is_retried_then_committed(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    m = manager(backup_config(tmp_path / "local", tmp_path / "backup", retries=3))
    m.backup.storage = FailingWrites(m.backup.storage, failures=2)
    m.save(1, tiny_state())
    status = m.backup.wait(timeout=30)
    (item,) = status.checkpoints
    assert item.state == "committed" and item.attempts == 3 and "injected I/O error" in (item.error or "")
    m.close()
    assert committed_steps(m.backup.storage, m.backup.storage.root) == [1]
    assert len([r for r in caplog.records if "retrying in" in r.getMessage()]) == 2


def test_a_copy_that_keeps_failing_is_reported_and_never_counted(tmpfs, tmp_path: Path, caplog) -> None:
    readonly = tmpfs("1m", readonly=True)  # the backup location refuses every write
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    m = manager(backup_config(tmp_path / "local", readonly / "backup", retries=2, keep_local=1))
    m.save(1, tiny_state())
    m.save(2, tiny_state())
    status = m.backup.wait(timeout=30)
    assert [c.state for c in status.checkpoints] == ["failed", "failed"]
    assert all(c.attempts == 3 for c in status.checkpoints)
    # never counted as a backup: keep_local removed nothing
    assert committed_steps(m.storage, m.storage.root) == [1, 2]
    assert any(r.levelno == logging.ERROR and "has NO backup" in r.getMessage() for r in caplog.records)
    with pytest.raises(BackupError) as info:
        m.close()
    assert len(info.value.failed) == 2 and "could not be replicated" in str(info.value)
    assert "checkpoint-1" in str(info.value) and "local checkpoints are intact" in str(info.value)
    for ref in layout.committed(m.storage, m.storage.root):
        verify(m.storage, ref.path)


class _Gate(threading.Event):
    """An event that also tells when a writer reached it (``reached``): ``SlowWrites`` waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.reached.set()
        return super().wait(timeout)


def test_close_waits_at_most_max_wait_s_and_the_next_run_catches_up(tmp_path: Path, monkeypatch) -> None:
    """close() returns while the copy is held at a gate that no replica write can pass (the
    test opens it only after close() returned): a close() that waited for the copy, beyond
    max_wait_s and STOP_GRACE_S, would never return. So that such a close() fails the test
    instead of hanging it, a timer opens the gate after 60 s anyway; close() then returns
    with the gate open, which the test asserts against. Once the gate is open the held copy
    sees the stop close() asked for, and is interrupted: nothing of it is committed."""
    import roll_ckpt.tiers.transfer as transfer

    monkeypatch.setattr(transfer, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(replication, "STOP_GRACE_S", 2.0)
    local, backup = tmp_path / "local", tmp_path / "backup"
    m = manager(backup_config(local, backup, max_wait_s=0.5))
    gate = _Gate()
    m.backup.storage = held = SlowWrites(m.backup.storage, delay=0.2, gate=gate)  # once open: ~5 s a copy
    fallback = threading.Timer(60, gate.set)  # only a close() that waits for the copy ever meets it
    fallback.daemon = True
    fallback.start()
    try:
        m.save(1, tiny_state())
        assert gate.reached.wait(30), "the copy never reached its first replica write"
        m.close()  # not an error: replication is cut off by the bound, not failed
        closed_while_held = not gate.is_set()
        written_before = held.writes
    finally:
        gate.set()
        fallback.cancel()
    assert closed_while_held, "close() returned only once the held copy could go on: it waited for replication"
    assert written_before == 0, "nothing was written before close() returned"
    deadline = time.monotonic() + 30  # the held copy ends (interrupted) once the gate is open
    while m.backup.status.running and time.monotonic() < deadline:
        time.sleep(0.02)
    (item,) = m.backup.status.checkpoints
    assert item.state == "interrupted", item
    bk = m.backup.storage
    assert committed_steps(bk, bk.root) == [] and leftovers(bk, bk.root) == []  # nothing committed, nothing left

    # the next run's first save copies what the previous one could not
    m2 = manager(backup_config(local, backup, resume="latest"))
    assert m2.resume(tiny_state()) == 1 and not m2.resumed.from_backup
    m2.save(2, tiny_state())
    status = m2.backup.wait(timeout=30)
    m2.close()
    assert sorted(c.step for c in status.committed) == [1, 2]
    assert committed_steps(m2.backup.storage, m2.backup.storage.root) == [1, 2]


def test_a_kill_during_replication_commits_nothing_and_is_copied_again(tmp_path: Path) -> None:
    local, backup = tmp_path / "local", tmp_path / "backup"
    raw = {"checkpoint_config": {"output_dir": str(local), "backup": {"output_dir": str(backup)}}}
    flag = tmp_path / "copying"  # the replica is being written
    kill_when_busy(REPLICATING_CHILD, json.dumps(raw), str(flag), flag=flag, delay=0.3)
    cfg = backup_config(local, backup, resume="latest")
    m = manager(cfg)
    bk = m.backup.storage
    assert committed_steps(bk, bk.root) == [], "a killed copy must not look committed"
    assert leftovers(bk, bk.root), "the killed copy left its temporary folder (removed below)"
    (ref,) = layout.committed(m.storage, m.storage.root)
    verify(m.storage, ref.path)  # the local checkpoint is intact

    assert m.resume(tiny_state()) == 1 and not m.resumed.from_backup
    m.save(2, tiny_state())
    status = m.backup.wait(timeout=30)
    m.close()
    assert sorted(c.step for c in status.committed) == [1, 2]
    assert committed_steps(bk, bk.root) == [1, 2]
    assert leftovers(bk, bk.root) == []
    for r in layout.committed(bk, bk.root):
        verify(bk, r.path)


# --------------------------------------------------------------------------- resume


def _two_saved(local: Path, backup: str) -> tuple[CheckpointManager, dict, dict]:
    state = tiny_state(3)
    m = manager(backup_config(local, backup))
    m.save(1, state)
    state["counter"]["seen"] += 7
    m.save(2, state)
    snap = state_snapshot(state)
    m.backup.wait(timeout=30)
    m.close()
    return m, state, snap


def test_resume_from_the_replica_when_the_local_copy_is_gone(tmp_path: Path, backup_url: str) -> None:
    local = tmp_path / "local"
    m, _, snap = _two_saved(local, backup_url)
    shutil.rmtree(local)
    fresh = tiny_state(11)
    with manager(backup_config(local, backup_url, resume="latest")) as r:
        assert r.resume(fresh) == 2
        assert r.resumed.from_backup
        assert r.resumed.path.endswith("checkpoint-2") and r.resumed.path.startswith(backup_url.rstrip("/"))
    assert_same_state(state_snapshot(fresh), snap)


def test_latest_is_the_newest_of_both_locations(tmp_path: Path) -> None:
    local, backup = tmp_path / "local", tmp_path / "backup"
    m, state, _ = _two_saved(local, str(backup))
    # a newer local checkpoint that has no replica (yet) wins over the replica's newest
    plain = load_config({"checkpoint_config": {"output_dir": str(local)}})
    with manager(plain) as p:
        p.save(3, state)
    with manager(backup_config(local, backup, resume="latest")) as r:
        storage, path = r.resumed.candidates()
        assert storage is r.storage and path.endswith("checkpoint-3")
        assert r.resume(tiny_state()) == 3 and not r.resumed.from_backup
    # both hold the newest: the local copy is taken
    shutil.rmtree(Path(path))
    with manager(backup_config(local, backup, resume="latest")) as r:
        assert r.resumed.candidates()[0] is r.storage
        assert r.resume(tiny_state()) == 2 and not r.resumed.from_backup


def test_a_damaged_local_copy_falls_back_to_the_replica(tmp_path: Path, backup_url: str, caplog) -> None:
    local = tmp_path / "local"
    m, _, snap = _two_saved(local, backup_url)
    (ckpt2,) = [r for r in layout.committed(m.storage, m.storage.root) if r.step == 2]
    flip_byte(Path(ckpt2.path) / "dcp" / "__0_0.distcp", 100)
    caplog.set_level(logging.WARNING, logger="roll_ckpt")
    fresh = tiny_state(5)
    with manager(backup_config(local, backup_url, resume="latest")) as r:
        assert r.resume(fresh) == 2
        assert r.resumed.from_backup
    assert_same_state(state_snapshot(fresh), snap)
    warned = [rec.getMessage() for rec in caplog.records if "cannot resume from the local copy" in rec.getMessage()]
    assert warned and "dcp/__0_0.distcp" in warned[0] and "checksum" in warned[0], warned


def test_a_damaged_manifest_falls_back_too_and_both_damaged_is_refused(tmp_path: Path) -> None:
    local, backup = tmp_path / "local", tmp_path / "backup"
    m, _, _ = _two_saved(local, str(backup))
    (ckpt2,) = [r for r in layout.committed(m.storage, m.storage.root) if r.step == 2]
    (Path(ckpt2.path) / "trainer_state.json").write_text("{}")  # altered (size changes)
    with manager(backup_config(local, backup, resume="latest")) as r:
        assert r.resume(tiny_state()) == 2 and r.resumed.from_backup
    # the replica damaged as well: refused, naming the local copy's damage
    run = Path(ckpt2.path).parent.name
    flip_byte(backup / run / "checkpoint-2" / "dcp" / "__0_0.distcp", 100)
    with manager(backup_config(local, backup, resume="latest")) as r:
        with pytest.raises(CheckpointCorruptError) as info:
            r.resume(tiny_state())
    assert ckpt2.path in str(info.value) and "trainer_state.json" in str(info.value)


# --------------------------------------------------------------------------- config


def test_backup_config_keys() -> None:
    cfg = load_config({"checkpoint_config": {"output_dir": "/a", "backup": {"output_dir": "/b"}}})
    b = cfg.checkpoint_config.backup
    assert (b.keep_local, b.max_wait_s, b.retries) == (0, 5.0, 3)
    cfg = load_config({"checkpoint_config": {"output_dir": "/a", "backup": {
        "output_dir": "s3://bk/x", "keep_local": 2, "max_wait_s": 30, "retries": 0}}})
    assert cfg.checkpoint_config.backup.max_wait_s == 30.0 and cfg.checkpoint_config.backup.retries == 0
    for bad, key in [({"max_wait_s": -1}, "max_wait_s"), ({"max_wait_s": True}, "max_wait_s"),
                     ({"max_wait_s": "5"}, "max_wait_s"), ({"retries": -2}, "retries"),
                     ({"retries": 1.5}, "retries"), ({"max_wait_s": float("inf")}, "max_wait_s")]:
        with pytest.raises(ConfigError, match=rf"checkpoint_config\.backup\.{key}"):
            load_config({"checkpoint_config": {"output_dir": "/a", "backup": {"output_dir": "/b", **bad}}})
    with pytest.raises(ConfigError, match="same location"):
        load_config({"checkpoint_config": {"output_dir": "/a/", "backup": {"output_dir": "/a"}}})


def test_unknown_backup_type_names_the_installed_backends(tmp_path: Path) -> None:
    from roll_ckpt.errors import UnknownPluginError

    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path / "a"),
                                             "backup": {"type": "file_sytem", "output_dir": str(tmp_path / "b")}}})
    with pytest.raises(UnknownPluginError, match="file_system"):
        CheckpointManager.from_config(cfg, quiet=True)
