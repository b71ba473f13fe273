"""The benchmark harness runs end to end in its tiny mode and writes what it promises.

Checks the shape of ``latest.json`` (targets with value / limit / pass, every case
measured), the markdown table and the plot — not the speed, which only ``make bench``
on an idle machine can judge.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from bench import importcost, peers, run
from helpers.launch import REPO, TESTS, run_python

pytestmark = pytest.mark.timeout(300)  # shared 2-core machines: the smoke run took 200 s under load 13


def _lacking() -> dict[str, str]:
    """The cases this torch cannot run, asked of the seam as the benchmark asks it."""
    from roll_ckpt.runtime import torch_compat as tc

    out = {}
    for cases, probe in ((("dcp_async_stager",), lambda: tc.default_stager(False)), (("dcp_process",), tc.process_mode),
                         (("dcp_async_plancache", "scale:dcp", "scale:dcp_cached", "scale:rc_full"),
                          tc.caching_save_planner), (("scale:dcp_nocoord",), tc.without_collectives)):
        try:
            made = probe()
            getattr(made, "close", lambda: None)()  # the stager's thread pool
        except tc.TorchCompatError as exc:
            out.update({c: str(exc) for c in cases})
    return out


def test_smoke_run_writes_the_report(tmp_path: Path) -> None:
    """``python -m bench`` from another folder (the package on ``PYTHONPATH``, ``--out``
    relative to that folder): its torchrun workers and its scale run find the package too."""
    out = tmp_path / "results"
    proc = run_python(["-m", "bench", "--smoke", "--out", "results"], timeout=290, cwd=tmp_path, warm=True,
                      env={"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads((out / "latest.json").read_text())

    assert set(res["targets"]) == {f"T{i}" for i in (*range(1, 15), *range(20, 28))} | {"import"}
    for name, t in res["targets"].items():
        assert {"value", "limit", "pass"} <= set(t), name
        assert isinstance(t["pass"], bool) and isinstance(t["limit"], (int, float)), name
        assert t["value"] is None or isinstance(t["value"], (int, float)), name
    assert res["all_pass"] == all(t["pass"] for t in res["targets"].values()) and not res["invariants"]

    # what this torch lacks is not run, and said: each a DCP option of a newer release
    lacking = _lacking()
    assert res["unavailable"].keys() == lacking.keys(), res["unavailable"]
    assert all(why.startswith(f"torch {torch.__version__} has no") for why in res["unavailable"].values())
    assert all(f"`{case}`" in (out / "latest.md").read_text() for case in lacking)
    cases = {r["case"] for r in res["cases"]} | set(lacking)
    assert {"torch_save", "dcp_save", "dcp_async", "dcp_async_stager", "rc_save", "rc_async",
            "rc_async_zc_model", "rc_async_zc_all", "rc_dedup", "rc_dedup_cold", "dcp_async_hsdp", "dcp_load", "rc_load",
            "rc_load_stream", "rc_budget_0.1", "rc_budget_0.25", "rc_budget_0.5", "rc_budget_none"} <= cases
    for r in res["cases"]:
        for key in ("blocked_s", "durable_s", "extra_rss", "extra_rss_frac", "copied", "gbps"):
            assert key in r, (r["case"], key)
        assert r["durable_s"] > 0 and r["bytes"] > 0, r["case"]
    zc = next(r for r in res["cases"] if r["case"] == "rc_async_zc_all")
    # only what is not in the store is copied (AdamW step counters, RNG state)
    assert zc["copied"] < 0.05 * zc["state_bytes"] and zc["policies"].get("zero_copy", 0) > 0
    # loads say how many bytes they fetched from storage per checkpoint byte
    for name in ("rc_load", "rc_load_stream", "dcp_load"):
        r = next(r for r in res["cases"] if r["case"] == name)
        assert "read_per_byte" in r, name
    assert set(res["targets"]["T4"]["read_per_byte"]) == {"rc_load", "rc_load_stream", "dcp_load"}
    # the budgeted saves complete
    for name in ("rc_budget_0.1", "rc_budget_0.25", "rc_budget_0.5"):
        r = next(r for r in res["cases"] if r["case"] == name)
        assert r["bytes"] > 0 and r["durable_s"] > 0, name

    # T6: the training loop, every method, with and without a save
    loop = res["loop"]["methods"]
    # torch-checkpointing's async save joins the loop where it is installed (the torchtitan leg)
    peer = set() if peers.PEERS["tc"]().why_not() else {"tc_async"}
    expected = {"dcp_thread", "dcp_process", "rc_regular", "rc_zc", "rc_zc_nice0"} | peer
    assert set(loop) | set(lacking) == expected | set(lacking)
    assert set(loop).isdisjoint(lacking)
    for name, r in loop.items():
        assert r["durable_s"] > 0 and r["without_s"] > 0 and r["lost_s"] is not None, name
        if name != "tc_async":  # (measured beside the loop only, not alone: bench/loop.py)
            assert r["cpu_s_per_gb"] is not None and r["cpu_s_per_gb"] > 0, name  # T6: the save path's CPU
    assert set(res["targets"]["T6"]["cpu_s_per_gb"]) == set(loop)
    # T12-T14 come from bench.scale (its smoke run: simulated ranks, no real jobs)
    assert (out / "scale.json").exists() and (out / "scale.md").exists()
    if "scale:dcp" not in lacking:  # both compare with DCP's simulated protocol
        assert res["targets"]["T13"]["value"] is not None and res["targets"]["T12"]["value"] is not None
    # T7: the tensor-count sweep, every method at every point
    points = res["many"]["points"]
    assert len(points) >= 2 and points[0]["tensors"] < points[-1]["tensors"]
    for pt in points:
        assert set(pt["methods"]) | set(lacking) == \
            {"dcp_async", "dcp_async_plancache", "rc_async", "rc_async_zc_all"} | set(lacking)
        assert all(m["blocked_s"] > 0 for m in pt["methods"].values())
    assert res["targets"]["T7"]["tensors"] == points[-1]["tensors"]  # no point >= 2,000 in the smoke run
    assert res["hash"]["file_hasher_gbps"] > 0
    # T10/T11: the Hugging Face Llama on FSDP2, every method
    tr = res["transformer"]
    assert set(tr["methods"]) == {"dcp_save", "rc_sync", "dcp_thread", "rc_regular", "rc_zc"} | peer
    assert tr["tensors"] > 20 and tr["k"]["rc_sync"] == 0 and tr["k"]["rc_zc"] >= 1
    for name, r in tr["methods"].items():
        assert r["durable_s"] > 0 and r["us_per_tensor"] > 0 and r["lost_s"] is not None, name
    assert set(res["targets"]["T10"]["us_per_tensor"]) == set(tr["methods"])

    lim = res["limits"]
    assert lim["disk_write_gbps"] > 0 and lim["disk_read_gbps"] > 0 and lim["memcpy_gbps"] > 0
    assert lim["disk_write_direct_gbps"] > 0

    md = (out / "latest.md").read_text()
    assert "| T1 |" in md and "rc_async_zc_all" in md and "Machine:" in md
    assert "## T6" in md and "## T7" in md and "| T9 |" in md and "Hash cost" in md
    assert "## T10/T11" in md and "| T11 |" in md
    imp = res["targets"]["import"]  # a fresh interpreter each time, though this run was forked warm
    assert imp["pass"] and imp["torch"] is False and len(imp["runs_s"]) == res["import"]["runs"], imp
    assert "| import |" in md and "no numpy, no torch.distributed" in md
    assert (out / "latest.png").stat().st_size > 10_000
    assert (out / "tensors.png").stat().st_size > 10_000
    assert not list(out.glob(".scratch-*")), "the scratch checkpoints are removed"


def test_check_flag_reports_failures_in_the_exit_status(tmp_path: Path) -> None:
    """``--check`` turns a failed target into exit status 1 (judged on a saved result)."""
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


def test_targets_six_to_nine_from_saved_figures() -> None:
    """T6–T9 are ratios of figures measured in the same run (T6: the save path's CPU per GB; T7: the
    median of at least 3 runs)."""

    def row(group: str, case: str, blocked: float, rss: float) -> dict:
        return {"group": group, "case": case, "kind": "save", "blocked_s": blocked, "durable_s": 1.0, "bytes": 1,
                "extra_rss_frac": rss, "gbps": 1.0, "hash_frac": 0.0, "state_bytes": 1 << 29}

    rows = [row("target", "rc_budget_0.25", 0.2, 0.28), row("small", "rc_dedup", 0.01, 1.05),
            row("small", "dcp_async_hsdp", 0.1, 1.0)]
    def cpu(per_gb: float) -> dict:
        return {"cpu_s_per_gb": per_gb, "raw_cpu_s_per_gb": [per_gb] * 3}

    loop = {"methods": {"dcp_thread": {"lost_s": 1.0, **cpu(2.0)}, "rc_zc": {"lost_s": 0.5, **cpu(0.8)},
                        "rc_regular": {"lost_s": 0.7, **cpu(1.4)}, "dcp_process": {"lost_s": 0.9, **cpu(2.4)}}}

    def blk(runs: list[float]) -> dict:
        return {"blocked_s": sorted(runs)[len(runs) // 2], "raw_blocked_s": runs}

    many = {"points": [{"tensors": 1000, "methods": {}},
                       {"tensors": 3000, "methods": {"dcp_async": blk([1.0, 1.0, 1.0]),
                                                     "rc_async": blk([0.4, 0.4, 0.4]),
                                                     "rc_async_zc_all": blk([0.02, 0.02, 0.02]),
                                                     "dcp_async_plancache": {"blocked_s": 0.8}}}]}
    tg = run.targets(rows, {}, {"loop": loop, "many": many})
    assert tg["T6"]["pass"] and tg["T6"]["value"] == pytest.approx(0.4)  # CPU per GB, zero-copy / DCP thread
    assert tg["T6"]["regular"] == pytest.approx(0.7) and tg["T6"]["process_mode"] == pytest.approx(1.2)
    assert tg["T6"]["loop_lost"]["value"] == pytest.approx(0.5)  # the former T6, reported
    assert tg["T7"]["pass"] and tg["T7"]["tensors"] == 3000 and tg["T7"]["value"] == pytest.approx(0.02)
    assert tg["T7"]["runs"] == 3
    assert tg["T8"]["pass"] and tg["T9"]["pass"] and tg["T9"]["value"] == pytest.approx(0.1)

    loop["methods"]["rc_zc"].update(cpu(1.2))  # 0.6x DCP's CPU per GB: over the limit
    many["points"][1]["methods"]["rc_async_zc_all"] = blk([0.03, 0.03, 0.03])  # > 25 ms
    rows[1]["extra_rss_frac"] = 2.0
    tg = run.targets(rows, {}, {"loop": loop, "many": many})
    assert tg["T6"]["value"] == pytest.approx(0.6) and not tg["T6"]["pass"]
    assert not tg["T7"]["pass"] and not tg["T9"]["pass"]

    # T7 is judged on the median of >= 3 runs' ratios: one slow run does not decide it, 2 runs do not pass
    many["points"][1]["methods"]["rc_async_zc_all"] = blk([0.02, 0.2, 0.015])
    tg = run.targets(rows, {}, {"loop": loop, "many": many})
    assert tg["T7"]["value"] == pytest.approx(0.02) and tg["T7"]["pass"]
    for m in ("dcp_async", "rc_async", "rc_async_zc_all"):
        many["points"][1]["methods"][m]["raw_blocked_s"] = many["points"][1]["methods"][m]["raw_blocked_s"][:2]
    assert not run.targets(rows, {}, {"loop": loop, "many": many})["T7"]["pass"]
    del loop["methods"]["dcp_thread"]  # no DCP figure: no ratio, no pass
    tg = run.targets(rows, {}, {"loop": loop, "many": many})
    assert tg["T6"]["value"] is None and not tg["T6"]["pass"]


def test_targets_ten_and_eleven_from_saved_figures() -> None:
    """T10: sync save time against dcp.save's; T11: the loop's loss against DCP's, with regular <= 1x."""
    tr = {"tensors": 2000, "methods": {
        "dcp_save": {"durable_s": 2.0, "lost_s": 2.0, "us_per_tensor": 1000.0},
        "rc_sync": {"durable_s": 0.4, "lost_s": 0.4, "us_per_tensor": 200.0},
        "dcp_thread": {"durable_s": 2.0, "lost_s": 1.0}, "rc_regular": {"durable_s": 0.5, "lost_s": 0.9},
        "rc_zc": {"durable_s": 0.5, "lost_s": 0.2}}}
    tg = run.targets([], {}, {"transformer": tr})
    assert tg["T10"]["pass"] and tg["T10"]["value"] == pytest.approx(0.2)
    assert tg["T11"]["pass"] and tg["T11"]["value"] == pytest.approx(0.2) and tg["T11"]["regular"] == pytest.approx(0.9)
    tr["methods"]["rc_regular"]["lost_s"] = 1.5  # regular staging loses more than DCP
    tr["methods"]["rc_sync"]["durable_s"] = 1.5
    tg = run.targets([], {}, {"transformer": tr})
    assert not tg["T10"]["pass"] and not tg["T11"]["pass"]


