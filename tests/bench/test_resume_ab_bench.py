"""``python -m bench.resume_ab`` runs end to end against a commit and leaves no worktree behind."""

from __future__ import annotations

import re
import subprocess

import pytest

from helpers.launch import REPO, run_python

pytestmark = pytest.mark.timeout(240)


def test_resume_side_by_side_reports_both_checkouts() -> None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          timeout=30, check=True).stdout.strip()
    proc = run_python(["-m", "bench.resume_ab", "--base", head, "--runs", "1", "--resumes", "1",
                       "--width", "64", "--depth", "2"], env={"OMP_NUM_THREADS": "1"}, timeout=230, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    medians = dict(re.findall(r"^(.+): median ([0-9.]+) ", proc.stdout, re.M))
    assert set(medians) == {"this checkout", head}, proc.stdout
    assert all(float(v) > 0 for v in medians.values())
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True,
                               timeout=30, check=True).stdout
    assert "resume-ab-" not in worktrees, worktrees
