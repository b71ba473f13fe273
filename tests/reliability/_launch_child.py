"""One launch of a job writing a shared ``output_dir`` (run by test_two_launches.py).

``_launch_child.py OUT NAME SYNC KEEP FLAT ACTION...`` runs its actions in order:
``resume`` (latest), ``save:N``, ``signal:X`` (publishes ``SYNC/NAME.X``), ``wait:X`` (waits
for ``SYNC/X``). ``FLAT`` 1: ``timestamp_subdir: false``. It prints one JSON line at the end:
the step resumed, the paths saved, and the error of the first action that raised one
(``{"error": type, "message": ...}``; the actions after it are skipped).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from helpers.training import config, train_step
from roll_ckpt import CheckpointManager, RollCkptError


def wait_for(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.02)


def main() -> int:
    out, name, sync, keep, flat, *actions = sys.argv[1:]
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    cfg = config(out, max_ckpt_to_keep=int(keep), timestamp_subdir=flat != "1", resume_from_checkpoint="latest")
    report: dict = {"saved": {}}
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        try:
            for action in actions:
                verb, _, arg = action.partition(":")
                if verb == "resume":
                    report["resumed"] = m.resume(state)
                elif verb == "save":
                    train_step(state, (4, 16), loss="sum")
                    report["saved"][arg] = m.save(int(arg), state)
                elif verb == "signal":
                    (Path(sync) / f"{name}.{arg}").write_text("1")
                elif verb == "wait":
                    wait_for(Path(sync) / arg)
        except RollCkptError as exc:
            report["error"] = {"type": type(exc).__name__, "message": str(exc)}
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
