"""Concurrency: runs sharing an ``output_dir`` never touch each other's checkpoints, and a
save issued while an asynchronous one is in flight waits for it (never interleaves)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import warm
from helpers.launch import child_env
from helpers.plugins import plugins_with_backend
from helpers.training import config, train_step
from roll_ckpt import CheckpointManager
from roll_ckpt.format import layout
from roll_ckpt.format.manifest import MANIFEST_NAME
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state
from roll_ckpt.format.manifest import verify
from roll_ckpt_fs import LocalStorage

from ._support import HERE, read_bytes


def test_two_runs_in_one_process_keep_their_own_checkpoints(tmp_path: Path) -> None:
    """Two live managers (two runs, e.g. actor and critic in one process) under one output_dir
    with max_ckpt_to_keep 1: each one's retention leaves the other's checkpoints alone."""
    out = tmp_path / "ckpt"
    a = CheckpointManager.from_config(config(out, max_ckpt_to_keep=1), quiet=True)
    b = CheckpointManager.from_config(config(out, max_ckpt_to_keep=1), quiet=True)
    sa, sb = tiny_state(seed=1), tiny_state(seed=2)
    storage = LocalStorage(str(out))
    latest: dict[str, tuple[str, bytes]] = {}
    for step in range(1, 5):
        for name, m, s in (("a", a, sa), ("b", b, sb)):
            train_step(s, (3, 8), count=("counter", "seen", 3))
            path = m.save(step, s)
            latest[name] = (path, read_bytes(storage, storage.join(path, MANIFEST_NAME)))
            for other, (opath, manifest) in latest.items():
                assert storage.exists(storage.join(opath, MANIFEST_NAME)), (
                    f"run {name}'s save of step {step} removed run {other}'s newest checkpoint {opath}")
                assert read_bytes(storage, storage.join(opath, MANIFEST_NAME)) == manifest
                verify(storage, opath)
    assert a.run_dir != b.run_dir
    for m in (a, b):  # each run kept exactly its newest (its own retention still works)
        mine = [r for r in layout.committed(storage, storage.root) if r.path.startswith(m.run_dir + "/")]
        assert [r.step for r in mine] == [4], mine
    a.close()
    b.close()


def test_a_closed_run_is_subject_to_retention_again(tmp_path: Path) -> None:
    """The protection lasts while the other run is alive: once closed, its checkpoints count."""
    out = tmp_path / "ckpt"
    with CheckpointManager.from_config(config(out, max_ckpt_to_keep=1), quiet=True) as a:
        first = a.save(1, tiny_state(seed=1))
    with CheckpointManager.from_config(config(out, max_ckpt_to_keep=1), quiet=True) as b:
        b.save(2, tiny_state(seed=2))
    storage = LocalStorage(str(out))
    assert [r.step for r in layout.committed(storage, storage.root)] == [2]
    assert not Path(first).exists()


@pytest.mark.timeout(300)
def test_two_runs_in_two_processes_keep_their_own_checkpoints(tmp_path: Path) -> None:
    """Two training processes (one saving sync, one async) save in lock step under one
    output_dir with max_ckpt_to_keep 1: after every save each checks that the other's newest
    checkpoint still verifies."""
    out, sync = tmp_path / "ckpt", tmp_path / "sync"
    sync.mkdir()
    steps = 4
    procs = {name: warm.popen([sys.executable, str(HERE / "_two_runs_child.py"), str(out), name, other,
                                     str(steps), str(sync), is_async],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
             for name, other, is_async in (("a", "b", "0"), ("b", "a", "1"))}
    results = {}
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            raise
        results[name] = (p.returncode, stdout, stderr[-3000:])
    report = "\n".join(f"run {name} exited {code}:\n{stdout}\n{stderr}" for name, (code, stdout, stderr) in results.items())
    assert all(code == 0 for code, _, _ in results.values()), report
    storage = LocalStorage(str(out))
    refs = layout.committed(storage, storage.root)
    assert sorted((r.run != "", r.step) for r in refs) == [(True, steps), (True, steps)], refs
    assert len({r.run for r in refs}) == 2
    for r in refs:
        verify(storage, r.path)


def test_a_run_folder_dropped_while_it_is_claimed_is_made_again(tmp_path: Path) -> None:
    """Between making its run folder and linking ``.run.json`` into it, a launch's folder is
    empty, and another launch's retention drops empty run folders (found by the test above
    in the torch-2.11 leg: the claim failed with FileNotFoundError). The claim makes it again."""
    from roll_ckpt.format.commit import claim_run_folder
    from roll_ckpt.tiers.retention import drop_empty_runs

    root = str(tmp_path / "ckpt")

    class OtherLaunchPrunes(LocalStorage):
        dropped = 0

        def write_create(self, path: str, data: bytes) -> None:
            if path.endswith(layout.RUN_RECORD) and not self.dropped:
                drop_empty_runs(LocalStorage(root), root)  # the other launch's retention, just then
                type(self).dropped += 1
            super().write_create(path, data)

    storage = OtherLaunchPrunes(root)
    name = claim_run_folder(storage, root, config(root).checkpoint_config, "exp", None)
    assert OtherLaunchPrunes.dropped == 1
    assert (tmp_path / "ckpt" / name / layout.RUN_RECORD).is_file()


# --------------------------------------------------------------------------- async + save


class _Recording:
    """Local disk that records every mutating call (in order) and can hold DCP data writes."""

    OPS = ("open_write", "write_create", "makedirs", "rename_dir", "rename_file", "remove", "remove_tree")

    def __init__(self, url: str, ctl: dict[str, Any]) -> None:
        self._inner = LocalStorage(url)
        self._ctl = ctl

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self.OPS:
            return attr

        def op(path: str, *args: Any) -> Any:
            with self._ctl["lock"]:
                self._ctl["events"].append((name, path))
            gate = self._ctl.get("gate")
            if name == "open_write" and "/dcp/" in path and gate is not None:
                self._ctl["held"].set()
                assert gate.wait(60)
            return attr(path, *args)

        return op


def _recording_manager(tmp_path: Path, ctl: dict[str, Any]) -> CheckpointManager:
    plugins = plugins_with_backend("recording_fs", lambda url, opts: _Recording(url, ctl), "recording")
    return CheckpointManager(config(tmp_path / "ckpt", type="recording_fs", async_save=True), plugins=plugins,
                             quiet=True)


@pytest.mark.parametrize("second", ["async", "final"])
def test_save_while_an_async_save_is_in_flight_waits_for_it(tmp_path: Path, second: str) -> None:
    ctl: dict[str, Any] = {"lock": threading.Lock(), "events": [], "gate": threading.Event(),
                           "held": threading.Event()}
    m = _recording_manager(tmp_path, ctl)
    state = tiny_state(seed=4)
    at_1 = state_snapshot(state)
    p1 = m.save(1, state)                      # async: returns once staged
    assert ctl["held"].wait(30), "the background write never started"
    train_step(state, (3, 8), count=("counter", "seen", 3))  # the loop goes on and changes the state
    at_2 = state_snapshot(state)
    done = threading.Event()
    box: dict[str, Any] = {}

    def second_save() -> None:
        try:
            box["path"] = m.save(2, state, final=second == "final")
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc
        done.set()

    t = threading.Thread(target=second_save)
    t.start()
    time.sleep(0.5)
    assert not done.is_set(), "the second save returned while the first one was still writing"
    with ctl["lock"]:
        touched = [e for e in ctl["events"] if "checkpoint-2" in e[1]]
    assert not touched, f"the second save started writing while the first was in flight: {touched}"
    gate, ctl["gate"] = ctl["gate"], None      # later writes are not held
    gate.set()                                 # the held write of step 1 goes on
    t.join(60)
    assert done.is_set() and "error" not in box, box.get("error")
    m.close()

    events = ctl["events"]
    last_1 = max(i for i, e in enumerate(events) if "checkpoint-1" in e[1])
    first_2 = min(i for i, e in enumerate(events) if "checkpoint-2" in e[1])
    assert last_1 < first_2, f"the saves interleaved: {events}"
    storage = LocalStorage(str(tmp_path / "ckpt"))
    assert [r.step for r in layout.committed(storage, storage.root)] == [1, 2]
    for path, want in ((p1, at_1), (box["path"], at_2)):
        verify(storage, path)
        cfg = config(tmp_path / "ckpt", resume_from_checkpoint=path)
        fresh = tiny_state(seed=9)
        with CheckpointManager.from_config(cfg, quiet=True) as r:
            r.resume(fresh)
        assert_same_state(state_snapshot(fresh), want)

