"""Asynchronous saves: save() returns once the state is staged, the loop may change the
state at once, errors of the background write surface at the next save and at close()."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.plugins import plugins_with_backend
from helpers.training import config, train_step
from roll_ckpt import CheckpointManager, SaveError
from roll_ckpt.format import layout
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state
from roll_ckpt_fs import LocalStorage


class _Wrapped:
    """A local-disk storage whose open_write can be gated, slowed (``delay`` seconds) or made
    to fail for DCP files."""

    def __init__(self, url: str, ctl: dict[str, Any]) -> None:
        self._inner = LocalStorage(url)
        self._ctl = ctl

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def open_write(self, path: str):
        if "/dcp/" in path:
            ctl = self._ctl
            if "entered" in ctl:
                ctl["entered"].set()
            if "gate" in ctl:
                assert ctl["gate"].wait(60), "the test never opened the gate"
            if "delay" in ctl:
                time.sleep(ctl["delay"])
            if ctl.get("fail", 0) > 0:
                ctl["fail"] -= 1
                raise OSError(errno.EIO, "injected I/O error", path)
        return self._inner.open_write(path)


def _manager(tmp_path: Path, ctl: dict[str, Any], **top: Any) -> CheckpointManager:
    plugins = plugins_with_backend("wrapped_fs", lambda url, opts: _Wrapped(url, ctl), "wrapped")
    return CheckpointManager(config(tmp_path / "ckpt", type="wrapped_fs", async_save=True, **top), plugins=plugins,
                             quiet=True)


def _committed(m: CheckpointManager) -> list[int]:
    return [r.step for r in layout.committed(m.storage, m.storage.root)]


def _leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "ckpt").glob("*/*") if p.name.startswith((".tmp-", ".inflight-")))


def test_save_returns_before_commit_and_snapshot_is_taken_at_save(tmp_path: Path) -> None:
    ctl = {"gate": threading.Event(), "entered": threading.Event()}
    m = _manager(tmp_path, ctl)
    state = tiny_state(seed=1)
    at_save = state_snapshot(state)
    path = m.save(3, state)
    # the background write has started and is held before writing any DCP data
    assert ctl["entered"].wait(30)
    assert m.stats.in_flight
    assert _committed(m) == [] and not Path(path).exists()
    # the loop goes on at once: parameters, optimizer, scheduler and counter change
    for _ in range(2):
        train_step(state, (3, 8), scheduler=True, count=("counter", "seen", 3))
    with torch.no_grad():
        for p in state["model"].parameters():
            p.mul_(-3.0)
    time.sleep(0.3)
    ctl["gate"].set()
    stats = m.wait()
    assert stats is not None and stats.is_async and stats.step == 3
    assert _committed(m) == [3]
    # blocked: the save() call only, not the write the test held 0.3 s after it returned;
    # total: until the commit, after the test let the write go
    assert stats.total_s - stats.blocked_s >= 0.3, stats
    assert stats.bytes_copied > 0
    m.close()

    fresh = tiny_state(seed=2)
    with CheckpointManager.from_config(config(tmp_path / "ckpt", resume_from_checkpoint=path), quiet=True) as r:
        assert r.resume(fresh) == 3
    assert_same_state(state_snapshot(fresh), at_save)


def test_failed_background_write_surfaces_at_next_save(tmp_path: Path) -> None:
    ctl = {"fail": 1}
    m = _manager(tmp_path, ctl)
    state = tiny_state()
    m.save(1, state)  # returns: the failure happens in the background
    train_step(state, (3, 8), scheduler=True, count=("counter", "seen", 3))
    with pytest.raises(SaveError) as info:
        m.save(2, state)
    msg = str(info.value)
    assert "checkpoint-1" in msg and "injected I/O error" in msg and "nothing of it was committed" in msg
    assert _committed(m) == [] and _leftovers(tmp_path) == []
    # the loop can go on: the next save works
    m.save(3, state)
    m.close()
    assert _committed(m) == [3]


def test_failed_background_write_surfaces_at_close(tmp_path: Path) -> None:
    ctl = {"fail": 1}
    m = _manager(tmp_path, ctl)
    m.save(1, tiny_state())
    with pytest.raises(SaveError, match="checkpoint-1"):
        m.close()
    assert _committed(m) == [] and _leftovers(tmp_path) == []
    m.close()  # closing again is a no-op


def test_failed_background_write_surfaces_leaving_a_with_block(tmp_path: Path) -> None:
    with pytest.raises(SaveError):
        with _manager(tmp_path, {"fail": 1}) as m:
            m.save(1, tiny_state())


def test_final_save_is_committed_when_it_returns(tmp_path: Path) -> None:
    m = _manager(tmp_path, {})
    state = tiny_state()
    m.save(4, state)            # async, in flight
    path = m.save(5, state, final=True)
    assert not m.stats.in_flight
    assert _committed(m) == [4, 5] and Path(path, "manifest.json").is_file()
    assert m.stats.last.step == 5 and not m.stats.last.is_async
    m.close()


def test_periodic_async_saves_through_maybe_save(tmp_path: Path) -> None:
    m = _manager(tmp_path, {}, save_steps=2)
    state = tiny_state()
    snaps = {}
    for step in range(1, 7):
        train_step(state, (3, 8), scheduler=True, count=("counter", "seen", 3))
        if m.maybe_save(step, state):
            snaps[step] = state_snapshot(state)
    m.close()
    assert _committed(m) == [2, 4, 6]
    for step, snap in snaps.items():
        fresh = tiny_state(seed=step)
        with CheckpointManager.from_config(config(tmp_path / "ckpt"), quiet=True) as r:
            path = next(ref.path for ref in layout.committed(r.storage, r.storage.root) if ref.step == step)
            assert r.resume(fresh, target=path) == step
        assert_same_state(state_snapshot(fresh), snap)


def test_blocked_time_of_an_async_save(tmp_path: Path) -> None:
    """What the loop waits for on a ~25 MB state whose storage takes 0.5 s more to write each
    DCP file: a sync save reports its whole time, the write included, as blocked; an async
    one returns before the write (nothing committed yet) and its blocked time leaves the
    write out (the caller was blocked at least the write's 0.5 s less than the save took)."""
    delay = 0.5
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}
    train_step(state, (2, 512), loss="sum")
    plugins = plugins_with_backend("wrapped_fs", lambda url, opts: _Wrapped(url, {"delay": delay}), "wrapped")
    results = {}
    for mode in (False, True):
        cfg = config(tmp_path / str(mode), type="wrapped_fs", async_save=mode)
        with CheckpointManager(cfg, plugins=plugins, quiet=True) as m:
            for step in (1, 2):  # the second save reuses the staging buffers
                m.save(step, state)
                returned = _committed(m)
                m.wait()
                assert m.stats.last is not None and m.stats.last.step == step
                if mode:
                    assert returned == [1, 2][:step - 1], returned  # the call returned before the commit
                    assert m.stats.last.total_s - m.stats.last.blocked_s >= delay, m.stats.last
                else:
                    assert returned == [1, 2][:step], returned
                    assert m.stats.last.blocked_s >= delay, m.stats.last  # the write included
            results[mode] = m.stats.last
    sync, async_ = results[False], results[True]
    assert not sync.is_async and sync.bytes_copied == 0
    assert sync.blocked_s == sync.total_s  # the loop waited for the commit
    assert async_.is_async and async_.bytes_copied >= 4 * 8 * 512 * 512 * 3


