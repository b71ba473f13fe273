"""Helpers for the replication and copy tests: storages that are slow or fail on purpose,
what a store holds, and a child process that is killed while it replicates (or copies)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from helpers import warm
from helpers.launch import child_env


class _SlowWriter:
    def __init__(self, inner: Any, owner: "SlowWrites") -> None:
        self._inner = inner
        self._owner = owner

    def write(self, data: Any) -> Any:
        if self._owner.gate is not None:
            assert self._owner.gate.wait(120), "the test never opened the gate"
        self._owner.wrote()
        time.sleep(self._owner.delay)
        return self._inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> "_SlowWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.close()

    def close(self) -> None:
        self._inner.close()


class SlowWrites:
    """Wraps a storage: every write to a data file sleeps ``delay``; ``flag`` is created at the
    first; with ``gate`` (an event) no write starts before it is set."""

    def __init__(self, inner: Any, delay: float, flag: str | None = None, gate: threading.Event | None = None) -> None:
        self._inner = inner
        self.delay = delay
        self.flag = flag
        self.gate = gate
        self.writes = 0

    def wrote(self) -> None:
        self.writes += 1
        if self.flag and self.writes == 1:
            Path(self.flag).write_text(str(os.getpid()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def open_write(self, path: str) -> Any:
        return _SlowWriter(self._inner.open_write(path), self)


class FailingWrites:
    """Wraps a storage: the first ``failures`` file writes raise ``OSError`` (a flaky store)."""

    def __init__(self, inner: Any, failures: int) -> None:
        self._inner = inner
        self.failures = failures
        self.calls = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def open_write(self, path: str) -> Any:
        with self._lock:
            self.calls += 1
            if self.calls <= self.failures:
                raise OSError(5, f"injected I/O error #{self.calls}", path)
        return self._inner.open_write(path)


def manager(cfg: Any) -> Any:
    from roll_ckpt import CheckpointManager

    return CheckpointManager.from_config(cfg, quiet=True)


def save_steps(m: Any, state: dict[str, Any], steps: Any) -> dict[int, Any]:
    """Save ``state`` at each of ``steps`` with the manager ``m`` (its counter moves on after
    each save): the state each step saved (``state_snapshot``)."""
    from roll_ckpt.testing import state_snapshot

    snaps = {}
    for step in steps:
        m.save(step, state)
        snaps[step] = state_snapshot(state)
        state["counter"]["seen"] += 1
    return snaps


def committed_steps(storage: Any, root: str) -> list[int]:
    from roll_ckpt.format import layout

    return [r.step for r in layout.committed(storage, root)]


def leftovers(storage: Any, root: str) -> list[str]:
    """What unfinished writes left: temporary folders and markers (under ``root`` and its run
    folders), and checkpoint folders without a manifest."""
    from roll_ckpt.format import layout

    out = []
    for folder in [root, *(p for _, p in layout.run_folders(storage, root))]:
        out += [e.path for e in storage.list(folder) if e.name.startswith((".tmp-", ".inflight-"))]
    return out + [r.path for r in layout.scan(storage, root) if not r.committed]


def wait_for(path: Path, timeout: float, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the child exited ({proc.returncode}) before {path} appeared:\n{out[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.02)


def kill_when_busy(code: str, *args: str, flag: Path, delay: float, env: Mapping[str, str] | None = None) -> None:
    """Run the child script ``code`` (written next to ``flag``) with ``args``; once it has
    created ``flag`` (it is writing) let it go on for ``delay`` seconds, then SIGKILL it."""
    script = flag.with_name("child.py")
    script.write_text(code)
    proc = warm.popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True, env=child_env(env, ROLL_CKPT_QUIET="1", OMP_NUM_THREADS="1"))
    try:
        wait_for(flag, 60, proc)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)


# The child scripts (run with tests/ on PYTHONPATH: helpers.launch.child_env).

# A child process that saves one checkpoint with replication to a slow backup, then waits
# to be killed: argv = config-json flag-file.
REPLICATING_CHILD = r'''
import json, sys, time
from core._backup_helpers import SlowWrites
import roll_ckpt.manager as manager
import roll_ckpt.tiers.transfer as transfer
from roll_ckpt import CheckpointManager, load_config
from roll_ckpt.testing import tiny_state

transfer.CHUNK_BYTES = 4096
cfg = load_config(json.loads(sys.argv[1]))
real_open = manager.open_storage
def slow_open(plugins, type_, url, options):  # the backup is written slowly
    storage = real_open(plugins, type_, url, options)
    return SlowWrites(storage, delay=0.1, flag=sys.argv[2]) if url == cfg.checkpoint_config.backup.output_dir else storage
manager.open_storage = slow_open
m = CheckpointManager.from_config(cfg, quiet=True)
m.save(1, tiny_state(1))
print("saved", flush=True)
time.sleep(120)
'''

# A child process that runs `roll-ckpt copy` with slow writes, to be killed: argv = copy arguments.
COPYING_CHILD = r'''
import os, sys
from core._backup_helpers import SlowWrites
import roll_ckpt.tiers.run as job
import roll_ckpt.tiers.transfer as transfer
from roll_ckpt import cli

transfer.CHUNK_BYTES = 4096
real_open = job.open_storage
def slow_open(plugins, type_, url, options):
    storage = real_open(plugins, type_, url, options)
    return SlowWrites(storage, 0.1, os.environ["COPY_FLAG"]) if url == os.environ["SLOW_URL"] else storage
job.open_storage = slow_open
sys.exit(cli.main(sys.argv[1:]))
'''
