"""Saves of an unchanged structure repeat the last full save's layout (roll_ckpt.dcp.writer):
the same ``.metadata`` bytes, a plain DCP folder, exact resumes; every change takes the full path."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from helpers.training import config
from roll_ckpt import CheckpointManager
from roll_ckpt.dcp.files import padded_value, slot_capacity

pytestmark = pytest.mark.timeout(120)


def _state(width: int = 8, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    return {"model": model, "optimizer": opt, "scheduler": sched, "buf": torch.zeros(5), "counter": {"n": 0}}


def _step(state: dict, k: int) -> None:
    model = state["model"]
    x = torch.randn(4, model[0].in_features)
    model(x).sum().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    state["scheduler"].step()
    state["buf"].add_(k)
    state["counter"]["n"] += 1


def _manager(out: Path, **kw) -> CheckpointManager:
    return CheckpointManager.from_config(config(out, timestamp_subdir=False, **kw), quiet=True)


def _metadata(out: Path, step: int) -> bytes:
    return (out / f"checkpoint-{step}" / "dcp" / ".metadata").read_bytes()


def _fast(m: CheckpointManager) -> int:
    return m.io.layouts.fast_saves


def test_a_padded_value_is_a_zip_torch_loads() -> None:
    buf = io.BytesIO()
    value = {"n": 10 ** 30, "rng": torch.get_rng_state(), "l": list(range(50))}
    torch.save(value, buf)
    raw = buf.getvalue()
    cap = slot_capacity(raw)
    assert cap - len(raw) >= 512
    pieces = padded_value(raw, cap)
    padded = b"".join(bytes(p) for p in pieces)
    assert len(padded) == cap
    back = torch.load(io.BytesIO(padded), weights_only=True)
    assert back["n"] == value["n"] and torch.equal(back["rng"], value["rng"]) and back["l"] == value["l"]
    assert padded_value(raw, len(raw) - 1) is None  # a value that outgrew its slot
    assert padded_value(raw + b"x", cap) is None  # not a zip ending in its directory: no padding


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_saves_of_one_structure_repeat_the_metadata(tmp_path: Path, async_save: bool) -> None:
    import torch.distributed.checkpoint as dcp

    state = _state()
    m = _manager(tmp_path, async_save=async_save)
    for step in range(1, 5):
        _step(state, step)
        m.save(step, state)
    m.wait()
    assert _fast(m) == 3  # every save after the first
    m.close()
    assert len({_metadata(tmp_path, s) for s in range(1, 5)}) == 1
    # plain DCP reads a checkpoint written that way, values and all
    sd = {"model": {k: torch.empty_like(v) for k, v in state["model"].state_dict().items()},
          "per_rank": {"0": {"buf": torch.empty(5), "counter": None}}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "checkpoint-4" / "dcp"))  # one process, no group
    for k, v in state["model"].state_dict().items():
        assert torch.equal(sd["model"][k], v)
    assert torch.equal(sd["per_rank"]["0"]["buf"], state["buf"])
    assert sd["per_rank"]["0"]["counter"] == ({"n": 4},)


def test_a_resumed_job_starts_from_its_checkpoint_layout_and_resumes_exactly(tmp_path: Path) -> None:
    state = _state()
    m = _manager(tmp_path)
    for step in (1, 2):
        _step(state, step)
        m.save(step, state)
    m.close()
    _step(state, 3)  # the uninterrupted job's next step
    again = _state(seed=1)
    m2 = _manager(tmp_path, resume_from_checkpoint=True)
    assert m2.resume(again) == 2
    assert m2.io.resumed_from[3] is not None  # checkpoint-2's .metadata, for the next save to adopt
    _step(again, 3)  # the RNG restored too: the same step
    for a, b in zip(state["model"].parameters(), again["model"].parameters()):
        assert torch.equal(a, b)
    m2.save(3, again)
    assert _fast(m2) == 1  # the first save after the restart took the short path
    m2.close()
    assert _metadata(tmp_path, 3) == _metadata(tmp_path, 2)
    third = _state(seed=2)
    m3 = _manager(tmp_path, resume_from_checkpoint=True)
    assert m3.resume(third) == 3
    m3.close()
    for a, b in zip(again["model"].parameters(), third["model"].parameters()):
        assert torch.equal(a, b)
    assert torch.equal(third["buf"], again["buf"]) and third["counter"] == again["counter"]
    assert third["optimizer"].state_dict()["state"][0]["exp_avg"].equal(again["optimizer"].state_dict()["state"][0]["exp_avg"])


def _grow(state: dict) -> None:
    state["counter"]["history"] = list(range(20_000))  # pickles to far more than its slot


@pytest.mark.parametrize("change", ["shape", "dtype", "new_key", "removed_key", "value_grew"])
def test_each_change_of_structure_takes_the_full_path(tmp_path: Path, change: str) -> None:
    state = _state()
    m = _manager(tmp_path)
    _step(state, 1)
    m.save(1, state)
    m.save(2, state)
    assert _fast(m) == 1
    if change == "shape":
        state["buf"] = torch.zeros(6)
    elif change == "dtype":
        state["buf"] = torch.zeros(5, dtype=torch.int32)  # the same bytes, another dtype
    elif change == "new_key":
        state["extra"] = {"a": 1}
    elif change == "removed_key":
        del state["counter"]
    else:
        _grow(state)
    m.save(3, state)
    assert _fast(m) == 1, "a changed structure must not reuse the old layout"
    assert _metadata(tmp_path, 3) != _metadata(tmp_path, 2)
    m.save(4, state)  # the new structure's layout holds from then on
    assert _fast(m) == 2
    m.close()
    back = _state(seed=3)
    if change == "new_key":
        back["extra"] = {}
    m2 = _manager(tmp_path, resume_from_checkpoint=True)
    assert m2.resume(back) == 4
    m2.close()
    assert torch.equal(back["buf"], state["buf"]) and back["buf"].dtype == state["buf"].dtype
    if change == "value_grew":
        assert back["counter"]["history"] == state["counter"]["history"]


def test_a_layout_not_written_as_planned_is_written_again_by_the_full_path(tmp_path: Path, monkeypatch) -> None:
    """No correctness rests on the kept layout: a process that wrote anything else makes the
    job write the save again through DCP's protocol."""
    from roll_ckpt.dcp import writer as dcp_write

    state = _state()
    m = _manager(tmp_path)
    m.save(1, state)
    real = dcp_write.DigestingWriter.write_files

    def off_by_one(self, files, planner, slots=None, values=None):
        out = real(self, files, planner, slots, values)
        if slots is not None:  # the short path: pretend an offset moved
            name = next(iter(self.written))
            index, offset, length = self.written[name][0]
            self.written[name][0] = (index, offset + 1, length)
        return out

    monkeypatch.setattr(dcp_write.DigestingWriter, "write_files", off_by_one)
    _step(state, 2)
    m.save(2, state)
    assert _fast(m) == 0
    monkeypatch.undo()
    m.close()
    back = _state(seed=4)
    m2 = _manager(tmp_path, resume_from_checkpoint=True)
    assert m2.resume(back) == 2
    m2.close()
    for a, b in zip(state["model"].parameters(), back["model"].parameters()):
        assert torch.equal(a, b)


