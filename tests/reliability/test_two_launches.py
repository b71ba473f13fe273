"""Two launches of one job writing one ``output_dir`` at once (a launch the scheduler thought
dead and restarted, a Ray actor that exists twice), as real overlapping processes.

With run folders (``timestamp_subdir: true``, the default) each launch writes its own; the
checkpoint a live launch resumed from is held (``roll_ckpt.format.commit``) so the other's
retention leaves it alone until the resumer has committed one of its own; ``latest`` is
always a whole checkpoint. Without run folders the second launch is refused with an error
that says what to do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import warm
from helpers.launch import child_env
from roll_ckpt.format import layout
from roll_ckpt.format.manifest import verify
from roll_ckpt_fs import LocalStorage

CHILD = Path(__file__).with_name("_launch_child.py")
pytestmark = pytest.mark.timeout(240)


def _start(out: Path, name: str, sync: Path, keep: int, *actions: str, flat: bool = False) -> subprocess.Popen:
    return warm.popen([sys.executable, str(CHILD), str(out), name, str(sync), str(keep), "1" if flat else "0",
                       *actions], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True, env=child_env(OMP_NUM_THREADS="1", ROLL_CKPT_QUIET="1"))


def _report(p: subprocess.Popen, timeout: float = 120) -> dict:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate(timeout=30)
        raise AssertionError(f"a launch did not end in {timeout:.0f} s:\n{out[-2000:]}\n{err[-3000:]}") from None
    assert p.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def _wait_file(path: Path, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), f"no {path.name}"
        time.sleep(0.02)


def _committed(out: Path) -> dict[str, int]:
    storage = LocalStorage(str(out))
    return {r.path: r.step for r in layout.committed(storage, storage.root)}


def test_the_checkpoint_a_live_launch_resumed_from_survives_the_other_launchs_retention(tmp_path: Path) -> None:
    out, sync = tmp_path / "ckpt", tmp_path / "sync"
    sync.mkdir()
    first = _report(_start(out, "a", sync, 1, "resume", "save:1", "save:2", "save:3"))
    resumed_from = first["saved"]["3"]
    assert list(_committed(out).values()) == [3]
    # b and c are two launches of the restarted job, alive at once
    # (b goes on only once the test has looked: its own commit of step 4 releases its hold, and
    # then its retention or c's may remove a's step 3 at once)
    b = _start(out, "b", sync, 1, "resume", "signal:resumed", "wait:checked", "save:4", "signal:saved",
               "wait:c.done")
    c = None
    try:
        _wait_file(sync / "b.resumed", [b])
        c = _start(out, "c", sync, 1, "save:4", "save:5", "signal:saved", "wait:b.saved", "save:6",
                   "signal:done")
        _wait_file(sync / "c.saved", [b, c])
        # c's retention (keep 1) ran twice; a's run is gone, but b resumed from its step 3
        assert resumed_from in _committed(out), _committed(out)
        storage = LocalStorage(str(out))
        verify(storage, resumed_from)
        (sync / "checked").touch()
        rb, rc = _report(b), _report(c)
    finally:
        for p in (b, c):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert rb["resumed"] == 3 and "error" not in rb and "error" not in rc, (rb, rc)
    left = _committed(out)
    # b committed its own step 4, so its hold went; c's save of 6 then removed a's step 3
    # but never b's checkpoint (b's run was alive)
    assert resumed_from not in left
    assert rb["saved"]["4"] in left and rc["saved"]["6"] in left, left
    for path in left:
        verify(storage, path)
    assert layout.latest(storage, storage.root).path in left  # latest is a whole checkpoint
    assert not list(out.rglob(".hold-*")), "holds are released"


def test_a_second_launch_into_one_folder_without_run_folders_is_refused(tmp_path: Path) -> None:
    out, sync = tmp_path / "ckpt", tmp_path / "sync"
    sync.mkdir()
    a = _start(out, "a", sync, 1, "resume", "save:1", "signal:saved", "wait:go", "save:2", flat=True)
    try:
        _wait_file(sync / "a.saved", [a])
        rb = _report(_start(out, "b", sync, 1, "resume", "save:2", flat=True))
        assert rb["resumed"] == 1
        assert rb["error"]["type"] == "RollCkptError", rb
        message = rb["error"]["message"]
        assert "is being written by another launch" in message and f"pid {a.pid}" in message, message
        assert "timestamp_subdir: true" in message
        (sync / "go").write_text("1")
        ra = _report(a)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(timeout=30)
    assert "error" not in ra, ra
    assert sorted(_committed(out).values()) == [2], "a's saves are a's alone; b wrote nothing"
    # once a is gone, a new launch takes the folder over
    rc = _report(_start(out, "c", sync, 1, "resume", "save:3", flat=True))
    assert rc["resumed"] == 2 and "error" not in rc, rc
    assert sorted(_committed(out).values()) == [3]
