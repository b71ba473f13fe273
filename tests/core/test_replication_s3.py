"""Replication, resume from the replica and `roll-ckpt copy` on a real S3 server: SeaweedFS
(``weed mini`` on loopback, from tests/backend_fs/s3server.py). The replica on S3 is
committed by S3's own protocol (data first, ``manifest.json`` last, create-only).
Nothing here can reach AWS: dummy credentials, no metadata service, a dead default endpoint."""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'roll-ckpt[s3]')")

from backend_fs import s3server  # noqa: E402  (tests/ is on sys.path: the S3 server fixture module)

from helpers.damage import flip_byte  # noqa: E402
from helpers.training import backup_config, config  # noqa: E402
from roll_ckpt.format import layout  # noqa: E402
from roll_ckpt.tiers import replication  # noqa: E402
from roll_ckpt.cli import main  # noqa: E402
from roll_ckpt.format.manifest import MANIFEST_NAME  # noqa: E402
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state  # noqa: E402
from roll_ckpt.format.manifest import verify  # noqa: E402
from roll_ckpt_fs import FsspecStorage, open_storage  # noqa: E402

from ._backup_helpers import (COPYING_CHILD, REPLICATING_CHILD, committed_steps, kill_when_busy,  # noqa: E402
                              leftovers, manager, save_steps)


# ``s3`` (the session's ``weed mini``) and ``offline_aws`` come from tests/conftest.py; the
# environment without AWS is inherited by the children these tests start.
pytestmark = pytest.mark.usefixtures("offline_aws")


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replication, "BACKOFF_S", 0.05)


@pytest.fixture
def s3_url(s3: s3server.SeaweedServer) -> str:
    return f"s3://{s3.bucket}/bk-{uuid.uuid4().hex[:12]}"


