"""Incremental saves (``checkpoint_config.incremental``, on by default): a LoRA-shaped state
whose frozen base is taken over from the checkpoint before, proved unchanged by content;
each checkpoint stays a whole, plain DCP folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from roll_ckpt import CheckpointManager, load_config

pytestmark = pytest.mark.timeout(120)

BASE = 256  # the frozen base: 2 x Linear(256, 256), ~0.5 MiB


def lora(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A frozen base and a small trainable adapter, AdamW over the adapter only."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(BASE, BASE), torch.nn.Linear(BASE, BASE), torch.nn.Linear(BASE, 4))
    for layer in model[:2]:
        layer.requires_grad_(False)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, BASE)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def manager(out: Path, **cc) -> CheckpointManager:
    cfg = {"output_dir": str(out), "timestamp_subdir": False, **cc}
    return CheckpointManager.from_config(load_config({"checkpoint_config": cfg}), quiet=True)


def files(ckpt: Path) -> dict[str, dict]:
    return {n: e for n, e in json.loads((ckpt / "manifest.json").read_text())["files"].items() if n.endswith(".distcp")}


def frozen_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model[:2].parameters())


def trainable_and_optimizer_bytes(model: torch.nn.Module) -> int:
    return 3 * sum(p.numel() * p.element_size() for p in model[2].parameters())  # + exp_avg, exp_avg_sq


def saved(out: Path, steps: int, **cc) -> tuple[torch.nn.Module, torch.optim.Optimizer, list]:
    model, opt = lora()
    stats = []
    with manager(out, **cc) as m:
        for s in range(1, steps + 1):
            step(model, opt)
            m.save(s, {"model": model, "optimizer": opt})
            stats.append(m.stats.last)
    return model, opt, stats


def test_the_frozen_base_is_linked_and_only_the_adapter_is_written(tmp_path: Path) -> None:
    model, _, stats = saved(tmp_path, 4)
    assert stats[0].bytes_taken_over == 0 and stats[0].bytes_written == stats[0].bytes
    for s in stats[1:]:
        assert s.bytes_taken_over >= frozen_bytes(model)
        # what is written: the adapter, AdamW's moments, .metadata and the small values
        assert s.bytes_written < trainable_and_optimizer_bytes(model) + 64 * 1024, s
    base_file = [n for n, e in files(tmp_path / "checkpoint-4").items() if e.get("taken_over")]
    assert base_file == ["dcp/__0_0.distcp"] and files(tmp_path / "checkpoint-4")[base_file[0]]["taken_over"] \
        == "checkpoint-3"
    inodes = {os.stat(tmp_path / f"checkpoint-{k}" / base_file[0]).st_ino for k in (1, 2, 3, 4)}
    assert len(inodes) == 1 and os.stat(tmp_path / "checkpoint-1" / base_file[0]).st_nlink == 4


def test_older_checkpoints_deleted_the_newest_verifies_and_resumes_bit_exactly(tmp_path: Path) -> None:
    from roll_ckpt.cli import main

    model, opt, _ = saved(tmp_path, 3)
    for k in (1, 2):
        shutil.rmtree(tmp_path / f"checkpoint-{k}")
    assert main(["--quiet", "verify", str(tmp_path / "checkpoint-3")]) == 0
    other, other_opt = lora(seed=7)
    with manager(tmp_path, ) as m:
        assert m.resume({"model": other, "optimizer": other_opt}, "latest") == 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])


def test_plain_dcp_load_reads_a_checkpoint_whose_files_were_taken_over(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model, _, stats = saved(tmp_path, 2)
    assert stats[1].bytes_taken_over > 0
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(target, checkpoint_id=str(tmp_path / "checkpoint-2" / "dcp"))  # one process, no group
    assert all(torch.equal(target["model"][k], v) for k, v in model.state_dict().items())


def test_a_change_through_a_numpy_view_is_caught_and_written(tmp_path: Path) -> None:
    model, opt = lora()
    with manager(tmp_path) as m:
        step(model, opt)
        m.save(1, {"model": model, "optimizer": opt})
        model[0].weight.detach().numpy()[3, 5] += 1.0  # behind autograd: no version bump, no grad
        step(model, opt)
        m.save(2, {"model": model, "optimizer": opt})
        assert m.stats.last.bytes_taken_over == 0
        step(model, opt)
        m.save(3, {"model": model, "optimizer": opt})
        assert m.stats.last.bytes_taken_over >= frozen_bytes(model)
    assert not any(e.get("taken_over") for e in files(tmp_path / "checkpoint-2").values())
    other, other_opt = lora()
    with manager(tmp_path) as m:
        m.resume({"model": other, "optimizer": other_opt}, str(tmp_path / "checkpoint-2"))
    assert torch.equal(other[0].weight, model[0].weight) and not torch.equal(other[0].weight, lora()[0][0].weight)


def test_a_full_fine_tune_hashes_nothing_first_and_takes_nothing_over(tmp_path: Path, monkeypatch) -> None:
    from roll_ckpt.dcp.files import DigestSink

    calls = []
    original = DigestSink.__init__
    monkeypatch.setattr(DigestSink, "__init__", lambda self: calls.append(1) or original(self))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(BASE, BASE), torch.nn.Linear(BASE, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with manager(tmp_path) as m:
        for s in (1, 2, 3):
            step(model, opt)
            m.save(s, {"model": model, "optimizer": opt})
            assert m.stats.last.bytes_taken_over == 0
    assert calls == []


def test_incremental_false_writes_every_file(tmp_path: Path) -> None:
    _, _, stats = saved(tmp_path, 2, incremental=False)
    assert [s.bytes_taken_over for s in stats] == [0, 0]
    assert not any(e.get("taken_over") for e in files(tmp_path / "checkpoint-2").values())
    assert all(os.stat(tmp_path / "checkpoint-2" / n).st_nlink == 1 for n in files(tmp_path / "checkpoint-2"))


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_memory_store_takes_over_by_copy_and_the_copy_is_whole(memory_url: str, is_async: bool) -> None:
    model, opt = lora()
    cfg = {"checkpoint_config": {"output_dir": memory_url, "timestamp_subdir": False},
           "strategy_config": {"async_save_ckpt": is_async}}
    with CheckpointManager.from_config(load_config(cfg), quiet=True) as m:
        for s in (1, 2):
            step(model, opt)
            m.save(s, {"model": model, "optimizer": opt})
            m.wait()
        assert m.stats.last.bytes_taken_over >= frozen_bytes(model)
        storage = m.storage
        storage.remove_tree(storage.join(storage.root, "checkpoint-1"))
    other, other_opt = lora(seed=3)
    with CheckpointManager.from_config(load_config(cfg), quiet=True) as m:
        assert m.resume({"model": other, "optimizer": other_opt}, "latest") == 2
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


def test_a_resumed_job_takes_over_from_the_checkpoint_it_resumed_from(tmp_path: Path) -> None:
    model, opt, _ = saved(tmp_path, 2)
    other, other_opt = lora(seed=5)
    with manager(tmp_path) as m:
        m.resume({"model": other, "optimizer": other_opt}, "latest")
        step(other, other_opt)
        m.save(3, {"model": other, "optimizer": other_opt})
        assert m.stats.last.bytes_taken_over >= frozen_bytes(model)
    assert files(tmp_path / "checkpoint-3")["dcp/__0_0.distcp"]["taken_over"] == "checkpoint-2"


def test_a_base_file_gone_before_the_save_is_written_instead(tmp_path: Path) -> None:
    model, opt = lora()
    with manager(tmp_path) as m:
        step(model, opt)
        m.save(1, {"model": model, "optimizer": opt})
        (tmp_path / "checkpoint-1" / "dcp" / "__0_0.distcp").unlink()  # pruned by hand meanwhile
        step(model, opt)
        m.save(2, {"model": model, "optimizer": opt})
        assert m.stats.last.bytes_taken_over == 0
    from roll_ckpt.cli import main

    assert main(["--quiet", "verify", str(tmp_path / "checkpoint-2")]) == 0


def test_ls_shows_what_each_save_wrote(capsys, tmp_path: Path) -> None:
    from .test_cli import run_cli

    saved(tmp_path, 2)
    rc, out, err = run_cli(capsys, "ls", str(tmp_path))
    assert rc == 0, err
    lines = out.splitlines()
    assert "WRITTEN" in lines[0] and "taken over unchanged" in out
    import re

    sizes = [re.findall(r"\d+(?:\.\d+)? [KMGT]?i?B", line) for line in lines[1:3]]  # SIZE, WRITTEN
    assert sizes[0][0] == sizes[0][1] and sizes[1][0] != sizes[1][1], lines
    rc, out, _ = run_cli(capsys, "ls", str(tmp_path), "--json")
    rows = json.loads(out)["checkpoints"]
    assert rows[0]["taken_over"] == 0 and rows[1]["taken_over"] > rows[1]["bytes"] / 2


def test_the_base_is_named_within_its_run() -> None:
    from roll_ckpt.dcp.writer import Base

    assert Base("u", "/out/20261202-1/checkpoint-3/dcp", {}).name == "checkpoint-3"
    assert Base("u", "s3://b/run/checkpoint-3/actor/dcp", {}).name == "checkpoint-3/actor"  # a component's part


def test_saves_of_a_frozen_base_repeat_the_layout_and_take_the_base_over(tmp_path: Path) -> None:
    """The frozen base lies in a file of its own (``plan_files``); the saves after the first
    repeat that layout, files and all (``roll_ckpt.dcp.writer``: fixed layouts), and still
    take the base's file over instead of writing it."""
    model, opt = lora()
    with manager(tmp_path) as m:
        for s in (1, 2, 3):
            step(model, opt)
            m.save(s, {"model": model, "optimizer": opt})
            if s > 1:
                assert m.stats.last.bytes_taken_over >= frozen_bytes(model)
        assert m.io.layouts.fast_saves == 2
    metadata = [(tmp_path / f"checkpoint-{s}" / "dcp" / ".metadata").read_bytes() for s in (1, 2, 3)]
    assert metadata[0] == metadata[1] == metadata[2]