def test_a_failed_short_save_commits_nothing_and_the_next_one_works(tmp_path: Path, monkeypatch) -> None:
    from roll_ckpt.dcp import writer as dcp_write
    from roll_ckpt.errors import SaveError

    state = _state()
    m = _manager(tmp_path)
    m.save(1, state)

    def broken(self, files, planner, slots=None, values=None):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(dcp_write.DigestingWriter, "write_files", broken)
    with pytest.raises(SaveError, match="Input/output error"):
        m.save(2, state)
    monkeypatch.undo()
    assert not (tmp_path / "checkpoint-2").exists()
    m.save(3, state)
    assert _fast(m) == 1  # the layout still holds
    m.close()


class _Marked(torch.Tensor):
    """A tensor subclass of the job's own: what DCP makes of it is not told from its shape and dtype."""


def test_a_state_holding_a_tensor_subclass_repeats_its_layout_too(tmp_path: Path) -> None:
    """A layout holds for the values its keys describe (``roll_ckpt.dcp.writer.layout_keys``);
    a tensor subclass (a float8 weight's shard) may make write items of its own: it is keyed
    by those items, and its saves repeat the layout as the others do."""
    state = _state()
    state["buf"] = torch.zeros(5).as_subclass(_Marked)
    m = _manager(tmp_path)
    for s in (1, 2, 3):
        _step(state, s)
        m.save(s, state)
    assert _fast(m) == 2
    m.close()
    assert all((tmp_path / f"checkpoint-{s}" / "manifest.json").is_file() for s in (1, 2, 3))
