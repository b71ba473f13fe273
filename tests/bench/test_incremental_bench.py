"""``python -m bench.incremental`` runs end to end on a small state and reports both states' cases."""

from __future__ import annotations

import json

import pytest

from helpers.launch import REPO, run_python

pytestmark = pytest.mark.timeout(240)


def test_incremental_bench_reports_both_states(tmp_path) -> None:
    proc = run_python(["-m", "bench.incremental", "--hidden", "128", "--layers", "4", "--rank", "4",
                       "--reps", "1", "--out", str(tmp_path)], env={"OMP_NUM_THREADS": "1"}, timeout=230, cwd=REPO, warm=True)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-5000:]  # 1: a target missed (noise)
    report = json.loads((tmp_path / "incremental.json").read_text())
    for state in ("lora", "full"):
        assert set(report[state]["median"]) == {"incremental", "full_write", "dcp"}
    lora = report["lora"]["median"]
    assert lora["incremental"]["written"] < lora["full_write"]["written"] / 2  # the base is not written again
    sizes = report["lora"]["sizes"]
    frozen = sizes["state"] - sizes["trainable_and_optimizer"]
    assert lora["full_write"]["written"] - lora["incremental"]["written"] >= frozen  # all of the base, framed
    assert "| LoRA | incremental |" in (tmp_path / "incremental.md").read_text()