def _raw_fs(s3: s3server.SeaweedServer) -> Any:
    """An independent client (its own instance, no listing cache): what another process sees."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **s3.storage_options)


def _config(local: Path, s3_url: str, s3: s3server.SeaweedServer, *, resume: Any = False, **bk: Any):
    return backup_config(local, s3_url, storage_options=s3.storage_options, resume=resume, **bk)


def test_replication_to_s3_end_to_end(tmp_path: Path, s3: s3server.SeaweedServer, s3_url: str) -> None:
    state = tiny_state(4)
    m = manager(_config(tmp_path / "local", s3_url, s3, keep_local=1))
    assert isinstance(m.backup.storage, FsspecStorage) and not m.backup.storage.atomic_rename
    snaps = save_steps(m, state, (1, 2, 3))
    status = m.backup.wait(timeout=60)
    m.close()
    assert [c.state for c in status.checkpoints] == ["committed"] * 3, status
    bk = m.backup.storage
    assert committed_steps(bk, bk.root) == [1, 2, 3] and leftovers(bk, bk.root) == []
    for ref in layout.committed(bk, bk.root):
        verify(bk, ref.path)
    assert committed_steps(m.storage, m.storage.root) == [3]  # keep_local: 1
    # another client sees every replica committed (its manifest is there)
    raw = _raw_fs(s3)
    run = Path(m.run_dir).name
    for step in (1, 2, 3):
        assert raw.exists(f"{bk.root}/{run}/checkpoint-{step}/{MANIFEST_NAME}")

    # resume from S3 once the local copies are gone
    shutil.rmtree(tmp_path / "local")
    fresh = tiny_state(8)
    with manager(_config(tmp_path / "local", s3_url, s3, resume="latest")) as r:
        assert r.resume(fresh) == 3 and r.resumed.from_backup
        assert r.resumed.path == f"{s3_url}/{run}/checkpoint-3"
    assert_same_state(state_snapshot(fresh), snaps[3])


def test_a_damaged_local_copy_falls_back_to_the_s3_replica(tmp_path: Path, s3: s3server.SeaweedServer,
                                                           s3_url: str, caplog) -> None:
    state = tiny_state(6)
    m = manager(_config(tmp_path / "local", s3_url, s3))
    m.save(1, state)
    snap = state_snapshot(state)
    m.backup.wait(timeout=60)
    m.close()
    (ref,) = layout.committed(m.storage, m.storage.root)
    flip_byte(Path(ref.path) / "dcp" / "__0_0.distcp", 100)
    caplog.set_level(logging.WARNING, logger="roll_ckpt")
    fresh = tiny_state(1)
    with manager(_config(tmp_path / "local", s3_url, s3, resume="latest")) as r:
        assert r.resume(fresh) == 1 and r.resumed.from_backup
        assert r.resumed.path.startswith("s3://")
    assert_same_state(state_snapshot(fresh), snap)
    assert any("dcp/__0_0.distcp" in rec.getMessage() for rec in caplog.records)


def test_a_kill_during_replication_to_s3(tmp_path: Path, s3: s3server.SeaweedServer, s3_url: str) -> None:
    local = tmp_path / "local"
    raw_cfg = {"checkpoint_config": {"output_dir": str(local), "backup": {
        "output_dir": s3_url, "storage_options": s3.storage_options}}}
    flag = tmp_path / "copying"
    # killed once some objects of the replica are on the server, its manifest is not
    kill_when_busy(REPLICATING_CHILD, json.dumps(raw_cfg), str(flag), flag=flag, delay=0.5)
    m = manager(_config(local, s3_url, s3, resume="latest"))
    bk = m.backup.storage
    assert committed_steps(bk, bk.root) == [], "a killed copy must not look committed on S3"
    assert m.resume(tiny_state()) == 1 and not m.resumed.from_backup
    m.save(2, tiny_state())
    status = m.backup.wait(timeout=60)
    m.close()
    assert sorted(c.step for c in status.committed) == [1, 2]
    assert committed_steps(bk, bk.root) == [1, 2] and leftovers(bk, bk.root) == []
    for ref in layout.committed(bk, bk.root):
        verify(bk, ref.path)


def _s3_options(s3: s3server.SeaweedServer, flag: str = "--storage-option") -> list[str]:
    return [flag, f"key={s3server.ACCESS_KEY}", flag, f"secret={s3server.SECRET_KEY}",
            flag, f"endpoint_url={s3.endpoint}"]


def test_copy_cli_local_to_s3_to_memory_to_local(tmp_path: Path, s3: s3server.SeaweedServer, s3_url: str,
                                                 memory_url: str, capsys) -> None:
    state = tiny_state(3)
    with manager(config(tmp_path / "src")) as m:
        m.save(1, state)
        m.save(2, state)
        snap = state_snapshot(state)
        run = Path(m.run_dir).name
    assert main(["-q", "copy", str(tmp_path / "src"), s3_url, *_s3_options(s3, "--dst-storage-option")]) == 0
    assert main(["-q", "copy", s3_url, memory_url, *_s3_options(s3, "--src-storage-option")]) == 0
    assert main(["-q", "copy", memory_url, str(tmp_path / "back")]) == 0
    assert main(["verify", s3_url, *_s3_options(s3)]) == 0
    out = capsys.readouterr().out
    assert out.count("OK  ") == 2
    bk = open_storage(s3_url, s3.storage_options)
    assert committed_steps(bk, bk.root) == [1, 2] and leftovers(bk, bk.root) == []
    fresh = tiny_state(0)
    with manager(config(tmp_path / "back", resume_from_checkpoint=str(tmp_path / "back" / run / "checkpoint-2"))) as r:
        assert r.resume(fresh) == 2
    assert_same_state(state_snapshot(fresh), snap)


def test_a_killed_copy_to_s3_commits_nothing_and_the_rerun_completes(tmp_path: Path, s3: s3server.SeaweedServer,
                                                                     s3_url: str, capsys) -> None:
    with manager(config(tmp_path / "src")) as m:
        m.save(1, tiny_state())
        run = Path(m.run_dir).name
    flag = tmp_path / "copying"
    args = ["copy", str(tmp_path / "src"), s3_url, *_s3_options(s3, "--dst-storage-option")]
    kill_when_busy(COPYING_CHILD, *args, flag=flag, delay=0.5, env={"COPY_FLAG": str(flag), "SLOW_URL": s3_url})
    bk = open_storage(s3_url, s3.storage_options)
    assert committed_steps(bk, bk.root) == []
    raw = _raw_fs(s3)
    assert not raw.exists(f"{bk.root}/{run}/checkpoint-1/{MANIFEST_NAME}")

    assert main(["-q", *args]) == 0
    assert "left by an interrupted copy" in capsys.readouterr().out
    assert committed_steps(bk, bk.root) == [1] and leftovers(bk, bk.root) == []
    verify(bk, bk.join(bk.root, run, "checkpoint-1"))
