"""examples/rl_components/ray_job.py on a real local Ray cluster: an actor group of 2 Ray
actors (FSDP2 on their own gloo group, asynchronous saves from their worker section's
``async_save_ckpt``), a critic actor and the driver's ``DriverState``.

A launch has actor rank 0 killed with ``ray.kill`` in the middle of writing its file of
step 8 (the rank writes half of it, signals through a file, and waits): step 8 then holds
the critic's and the driver's parts but never the actor's, so it is not committed. The
launch is ended (every worker killed), and a new one (a new ``run_name``) resumes every
component from step 4 and ends with the history and final weights and optimizer state of
an uninterrupted run, bit for bit. The uninterrupted run is the same job as plain
processes (``rl_job.py --fsdp2``), started first so that it runs while Ray starts.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rl_components"
sys.path.insert(0, str(EXAMPLE))

import ray_job  # noqa: E402
from helpers import warm  # noqa: E402
from rl_job import ActorTrain, read_config  # noqa: E402

from roll_ckpt.format import layout  # noqa: E402

pytestmark = pytest.mark.timeout(300)

KILL_STEP, RESUME_STEP = 8, 4
CPUS_PER_WORKER = 0.5               # 3 workers and the driver on a 2-core machine
SIGNAL_TIMEOUT_S = 120.0
REFERENCE_TIMEOUT_S = 150.0


# --------------------------------------------------------------------------- the fault


class _PausingFile:
    """A data file whose first write puts half of the bytes down, then signals and waits
    (until the driver kills this process)."""

    def __init__(self, inner: Any, path: str, signal: str) -> None:
        self._inner, self._path, self._signal = inner, path, signal

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self._inner.write(view[: max(1, len(view) // 2)])
        self._inner.flush()
        Path(self._signal).write_text(self._path)
        time.sleep(SIGNAL_TIMEOUT_S * 2)
        raise AssertionError("not killed")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> "_PausingFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.close()


class PauseMidWrite:
    """The rank's storage: the first ``.distcp`` file of step ``step`` pauses mid-write."""

    def __init__(self, inner: Any, step: int, signal: str) -> None:
        self._inner, self._step, self._signal = inner, step, signal

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def open_write(self, path: str) -> Any:
        f = self._inner.open_write(path)
        if f"/checkpoint-{self._step}/" in str(path) and str(path).endswith(".distcp"):
            return _PausingFile(f, str(path), self._signal)
        return f


class PausingActorTrain(ActorTrain):
    """The example's actor rank; rank ``pause["rank"]`` pauses in its write of step ``pause["step"]``."""

    def __init__(self, raw_config: dict, rank: int, world_size: int, master_addr: str, master_port: int,
                 pause: dict) -> None:
        super().__init__(raw_config, rank, world_size, master_addr, master_port)
        if rank == pause["rank"]:
            self.manager.storage = PauseMidWrite(self.manager.storage, pause["step"], pause["signal"])


# --------------------------------------------------------------------------- the cluster


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A local Ray cluster sized for 2 cores, its files in a fresh temporary folder (short:
    Ray's socket paths must stay under 108 bytes), shut down and removed after."""
    temp = tempfile.mkdtemp(prefix="rk-ray-")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")         # no token file in the home folder
    # The workers unpickle this module's classes by value; rl_job/ray_job come with working_dir.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # ray.init installs a SIGTERM handler (sys.exit) that ray.shutdown leaves behind: put the
    # worker's back, or a later test of this process that sends itself SIGTERM exits (seen in
    # the torch-2.11 leg: tests/core/test_preemption.py after this one on the same worker).
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    t0 = time.monotonic()
    try:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, _temp_dir=temp,
                 _plasma_directory=temp, log_to_driver=False, runtime_env={"working_dir": str(EXAMPLE)})
        print(f"ray.init: {time.monotonic() - t0:.1f}s")
        yield
    finally:
        ray.shutdown()
        for s, handler in handlers.items():
            signal.signal(s, handler)
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        # Ray's agents may still write their last files while they exit: remove until gone.
        deadline = time.monotonic() + 30
        while Path(temp).exists() and time.monotonic() < deadline:
            shutil.rmtree(temp, ignore_errors=True)
            time.sleep(0.2)
        assert not Path(temp).exists(), f"Ray's files are still in {temp}"


def job_config(output: Path) -> dict:
    """config.yaml with the actor sharded by FSDP2 and saving asynchronously (its worker section)."""
    raw = read_config(EXAMPLE / "config.yaml", str(output))
    raw["rl"]["actor_fsdp2"] = True
    raw["actor_train"]["strategy_args"]["strategy_config"]["async_save_ckpt"] = True
    return raw


