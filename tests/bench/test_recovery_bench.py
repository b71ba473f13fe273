"""``python -m bench.recovery`` runs end to end on a small model and reports both tiers."""

from __future__ import annotations

import json

import pytest

from helpers.launch import REPO, run_python

pytestmark = pytest.mark.timeout(240)


def test_recovery_bench_reports_both_tiers() -> None:
    proc = run_python(["-m", "bench.recovery", "--width", "128", "--depth", "2", "--repeat", "1"],
                      env={"OMP_NUM_THREADS": "1"}, timeout=230, cwd=REPO, warm=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout)
    rec = report["recovery"]
    assert rec["local"]["resumed_step"] == 9 and rec["local"]["steps_lost"] == 0
    assert rec["persistent"]["resumed_step"] == 5 and rec["persistent"]["steps_lost"] == 4
    assert "/node0/checkpoint-9/" in rec["local"]["resumed_from"]
    saves = report["saves_before_the_failure"]
    assert saves["local_tier_bytes_node0"] > 0 and saves["local_blocked_s_median"] is not None
