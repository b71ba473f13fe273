"""Small helpers of the conformance suite: raw reads and writes, and a crashed writer's marker."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from ..format.commit import PendingCheckpoint
from ..contracts import Entry, Storage

__all__ = ["read_file", "write_file", "names", "dead_pid", "write_stale_marker"]


def read_file(storage: Storage, path: str) -> bytes:
    with storage.open_read(path) as f:
        return f.read()


def write_file(storage: Storage, path: str, data: bytes) -> None:
    with storage.open_write(path) as f:
        f.write(data)


def names(entries: list[Entry]) -> set[str]:
    return {e.name for e in entries}


def dead_pid() -> int:
    """The pid of a process of this host that has exited (for stale-marker tests)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def write_stale_marker(storage: Storage, pending: PendingCheckpoint, pid: int | None = None) -> None:
    """Rewrite ``pending``'s owner marker as if its writer (a process now gone) had crashed."""
    owner = {"host": socket.gethostname(), "pid": dead_pid() if pid is None else pid,
             "started": time.time() - 60, "write_path": pending.write_path,
             "final_path": pending.final_path}
    write_file(storage, pending.marker_path, json.dumps(owner).encode())


# --------------------------------------------------------------------------- the suite
