"""A checkpoint written on another leg (another torch, NumPy, Python) resumes here with every
restored byte equal: the model and optimizer tensors, the optimizer's hyperparameters, the
scheduler, the sampler's generator, a counter, the step, and each process's Python, NumPy and
torch RNG states. One process, 2 FSDP2 ranks, and 2 FSDP2 ranks into one process.

Each leg's run reads every other built leg's checkpoints (``helpers.legs``), so the matrix
(``make test-matrix``) proves every ordered pair, and CI's two legs both directions. The
writer is another leg's interpreter, started fresh; the reader is this one. A value only one
release has (torch 2.13's AdamW ``decoupled_weight_decay``, torch 2.6's scheduler ``verbose``)
is not a restored value: each side lists what a fresh job of its torch holds, and a value
missing on one side must be one that side's torch does not hold at all.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import legs
from helpers.launch import child_env, torchrun
from helpers.ranks import run_ranks

JOB = Path(__file__).with_name("_cross_job.py")
OTHERS = legs.others()
pytestmark = pytest.mark.timeout(420)

if not OTHERS:
    pytest.skip("no other leg's environment is built here (python -m matrix build roll-2.8, or make test-matrix)",
                allow_module_level=True)


def _write(leg: legs.Leg, mode: str, out: Path) -> None:
    out.mkdir(parents=True)
    env = child_env(OMP_NUM_THREADS="1", ROLL_CKPT_QUIET="1")
    env.pop("VIRTUAL_ENV", None)
    if mode == "single":
        ran = subprocess.run([leg.python, str(JOB), "write", mode, str(out)], capture_output=True, text=True,
                             timeout=240, env=env)
        assert ran.returncode == 0, f"{leg.id} could not write:\n{ran.stdout[-3000:]}{ran.stderr[-5000:]}"
        return
    code, output, timed_out = run_ranks(JOB, ["write", mode, str(out)], nproc=2, timeout=240, env=env,
                                        python=leg.python)
    assert code == 0 and not timed_out, f"{leg.id} could not write on 2 ranks:\n{output[-8000:]}"


def _read(mode: str, src: Path, out: Path, nproc: int) -> None:
    shutil.copytree(src / "ckpt", out / "ckpt")
    if nproc == 1:
        from helpers.launch import run_python

        ran = run_python([str(JOB), "read", mode, str(out)], timeout=240, env={"ROLL_CKPT_QUIET": "1"})
        assert ran.returncode == 0, f"could not resume:\n{ran.stdout[-3000:]}{ran.stderr[-5000:]}"
    else:
        torchrun(JOB, "read", mode, str(out), nproc=nproc, timeout=240)


def _compare(written: dict, restored: dict, where: str) -> None:
    """Every value both sides have is equal; a value only one side has is one the other side's
    torch does not have at all (``known``: a fresh job's values there), never one it lost."""
    w, r = written["digests"], restored["digests"]
    missing = sorted(k for k in w if k not in r and k in restored["known"])
    extra = sorted(k for k in r if k not in w and k in written["known"])
    differ = sorted(k for k in w if k in r and w[k] != r[k])
    assert not (missing or extra or differ), (
        f"{where} (written on {written['versions']}, read on {restored['versions']}): "
        f"missing {missing[:10]}, unexpected {extra[:10]}, different {differ[:10]}")


@pytest.mark.parametrize("leg", OTHERS, ids=lambda leg: leg.id)
def test_one_process_checkpoint_of_another_leg_resumes_byte_for_byte(leg: legs.Leg, tmp_path: Path) -> None:
    _write(leg, "single", tmp_path / "written")
    _read("single", tmp_path / "written", tmp_path / "read", nproc=1)
    _compare(json.loads((tmp_path / "written" / "write-single-0.json").read_text()),
             json.loads((tmp_path / "read" / "read-single-0.json").read_text()), "one process")


@pytest.mark.parametrize("leg", OTHERS, ids=lambda leg: leg.id)
def test_fsdp2_checkpoint_of_another_leg_resumes_on_2_ranks_and_resharded_into_one(leg: legs.Leg,
                                                                                  tmp_path: Path) -> None:
    _write(leg, "fsdp2", tmp_path / "written")
    written = [json.loads((tmp_path / "written" / f"write-fsdp2-{r}.json").read_text()) for r in range(2)]
    _read("fsdp2", tmp_path / "written", tmp_path / "read2", nproc=2)
    for r in range(2):
        _compare(written[r], json.loads((tmp_path / "read2" / f"read-fsdp2-{r}.json").read_text()),
                 f"2 FSDP2 ranks, rank {r}")
    _read("reshard", tmp_path / "written", tmp_path / "read1", nproc=1)
    _compare(written[0], json.loads((tmp_path / "read1" / "read-reshard-0.json").read_text()),
             "2 FSDP2 ranks into one process (rank 0's per-process state)")
