"""What the ROLL integration tests share: launches of the ROLL test double's driver
(``_double_job.py``, each its own bounded process group with its own Ray cluster, shut down
when it ends), and checks of ROLL's tree and keys."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from helpers.launch import REPO, child_env, kill_group

HERE = Path(__file__).resolve().parent
DOUBLE = HERE / "roll_double"
JOB = HERE / "_double_job.py"
LAUNCH_TIMEOUT_S = 120



class Launch:
    """One driver launch running in the background: its output lines as they come."""

    def __init__(self, cmd: list[str], env: dict[str, str], result: Path) -> None:
        self.result = result
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                     env=env, start_new_session=True)
        self.lines: list[str] = []
        self._queue: "queue.Queue[str | None]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_line(self, prefix: str, timeout: float = LAUNCH_TIMEOUT_S) -> str:
        """The first output line starting with ``prefix`` (earlier ones kept in :attr:`lines`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            if line.startswith(prefix):
                return line.strip()
        self.kill()
        raise AssertionError(f"no line starting with {prefix!r} within {timeout}s:\n{self.output[-6000:]}")

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout: float = LAUNCH_TIMEOUT_S) -> tuple[int, dict]:
        """Wait for the end (killing the group after ``timeout``); the exit status and the result."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise AssertionError(f"the launch did not end within {timeout}s:\n{self.output[-6000:]}") from None
            if line is None:
                break
            self.lines.append(line)
        rc = self.proc.wait(timeout=30)
        self.kill()  # the driver's group (by its pid): anything it left behind
        print(f"launch: {time.monotonic() - self.t0:.1f}s, status {rc}")
        return rc, (json.loads(self.result.read_text()) if self.result.exists() else {})

    def kill(self) -> None:
        kill_group(self.proc)


@pytest.fixture
def launcher(tmp_path: Path):
    """``launcher(*args)`` starts one driver launch (``_double_job.py``) in the background. The
    launches share the model folder, the local output_dir and checkpoint_config's root
    (``tmp_path/ckpt``); Ray keeps its files in a short temporary folder, removed at the end."""
    ray_tmp = tempfile.mkdtemp(prefix="rk-ray-")        # Ray's socket paths must stay short
    count = [0]
    started: list[Launch] = []

    def start(*args: str) -> Launch:
        count[0] += 1
        result = tmp_path / f"result-{count[0]}.json"
        cmd = [sys.executable, str(JOB), "--model", str(tmp_path / "model"), "--output", str(tmp_path / "out"),
               "--ckpt-root", str(tmp_path / "ckpt"), "--result", str(result), *args]
        env = child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp)
        env["PYTHONPATH"] = os.pathsep.join([str(DOUBLE), env["PYTHONPATH"]])
        started.append(Launch(cmd, env, result))
        return started[-1]

    try:
        yield start
    finally:
        for run in started:
            run.kill()
        deadline = time.monotonic() + 30      # Ray's last writers may still be exiting
        while Path(ray_tmp).exists() and time.monotonic() < deadline:
            shutil.rmtree(ray_tmp, ignore_errors=True)
            time.sleep(0.2)


@pytest.fixture
def launch(launcher: Any):
    """``launch(*args)``: one launch to its end; its result JSON (it must succeed)."""

    def run(*args: str) -> dict:
        job = launcher(*args)
        rc, result = job.finish()
        assert rc == 0, job.output[-6000:]
        result["output"] = job.output
        return result

    return run
