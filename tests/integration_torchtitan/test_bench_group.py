"""The benchmark's group ``torchtitan`` (``python -m bench.torchtitan``, T18) end to end in its
smoke size: both managers built over the same objects on 2 ranks, every case measured, the
target computed. Not the speed: ``make bench-torchtitan`` measures that."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import subprocess
import sys

from helpers.launch import REPO, child_env, kill_group
from integration_torchtitan._tt import needs_torchtitan

pytestmark = [needs_torchtitan, pytest.mark.timeout(300)]


def test_the_torchtitan_group_measures_both_managers(tmp_path: Path) -> None:
    env = child_env(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "bench.torchtitan", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=270)
    finally:
        kill_group(proc)  # the bench's torchrun and its workers too
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    res = json.loads((tmp_path / "torchtitan.json").read_text())
    assert set(res["cases"]) == {"tt_async", "rc_async", "tt_sync", "rc_sync"}
    for name, case in res["cases"].items():
        assert case["saves"] >= 1 and case["blocked_s"] > 0 and case["durable_s"] >= case["blocked_s"] * 0.99, name
        assert case["per_step_s"] is not None, name
    t = res["target"]
    assert t["op"] == "<=" and t["limit"] == 0.5 and isinstance(t["pass"], bool) and t["value"] > 0
    assert "T18:" in (tmp_path / "torchtitan.md").read_text()