@pytest.mark.parametrize("nice", [0, 7])
def test_background_write_runs_at_the_configured_nice_value(tmp_path: Path, nice: int) -> None:
    """The writer thread lowers its own priority (checkpoint_config.background_nice); the
    caller's thread keeps its own."""
    import os

    ctl = {"gate": threading.Event(), "entered": threading.Event()}
    seen: dict[str, int] = {}
    inner_enter = ctl["entered"]

    class _Seen(threading.Event):
        def set(self) -> None:  # called in the writer thread when it opens a DCP file
            seen["writer"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            inner_enter.set()

    ctl["entered"] = _Seen()
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    m = _manager(tmp_path, ctl, background_nice=nice)
    m.save(1, tiny_state(seed=1))
    assert inner_enter.wait(30)
    ctl["gate"].set()
    m.close()
    assert seen["writer"] == max(before, nice)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_background_nice_is_validated(tmp_path: Path) -> None:
    from roll_ckpt import ConfigError

    for bad in (-1, 20, "high", 2.5):
        with pytest.raises(ConfigError, match="background_nice"):
            config(tmp_path, background_nice=bad)


def test_regular_staging_reads_each_tensor_anew_even_when_its_memory_is_swapped(tmp_path: Path) -> None:
    """Staging keeps flat views of the state's tensors across saves; a tensor changed in
    place, or given other memory (``p.data = ...``), or a non-contiguous one, is still
    written as it is at the save."""
    m = CheckpointManager(config(tmp_path / "ckpt", async_save=True), quiet=True)
    state = tiny_state(seed=1)
    params = list(state["model"].parameters())
    with torch.no_grad():
        params[-1].data = params[-1].data.t().contiguous().t()  # not contiguous: copied, never kept
    expected = []
    for step in (1, 2, 3):
        with torch.no_grad():
            if step == 2:
                params[0].add_(1.0)  # in place
            if step == 3:
                params[0].data = torch.randn_like(params[0])  # other memory, same tensor object
                params[-1].mul_(2.0)
        expected.append(state_snapshot(state))
        m.save(step, state)
        m.wait()
    for step, snap in zip((1, 2, 3), expected):
        fresh = tiny_state(seed=9)
        r = CheckpointManager(config(tmp_path / "ckpt"), quiet=True)
        assert r.resume(fresh, target=str(next(p.path for p in layout.committed(r.storage, r.storage.root)
                                                if p.step == step))) == step
        r.close()
        assert_same_state(state_snapshot(fresh), snap)
    m.close()


def test_the_cached_state_dict_survives_storage_resized_in_place_and_not_a_swap(tmp_path: Path) -> None:
    """An offload store frees a parameter's memory and brings it back by resizing its
    storage in place (the cached state dict's views follow it: no rebuild); ``p.data =
    other`` gives the parameter another storage (rebuilt)."""
    m = CheckpointManager(config(tmp_path / "ckpt", async_save=True), quiet=True)
    state = tiny_state(seed=1)
    p = next(state["model"].parameters())
    m.save(1, state)
    m.wait()
    builds = m.strategy.state_dicts.builds
    nbytes = p.untyped_storage().nbytes()
    with torch.no_grad():
        keep = p.detach().clone()
        address = p.data_ptr()
        taken = []
        for _ in range(16):  # brought back in other memory (the allocator may hand the old block back)
            p.untyped_storage().resize_(0)  # offloaded
            taken.append(torch.empty_like(keep))  # (the freed memory goes elsewhere)
            p.untyped_storage().resize_(nbytes)  # brought back: the same storage
            if p.data_ptr() != address:
                break
        p.copy_(keep)
        assert p.data_ptr() != address and taken
    m.save(2, state)
    m.wait()
    assert m.strategy.state_dicts.builds == builds
    with torch.no_grad():
        p.data = torch.randn_like(p)
    m.save(3, state)
    m.wait()
    assert m.strategy.state_dicts.builds == builds + 1
    m.close()


@pytest.mark.parametrize("tier", ["persistent", "local"])
def test_a_save_staged_in_waves_reports_the_caller_blocked_until_the_last_wave(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier: str) -> None:
    """Staged in waves (``max_staging_bytes``), an async save's call returns only once the last
    wave is in, while the writer already writes: the blocked time the writer reports is the
    whole call, recorded by the caller, not the staging alone. (The caller stays 0.4 s
    after its last wave; the writer finishes this tiny state well before.)"""
    from roll_ckpt import load_config
    from roll_ckpt.save.staging import WaveGate

    fill, filled = WaveGate.fill, []

    def slow_fill(self: WaveGate) -> None:
        fill(self)
        filled.append(len(self.waves))
        time.sleep(0.4)

    monkeypatch.setattr(WaveGate, "fill", slow_fill)
    cfg = load_config({
        "save_steps": 1 if tier == "persistent" else 100,
        "strategy_config": {"async_save_ckpt": True, "max_staging_bytes": 1024},
        "checkpoint_config": {"output_dir": str(tmp_path / "ckpt"),
                              **({"local": {"dir": str(tmp_path / "local")}} if tier == "local" else {})}})
    with CheckpointManager(cfg, quiet=True) as m:
        t0 = time.perf_counter()
        m.maybe_save(1, tiny_state())
        call_s = time.perf_counter() - t0
        m.wait()
        last = m.stats.last if tier == "persistent" else m.local.last_save
        assert last is not None, tier
        blocked = last.blocked_s if tier == "persistent" else last["blocked_s"]
        assert filled and filled[0] > 1, filled  # staged in waves
        assert blocked >= 0.4, (tier, blocked, call_s)
