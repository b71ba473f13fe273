"""The benchmark harness runs end to end in its tiny mode and writes what it promises.

Checks the shape of ``latest.json`` (targets with value / limit / pass, every case
measured), the markdown table and the plot — not the speed, which only ``make bench``
on an idle machine can judge.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers.launch import REPO, run_python

pytestmark = pytest.mark.timeout(180)


def test_smoke_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = run_python([str(REPO / "bench" / "run.py"), "--smoke", "--out", str(out)], env={"OMP_NUM_THREADS": "1"},
                      timeout=170, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads((out / "latest.json").read_text())

    assert set(res["targets"]) == {"T1", "T2", "T3", "T4", "T5"}
    for name, t in res["targets"].items():
        assert {"value", "limit", "pass"} <= set(t), name
        assert isinstance(t["pass"], bool) and isinstance(t["limit"], (int, float)), name
        assert t["value"] is None or isinstance(t["value"], (int, float)), name
    assert res["all_pass"] == all(t["pass"] for t in res["targets"].values()) and not res["invariants"]

    cases = {r["case"] for r in res["cases"]}
    assert {"torch_save", "dcp_save", "dcp_async", "dcp_async_stager", "rc_save", "rc_async",
            "rc_async_zc_model", "rc_async_zc_all", "rc_dedup", "dcp_load", "rc_load"} <= cases
    for r in res["cases"]:
        for key in ("blocked_s", "durable_s", "extra_rss", "extra_rss_frac", "copied", "gbps"):
            assert key in r, (r["case"], key)
        assert r["durable_s"] > 0 and r["bytes"] > 0, r["case"]
    zc = next(r for r in res["cases"] if r["case"] == "rc_async_zc_all")
    # only what is not in the store is copied (AdamW step counters, RNG state)
    assert zc["copied"] < 0.05 * zc["state_bytes"] and zc["policies"].get("zero_copy", 0) > 0
    lim = res["limits"]
    assert lim["disk_write_gbps"] > 0 and lim["disk_read_gbps"] > 0 and lim["memcpy_gbps"] > 0

    md = (out / "latest.md").read_text()
    assert "| T1 |" in md and "rc_async_zc_all" in md and "Machine:" in md
    assert (out / "latest.png").stat().st_size > 10_000
    assert not list(out.glob(".scratch-*")), "the scratch checkpoints are removed"


def test_check_flag_reports_failures_in_the_exit_status(tmp_path: Path) -> None:
    """``--check`` turns a failed target into exit status 1 (judged on a saved result)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import run
    finally:
        sys.path.pop(0)
    rows = [{"group": "target", "case": c, "kind": k, "blocked_s": b, "gbps": g, "extra_rss_frac": f,
             "hash_frac": h, "state_bytes": 1 << 29}
            for c, k, b, g, f, h in [("rc_async_zc_all", "save", 0.5, 1.0, 0.5, 0.0),
                                     ("dcp_async", "save", 0.5, 1.0, 1.0, 0.0),
                                     ("rc_save", "save", 1.0, 0.1, 0.0, 0.5),
                                     ("dcp_save", "save", 1.0, 1.0, 0.0, 0.0),
                                     ("rc_load", "load", 1.0, 0.5, 0.0, 0.0),
                                     ("dcp_load", "load", 1.0, 1.0, 0.0, 0.0)]]
    tg = run.targets(rows, {"disk_write_gbps": 1.0, "disk_read_gbps": 1.0})
    assert not any(t["pass"] for t in tg.values())
    assert tg["T1"]["value"] == pytest.approx(1.0) and tg["T3"]["vs_dcp"]["value"] == pytest.approx(0.1)
