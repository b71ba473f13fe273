"""FSDP2 strategy on 2 gloo ranks (CPU): exact resume, staging paths, zero-copy, resharding."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import launch
from helpers import training
from helpers.training import mlp

WORKERS = Path(__file__).with_name("workers.py")
pytestmark = pytest.mark.timeout(300)
# scripts/gpu_check.sh sets these on a GPU machine (one process per GPU with NCCL).
NPROC = int(os.environ.get("ROLL_CKPT_TEST_NPROC", "2"))
ON_GPU = os.environ.get("ROLL_CKPT_TEST_DEVICE", "cpu") == "cuda"


def torchrun(nproc: int, *args: str, timeout: int = 180, check: bool = True, workers: Path = WORKERS) -> None:
    launch.torchrun(workers, *args, nproc=nproc, timeout=timeout, check=check)


def result(out: Path, name: str) -> dict:
    return json.loads((out / f"result-{name}.json").read_text())


def load_full(path: Path) -> dict[str, object]:
    """Every value of a DCP folder as full tensors, read on one process."""
    from roll_ckpt.dcp.reader import SafeReader
    from roll_ckpt.runtime.torch_compat import load_state_dict_no_dist
    from roll_ckpt.dcp.checked import SafeEmptyLoadPlanner
    from roll_ckpt_fs import LocalStorage

    sd: dict[str, object] = {}
    load_state_dict_no_dist(sd, SafeReader(LocalStorage(str(path)), str(path)), SafeEmptyLoadPlanner())
    return sd


def flat(d: object, prefix: str = "") -> dict[str, object]:
    if isinstance(d, dict):
        out: dict[str, object] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def assert_same(a: dict, b: dict) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        if isinstance(fa[k], torch.Tensor):
            assert torch.equal(fa[k], fb[k]), k
        else:
            assert fa[k] == fb[k], k


def test_exact_resume_after_abrupt_death_with_async_zero_copy_saves(tmp_path: Path) -> None:
    torchrun(NPROC, "resume_exact", str(tmp_path / "a"), "full", "0")
    # dies right after saving step 6; how the process group reacts to the abrupt exit of a
    # peer (exit code 0 or a gloo abort) does not matter, the checkpoint is committed
    torchrun(NPROC, "resume_exact", str(tmp_path / "b"), "die", "6", check=False)
    torchrun(NPROC, "resume_exact", str(tmp_path / "b"), "resume", "0")
    full_run, resumed = result(tmp_path / "a", "resume_exact-full"), result(tmp_path / "b", "resume_exact-resume")
    assert resumed["start"] == 6
    assert resumed["losses"] == {k: v for k, v in full_run["losses"].items() if int(k) > 6}
    assert full_run["policies"]["zero_copy"] >= 4 * 3  # periodic saves write from the offload store
    a = torch.load(tmp_path / "a" / "params-full.pt")
    b = torch.load(tmp_path / "b" / "params-resume.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["local", "local_dedup"])
def test_store_and_regular_paths_write_equal_checkpoints(tmp_path: Path, kind: str) -> None:
    if kind == "local_dedup" and NPROC < 2:
        pytest.skip("deduplication needs a tensor replicated over at least 2 ranks")
    if kind == "local_dedup" and not training.gloo_averages():
        pytest.skip(training.GLOO_AVG_MISSING)
    torchrun(NPROC, "paths_equal", str(tmp_path), kind)
    r = result(tmp_path, f"paths_equal-{kind}")
    assert set(r["regular"]) == {"regular"}
    if kind == "local":
        assert r["store"]["zero_copy"] >= 4 * 3  # 4 weights/biases x (param, exp_avg, exp_avg_sq)
    else:
        assert "zero_copy" not in r["store"]  # a deduplicated shard is rebuilt, then staged regularly
    assert_same(load_full(tmp_path / "checkpoint-1" / "dcp"), load_full(tmp_path / "checkpoint-2" / "dcp"))


def test_zero_copy_staging_copies_nothing_from_the_store(tmp_path: Path) -> None:
    torchrun(NPROC, "zero_copy_bytes", str(tmp_path), "2800", timeout=240)
    r = result(tmp_path, "zero_copy_bytes")
    total_state = sum(rank["state_bytes"] for rank in r["ranks"])
    assert total_state >= 256e6
    print(f"\nzero-copy save of {total_state / 1e6:.0f} MB: blocked {r['zc_blocked_s'] * 1e3:.1f} ms "
          f"(regular staging: {r['reg_blocked_s'] * 1e3:.1f} ms)")
    for rank in r["ranks"]:
        # only the few tensors outside the store (RNG, optimizer step counters) are copied
        assert rank["zc_bytes_copied"] < 64 * 1024
        assert 0 < rank["copied_by_calls"] < 64 * 1024, "only the tensors outside the store are copied"
        assert rank["zc_extra_rss"] < 0.05 * rank["state_bytes"]
        assert rank["reg_bytes_copied"] >= rank["state_bytes"]


def test_save_issues_no_extra_collective(tmp_path: Path) -> None:
    torchrun(NPROC, "collectives", str(tmp_path))
    r = result(tmp_path, "collectives")
    agreements = 2  # a save's own: before the write and after the commit (runtime/distributed.py)
    plain = dict(r["plain"])
    assert plain and r["first"] == {**plain, "all_reduce": plain.get("all_reduce", 0) + agreements}
    # the same structure again (zero-copy from the store): the fixed-layout protocol and the agreements
    assert r["ours"] == {"all_reduce": 1 + agreements, "gather_object": 1, "broadcast_object_list": 1}
    assert r["fast"] == 1


@pytest.mark.skipif(ON_GPU, reason="needs 3 processes; one per GPU with NCCL")
def test_reshard_two_ranks_to_one_and_three(tmp_path: Path) -> None:
    torchrun(NPROC, "reshard_save", str(tmp_path))
    expected = torch.load(tmp_path / "expected.pt")
    torchrun(3, "reshard_load", str(tmp_path))
    got3 = torch.load(tmp_path / "loaded-3.pt")
    assert got3["step"] == 5
    for part in ("params", "optim"):
        assert expected[part].keys() == got3[part].keys()
        assert all(torch.equal(expected[part][k], got3[part][k]) for k in expected[part])
    # one plain process, no process group: the dcp strategy loads the FSDP2 checkpoint
    from roll_ckpt import CheckpointManager, load_config

    model = mlp(33, 3, seed=99)  # workers.py's model, on one process
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = CheckpointManager.from_config(load_config({
        "checkpoint_config": {"output_dir": str(tmp_path / "single")},
        "resume_from_checkpoint": str(tmp_path / "checkpoint-5")}), quiet=True)
    assert m.resume({"model": model, "optimizer": opt}) == 5
    assert m.strategy.name == "dcp"
    sd = model.state_dict()
    assert all(torch.equal(expected["params"][k], sd[k]) for k in expected["params"])
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt)
    for key, want in expected["optim"].items():
        fqn, _, name = key.rpartition(".")
        assert torch.equal(want, osd["state"][fqn][name]), key


@pytest.mark.parametrize("guard", ["on", "off"])
def test_mutating_the_store_during_a_write_never_mixes_steps(tmp_path: Path, guard: str) -> None:
    torchrun(NPROC, "race", str(tmp_path), guard)
    expected = torch.load(tmp_path / "expected.pt")
    saved = flat(load_full(tmp_path / "checkpoint-1" / "dcp"))
    same = all(torch.equal(expected[k], saved[f"model.{k}"]) for k in expected)
    if guard == "on":
        assert same, "the checkpoint mixes values from two steps"
    else:  # control: without the store's hold the race shows up, so the test can tell
        assert not same


def test_incremental_saves_take_each_ranks_frozen_shards_over(tmp_path: Path) -> None:
    """2 ranks, the first two layers frozen, async zero-copy saves: from the second save on
    each rank's file of frozen shards is a hard link to the one before, every checkpoint
    lists all its files, and with the older ones deleted the newest resumes exactly."""
    torchrun(NPROC, "incremental", str(tmp_path), timeout=240)
    r = result(tmp_path, "incremental")
    first, *later = r["stats"]
    assert first["taken"] == 0 and first["policies"].get("zero_copy", 0) > 0, r["stats"]
    for s in later:
        assert r["frozen_bytes"] <= s["taken"] < s["bytes"], r["stats"]
    assert r["taken"]["checkpoint-1"] == []
    frozen_files = [f"dcp/__{rank}_0.distcp" for rank in range(NPROC)]
    assert r["taken"]["checkpoint-2"] == r["taken"]["checkpoint-3"] == frozen_files, r["taken"]
    assert all(r["links"][f"checkpoint-{c}/{n[4:]}"] == 3 for c in (1, 2, 3) for n in frozen_files), r["links"]
    assert r["start"] == 3 and r["exact"], r
    assert r["taken_after_resume"] >= r["frozen_bytes"], r


def test_a_state_whose_first_module_is_unsharded_is_claimed_by_fsdp2(tmp_path: Path) -> None:
    """A reference model (unsharded) before the sharded actor: the job is FSDP2's, not dcp's."""
    torchrun(NPROC, "claimed_by_any_module", str(tmp_path))
    r = result(tmp_path, "claimed_by_any_module")
    assert r == {"strategy": "fsdp2", "exact": True}
