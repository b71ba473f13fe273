"""Preemption: SIGTERM becomes a committed checkpoint at the next step, the job exits with
``preemption.exit_code``, and a relaunch continues exactly; the handler that was there
before is deferred (passed the signal once the save committed, or at close without one)
and restored. Ray's handlers, in a real driver and a real actor: test_preemption_ray.py."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import warm
from helpers.launch import child_env
from roll_ckpt import CheckpointManager, DriverState, Preempted, load_config, new_run_name
from roll_ckpt.format import layout
from roll_ckpt.testing import tiny_state

CHILD = Path(__file__).with_name("_preempt_child.py")
MAX_STEPS = 24
EXIT_CODE = 7
GRACE_S = 20.0


def _log(path: Path) -> list[list[str]]:
    return [ln.split() for ln in path.read_text().splitlines()] if path.exists() else []


class Job:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.launches = 0

    def run(self, signal_at: str = "none", kill_after_step: int | None = None) -> tuple[int, list[list[str]]]:
        """One launch. With ``kill_after_step`` the test plays the scheduler: SIGTERM once the
        job logged that step, then, if the job is still running when the grace period
        (``GRACE_S``) ends, SIGKILL, as Kubernetes or Slurm do. A job killed so exits
        -SIGKILL, not ``preemption.exit_code``, and has not logged ``preempted``."""
        self.launches += 1
        log = self.out / f"launch-{self.launches}.log"
        proc = warm.popen([sys.executable, str(CHILD), str(self.out), str(log), str(MAX_STEPS), signal_at],
                                env=child_env(ROLL_CKPT_QUIET="1", OMP_NUM_THREADS="1"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        grace_ends = None
        killed = False
        deadline = time.monotonic() + 120  # (a launch that hangs fails the test: not the scheduler's doing)
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if kill_after_step is not None and grace_ends is None and \
                        any(w[0] == "trained" and int(w[1]) >= kill_after_step for w in _log(log)):
                    proc.send_signal(signal.SIGTERM)
                    grace_ends = time.monotonic() + GRACE_S
                elif grace_ends is not None and time.monotonic() >= grace_ends:
                    proc.send_signal(signal.SIGKILL)  # the grace period is over
                    killed = True
                    break
                time.sleep(0.01)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        output = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
        why = f" (SIGKILLed by the scheduler {GRACE_S:.0f}s after SIGTERM)" if killed else ""
        assert rc in (0, EXIT_CODE), f"launch {self.launches} ({signal_at}) exited {rc}{why}:\n{output}"
        return rc, _log(log)

    def newest(self) -> layout.CheckpointRef:
        ref = layout.latest(_storage(self.out), str(self.out))
        assert ref is not None
        return ref


def _storage(out: Path):
    from roll_ckpt_fs import LocalStorage

    return LocalStorage(str(out))


def _check_preempted(job: Job, lines: list[list[str]], rc: int) -> int:
    assert rc == EXIT_CODE
    stopped = int(next(w[1] for w in lines if w[0] == "preempted"))
    last_trained = max(int(w[1]) for w in lines if w[0] == "trained")
    assert stopped == last_trained, "the checkpoint is of the step the loop was at"
    newest = job.newest()
    assert newest.step == stopped, f"newest committed step {newest.step}, stopped at {stopped}"
    state = json.loads((Path(newest.path) / "trainer_state.json").read_text())
    assert "preempted" in state["user"]
    return stopped


def _final(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.pt", weights_only=True)


def test_sigterm_at_any_moment_commits_the_step_and_the_relaunch_is_exact(tmp_path: Path) -> None:
    reference = Job(tmp_path / "reference")
    reference.out.mkdir()
    rc, lines = reference.run()
    assert rc == 0 and lines[-1] == ["done"]

    job = Job(tmp_path / "job")
    job.out.mkdir()
    rnd = random.Random(int(os.environ.get("ROLL_CKPT_PREEMPT_SEED", "14")))
    stops = []
    # random moments, a signal during resume, right after it, and while an async save writes
    plan = [("none", rnd.randint(2, 5)), ("during_resume", None), ("after_resume", None), ("in_flight", None),
            ("none", None)]
    for signal_at, kill_after in plan:
        before = stops[-1] if stops else 0
        if signal_at == "none" and kill_after is None:
            kill_after = before + rnd.randint(1, 4)
        rc, lines = job.run(signal_at, kill_after)  # SIGKILLed if still running when the grace period ends
        stopped = _check_preempted(job, lines, rc)
        resumed = int(next(w[1] for w in lines if w[0] == "resumed"))
        assert resumed == before
        if signal_at in ("during_resume", "after_resume"):
            assert stopped == resumed + 1, "honoured at the first maybe_save after resume"
        if signal_at == "in_flight":
            assert ["trained", str(stopped), "1"] in lines, "the signal came while an async save was writing"
        stops.append(stopped)
    rc, lines = job.run()
    assert rc == 0 and lines[-1] == ["done"]
    assert int(lines[0][1]) == stops[-1]
    final, expected = _final(job.out), _final(reference.out)
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in final), "the relaunches continue bit-exactly"


# --------------------------------------------------------------------------- in one process


def _config(tmp_path: Path, **preemption) -> object:
    return load_config({"checkpoint_config": {"output_dir": str(tmp_path / "ckpt"), "preemption": preemption},
                        "save_steps": 100})


def test_exit_false_returns_and_sets_preempted(tmp_path: Path) -> None:
    state = tiny_state()
    m = CheckpointManager(_config(tmp_path, exit=False), quiet=True)
    assert m.maybe_save(1, state) is None and not m.preemption.committed
    os.kill(os.getpid(), signal.SIGTERM)
    assert m.preemption.requested
    path = m.maybe_save(2, state)
    assert m.preemption.committed and path is not None and path.endswith("checkpoint-2")
    with pytest.raises(Exception, match="closed"):
        m.save(3, state)
    assert layout.latest(_storage(tmp_path / "ckpt"), str(tmp_path / "ckpt")).step == 2


def test_the_previous_handler_is_deferred_until_the_save_committed_and_restored(tmp_path: Path) -> None:
    seen: list[tuple[int, object, int | None]] = []
    ckpt = tmp_path / "ckpt"

    def recorder(signum, frame):  # a framework's handler that only records the signal
        newest = layout.latest(_storage(ckpt), str(ckpt))
        seen.append((signum, frame, newest.step if newest else None))

    previous = signal.signal(signal.SIGUSR1, recorder)
    try:
        m = CheckpointManager(_config(tmp_path, signals=["SIGUSR1"], exit_code=3), quiet=True)
        assert signal.getsignal(signal.SIGUSR1) is not recorder
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [], "the handler that was there first waits for the preemption save"
        with pytest.raises(Preempted) as info:
            m.maybe_save(4, tiny_state())
        assert info.value.code == 3 and info.value.exit_code == 3 and info.value.step == 4
        assert seen == [(signal.SIGUSR1, None, 4)], "it ran once, after step 4 was committed"
        assert signal.getsignal(signal.SIGUSR1) is recorder, "close() restored the previous handler"
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_signals_off_and_a_request_from_code(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    m = CheckpointManager(_config(tmp_path / "off", signals=[]), quiet=True)
    assert signal.getsignal(signal.SIGTERM) is before, "signals: [] installs nothing"
    m.close()
    m = CheckpointManager(_config(tmp_path / "on", exit=False), quiet=True)
    m.preemption.request()  # what a Ray actor off the main thread does
    assert m.maybe_save(5, tiny_state()).endswith("checkpoint-5") and m.preemption.committed


def test_off_the_main_thread_it_is_logged_once_and_the_rest_works(tmp_path: Path, caplog) -> None:
    import threading

    import roll_ckpt.runtime.preemption as preemption

    preemption._told_not_main = False
    out: dict = {}

    def worker() -> None:
        for i in range(2):
            m = CheckpointManager(_config(tmp_path / str(i), exit=False), quiet=True)
            m.preemption.request()
            out[i] = m.maybe_save(1, tiny_state())

    with caplog.at_level("INFO", logger="roll_ckpt"):
        t = threading.Thread(target=worker)
        t.start()
        t.join(60)
    assert all(p and p.endswith("checkpoint-1") for p in out.values()) and len(out) == 2
    told = [r for r in caplog.records if "not on the main thread" in r.getMessage()]
    assert len(told) == 1


def test_components_save_the_same_step_and_it_commits_whole(tmp_path: Path) -> None:
    """Every component's manager sees the signal; the step they all save commits as one."""
    run = new_run_name()
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path / "ckpt"), "run_name": run,
                                             "components": ["actor", "critic", "pipeline"],
                                             "preemption": {"exit": False}}, "save_steps": 10})
    managers = {c: CheckpointManager(cfg, component=c, quiet=True) for c in ("actor", "critic", "pipeline")}
    states = {"actor": tiny_state(1), "critic": tiny_state(2), "pipeline": {"driver": DriverState(step=0)}}
    for step in (1, 2, 3):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        states["pipeline"]["driver"]["step"] = step
        for c, m in managers.items():
            m.maybe_save(step, states[c])
    assert all(m.preemption.committed for m in managers.values())
    newest = layout.latest(_storage(tmp_path / "ckpt"), str(tmp_path / "ckpt"))
    assert newest.step == 3 and (Path(newest.path) / "manifest.json").exists()
    assert sorted(p.name for p in Path(newest.path).iterdir() if p.is_dir()) == ["actor", "critic", "pipeline"]


