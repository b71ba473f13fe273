"""Ranks forked from a warm interpreter (``_rank_server.py``): what ``torchrun --standalone``
gives a worker script (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``
on a free port, an own session), without an agent and without importing torch again in
every rank: about 4 s of CPU saved a process, most of a short multi-rank test here.

As torchrun's agent does, the first rank that fails ends the others (SIGTERM, SIGKILL
after a grace period) and the launch fails. ``ROLL_CKPT_TEST_TORCHRUN=1`` makes
:func:`helpers.launch.torchrun` run the real torchrun instead.
"""

from __future__ import annotations

import atexit
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping

from .forkserver import ForkServer

SERVER = Path(__file__).with_name("_rank_server.py")
GRACE_S = 10.0
_server: ForkServer | None = None


def _the_server() -> ForkServer:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = ForkServer(SERVER, env={"OMP_NUM_THREADS": "1"})
        atexit.register(_server.close)
    return _server


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def supervise(pids: list[int], poll: Callable[[int], int | None], timeout: float | None = None,
              report: Callable[[int, int], None] | None = None) -> tuple[int, bool]:
    """Wait for the ranks ``pids`` as torchrun's agent does: ``poll(pid)`` gives a rank's
    raw wait status once it ended; the first failure (``report(pid, exit code)``) ends the
    others (SIGTERM, SIGKILL after :data:`GRACE_S`), and so does ``timeout``. Returns (0, or
    the first failure's exit code; whether the timeout ran out)."""
    codes: dict[int, int] = {}
    first_failure = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    stop_at: float | None = None
    timed_out = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes and (status := poll(pid)) is not None:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and report is not None:
                    report(pid, codes[pid])
                if codes[pid] != 0 and first_failure == 0:
                    first_failure = codes[pid]
                    stop_at = time.monotonic() + GRACE_S
                    signal_all([p for p in pids if p not in codes], signal.SIGTERM)
        now = time.monotonic()
        if deadline is not None and now > deadline and not timed_out:
            timed_out = True
            stop_at = now
        if stop_at is not None and now >= stop_at:
            signal_all([p for p in pids if p not in codes], signal.SIGKILL)
        time.sleep(0.05)
    return first_failure, timed_out


def run_ranks(script: str | os.PathLike[str], args: list[str], *, nproc: int, timeout: float,
              env: Mapping[str, str]) -> tuple[int, str, bool]:
    """Run ``script args`` on ``nproc`` forked ranks with ``env`` (``child_env``'s, ranks'
    variables added here). Returns (exit code: 0 when every rank succeeded, else the first
    failure's; the ranks' output, rank by rank; whether ``timeout`` ran out)."""
    from .launch import free_port, rank_env

    server = _the_server()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        logs = Path(tmp)
        pids = [server.fork({"script": str(script), "args": list(args), "cwd": os.getcwd(),
                             "log": str(logs / f"rank-{rank}.log"), "env": {**env, **rank_env(rank, nproc, port)}})
                for rank in range(nproc)]
        first_failure, timed_out = supervise(pids, server.poll, timeout)
        output = "".join(f"[rank {r}]\n{(logs / f'rank-{r}.log').read_text(errors='replace')}"
                         for r in range(nproc) if (logs / f"rank-{r}.log").exists())
    return (first_failure or (1 if timed_out else 0)), output, timed_out
