"""``python _rank_agent.py NPROC SCRIPT ARGS...``: ``torchrun --standalone`` for the tests,
with one import of torch instead of one per rank and one for the agent.

It imports what the ranks need once (:func:`_rank_server._preload`), forks ``NPROC`` ranks
with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``
on a free port) and runs ``SCRIPT`` in each as ``__main__``; the ranks write to this
process's stdout and stderr. As torchrun's agent: SIGTERM or SIGINT to it reaches every
rank; the first rank that fails ends the others (SIGTERM, SIGKILL after a grace period);
its exit status is 0 when every rank succeeded, else 1.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared helpers


def main(argv: list[str]) -> int:
    from helpers._rank_server import _preload, run
    from helpers.forkserver import die_with_parent
    from helpers.launch import free_port, rank_env
    from helpers.ranks import signal_all, supervise

    nproc, script, args = int(argv[0]), argv[1], argv[2:]
    _preload()
    port = free_port()
    children: dict[int, int] = {}
    for rank in range(nproc):
        spec = {"script": script, "args": args, "cwd": os.getcwd(),
                "env": {**os.environ, **rank_env(rank, nproc, port)}}
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the rank
            code = 1
            try:
                die_with_parent()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                code = run(spec)
            except BaseException:  # noqa: BLE001 - reported on stderr, as a worker's
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank

    def forward(signum: int, _frame: object) -> None:
        signal_all(list(children), signum)

    def poll(pid: int) -> int | None:
        done, status = os.waitpid(pid, os.WNOHANG)
        return status if done else None

    def report(pid: int, code: int) -> None:  # as torchrun's agent does
        how = f"Signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
        print(f"[rank agent] rank {children[pid]} (pid {pid}) failed: {how}", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed, _ = supervise(list(children), poll, report=report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
