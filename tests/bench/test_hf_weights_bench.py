"""``python -m bench.hf_weights`` runs end to end on a small model and reports the three cases."""

from __future__ import annotations

import json

import pytest

from helpers.launch import REPO, run_python

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(240)


def test_hf_weights_bench_reports_every_case(tmp_path) -> None:
    proc = run_python(["-m", "bench.hf_weights", "--layers", "2", "--hidden", "128", "--reps", "1",
                       "--out", str(tmp_path)], env={"OMP_NUM_THREADS": "1"}, timeout=230, cwd=REPO, warm=True)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-5000:]  # 1: the target missed (noise)
    report = json.loads((tmp_path / "hf_weights.json").read_text())
    assert set(report["median"]) == {"rc_async", "rc_async_hf", "roll_way"}
    assert report["median"]["rc_async_hf"]["readable_s"] >= report["median"]["rc_async_hf"]["blocked_s"]
    assert "| rc_async_hf |" in (tmp_path / "hf_weights.md").read_text()
