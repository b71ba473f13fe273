"""A rank that hangs instead of dying (SIGSTOP) in each phase of a save, its commit and a
resume, on 2 gloo ranks (``make test``: write and commit; ``make test-reliability`` all
four): the other rank stops waiting after ``collective_timeout_s`` with
an error naming its rank, the phase and the step; nothing is half-committed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import warm
from helpers.launch import child_env, free_port, rank_env
from roll_ckpt.format import layout
from roll_ckpt.format.manifest import verify
from roll_ckpt_fs import LocalStorage

CHILD = Path(__file__).with_name("_hang_child.py")
TIMEOUT_S = 3  # checkpoint_config.collective_timeout_s in the child

# phase -> (the rank that stops, the phase the other reports, its step)
PHASES = {
    "write": (1, "save: starting of step 2", 2),
    "commit": (0, "save: committing of step 2", 2),
    "choose": (1, "resume: choosing the checkpoint", None),
    "load": (1, "resume: loading of step 1", 1),
}
FULL = int(os.environ.get("ROLL_CKPT_KILLS", "5")) > 5
"""``make test-reliability``: every phase; ``make test``: a save's two (the resume's two
need a first job to resume from, twice the time)."""


def _launch(out: Path, phase: str) -> list[subprocess.Popen]:
    port = free_port()
    return [warm.popen([sys.executable, str(CHILD), str(out), phase], stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                       env=child_env(rank_env(rank, 2, port), OMP_NUM_THREADS="1", ROLL_CKPT_QUIET="1"))
            for rank in range(2)]


def _wait_stopped(pid: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return True
        except OSError:
            return False
        time.sleep(0.05)
    return False


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)  # (a stopped process dies of SIGKILL too)
        p.wait(timeout=30)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("phase", list(PHASES) if FULL else ["write", "commit"])
def test_a_stopped_rank_ends_the_wait_with_rank_phase_and_step(tmp_path: Path, phase: str) -> None:
    stopper, what, step = PHASES[phase]
    waiter = 1 - stopper
    if phase in ("choose", "load"):  # a checkpoint to resume from, written by a whole job first
        procs = _launch(tmp_path, "write-only")
        _kill_after_exit(procs)
        for report in tmp_path.glob("*.json"):
            report.unlink()
    procs = _launch(tmp_path, phase)
    try:
        deadline = time.monotonic() + 90
        assert _wait_stopped(procs[stopper].pid, deadline), _output(procs)
        procs[waiter].wait(timeout=max(1.0, deadline - time.monotonic()))
        report = tmp_path / f"{waiter}.json"
        assert report.exists(), _output(procs)
        result = json.loads(report.read_text())
        assert result["error"] == "CollectiveTimeoutError", result
        assert f"rank {waiter}: {what}" in result["message"], result["message"]
        assert f"after {TIMEOUT_S} s (checkpoint_config.collective_timeout_s)" in result["message"]
        assert result["s"] < TIMEOUT_S + 10, result  # bounded: the waiter did not wait for ever
        assert procs[stopper].poll() is None, "the stopped rank is still there, stopped"
        storage = LocalStorage(str(tmp_path / "ckpt"))
        refs = layout.committed(storage, storage.root)
        assert [r.step for r in refs] == [1], refs  # step 2 never half-committed
        verify(storage, refs[0].path)
    finally:
        _kill(procs)
    assert not (tmp_path / f"{stopper}.json").exists()


def _kill_after_exit(procs: list[subprocess.Popen]) -> None:
    try:
        for p in procs:
            p.wait(timeout=90)
        assert all(p.returncode == 0 for p in procs), _output(procs)
    finally:
        _kill(procs)


def _output(procs: list[subprocess.Popen]) -> str:
    out = []
    for rank, p in enumerate(procs):
        if p.poll() is None:
            out.append(f"rank {rank}: still running")
            continue
        out.append(f"rank {rank} exited {p.returncode}:\n{(p.stdout.read() if p.stdout else '')[-3000:]}")
    return "\n".join(out)


def test_a_peer_that_is_gone_is_not_called_a_timeout() -> None:
    """gloo's "connection reset by peer" (the other process ended: killed, crashed) is said as
    such, at once; a wait that ran out names the limit it ran out of."""
    from roll_ckpt.errors import CollectiveTimeoutError
    from roll_ckpt.runtime.distributed import bounded

    with pytest.raises(CollectiveTimeoutError, match=r"rank 0: save: writing of step 4 lost its connection to another "
                                                     r"rank: that process ended \(killed, crashed\) or was cut off"):
        with bounded(0, "save: writing", 4, 600.0):
            raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:6796: Connection reset by peer.")
    with pytest.raises(CollectiveTimeoutError, match=r"gave up waiting for the other ranks after 600 s"):
        with bounded(0, "save: writing", 4, 600.0):
            raise RuntimeError("[pair.cc:588] Timed out waiting 600000ms for recv operation to complete")
