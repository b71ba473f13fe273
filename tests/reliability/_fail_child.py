"""One rank of a gloo job in which one rank's save or resume fails in one phase (run by
test_failures_reach_every_rank.py): ``_fail_child.py OUT SCENARIOS``; ``RANK``/``WORLD_SIZE``/
``MASTER_*`` come from the test. ``SCENARIOS`` is a JSON list of ``[phase, rank, step]``.

Each scenario has a manager of its own, with ``collective_timeout_s`` at its default
(600 s), and its own folder ``OUT/<i>``: the save of step 1 takes DCP's full path, the save
of step 2 the fixed layout; a resume scenario resumes step 1 (saved first, without a fault).
The fault is an ``OSError`` raised on ``rank`` in ``phase`` at ``step``. Each rank writes
``OUT/<rank>.json``: per scenario, the class and message it raised and the seconds it took.
A scenario that takes more than ``HUNG_S`` ends the process (the report says which).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from helpers.launch import exit_worker
from helpers.training import config
from roll_ckpt import CheckpointManager

HUNG_S = 30.0

SAVE_PHASES = ("state_dict", "space", "stage", "begin", "write", "commit")
RESUME_PHASES = ("checks", "load", "apply")


def _fault(phase: str, rank: int) -> OSError:
    return OSError(errno.EIO, f"injected in {phase} on rank {rank}")


def _target(phase: str) -> tuple[Any, str]:
    """The object and attribute whose call the fault replaces."""
    from roll_ckpt.format.commit import PendingCheckpoint
    from roll_ckpt.dcp.reader import SafeReader
    import roll_ckpt.save.pipeline as pipeline_module
    from roll_ckpt.tiers.space import SpaceGuard
    from roll_ckpt.dcp.writer import DigestingWriter
    import roll_ckpt.strategies.dcp as strategy_module
    from roll_ckpt.strategies.dcp import DCPStrategy

    return {
        "state_dict": (DCPStrategy, "state_dict"),
        "space": (SpaceGuard, "check"),
        "stage": (pipeline_module, "stage_state_dict"),  # staging, as the pipeline calls it
        "begin": (PendingCheckpoint, "begin"),
        "write": (DigestingWriter, "write_files"),
        "commit": (PendingCheckpoint, "commit"),
        "checks": (SafeReader, "check_files"),
        "load": (strategy_module, "read_dcp"),  # the job's DCP read (dcp/reader.py's), as the strategy calls it
        "apply": (DCPStrategy, "hand_over"),
    }[phase]


@contextlib.contextmanager
def injected(phase: str, rank: int, active: list[bool]) -> Iterator[None]:
    owner, name = _target(phase)
    real = getattr(owner, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        if active[0]:
            raise _fault(phase, rank)
        return real(*args, **kwargs)

    setattr(owner, name, failing)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "counter": {"n": 0}}


def _manager(out: str, resume: bool) -> CheckpointManager:
    cfg = config(out, timestamp_subdir=False, resume_from_checkpoint="latest" if resume else False)
    return CheckpointManager.from_config(cfg, quiet=True)


def run(out: str, phase: str, faulty: int, step: int, me: int) -> dict[str, Any]:
    resume = phase in RESUME_PHASES
    state = _state()
    if resume:  # the checkpoint to resume from, saved without a fault
        with contextlib.closing(_manager(out, False)) as m:
            m.resume(state)
            m.save(1, state)
    active = [False]
    m = _manager(out, resume)
    cm = injected(phase, faulty, active) if me == faulty else contextlib.nullcontext()
    t0 = time.monotonic()
    result: dict[str, Any] = {"error": None}
    with cm:
        try:
            if resume:
                active[0] = True
                t0 = time.monotonic()
                m.resume(state)
            else:
                m.resume(state)
                for s in range(1, step + 1):
                    active[0] = s == step
                    result["fixed_layout"] = getattr(m.io.layouts, "layout", None) is not None  # (no layouts before the first write)
                    t0 = time.monotonic()
                    m.save(s, state)
        except Exception as exc:
            result.update(error=type(exc).__name__, message=str(exc))
        result["s"] = time.monotonic() - t0
        active[0] = False
    try:
        m.close()
    except Exception as exc:  # (a failed save's error was raised already)
        result["close"] = f"{type(exc).__name__}: {exc}"
    return result


def main(out: str, scenarios: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    me = dist.get_rank()
    world = dist.get_world_size()
    report: dict[str, Any] = {"results": []}
    path = f"{out}/{me}.json"
    current: list[Any] = [None, time.monotonic()]

    def watchdog() -> None:
        while True:
            time.sleep(1)
            if current[0] is not None and time.monotonic() - current[1] > HUNG_S:
                report["hung"] = current[0]
                with open(path, "w") as f:
                    json.dump(report, f)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    for i, (phase, rank, step) in enumerate(json.loads(scenarios)):
        faulty = rank % world
        current[:] = [[phase, faulty, step], time.monotonic()]
        result = run(f"{out}/{i}", phase, faulty, step, me)
        report["results"].append({"phase": phase, "rank": faulty, "step": step, **result})
        current[0] = None
        dist.barrier()
    with open(path, "w") as f:
        json.dump(report, f)
    exit_worker(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
