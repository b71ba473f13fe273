"""``python _rank_agent.py NPROC SCRIPT ARGS...``: ``torchrun --standalone`` for the tests.

Started warm (:func:`helpers.launch.start_torchrun`), it starts ``NPROC`` ranks with
torchrun's environment (:func:`helpers.ranks.start_ranks`): its python children are forked
from it, so torch is imported once, not once per rank and once for the agent. The ranks
write to this process's stdout and stderr, in its process group, and die with it. As
torchrun's agent: SIGTERM or SIGINT to it reaches every rank; the first rank that fails
ends the others (SIGTERM, SIGKILL after a grace period); its exit status is 0 when every
rank succeeded, else 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared helpers


def main(argv: list[str]) -> int:
    from helpers.forkserver import die_with_parent
    from helpers.ranks import signal_all, start_ranks, supervise

    nproc, script, args = int(argv[0]), argv[1], argv[2:]
    procs = start_ranks(script, args, nproc=nproc, env=os.environ, preexec_fn=die_with_parent)
    rank_of = {proc.pid: rank for rank, proc in enumerate(procs)}

    def forward(signum: int, _frame: object) -> None:
        signal_all(procs, signum)

    def report(proc: subprocess.Popen) -> None:  # as torchrun's agent does
        code = proc.returncode
        how = f"Signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
        print(f"[rank agent] rank {rank_of[proc.pid]} (pid {proc.pid}) failed: {how}", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed, _ = supervise(procs, report=report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
