"""One of two training runs sharing an ``output_dir`` (run by test_concurrency.py).

``python _two_runs_child.py OUT NAME OTHER STEPS SYNC_DIR ASYNC`` saves ``STEPS`` steps with
``max_ckpt_to_keep: 1`` in lock step with the run ``OTHER``: after each committed save it
publishes ``SYNC_DIR/NAME.saved.<step>`` (holding the checkpoint's path), waits for the
other's, checks that the other's newest checkpoint is still committed and verifies,
publishes ``NAME.checked.<step>`` and waits for the other's before the next step, so both
runs are alive and saving (and applying retention) throughout. Exit status 3: the other
run's checkpoint was touched. ``tests/`` is on ``PYTHONPATH`` (helpers.launch.child_env).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from helpers.training import config, train_step
from roll_ckpt import CheckpointManager
from roll_ckpt.format.manifest import verify
from roll_ckpt_fs import LocalStorage


def wait_for(path: Path, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.01)
    return path.read_text()


def publish(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def main() -> int:
    out, name, other, steps, sync, is_async = sys.argv[1:7]
    sync_dir = Path(sync)
    torch.manual_seed(0 if name == "a" else 1)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    cfg = config(out, max_ckpt_to_keep=1, async_save=is_async == "1")
    storage = LocalStorage(out)
    with CheckpointManager.from_config(cfg, quiet=True) as manager:
        for step in range(1, int(steps) + 1):
            train_step(state, (4, 64), loss="sum")
            path = manager.save(step, state)
            manager.wait()
            publish(sync_dir / f"{name}.saved.{step}", path)
            theirs = wait_for(sync_dir / f"{other}.saved.{step}")
            try:
                verify(storage, theirs)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                print(f"TOUCHED {theirs}: {exc}", flush=True)
                return 3
            publish(sync_dir / f"{name}.checked.{step}", "ok")
            wait_for(sync_dir / f"{other}.checked.{step}")
    print(f"done {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
