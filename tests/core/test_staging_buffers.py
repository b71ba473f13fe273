"""Host memory between saves: regular staging frees its buffers' memory once a save is
written, makes it again off the loop before a save the manager knows of, and keeps it with
``strategy_config.keep_staging_buffers: true``; every save still writes the state as it was
at the call, whichever way its buffers came back."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import pytest
import torch

from helpers.training import config, train_step
from roll_ckpt import CheckpointManager, ConfigError
from roll_ckpt.testing import assert_same_state, state_snapshot

_MIB = 2**20


def _anon_mib() -> float:
    """This process's anonymous resident memory, after garbage of earlier tests is collected
    and freed heap given back (it would otherwise leave between two readings)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


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
    """RSS read around each event alone (a pytest worker's heap moves between distant readings)."""
    state = _state()
    size = _state_mib(state)
    with _manager(tmp_path) as m:
        for step in (1, 2):
            m.maybe_save(step, state)
        before = _anon_mib()
        m.maybe_save(3, state)  # step 3 saves: its buffers are laid out in the call
        staged = _anon_mib()
        m.wait()
        written = _anon_mib()
        assert staged - before > 0.9 * size, (staged - before, size)
        assert staged - written > 0.9 * size, (staged - written, size)  # given back once written
        assert m.last_save.bytes_allocated >= size * _MIB
        m.maybe_save(4, state)
        assert _anon_mib() - written < 0.25 * size  # two steps before a save: nothing made yet
        m.maybe_save(5, state)  # the step before a save step: the buffers come back meanwhile
        ready = m.prepare_save()  # queued behind maybe_save's own: done once the buffers are
        assert ready is not None
        ready.result(timeout=60)
        made = _anon_mib()
        assert made - written > 0.9 * size, (made - written, size)
        m.maybe_save(6, state)
        m.wait()
        assert made - _anon_mib() > 0.9 * size  # given back again
        assert m.last_save is not None and m.last_save.step == 6
        assert m.last_save.bytes_allocated == 0  # announced: nothing allocated in the call


def test_kept_buffers_stay_between_saves(tmp_path: Path) -> None:
    state = _state()
    size = _state_mib(state)
    with _manager(tmp_path, keep_staging_buffers=True) as m:
        m.save(1, state)
        m.wait()
        assert m.last_save.bytes_allocated >= size * _MIB  # the first save lays its buffers out
        assert m.prepare_save() is None  # nothing to make ready: the memory never left
        before = _anon_mib()
        m.save(2, state)  # not announced, and yet nothing to allocate: the buffers were kept
        m.wait()
        assert m.last_save.bytes_allocated == 0
        assert _anon_mib() - before < 0.25 * size  # the same buffers, not a second set


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
