"""The peer libraries in the benchmark (bench/peers.py): their targets judged on saved figures,
what a run says when a peer is absent, and -- where ``make bench-peers`` has built
``.venv-bench`` -- every peer case measured on 2 ranks, with no process of theirs left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bench import peers, run
from helpers.launch import REPO

pytestmark = pytest.mark.timeout(300)

BENCH_PY = REPO / ".venv-bench" / "bin" / "python"


def _row(group: str, case: str, kind: str = "save", ranks: int = 2, **figures: float) -> dict:
    return {"group": group, "case": case, "kind": kind, "ranks": ranks, "state_bytes": 1 << 29, "tensors": 3000,
            "blocked_s": 1.0, "durable_s": 1.0, "gbps": 1.0, "extra_rss_frac": 0.0, "hash_frac": 0.0, **figures}


def test_peer_targets_take_the_worst_state_and_rank_count() -> None:
    """T22-T25 are roll-ckpt / peer ratios of the same run; the worst state and rank count decides."""
    rows = []
    for g, ranks, scale in (("target", 2, 1.0), ("target-1", 1, 1.0), ("tensors", 2, 0.5), ("tensors-1", 1, 3.0)):
        rows += [_row(g, "rc_async", ranks=ranks, blocked_s=0.1, durable_s=1.0),
                 _row(g, "tc_async", ranks=ranks, blocked_s=0.2, durable_s=2.0, call_s=0.001),
                 _row(g, "bcp_async", ranks=ranks, blocked_s=1.0, durable_s=2.0),
                 _row(g, "rc_load", "load", ranks=ranks, durable_s=scale),
                 _row(g, "tc_load", "load", ranks=ranks, durable_s=1.0),
                 _row(g, "bcp_load", "load", ranks=ranks, durable_s=1.0)]
    tg = run.targets(rows, {})
    assert tg["T20"]["pass"] and tg["T20"]["value"] == pytest.approx(0.5)
    assert tg["T20"]["per_state"][0]["peer_call_s"] == 0.001  # its call's own time, reported beside
    assert tg["T21"]["value"] == pytest.approx(0.1) and tg["T22"]["value"] == pytest.approx(0.5)
    assert tg["T23"]["pass"] and len(tg["T23"]["per_state"]) == 4
    # the loads: 3x slower on 1 rank of the many-tensors state decides, whatever the others say
    assert not tg["T24"]["pass"] and tg["T24"]["value"] == pytest.approx(3.0)
    assert tg["T24"]["worst"] == {"group": "tensors-1", "ranks": 1, "state_mib": 512.0, "tensors": 3000}
    assert not any("open" in tg[k] for k in ("T20", "T24", "T25"))  # (no known open target left)


def test_a_peer_that_did_not_run_fails_its_targets_and_says_why() -> None:
    rows = [_row("target", "rc_async", blocked_s=0.1, durable_s=1.0), _row("target", "rc_load", "load", durable_s=1.0)]
    why = f"torch-checkpointing {peers.INSTALL_HINT}"
    tg = run.targets(rows, {}, {"peers": {"unavailable": {"tc_async": why, "tc_load": why}}})
    for k in ("T20", "T22", "T24"):
        assert tg[k]["value"] is None and not tg[k]["pass"] and tg[k]["not_run"] == why, k
    assert tg["T21"]["not_run"] and not tg["T21"]["pass"]


def test_a_peer_not_installed_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setattr(peers, "_version", lambda dist: None)
    for key, cls in peers.PEERS.items():
        why = cls().why_not()
        assert why and "make bench-peers" in why, key
    monkeypatch.setattr(peers, "_version", lambda dist: "0.0.0")
    assert "written against" in peers.TorchCheckpointing().why_not()
    described = peers.describe()
    assert set(described["peers"]) == {"tc", "bcp"} and any("NVRx" in k for k in described["cannot_run"])
    assert all(p["settings"] for p in described["peers"].values())


def _marked(mark: str) -> list[int]:
    """The processes whose environment carries ``mark``: everything the run started."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not BENCH_PY.exists(), reason="the peers' venv .venv-bench is not built (make bench-peers)")
def test_every_peer_case_runs_and_leaves_no_process(tmp_path: Path) -> None:
    """On 2 gloo ranks, a state of many small tensors: every peer case measured beside roll-ckpt's
    and DCP's, the kept memory of each save, and no writer process or gRPC server left behind."""
    out = tmp_path / "result.json"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"device": "cpu", "scratch": str(tmp_path / "scratch"), "groups": [
        {"name": "tensors", "tensors": 200, "reps": 1, "warmup": False, "cases": run.COMPARE_CASES}]}))
    mark = f"ROLL_CKPT_BENCH_PEERS_TEST={uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLL_CKPT_")}
    env.update(PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", ROLL_CKPT_QUIET="1", OMP_NUM_THREADS="1")
    env[mark.split("=")[0]] = mark.split("=")[1]
    cmd = [str(BENCH_PY), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "bench.worker",
           str(spec), str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group: torchrun and its workers
            proc.wait()
    left = []
    deadline = time.monotonic() + 10  # a process that is ending may still be there for a moment
    while time.monotonic() < deadline:
        left = [p for p in _marked(mark) if p != os.getpid()]
        if not left:
            break
        time.sleep(0.2)
    for pid in left:  # not to leave them to the next test: each ended by its pid
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    assert not left, f"processes left behind by the run: {left}"

    group = json.loads(out.read_text())["groups"][0]
    assert not group["unavailable"], group["unavailable"]
    assert set(group["cases"]) == set(run.COMPARE_CASES)
    rows = {name: run.summarise(group, name, case) for name, case in group["cases"].items()}
    for name in run.PEER_CASES:
        r = rows[name]
        assert r["durable_s"] > 0 and r["bytes"] > 0, name
        if r["kind"] == "save":
            assert r.get("kept") is not None, name
    tc = rows["tc_async"]
    assert tc["call_s"] <= tc["blocked_s"] <= tc["written_s"] <= tc["durable_s"]  # its stall counted to the lock
    assert rows["tc_async"]["kept_children"] > 0  # its writer process
    assert rows["bcp_async"]["kept_children"] > 0 and rows["bcp_save"]["kept_children"] > 0  # rank 0's gRPC server
    assert rows["tc_save"]["kept_children"] == 0
    assert not sys.modules.get("torch_checkpointing") and not sys.modules.get("bytecheckpoint")
