"""Ranks as ``torchrun --standalone`` starts them, without importing torch in every rank.

Each rank is ``python SCRIPT ARGS`` with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``PORT`` on a free port), started with a ``Popen`` that
forks it warm: :func:`helpers.warm.popen` from a test, plain ``subprocess.Popen`` from a
warm child such as the tests' agent (``_rank_agent.py``), whose python children are forked
from it (:mod:`helpers._warm_server`). About 4 s of CPU saved a rank, most of a short
multi-rank test here.

As torchrun's agent does, the first rank that fails ends the others (SIGTERM, SIGKILL
after a grace period) and the launch fails. ``ROLL_CKPT_TEST_TORCHRUN=1`` makes
:func:`helpers.launch.torchrun` run the real torchrun instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

GRACE_S = 10.0


def signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        if proc.returncode is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass


def start_ranks(script: str | os.PathLike[str], args: list[str], *, nproc: int, env: Mapping[str, str],
                popen: Callable[..., subprocess.Popen] = subprocess.Popen, stdouts: list[Any] | None = None,
                python: str = sys.executable, **kwargs: Any) -> list[subprocess.Popen]:
    """Start ``nproc`` ranks of ``python script args`` with ``env`` and torchrun's variables added;
    rank ``r`` writes to ``stdouts[r]`` when given, ``kwargs`` go to every ``popen``."""
    from .launch import free_port, rank_env

    port = free_port()
    return [popen([python, str(script), *map(str, args)], env={**env, **rank_env(rank, nproc, port)},
                  **({"stdout": stdouts[rank]} if stdouts else {}), **kwargs) for rank in range(nproc)]


def supervise(procs: list[subprocess.Popen], timeout: float | None = None,
              report: Callable[[subprocess.Popen], None] | None = None) -> tuple[int, bool]:
    """Wait for the ranks as torchrun's agent does: the first failure (``report(proc)``) ends
    the others (SIGTERM, SIGKILL after :data:`GRACE_S`), and so does ``timeout``. Returns (0,
    or the first failure's exit code, negative for a signal; whether the timeout ran out)."""
    first_failure = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    stop_at: float | None = None
    timed_out = False
    running = list(procs)
    while running:
        for proc in list(running):
            if proc.poll() is not None:
                running.remove(proc)
                if proc.returncode != 0:
                    if report is not None:
                        report(proc)
                    if first_failure == 0:
                        first_failure = proc.returncode
                        stop_at = time.monotonic() + GRACE_S
                        signal_all(running, signal.SIGTERM)
        now = time.monotonic()
        if deadline is not None and now > deadline and not timed_out:
            timed_out = True
            stop_at = now
        if stop_at is not None and now >= stop_at:
            signal_all(running, signal.SIGKILL)
        time.sleep(0.05)
    return first_failure, timed_out


def run_ranks(script: str | os.PathLike[str], args: list[str], *, nproc: int, timeout: float,
              env: Mapping[str, str], python: str | None = None) -> tuple[int, str, bool]:
    """Run ``script args`` on ``nproc`` ranks forked from the warm interpreter, with ``env``
    (``child_env``'s), or started by another interpreter (``python``: another leg's, fresh
    processes). Returns (exit code: 0 when every rank succeeded, else the first failure's;
    the ranks' output, rank by rank; whether ``timeout`` ran out)."""
    from . import warm

    popen = warm.popen if python is None else subprocess.Popen

    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        logs = [Path(tmp) / f"rank-{rank}.log" for rank in range(nproc)]
        files = [open(log, "wb") for log in logs]
        try:
            procs = start_ranks(script, args, nproc=nproc, env=env, popen=popen, stdin=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, cwd=os.getcwd(), stdouts=files,
                                python=python or sys.executable)
        finally:
            for f in files:
                f.close()
        try:
            first_failure, timed_out = supervise(procs, timeout)
        finally:
            signal_all(procs, signal.SIGKILL)
            for proc in procs:
                proc.wait()
        output = "".join(f"[rank {r}]\n{log.read_text(errors='replace')}" for r, log in enumerate(logs))
    return (first_failure or (1 if timed_out else 0)), output, timed_out
