"""A failure on one rank reaches every rank at once, with the original error.

On 2 and 4 gloo ranks, with ``collective_timeout_s`` at its default (600 s): an ``OSError``
injected on one rank (the coordinator, or the last rank) in each phase of a save — its state
dict, the space check, staging, the coordinator's begin, the write, the commit — on DCP's full
path (step 1) and on the fixed layout (step 2), and in each phase of a resume (the file
checks, the load, handing the values over). Every rank must end within ``BOUND_S`` with the
same error class, its message naming the rank the fault was injected on and the fault itself;
nothing of the failed step is committed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import warm
from helpers.launch import child_env, free_port, rank_env
from roll_ckpt.format import layout
from roll_ckpt_fs import LocalStorage

CHILD = Path(__file__).with_name("_fail_child.py")
BOUND_S = 5.0

SAVE = [("state_dict", r, s) for r in (0, -1) for s in (1, 2)] + \
       [("stage", r, s) for r in (0, -1) for s in (1, 2)] + \
       [("write", r, s) for r in (0, -1) for s in (1, 2)] + \
       [(p, 0, s) for p in ("space", "begin", "commit") for s in (1, 2)]
RESUME = [(p, r, 1) for p in ("checks", "load", "apply") for r in (0, -1)]
SCENARIOS = SAVE + RESUME


def _run(out: Path, world: int, scenarios: list[tuple[str, int, int]]) -> list[dict]:
    port = free_port()
    procs = [warm.popen([sys.executable, str(CHILD), str(out), json.dumps(scenarios)], stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                        env=child_env(rank_env(rank, world, port), OMP_NUM_THREADS="1", ROLL_CKPT_QUIET="1"))
             for rank in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    reports = []
    for rank in range(world):
        path = out / f"{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report:\n" + "\n".join(o[-3000:] for o in outputs)
        report = json.loads(path.read_text())
        assert "hung" not in report, f"rank {rank} hung in {report['hung']}:\n" + "\n".join(o[-3000:] for o in outputs)
        reports.append(report)
    return reports


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_a_failure_on_one_rank_ends_every_rank_at_once_with_its_error(tmp_path: Path, world: int) -> None:
    scenarios = SCENARIOS
    reports = _run(tmp_path, world, scenarios)
    problems = []
    for i, (phase, rank, step) in enumerate(scenarios):
        faulty = rank % world
        got = [r["results"][i] for r in reports]
        what = f"{phase} on rank {faulty} at step {step}"
        if phase in ("checks", "load", "apply"):
            pass
        elif any(g["fixed_layout"] != (step == 2) for g in got):  # step 1: DCP's full path; step 2: the fixed layout
            problems.append(f"{what}: not on the path meant: {[g['fixed_layout'] for g in got]}")
        classes = {g["error"] for g in got}
        if None in classes or len(classes) != 1:
            problems.append(f"{what}: the ranks raised {[g['error'] for g in got]}")
            continue
        for me, g in enumerate(got):
            if f"rank {faulty}:" not in g["message"] or f"injected in {phase} on rank {faulty}" not in g["message"]:
                problems.append(f"{what}: rank {me} raised {g['error']}: {g['message'][:300]}")
            if g["s"] > BOUND_S:
                problems.append(f"{what}: rank {me} took {g['s']:.1f} s")
        storage = LocalStorage(str(tmp_path / str(i)))
        committed = [ref.step for ref in layout.committed(storage, storage.root)]
        expected = [1] if phase in ("checks", "load", "apply") else list(range(1, step))
        if committed != expected:
            problems.append(f"{what}: committed steps {committed}, expected {expected}")
    assert not problems, "\n".join(problems)
