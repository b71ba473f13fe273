"""Host memory between saves: regular staging frees its buffers' memory once a save is
written, makes it again off the loop before a save the manager knows of, and keeps it with
``strategy_config.keep_staging_buffers: true``; every save still writes the state as it was
at the call, whichever way its buffers came back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import warm
from helpers.training import config, train_step
from roll_ckpt import CheckpointManager, ConfigError
from roll_ckpt.testing import assert_same_state, state_snapshot

_MIB = 2**20
CHILD = Path(__file__).with_name("_staging_child.py")


def _state(seed: int = 0) -> dict:
    """~48 MiB of model and AdamW state: big enough that its staging shows in RSS."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(16)])
    state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}
    train_step(state, (2, 512), loss="sum")
    return state


def _state_mib(state: dict) -> float:
    n = sum(p.numel() * 3 for p in state["model"].parameters())  # weights + exp_avg + exp_avg_sq
    return n * 4 / _MIB


def _manager(tmp_path: Path, **strategy) -> CheckpointManager:
    cfg = config(tmp_path / "ckpt", save_steps=3,
                 strategy_config={"async_save_ckpt": True, **strategy})
    return CheckpointManager(cfg, quiet=True)


def test_buffers_are_freed_between_saves_and_ready_again_before_the_next(tmp_path: Path) -> None:
    """Read in a process of its own (``_staging_child.py``): the memory is there once a save is
    staged, gone once it is written and on the steps between, back (touched) once the step
    before the next save made it ready, so that save allocates nothing; gone again after it."""
    done = warm.run([sys.executable, str(CHILD), str(tmp_path / "ckpt")], timeout=240, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    got = json.loads(done.stdout.decode().strip().splitlines()[-1])
    size = got["state"]
    assert got["staged"] > 0.9 * size, got
    assert got["written"] < 0.25 * size and got["step_4"] < 0.25 * size, got
    assert got["ready"] > 0.9 * size, got
    assert got["allocated_6"] == 0 and got["written_6"] < 0.25 * size, got


def test_a_save_not_announced_brings_the_freed_memory_back_itself(tmp_path: Path) -> None:
    state = _state()
    size = _state_mib(state)
    with _manager(tmp_path) as m:
        m.save(1, state)
        m.wait()
        assert m.stats.last.bytes_allocated >= size * _MIB  # laid out in the call
        m.save(2, state)  # written, its memory freed: nobody announced this one
        m.wait()
        assert m.stats.last.bytes_allocated >= size * _MIB
        m.prepare_save().result(timeout=60)
        m.save(3, state)
        m.wait()
        assert m.stats.last.bytes_allocated == 0


def test_kept_buffers_stay_between_saves(tmp_path: Path) -> None:
    state = _state()
    size = _state_mib(state)
    with _manager(tmp_path, keep_staging_buffers=True) as m:
        m.save(1, state)
        m.wait()
        assert m.stats.last.bytes_allocated >= size * _MIB  # the first save lays its buffers out
        assert m.prepare_save() is None  # nothing to make ready: the memory never left
        m.save(2, state)  # not announced, and yet nothing to allocate: the buffers were kept
        m.wait()
        assert m.stats.last.bytes_allocated == 0


@pytest.mark.parametrize("announced", [False, True])
def test_a_save_into_buffers_made_again_holds_the_state_at_the_call(tmp_path: Path, announced: bool) -> None:
    state = _state(seed=1)
    with _manager(tmp_path) as m:
        m.save(1, state)
        m.wait()  # written: the buffers' memory is freed
        if announced:
            m.prepare_save().result(timeout=60)
        at_call = state_snapshot(state)
        path = m.save(2, state)
        with torch.no_grad():  # the loop goes on at once
            for p in state["model"].parameters():
                p.mul_(-2.0)
        train_step(state, (2, 512), loss="sum")
        stats = m.wait()
    # not announced, the call brought the memory back itself
    assert (stats.bytes_allocated == 0) if announced else (stats.bytes_allocated >= _state_mib(state) * _MIB)
    fresh = _state(seed=7)
    with CheckpointManager(config(tmp_path / "ckpt", resume_from_checkpoint=path), quiet=True) as r:
        assert r.resume(fresh) == 2
    assert_same_state(state_snapshot(fresh), at_call)


def test_keep_staging_buffers_must_be_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="strategy_config.keep_staging_buffers"):
        config(tmp_path, strategy_config={"keep_staging_buffers": "yes"})


def test_buffers_whose_memory_cannot_be_resized_are_laid_out_again(tmp_path: Path, monkeypatch) -> None:
    """A storage that refuses to be resized (as some allocators' may): the layout is dropped
    after the write, its memory going with it, and the next save lays it out anew."""
    def refuse(self, nbytes):
        raise RuntimeError("Trying to resize storage that is not resizable")

    monkeypatch.setattr(torch.UntypedStorage, "resize_", refuse)
    state = _state(seed=3)
    with _manager(tmp_path) as m:
        m.save(1, state)
        m.wait()
        ready = m.prepare_save()  # (with resizable storages this save would allocate nothing)
        assert ready is not None
        ready.result(timeout=60)
        at_call = state_snapshot(state)
        path = m.save(2, state)
        train_step(state, (2, 512), loss="sum")
        stats = m.wait()
    assert stats.bytes_allocated >= _state_mib(state) * _MIB  # laid out again
    fresh = _state(seed=9)
    with CheckpointManager(config(tmp_path / "ckpt", resume_from_checkpoint=path), quiet=True) as r:
        assert r.resume(fresh) == 2
    assert_same_state(state_snapshot(fresh), at_call)
