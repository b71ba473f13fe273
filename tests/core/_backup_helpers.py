"""Helpers for the replication and copy tests: storages that are slow or fail on purpose,
and a child process that is killed while it replicates (or copies)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any


class _SlowWriter:
    def __init__(self, inner: Any, owner: "SlowWrites") -> None:
        self._inner = inner
        self._owner = owner

    def write(self, data: Any) -> Any:
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
    """Wraps a storage: every write to a data file sleeps ``delay``; ``flag`` is created at the first."""

    def __init__(self, inner: Any, delay: float, flag: str | None = None) -> None:
        self._inner = inner
        self.delay = delay
        self.flag = flag
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


def flip_byte(path: Path, offset: int = 100) -> None:
    """Damage a file in place without changing its size."""
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def wait_for(path: Path, timeout: float, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the child exited ({proc.returncode}) before {path} appeared:\n{out[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.02)


# A child process that saves one checkpoint with replication to a slow backup, then waits
# to be killed: argv = config-json flag-file.
REPLICATING_CHILD = r'''
import json, os, sys, time
sys.path.insert(0, os.environ["HELPERS_DIR"])
from _backup_helpers import SlowWrites
import roll_ckpt.manager as manager
import roll_ckpt.transfer as transfer
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
sys.path.insert(0, os.environ["HELPERS_DIR"])
from _backup_helpers import SlowWrites
import roll_ckpt.job as job
import roll_ckpt.transfer as transfer
from roll_ckpt import cli

transfer.CHUNK_BYTES = 4096
real_open = job.open_storage
def slow_open(plugins, type_, url, options):
    storage = real_open(plugins, type_, url, options)
    return SlowWrites(storage, 0.1, os.environ["COPY_FLAG"]) if url == os.environ["SLOW_URL"] else storage
job.open_storage = slow_open
sys.exit(cli.main(sys.argv[1:]))
'''

HELPERS_DIR = str(Path(__file__).resolve().parent)
