"""A refusal that only the coordinator can see reaches every rank of a component's group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.launch import torchrun
from roll_ckpt import new_run_name

CHILD = Path(__file__).with_name("_ranks_child.py")
pytestmark = pytest.mark.timeout(240)


def test_a_part_refused_on_the_coordinator_is_refused_on_every_rank(tmp_path: Path) -> None:
    run = new_run_name()
    torchrun(CHILD, tmp_path, run, "first")
    assert [json.loads((tmp_path / f"first-{r}.json").read_text()).get("saved") for r in (0, 1)] == [True, True]
    # Each rank writes its result before it leaves. Once in ~20 runs here a rank then aborted
    # while the process group was torn down after the refused DCP save ("terminate called
    # without an active exception", in gloo): the results are what this test is about.
    output = torchrun(CHILD, tmp_path, run, "second", check=False)
    errors = []
    for rank in (0, 1):
        assert (tmp_path / f"second-{rank}.json").exists(), output
        result = json.loads((tmp_path / f"second-{rank}.json").read_text())
        assert "already committed" in result.get("error", ""), result
        errors.append(result["error"])
    # Carried to rank 1 by the save's agreement, not learnt from a collective that timed out
    # or lost its peer: every rank raises the coordinator's refusal itself, naming rank 0.
    assert errors[0].startswith("RollCkptError: rank 0: ") and errors[1] == errors[0], errors
    assert not [p for p in (tmp_path / "ckpt" / run / "checkpoint-2").iterdir() if p.name.startswith((".tmp-", ".inflight-"))]
