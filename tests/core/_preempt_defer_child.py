"""A job whose SIGTERM handler was there before the manager, for the deferral tests.

``python _preempt_defer_child.py OUT LOG MODE``:

* ``default``: SIGTERM has the default action; the job sends itself SIGTERM after its last
  ``maybe_save``, then makes its final save and closes: ``close()`` raises the signal again
  once everything is committed, so the process ends killed by SIGTERM (``closed`` is never
  logged).
* ``exits``: a handler installed first ends the process with ``sys.exit(5)`` (as Ray's
  driver handler does with 15); the job sends itself SIGTERM after step 3. The handler
  runs once step 3 is committed (it logs the newest committed step), and the process
  exits with its status, not ``preemption.exit_code`` (7).

Lines of LOG: ``trained N``, ``handler NEWEST``, ``preempted N``, ``final N``, ``closed``.
"""

from __future__ import annotations

import os
import signal
import sys

from roll_ckpt import CheckpointManager, Preempted, load_config
from roll_ckpt.format import layout
from roll_ckpt.testing import tiny_state
from roll_ckpt_fs import LocalStorage

MAX_STEPS = 5


def main(out: str, log_path: str, mode: str) -> int:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(*words: object) -> None:
        os.write(fd, (" ".join(map(str, words)) + "\n").encode())

    if mode == "exits":
        def handler(signum: int, frame: object) -> None:
            newest = layout.latest(LocalStorage(out), out)
            log("handler", newest.step if newest else None)
            sys.exit(5)

        signal.signal(signal.SIGTERM, handler)
    else:
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    cfg = load_config({"checkpoint_config": {"output_dir": out, "preemption": {"exit_code": 7}}, "save_steps": 2})
    state = tiny_state()
    manager = CheckpointManager(cfg, quiet=True)
    try:
        for step in range(1, MAX_STEPS + 1):
            log("trained", step)
            if mode == "exits" and step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            manager.maybe_save(step, state)
    except Preempted as exc:
        log("preempted", exc.step)
        raise
    os.kill(os.getpid(), signal.SIGTERM)  # after the last maybe_save: nothing acts on it but close()
    manager.save(MAX_STEPS, state, final=True)
    log("final", MAX_STEPS)
    manager.close()
    log("closed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3]))
