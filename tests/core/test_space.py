"""The space check before a save: the estimate is within 5% of the real size; a save that
cannot fit is refused before anything is written (both sizes and the max_ckpt_to_keep that
would help in the message) and earlier checkpoints stay intact; retention runs first when it
can make room; stores that cannot tell their free space are not checked; with several
processes the coordinator's refusal reaches every rank (no deadlock, no extra collective)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.launch import child_env, free_port, rank_env
from helpers.training import config
from roll_ckpt import CheckpointManager
from roll_ckpt.errors import StorageFullError
from roll_ckpt.format import layout
from roll_ckpt.tiers.space import SpaceGuard, estimate_checkpoint_bytes
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state
from roll_ckpt.format.manifest import verify


def _linear(width: int, seed: int = 0, adam: bool = False) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters()) if adam else torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "counter": {"step": 0}}


def _many_small() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(60)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return {"model": model, "optimizer": opt, "scheduler": sched, "notes": {"text": "x" * 3000, "ids": list(range(500))}}


def _manager(root: Path, **cc) -> CheckpointManager:
    return CheckpointManager.from_config(config(root, **cc), quiet=True)


def _real_sizes(path: str) -> tuple[int, int]:
    """(manifest total, bytes of every file on disk including the manifest)."""
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    listed = sum(e["size"] for e in manifest["files"].values())
    on_disk = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    return listed, on_disk


@pytest.mark.parametrize("kind", ["tiny", "linear-adamw", "many-small", "with-metadata"])
def test_estimate_is_within_5_percent_of_the_real_size(tmp_path: Path, kind: str) -> None:
    state = {"tiny": tiny_state, "linear-adamw": lambda: _linear(384, adam=True),
             "many-small": _many_small, "with-metadata": tiny_state}[kind]()
    metadata = {"note": "y" * 2000, "loss": 0.5} if kind == "with-metadata" else None
    with _manager(tmp_path / "ckpt") as m:
        path = m.save(1, state, metadata=metadata)
        est = m.stats.space_estimate
    listed, on_disk = _real_sizes(path)
    print(f"\n[{kind}] estimate {est.total} B, manifest total {listed} B, on disk {on_disk} B "
          f"({100 * (est.total - on_disk) / on_disk:+.2f}%)")
    assert abs(est.total - on_disk) <= 0.05 * on_disk
    assert abs(est.total - listed) <= 0.05 * listed
    # the tensors' own bytes are exact
    sd = m.strategy.state_dict(state)
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(sd)
    assert est.tensor_bytes == sum(v.numel() * v.element_size() for v in flat.values() if isinstance(v, torch.Tensor))


def test_a_save_that_cannot_fit_is_refused_before_writing_and_earlier_checkpoints_stay(tmpfs) -> None:
    mnt = tmpfs("8m")
    root = mnt / "ckpt"
    small = _linear(256, seed=1)
    m = _manager(root)
    first = m.save(1, small)
    snap = state_snapshot(small)
    usage_before = shutil.disk_usage(mnt).used
    files_before = sorted(str(p) for p in root.rglob("*"))

    big = _linear(1536, seed=2)  # ~9.4 MB of parameters: more than the whole tmpfs
    with pytest.raises(StorageFullError) as info:
        m.save(2, big)
    msg = str(info.value)
    print("\n" + msg)
    assert "checkpoint-2" in msg and str(root) in msg
    assert re.search(r"needs about 9\.\d MiB and only 7\.\d MiB are free", msg), msg  # both numbers, human-readable
    assert "max_ckpt_to_keep" in msg and "refused before writing anything" in msg
    # nothing was written: no folder, no marker, not a byte more on the file system
    assert sorted(str(p) for p in root.rglob("*")) == files_before
    assert shutil.disk_usage(mnt).used == usage_before
    assert [r.step for r in layout.scan(m.storage, m.storage.root)] == [1]
    verify(m.storage, first)

    # training goes on: a save that fits still works, and the earlier checkpoint loads
    third = m.save(3, small)
    m.close()
    verify(m.storage, third)
    fresh = _linear(256, seed=9)
    with CheckpointManager.from_config(config(root, resume_from_checkpoint=first), quiet=True) as r:
        assert r.resume(fresh) == 1
    assert_same_state(state_snapshot(fresh), snap)


def test_an_async_save_that_cannot_fit_is_refused_by_save_itself(tmpfs) -> None:
    mnt = tmpfs("8m")
    cfg = config(mnt / "ckpt", async_save=True)
    m = CheckpointManager.from_config(cfg, quiet=True)
    m.save(1, _linear(128))
    m.wait()
    with pytest.raises(StorageFullError, match="no space left for checkpoint-2"):
        m.save(2, _linear(1536))  # refused before staging: nothing runs in the background
    assert not m.stats.in_flight
    m.save(3, _linear(128))
    m.close()
    assert [r.step for r in layout.committed(m.storage, m.storage.root)] == [1, 3]
    assert not [p for p in (mnt / "ckpt").rglob("*") if p.name.startswith((".tmp-", ".inflight-"))]


def test_retention_runs_first_when_it_can_make_room(tmpfs, caplog) -> None:
    mnt = tmpfs("8m")
    state = _linear(900)  # ~3.2 MB per checkpoint: two fit, a third only once the oldest is gone
    caplog.set_level(logging.INFO, logger="roll_ckpt")

    # without retention the third save is refused, and the message says which setting would help
    m = _manager(mnt / "a")
    m.save(1, state)
    m.save(2, state)
    with pytest.raises(StorageFullError) as info:
        m.save(3, state)
    assert "set checkpoint_config.max_ckpt_to_keep: 2 (now 0, which keeps all)" in str(info.value)
    m.close()
    shutil.rmtree(mnt / "a")

    # with max_ckpt_to_keep: 2 retention removes checkpoint-1 before the save instead
    m = _manager(mnt / "b", max_ckpt_to_keep=2)
    m.save(1, state)
    m.save(2, state)
    path3 = m.save(3, state)
    m.close()
    assert [r.step for r in layout.committed(m.storage, m.storage.root)] == [2, 3]
    verify(m.storage, path3)
    assert any("to make room for checkpoint-3" in r.getMessage() for r in caplog.records)


def test_without_the_check_a_full_disk_still_fails_cleanly_mid_write(tmpfs, monkeypatch) -> None:
    """Where free space is unknown (or another writer fills the disk after the check), the
    write itself runs out of space: the same error kind, nothing committed or left behind."""
    mnt = tmpfs("4m")
    monkeypatch.setattr(SpaceGuard, "free", lambda self, path: None)
    m = _manager(mnt / "ckpt")
    first = m.save(1, _linear(128))
    with pytest.raises(StorageFullError, match="no space left while writing checkpoint-2"):
        m.save(2, _linear(1200))
    assert [r.step for r in layout.scan(m.storage, m.storage.root)] == [1]
    assert not [p for p in (mnt / "ckpt").rglob("*") if p.name.startswith((".tmp-", ".inflight-"))]
    verify(m.storage, first)
    m.close()


def test_nothing_left_to_remove_says_so(tmp_path: Path) -> None:
    guard = SpaceGuard(storage=None, root="", where="X")  # type: ignore[arg-type]
    assert "no older checkpoint is left" in guard._hint(100, 10, 1, [50])
    assert "even checkpoint_config.max_ckpt_to_keep: 1" in guard._hint(1000, 10, 0, [50, 50, 50])
    assert "max_ckpt_to_keep: 4 (now 0" in guard._hint(100, 10, 0, [95, 5, 5, 5])  # drop the oldest only
    assert "max_ckpt_to_keep: 2 (now 5)" in guard._hint(100, 10, 5, [50, 50, 50])


def test_stores_that_cannot_tell_are_not_checked(memory_url: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="roll_ckpt")
    cfg = config(memory_url)
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        assert m.storage.free_bytes(m.storage.root) is None
        m.save(1, tiny_state())
        m.save(2, tiny_state())
        assert m.stats.space_estimate is None  # nothing estimated either
    told = [r for r in caplog.records if "cannot tell its free space" in r.getMessage()]
    assert len(told) == 1


def test_estimate_counts_per_process_values_once_per_rank() -> None:
    sd = {"model": {"w": torch.zeros(1000)}, "per_rank": {"0": {"rng": torch.zeros(10, dtype=torch.uint8)}}}
    one = estimate_checkpoint_bytes(sd, world_size=1)
    four = estimate_checkpoint_bytes(sd, world_size=4)
    assert one.tensor_bytes == 4010 and four.tensor_bytes == 4000 + 4 * 10
    assert four.total > one.total


WORKER = r'''
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from roll_ckpt.runtime.torch_compat import fsdp2_options
from roll_ckpt import CheckpointManager, load_config
from roll_ckpt.errors import StorageFullError

root, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))

def state(width):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8))
    for layer in model:
        fully_shard(layer, mesh=mesh, **fsdp2_options(mesh.device_type))
    fully_shard(model, mesh=mesh, **fsdp2_options(mesh.device_type))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "counter": {"rank": rank}}

m = CheckpointManager.from_config(load_config({"checkpoint_config": {"output_dir": root}}), quiet=True)
result = {"rank": rank, "strategy": None}
path = m.save(1, state(256))
result["strategy"] = m.strategy.name
if rank == 0:
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    result["estimate"] = m.stats.space_estimate.total
    result["real"] = sum(e["size"] for e in manifest["files"].values())
try:
    m.save(2, state(1024))  # 1024*1024*4*3 (weights + AdamW state) ~ 12.6 MB: cannot fit in 8m
    result["refused"] = None
except StorageFullError as exc:
    result["refused"] = str(exc)
m.save(3, state(64))  # the ranks are still in step: the next save works
m.close()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
os._exit(0)  # skip interpreter exit: see tests/helpers/launch.py exit_worker
'''


@pytest.mark.timeout(120)
def test_two_ranks_coordinator_refusal_reaches_every_rank(tmpfs, tmp_path: Path) -> None:
    pytest.importorskip("roll_ckpt_fsdp2")
    mnt = tmpfs("8m")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    for rank in range(2):  # two plain processes (no torchrun agent: faster to start)
        env = child_env(rank_env(rank, 2, port), OMP_NUM_THREADS="1", ROLL_CKPT_QUIET="1")
        procs.append(subprocess.Popen([sys.executable, str(script), str(mnt / "ckpt"), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=100)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-4000:] for o in outs)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["strategy"] == "fsdp2"
    print(f"\n2 ranks, FSDP2: estimate {r0['estimate']} B, real {r0['real']} B; rank 1 got: {r1['refused']}")
    assert abs(r0["estimate"] - r0["real"]) <= 0.05 * r0["real"]
    assert r0["refused"] and "no space left for checkpoint-2" in r0["refused"]
    assert r1["refused"] and "no space left for checkpoint-2" in r1["refused"]
    m = _manager(mnt / "ckpt")
    assert [r.step for r in layout.scan(m.storage, m.storage.root)] == [1, 3]
    assert not [p for p in (mnt / "ckpt").rglob("*") if p.name.startswith((".tmp-", ".inflight-"))]
