"""The training job the crash tests SIGKILL (run as a child process; never imported by pytest).

One *worker* resumes from the newest committed checkpoint under ``out`` (fresh start when
there is none), then trains a small MLP (a few MB of weights + AdamW state, so a save
takes long enough for kills to land in the middle of one) and saves after every step,
sync or async, until it is killed. It reports through a log file, one line per event,
written with a single ``os.write`` so a line is never torn by the kill:

    ready <step> <digest>       resumed (step 0: fresh start); digest of the restored state
    step <step> <digest>        trained step <step>; digest of the state about to be saved
    committed <step> <path>     the save of <step> has returned committed (sync: save returned;
                                async: the manager reported it committed at the next save)
    dying <n> <op> <name>       (with ``kill_op``) about to SIGKILL itself before storage operation n
    done <n>                    finished (``saves``/``max_steps`` reached) after n counted operations

Every line ends with `` @<unix time>``.

Training is deterministic (fixed data per step, dropout from the restored torch RNG), so
the state of step N has the same digest in every run that reaches it: a resumed state
can be compared with the one that was saved.

Two ways to start a worker (``tests/`` on ``PYTHONPATH``: helpers.launch.child_env):

* ``python _crash_child.py worker SPEC_JSON`` - a fresh interpreter (imports torch: seconds);
* ``python _crash_child.py serve`` - a *fork server* (:mod:`helpers.forkserver`): imports
  torch and roll_ckpt once, then forks one worker per ``{"fork": SPEC}`` and reaps one per
  ``{"reap": N}``; a worker's output goes to ``<log>.err``. Before serving, the server runs
  one short sync job in a temporary folder so that every lazy import is done; it never
  starts a thread.

A worker SPEC (JSON): ``out``, ``log``, ``storage_options``, ``async``, ``keep``
(max_ckpt_to_keep), ``max_steps`` or ``saves`` (stop after this many saves), ``resume_only``,
``kill_op`` (see :class:`KillSwitch`; 0 counts without killing).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch

# Imported up front so that forked workers start warm.
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401
from roll_ckpt import CheckpointManager
import roll_ckpt.dcp.reader, roll_ckpt.dcp.writer  # noqa: F401,E401
import roll_ckpt_fs  # noqa: F401
import xxhash

from helpers.forkserver import emit, serve
from helpers.training import config, train_step

try:  # the S3 modes; optional
    import s3fs  # noqa: F401
except ImportError:  # pragma: no cover
    pass

HIDDEN = 256


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = xxhash.xxh3_64()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for st in optimizer.state_dict()["state"].values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().numpy().tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


class _CountingFile:
    """A file from ``open_write`` whose ``close`` (the durable point) is a counted operation."""

    def __init__(self, inner: Any, switch: "KillSwitch", path: str) -> None:
        self._inner, self._switch, self._path = inner, switch, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def close(self) -> None:
        if not self._inner.closed:
            self._switch.tick("close", self._path)
        self._inner.close()

    def __enter__(self) -> "_CountingFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class KillSwitch:
    """Wraps the manager's storage: counts every mutating operation once armed and SIGKILLs
    this process just before operation number ``at`` (0: never)."""

    OPS = {"open_write", "write_create", "makedirs", "rename_dir", "rename_file", "sync_dir",
           "remove", "remove_tree"}

    def __init__(self, inner: Any, fd: int, at: int) -> None:
        self._inner, self._fd, self._at = inner, fd, at
        self.count = 0
        self.armed = False

    def tick(self, op: str, path: str) -> None:
        if not self.armed:
            return
        self.count += 1
        if self._at and self.count == self._at:
            emit(self._fd, "dying", self.count, op, str(path).rstrip("/").rsplit("/", 1)[-1])
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self.OPS or not callable(attr):
            return attr

        def op(path: str, *args: Any, **kwargs: Any) -> Any:
            self.tick(name, path)
            out = attr(path, *args, **kwargs)
            return _CountingFile(out, self, path) if name == "open_write" else out

        return op


def worker(spec: dict[str, Any]) -> int:
    """Resume, then train and save every step until ``max_steps`` (or a kill)."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    torch.manual_seed(1234)
    d = int(spec.get("hidden", HIDDEN))
    model = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(4 * d, d))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    progress = {"samples": 0}
    state = {"model": model, "optimizer": optimizer, "progress": progress}
    cfg = config(spec["out"], storage_options=spec.get("storage_options") or {},
                 max_ckpt_to_keep=int(spec.get("keep", 0)), resume_from_checkpoint="latest",
                 async_save=bool(spec.get("async")))
    manager = CheckpointManager.from_config(cfg, quiet=True)
    switch = None
    if "kill_op" in spec:  # count (and maybe die at) the storage operations of the saves
        switch = manager.storage = KillSwitch(manager.storage, fd, int(spec["kill_op"]))
    start = manager.resume(state)
    emit(fd, "ready", start, digest(model, optimizer))
    if spec.get("resume_only"):
        manager.close()
        return 0
    if switch is not None:
        # Claim the run folder (and clean leftovers) first, so that operation N is the same
        # point of the save protocol in every worker: the random kills cover the start-up.
        manager._claimed_run()
        switch.armed = True
    reported = start
    last_step = start + int(spec["saves"]) if "saves" in spec else int(spec.get("max_steps", 100_000))
    for step in range(start + 1, last_step + 1):
        train_step(state, torch.randn(8, d, generator=torch.Generator().manual_seed(step)),
                   count=("progress", "samples", 8))
        emit(fd, "step", step, digest(model, optimizer))
        manager.save(step, state)
        last = manager.stats.last
        if last is not None and last.step > reported:
            emit(fd, "committed", last.step, last.path)
            reported = last.step
    manager.close()
    last = manager.stats.last
    if last is not None and last.step > reported:
        emit(fd, "committed", last.step, last.path)
    emit(fd, "done", switch.count if switch is not None else 0)
    return 0


def _prewarm() -> None:
    """Run one short sync job in the server, so forked workers find every lazy import done."""
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="roll-ckpt-prewarm-")
    try:
        spec = {"out": os.path.join(tmp, "ckpt"), "log": os.path.join(tmp, "log"), "max_steps": 2}
        worker(spec)
        worker(dict(spec, resume_only=True))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    if sys.argv[1] == "serve":
        torch.set_num_threads(1)
        return serve(worker, stderr_of=lambda spec: spec["log"] + ".err", prewarm=_prewarm)
    return worker(json.loads(sys.argv[2]))


if __name__ == "__main__":
    sys.exit(main())