def wait_for(path: Path) -> str:
    deadline = time.monotonic() + SIGNAL_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no actor rank reached its write of step {KILL_STEP}")
        time.sleep(0.05)
    return path.read_text()


@pytest.fixture
def reference(tmp_path: Path) -> Any:
    """The same job uninterrupted, as plain processes (rl_job.py --fsdp2), started before
    the Ray cluster so that it runs meanwhile; returns its final digests and history."""
    out = tmp_path / "reference"
    cmd = [sys.executable, str(EXAMPLE / "rl_job.py"), "--output", str(out), "--fsdp2"]
    proc = warm.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)

    def result() -> tuple[dict[str, str], list[dict]]:
        stdout, stderr = proc.communicate(timeout=REFERENCE_TIMEOUT_S)
        assert proc.returncode == 0 and "Traceback" not in stderr, f"{cmd}\n{stdout}\n{stderr}"
        digests = dict(re.findall(r"^final (\S+) state digest (\w+)$", stdout, re.M))
        return digests, json.loads((out / "history.json").read_text())

    try:
        yield result
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_actor_killed_mid_save_resumes_exactly_in_a_new_launch(reference: Any, ray_cluster: Any,
                                                                     tmp_path: Path) -> None:
    t0 = time.monotonic()
    # The launch that loses an actor rank in the middle of its write of step 8.
    out = tmp_path / "crash"
    signal = tmp_path / "rank0-in-write"
    crashed = ray_job.Launch(job_config(out), cpus_per_worker=CPUS_PER_WORKER, actor_cls=PausingActorTrain,
                             actor_args=({"rank": 0, "step": KILL_STEP, "signal": str(signal)},))
    ckpt = Path(crashed.cfg.checkpoint_config.output_dir)
    run1 = crashed.run_name
    assert crashed.cfg.for_component("actor_train").async_save          # the worker section's key
    assert not crashed.cfg.async_save and not crashed.cfg.for_component("critic").async_save
    try:
        assert crashed.resume() == 0
        for step in range(1, KILL_STEP + 1):
            crashed.step(step)
            crashed.save(step)              # the actor's saves return once staged; the critic and driver commit
        written = wait_for(signal)
        assert f"{run1}/checkpoint-{KILL_STEP}/" in written and written.endswith(".distcp")
        ray.kill(crashed.actor.ranks[0])
        newest = layout.latest(crashed.manager.storage, crashed.manager.storage.root)
        assert newest is not None and (newest.run, newest.step) == (run1, RESUME_STEP)
        step8 = ckpt / run1 / f"checkpoint-{KILL_STEP}"
        assert (step8 / "critic" / "manifest.json").is_file() and (step8 / "pipeline" / "manifest.json").is_file()
        assert not (step8 / "actor_train").exists() and not (step8 / "manifest.json").exists()
    finally:
        crashed.end()                       # the launch is over: every worker killed
    assert crashed.driver["step"] == KILL_STEP
    t_crashed = time.monotonic() - t0

    # A new launch: a new run_name; every component resumes from step 4 and ends as the
    # uninterrupted run did (the same job as plain processes, saving synchronously).
    expected_digests, expected_history = reference()
    assert len(expected_history) == 12 and set(expected_digests) == {"actor_train", "critic"}
    assert crashed.driver["history"] == expected_history[:KILL_STEP]
    resumed = ray_job.Launch(job_config(out), cpus_per_worker=CPUS_PER_WORKER)
    try:
        assert resumed.run_name != run1
        assert resumed.resume() == RESUME_STEP
        assert resumed.driver["history"] == expected_history[:RESUME_STEP]
        for step in range(RESUME_STEP + 1, resumed.cfg.max_steps + 1):
            assert resumed.step(step) == expected_history[step - 1], f"step {step}"
            resumed.save(step)
        assert resumed.finish() == expected_digests
    finally:
        resumed.end()
    assert resumed.driver["history"] == expected_history

    # The new launch's steps are whole, each with its three parts. (The killed launch's run
    # folder is not judged here: its owner record names this process, the driver of every
    # launch in this test, which still runs; retention done in a worker process counts such
    # a run as another live job's and leaves it alone.)
    for step in (8, 12):
        path = ckpt / resumed.run_name / f"checkpoint-{step}"
        assert (path / "manifest.json").is_file()
        assert sorted(p.name for p in path.iterdir() if p.is_dir()) == ["actor_train", "critic", "pipeline"]
    print(f"crashed launch {t_crashed:.1f}s; whole test body {time.monotonic() - t0:.1f}s")
