"""A save that runs out of space fails cleanly: StorageFullError, nothing half-written is
committed or left behind, earlier checkpoints stay intact, training goes on, and the next
save succeeds once there is room again."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers.training import config, train_step
from roll_ckpt import CheckpointManager
from roll_ckpt.errors import StorageFullError
from roll_ckpt.format import layout
from roll_ckpt.testing import assert_same_state, state_snapshot
from roll_ckpt.format.manifest import verify


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(384, 384)              # ~0.6 MB of parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no optimizer state: the size is the model's
    return {"model": model, "optimizer": opt, "counter": {"step": 0}}


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.startswith((".tmp-", ".inflight-")))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full(tmpfs, async_save: bool) -> None:
    mnt = tmpfs("4m")
    root = mnt / "ckpt"
    cfg = config(root, async_save=async_save)
    state = _state(1)
    m = CheckpointManager.from_config(cfg, quiet=True)
    first = m.save(1, state)
    m.wait()
    snap1 = state_snapshot(state)

    # leave less room than one checkpoint needs
    need = sum(p.stat().st_size for p in Path(first).rglob("*") if p.is_file())
    filler = mnt / "filler.bin"
    with open(filler, "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(mnt).free - need // 2))
    assert shutil.disk_usage(mnt).free < need
    train_step(state, (4, 384), count=("counter", "step", 1))
    with pytest.raises(StorageFullError) as info:
        m.save(2, state)
        assert async_save, "a synchronous save must raise from save()"
        m.wait()  # async: save() returned once staged; the failure surfaces here
    msg = str(info.value)
    print(f"\n[{'async' if async_save else 'sync'}] {msg}")
    assert "no space left" in msg and "checkpoint-2" in msg and "Free space" in msg

    # nothing half-written: no new committed checkpoint, no temporary folder, no marker
    assert [r.step for r in layout.committed(m.storage, m.storage.root)] == [1]
    assert [r.step for r in layout.scan(m.storage, m.storage.root)] == [1]
    assert _leftovers(root) == []
    # the earlier checkpoint is intact and loads
    verify(m.storage, first)
    fresh = _state(7)
    with CheckpointManager.from_config(config(root, resume_from_checkpoint=first), quiet=True) as r:
        assert r.resume(fresh) == 1
    assert_same_state(state_snapshot(fresh), snap1)

    # training goes on, and once there is room again the next save works
    train_step(state, (4, 384), count=("counter", "step", 1))
    filler.unlink()
    third = m.save(3, state)
    m.close()
    verify(m.storage, third)
    assert [r.step for r in layout.committed(m.storage, m.storage.root)] == [1, 3]
    assert _leftovers(root) == []


def test_disk_already_full_at_first_save(tmpfs) -> None:
    mnt = tmpfs("1m")
    filler = mnt / "filler.bin"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    root = mnt / "ckpt"
    cfg = config(root)
    state = _state(2)
    m = CheckpointManager.from_config(cfg, quiet=True)
    with pytest.raises(StorageFullError) as info:
        m.save(1, state)
    assert "no space left" in str(info.value) and str(root) in str(info.value)
    assert not list(root.rglob(".run.json")), "no partial run marker is left behind"
    filler.unlink()
    train_step(state, (4, 384), count=("counter", "step", 1))
    path = m.save(2, state)
    m.close()
    verify(m.storage, path)
    assert [r.step for r in layout.committed(m.storage, m.storage.root)] == [2]
