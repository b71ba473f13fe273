"""The priority of roll-ckpt's background threads against the training loop.

An asynchronous save returns once the state is staged; the write that follows runs in
roll-ckpt's threads while the loop goes on, and both want the CPU. Those threads lower
their own scheduling priority (Linux: a thread is a task with its own nice value, and the
threads it starts inherit it), so the loop's threads win the CPU whenever both are
runnable and the write uses what the loop leaves idle. A thread cannot raise its priority
back without privileges; only roll-ckpt's own threads call this.
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["lower_priority", "MAX_NICE"]

log = logging.getLogger("roll_ckpt")

MAX_NICE = 19


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value to ``nice`` (never lowers it; 0: no change)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if current < nice:
            os.setpriority(os.PRIO_PROCESS, tid, min(nice, MAX_NICE))
    except OSError as exc:  # a sandbox that forbids it: the write still runs, at the loop's priority
        log.debug("roll-ckpt: cannot lower the priority of thread %s: %s", tid, exc)