# --------------------------------------------------------------------------- the handler that was there before

DEFER_CHILD = Path(__file__).with_name("_preempt_defer_child.py")


def _run_defer_child(tmp_path: Path, mode: str) -> tuple[int, list[list[str]], str]:
    out, log = tmp_path / "ckpt", tmp_path / "child.log"
    proc = warm.popen([sys.executable, str(DEFER_CHILD), str(out), str(log), mode],
                      env=child_env(ROLL_CKPT_QUIET="1", OMP_NUM_THREADS="1"),
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, _log(log), output.decode(errors="replace")


@pytest.mark.timeout(120)
def test_the_default_action_is_taken_when_the_manager_closes_after_its_last_save(tmp_path: Path) -> None:
    """SIGTERM after the last maybe_save, default action: the final save commits, then
    close() raises the signal again and the process ends killed by it."""
    rc, lines, output = _run_defer_child(tmp_path, "default")
    assert rc == -signal.SIGTERM, f"exited {rc}:\n{output}"
    assert lines[-1] == ["final", "5"], "killed inside close(), after the final save"
    assert layout.latest(_storage(tmp_path / "ckpt"), str(tmp_path / "ckpt")).step == 5


@pytest.mark.timeout(120)
def test_a_handler_that_ends_the_process_runs_after_the_save_and_keeps_its_status(tmp_path: Path) -> None:
    """A handler installed first that calls sys.exit(5) (as Ray's does) runs once step 3 is
    committed; Preempted takes its status, not preemption.exit_code (7)."""
    rc, lines, output = _run_defer_child(tmp_path, "exits")
    assert rc == 5, f"exited {rc}:\n{output}"
    assert lines[-2:] == [["handler", "3"], ["preempted", "3"]], lines
    newest = layout.latest(_storage(tmp_path / "ckpt"), str(tmp_path / "ckpt"))
    assert newest.step == 3 and "preempted" in json.loads((Path(newest.path) / "trainer_state.json").read_text())["user"]


class _Exits:
    """A handler that records when it ran (the newest committed step) and ends the process
    as Ray's worker handler does: a SystemExit with a status and a ``ray_terminate_msg``."""

    def __init__(self, ckpt: Path, code: int) -> None:
        self.ckpt, self.code, self.calls = ckpt, code, []

    def __call__(self, signum: int, frame: object) -> None:
        newest = layout.latest(_storage(self.ckpt), str(self.ckpt)) if self.ckpt.exists() else None
        self.calls.append((signum, newest.step if newest else None))
        exc = SystemExit(self.code)
        exc.ray_terminate_msg = "The process receives a SIGTERM."
        raise exc


@pytest.fixture
def usr1():
    """SIGUSR1's handler put back after the test."""
    previous = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, previous)


