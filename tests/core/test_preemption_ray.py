"""Preemption where ROLL runs: a real Ray driver and a real Ray actor get SIGTERM in the
middle of their loop. Ray's SIGTERM handler (``sys.exit(15)`` in a driver after
``ray.init``; a ``SystemExit`` "The process receives a SIGTERM." in a worker) would end
the process at once; it is deferred until the preemption checkpoint is committed, and the
process then ends the way Ray's handler makes it end.

Each test runs its job in a process of its own (``_preempt_ray_child.py``, a session of
its own) with a local cluster whose files are in a fresh temporary folder; whatever of
that cluster is still running afterwards is ended by its pid (and fails the test), and the
folder is removed. The test plays the scheduler: SIGTERM, then SIGKILL to what it signalled
if that is still running when the grace period (``GRACE_S``) ends; a process killed so does
not end the way Ray's handler makes it end, and the test fails on that.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("ray")

from helpers.launch import child_env  # noqa: E402
from roll_ckpt.format import layout  # noqa: E402

CHILD = Path(__file__).with_name("_preempt_ray_child.py")
SIGNAL_AFTER_STEP = 3
JOB_TIMEOUT_S = 150.0
GRACE_S = 30.0

pytestmark = pytest.mark.timeout(240)


def _log(path: Path) -> list[list[str]]:
    return [ln.split() for ln in path.read_text().splitlines()] if path.exists() else []


class Cluster:
    """Where a job's Ray cluster keeps its files, and the sessions of the jobs started."""

    def __init__(self, temp: str) -> None:
        self.temp = temp
        self.sessions: list[int] = []

    def processes(self) -> list[int]:
        """The cluster's processes still there: in a job's session (every process Ray starts
        is: the GCS, the raylet, the workers, which rename themselves ``ray::...``), or
        naming the cluster's folder."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] == "Z":
                    continue
                if int(fields[3]) in self.sessions or self.temp.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
        return pids


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A fresh folder for the cluster's files (short: Ray's socket paths stay under 108
    bytes). After the test, any process of the cluster still there is ended by its pid
    (and the test fails), and the folder is removed."""
    c = Cluster(tempfile.mkdtemp(prefix="rk-ray-"))
    try:
        yield c
    finally:
        deadline = time.monotonic() + 30
        while c.processes() and time.monotonic() < deadline:
            time.sleep(0.2)  # ray.shutdown (atexit in the driver) and Ray's reaper end them
        left = c.processes()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while Path(c.temp).exists() and time.monotonic() < deadline:
            shutil.rmtree(c.temp, ignore_errors=True)
            time.sleep(0.2)
        assert not left, f"processes of the Ray cluster were still running: {left}"


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _run(mode: str, tmp_path: Path, cluster: Cluster, target: str) -> tuple[int, list[list[str]], str]:
    """Start the job, SIGTERM ``target`` (``driver``: the job's process; ``actor``: the
    actor's pid, as the job logged it) once step 3 is trained, and SIGKILL it (the driver:
    with its whole session) if it is still running ``GRACE_S`` later; wait for the job."""
    out, log, printed = tmp_path / "ckpt", tmp_path / "job.log", tmp_path / "job.out"
    env = child_env(RAY_AUTH_MODE="disabled", ROLL_CKPT_QUIET="1", OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)  # a cluster of its own, never one this machine already runs
    with printed.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, str(CHILD), mode, str(out), str(log), cluster.temp], env=env,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    cluster.sessions.append(proc.pid)
    signalled = False
    grace_ends = None
    killed = ""
    deadline = time.monotonic() + JOB_TIMEOUT_S  # (a job that hangs fails the test: not the scheduler's doing)
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            lines = _log(log)
            if not signalled and any(w[0] == "trained" and int(w[1]) >= SIGNAL_AFTER_STEP for w in lines):
                pid = proc.pid if target == "driver" else int(next(w[1] for w in lines if w[0] == "actor"))
                os.kill(pid, signal.SIGTERM)
                signalled = True
                grace_ends = time.monotonic() + GRACE_S
            elif grace_ends is not None and not killed and time.monotonic() >= grace_ends and _alive(pid):
                if target == "driver":
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
                killed = f"\n[test] the {target} was SIGKILLed by the scheduler {GRACE_S:.0f}s after SIGTERM"
            time.sleep(0.02)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = printed.read_text(errors="replace") + killed
    assert signalled, f"the job never reached step {SIGNAL_AFTER_STEP} (exit {rc}):\n{output[-4000:]}"
    return rc, _log(log), output


def _check_committed(tmp_path: Path, lines: list[list[str]], output: str) -> int:
    preempted = next((w for w in lines if w[0] == "preempted"), None)
    assert preempted is not None, f"the job saved no preemption checkpoint: {lines}\n{output[-4000:]}"
    stopped = int(preempted[1])
    last_trained = max(int(w[1]) for w in lines if w[0] == "trained")
    assert stopped == last_trained >= SIGNAL_AFTER_STEP, "the checkpoint is of the step the loop was at"
    from roll_ckpt_fs import LocalStorage

    ckpt = tmp_path / "ckpt"
    refs = layout.committed(LocalStorage(str(ckpt)), str(ckpt))
    assert [r.step for r in refs] == [stopped], "the preemption checkpoint, committed (and nothing else)"
    state = json.loads((Path(refs[0].path) / "trainer_state.json").read_text())
    assert state["user"]["preempted"] == "SIGTERM received"
    return stopped


def test_sigterm_to_a_ray_driver_commits_the_step_then_exits_as_ray_does(tmp_path: Path, cluster: Cluster) -> None:
    rc, lines, output = _run("driver", tmp_path, cluster, "driver")
    assert ["ray-ready"] in lines, output[-4000:]
    stopped = _check_committed(tmp_path, lines, output)
    assert ["preempted", str(stopped), "15"] in lines
    assert rc == signal.SIGTERM, f"Ray's handler exits with sys.exit(15); got {rc}:\n{output[-4000:]}"


def test_sigterm_to_a_ray_actor_commits_the_step_then_the_actor_exits_as_ray_does(tmp_path: Path,
                                                                                   cluster: Cluster) -> None:
    rc, lines, output = _run("actor", tmp_path, cluster, "actor")
    assert rc == 0, output[-4000:]
    stopped = _check_committed(tmp_path, lines, output)
    assert ["preempted", str(stopped), "1"] in lines
    error = next((w for w in lines if w[0] == "loop-error"), None)
    assert error is not None and error[1] == "ActorDiedError", lines
    detail = " ".join(error[2:])
    assert "The process receives a SIGTERM." in detail and "exit code 1" in detail, \
        f"the actor's worker ends as Ray's own handler makes it: {detail}"
    assert ["actor-gone", "True"] in lines, "the actor's process is gone"