def test_t4_is_the_share_of_the_disks_read_bandwidth() -> None:
    """T4: roll-ckpt's resume GB/s / the uncached read GB/s with as many readers as ranks (>= 0.9);
    dcp.load's figures beside it."""

    def load(case: str, gbps: float) -> dict:
        return {"group": "target", "case": case, "kind": "load", "gbps": gbps, "ranks": 2, "blocked_s": 1.0}

    rows = [load("rc_load", 0.95), load("dcp_load", 0.8)]
    tg = run.targets(rows, {"disk_read_gbps": 2.0, "disk_read2_gbps": 1.0})
    assert tg["T4"]["pass"] and tg["T4"]["value"] == pytest.approx(0.95) and tg["T4"]["readers"] == 2
    assert tg["T4"]["dcp_vs_disk_read"] == pytest.approx(0.8) and tg["T4"]["vs_dcp"] == pytest.approx(0.95 / 0.8)
    rows[0]["gbps"] = 0.85
    assert not run.targets(rows, {"disk_read_gbps": 2.0, "disk_read2_gbps": 1.0})["T4"]["pass"]


def test_import_time_is_measured_in_a_fresh_interpreter_and_fails_on_a_heavy_import(monkeypatch) -> None:
    """The row ``import``: ``import roll_ckpt`` timed in new interpreters; numpy or
    torch.distributed in ``sys.modules`` after it fails the row, whatever the time."""
    got = importcost.measure(runs=2)
    assert got["error"] is None and len(got["runs_s"]) == 2 and got["median_s"] > 0, got
    row = run.targets([], {}, {"import": got})["import"]
    assert row["pass"] and row["value"] == got["median_s"] and row["limit"] == importcost.LIMIT_S
    assert not run.targets([], {})["import"]["pass"]  # not measured: no pass

    monkeypatch.setattr(importcost, "CODE", "import numpy\n" + importcost.CODE)
    heavy = importcost.measure(runs=1)
    assert "numpy" in heavy["error"] and heavy["median_s"] is None, heavy
    row = importcost.target(heavy)
    assert not row["pass"] and row["value"] is None and "numpy" in row["error"]