def test_preempted_takes_the_status_and_attributes_of_the_handler_s_exit(tmp_path: Path, usr1) -> None:
    exits = _Exits(tmp_path / "ckpt", 1)
    signal.signal(signal.SIGUSR1, exits)
    m = CheckpointManager(_config(tmp_path, signals=["SIGUSR1"], exit_code=3), quiet=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert exits.calls == []
    with pytest.raises(Preempted) as info:
        m.maybe_save(6, tiny_state())
    assert exits.calls == [(signal.SIGUSR1, 6)], "after step 6 was committed, once"
    assert info.value.code == 1 and info.value.exit_code == 1 and info.value.step == 6
    assert info.value.ray_terminate_msg == "The process receives a SIGTERM.", "Ray reports the same exit"
    assert isinstance(info.value.__cause__, SystemExit)
    assert signal.getsignal(signal.SIGUSR1) is exits


def test_exit_false_passes_the_signal_on_and_keeps_control(tmp_path: Path, usr1) -> None:
    exits = _Exits(tmp_path / "ckpt", 1)
    signal.signal(signal.SIGUSR1, exits)
    m = CheckpointManager(_config(tmp_path, signals=["SIGUSR1"], exit=False), quiet=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    path = m.maybe_save(2, tiny_state())
    assert path.endswith("checkpoint-2") and m.preemption.committed
    assert exits.calls == [(signal.SIGUSR1, 2)], "called once the save committed; what it raised is dropped"
    m.close()
    assert exits.calls == [(signal.SIGUSR1, 2)], "passed on once"


def test_close_without_a_save_passes_the_signal_on_once_the_last_manager_closed(tmp_path: Path, usr1) -> None:
    exits = _Exits(tmp_path / "b", 9)
    signal.signal(signal.SIGUSR1, exits)
    a = CheckpointManager(_config(tmp_path / "a", signals=["SIGUSR1"]), quiet=True)
    b = CheckpointManager(load_config({"checkpoint_config": {"output_dir": str(tmp_path / "b"),
                                                             "preemption": {"signals": ["SIGUSR1"]}},
                                       "strategy_config": {"async_save_ckpt": True}}), quiet=True)
    b.save(2, tiny_state())                     # asynchronous: still writing, perhaps
    os.kill(os.getpid(), signal.SIGUSR1)        # after the last maybe_save
    a.close()
    assert exits.calls == [], "another manager still watches"
    with pytest.raises(SystemExit) as info:
        b.close()
    assert info.value.code == 9 and not isinstance(info.value, Preempted)
    assert exits.calls == [(signal.SIGUSR1, 2)], "after close() drained the save in flight"
    assert signal.getsignal(signal.SIGUSR1) is exits
    b.close()                                   # closed: nothing more
    assert len(exits.calls) == 1


def test_an_ignored_signal_stays_ignored(tmp_path: Path, usr1) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    m = CheckpointManager(_config(tmp_path / "a", signals=["SIGUSR1"], exit_code=4), quiet=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    m.close()                                   # without a save: nothing to pass on
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    m = CheckpointManager(_config(tmp_path / "b", signals=["SIGUSR1"], exit_code=4), quiet=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.raises(Preempted) as info:
        m.maybe_save(1, tiny_state())
    assert info.value.code == 4
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN


def test_a_handler_installed_after_the_manager_stays_and_a_forked_child_passes_signals_on(tmp_path: Path,
                                                                                         usr1) -> None:
    signal.signal(signal.SIGUSR1, lambda signum, frame: os._exit(42))  # what a forked child should still get
    m = CheckpointManager(_config(tmp_path, signals=["SIGUSR1"]), quiet=True)
    pid = os.fork()
    if pid == 0:  # the child inherited the manager's handler: roll-ckpt is not there for it
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 42, "the handler from before ran at once in the child"
    assert not m.preemption.requested, "the child's signal is not the parent's"

    def later(signum, frame):
        pass

    signal.signal(signal.SIGUSR1, later)  # installed after the manager's, without chaining it
    m.close()
    assert signal.getsignal(signal.SIGUSR1) is later, "close() does not put back what it replaced"
