"""roll-ckpt benchmark: stall, memory and throughput against DCP, torch.save, the peer libraries and the disk.

    python -m bench [--smoke|--quick|--full] [--check] [--device cpu|cuda] [--out DIR]   (or python -m bench.run)

Everything is measured in one run, side by side: the machine's limits (durable write,
uncached read, memcpy) are cases of the same alternation as the checkpoint cases. Each
case runs ``reps`` times on the same FSDP2 + AdamW state, in alternating order; the
report shows medians. Two more groups run on 1 rank: ``loop`` (T6: the CPU seconds per GB
of each async save alone, children included, and a CPU-bound training loop's time lost per
async save, :mod:`bench.loop`) and ``many`` (T7: blocked time against the number of tensors,
:mod:`bench.many`). The group ``torchtitan`` (not run by default: ``--groups torchtitan``) runs
:mod:`bench.torchtitan` (T18: torchtitan's own checkpoint manager, ``async_mode: async``,
against roll-ckpt's), writing DIR/torchtitan.{json,md}; the group ``verl`` (not run by default:
``--groups verl``, in the verl leg's interpreter) runs :mod:`bench.verl` (T19: verl's own manager
against roll-ckpt-verl's on verl's FSDP2 engine), writing DIR/verl.{json,md}. The group ``scale`` runs :mod:`bench.scale` (T12-T14: DCP's and roll-ckpt's
coordination simulated for N ranks, and real gloo jobs counting storage operations), which
writes DIR/scale.{json,md,png}. Writes DIR/latest.json, DIR/latest.md, DIR/latest.png and
DIR/tensors.png (default DIR: bench/results). Every run also times ``import roll_ckpt`` in fresh
interpreters (:mod:`bench.importcost`: the row ``import``, which also fails when that import
brings in numpy or torch.distributed). ``--check`` exits 1 when a target fails.

The peer libraries a user would pick instead (:mod:`bench.peers`: torch-checkpointing,
ByteCheckpoint) are cases of the same alternation on the same states: the target state on
2 ranks (with every other case) and on 1, and the group ``tensors`` (3,000 small tensors) on
both; T20-T25 are roll-ckpt / peer ratios (blocked, durable, resume), the worst state and rank
count deciding. Every save case also reports the host memory it keeps between saves.
``make bench`` runs in ``.venv-bench`` (``make bench-peers``), where the peers are installed;
elsewhere their cases are listed as not run, and T20-T25 fail.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import importcost, peers
from .common import median, writer_digest
from .launch import RESULTS, ROOT, child_env, module, torchrun
from .scale_limits import OPS_LIMIT, T12_LIMIT, T13_LIMIT

MB = 1 << 20

# The cases of each group; the limits run inside the alternation of the "target" group.
LIMITS = ["limit_write", "limit_write2", "limit_write_direct", "limit_read", "limit_read2", "limit_memcpy", "limit_memcpy_fresh"]
# The peer libraries' cases (bench/peers.py; torch-checkpointing, ByteCheckpoint).
PEER_CASES = ["tc_save", "tc_async", "tc_load", "bcp_save", "bcp_async", "bcp_load"]
# Loads sit between saves, never next to each other: a load right after another one ran
# measurably slower here (whichever came second), and the alternation would then favour
# one of them.
TARGET_CASES = ["dcp_async", "rc_load", "rc_async_zc_all", "tc_async", "dcp_load", "dcp_save", "tc_load", "rc_save",
                "rc_async_keep", "bcp_load", "bcp_async", "rc_load_stream", "rc_async", "rc_save_t1", "tc_save",
                "rc_async_cold", "bcp_save"]
# roll-ckpt, DCP and the peers on the same state: the 1-rank run of the target state and
# both runs of the many-tensors state (T20-T25).
COMPARE_CASES = ["dcp_async", "rc_load", "rc_async", "tc_async", "dcp_load", "rc_async_zc_all", "bcp_async",
                 "tc_load", "rc_save", "rc_async_keep", "dcp_save", "bcp_load", "tc_save", "rc_async_cold", "bcp_save"]
PEER_GROUPS = ["target", "target-1", "tensors", "tensors-1", "moe", "moe-1"]
"""The groups the peers run in (a group on 1 rank is reported as ``<name>-1``)."""
# The resumes alone, on the MoE-shaped state (``moe``: 30,000 tensors, as a model whose experts
# are unfused into tensors of their own has): T24/T25 take its worst ratio too.
LOAD_CASES = ["rc_load", "tc_load", "dcp_load", "bcp_load"]
# T8: regular staging within a budget (x the rank's state), cold staging buffers.
BUDGET_CASES = ["rc_budget_0.1", "rc_budget_0.25", "rc_budget_0.5", "rc_budget_none"]
ALL_CASES = ["torch_save", "rc_load", "dcp_save", "dcp_async", "dcp_async_stager", "rc_save", "dcp_load",
             "rc_async", "rc_async_zc_model", "rc_async_zc_all", "dcp_async_hsdp", "rc_dedup", "rc_dedup_cold"]

# T10/T11, the user's shape: a transformers LlamaForCausalLM with 64 decoder layers (2,316
# tensors and 78 MiB per rank with AdamW on 2 ranks), each layer its own FSDP2 unit.
TRANSFORMER = {"layers": 64, "hidden": 128, "intermediate": 344, "vocab": 4096, "reps": 3, "window_s": 1.5}

# width x depth of Linear(width, width, bias=False) layers; with AdamW the state is 3 x params.
MODES: dict[str, dict[str, Any]] = {
    # T1/T2 need >= 512 MiB in the store: 11 x 2048^2 x 4 B x 3 = 528 MiB over 2 ranks.
    # 4 repetitions: with the order reversed every other one, each case runs as often
    # before as after its neighbours.
    # loop (T6): Linear(width, width) x depth + AdamW on 1 rank, ~100 MiB in 512 tensors;
    # many (T7): tensor counts of the sweep.
    # tensors: the many-tensors state (bench.many.build) the peers are compared on too.
    "quick": {"reps": 4, "target": (2048, 11), "small": (2048, 2), "warmup": False, "tensors": 3000,
              "loop": {"width": 368, "depth": 64, "reps": 4, "window_s": 1.5},
              "many": {"points": [100, 1000, 3000], "reps": 3},
              "transformer": TRANSFORMER},
    "full": {"reps": 6, "target": (4096, 11), "small": (2048, 11), "warmup": True, "tensors": 3000, "moe": 30000,
             "loop": {"width": 368, "depth": 64, "reps": 5, "window_s": 2.0},
             "many": {"points": [100, 1000, 3000, 10000], "reps": 5},
             "transformer": {**TRANSFORMER, "reps": 5}},
    # Every case once, in one 2-rank group: checks the harness end to end, not the speed
    # (a fixed K of 2 steps for the loop and transformer groups, 1 torch thread a rank in the loop).
    "smoke": {"reps": 1, "target": (256, 2), "small": (256, 2), "warmup": False, "one_group": True, "tensors": 200,
              "ranks": "2", "loop": {"width": 64, "depth": 4, "reps": 1, "steps": 2, "threads": 1, "cpu_reps": 1},
              "many": {"points": [100, 300], "reps": 1},
              "transformer": {**TRANSFORMER, "layers": 2, "reps": 1, "steps": 2}},
}


def machine(scratch: str, device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "host": platform.node(), "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch.__version__, "cpus": os.cpu_count(), "device": device,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        import psutil

        info["ram_gib"] = round(psutil.virtual_memory().total / (1 << 30), 1)
    except ImportError:
        pass
    try:
        out = subprocess.run(["df", "-T", "-h", scratch], capture_output=True, text=True).stdout.splitlines()[-1].split()
        info["disk"] = f"{out[0]} ({out[1]}, {out[2]})"
    except (OSError, IndexError):
        pass
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    try:
        info["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    except OSError:
        pass
    return info


def run_worker(nproc: int, spec: dict[str, Any], workdir: str, timeout: float) -> dict[str, Any]:
    spec_path = os.path.join(workdir, f"spec-{nproc}.json")
    out_path = os.path.join(workdir, f"result-{nproc}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = torchrun(nproc, "worker", spec_path, out_path)
    env = child_env(ROLL_CKPT_QUIET="1", PYTHONWARNINGS="ignore")
    log_path = os.path.join(workdir, f"worker-{nproc}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        tail: list[str] = []
        assert proc.stderr is not None
        deadline = time.monotonic() + timeout
        for line in proc.stderr:  # progress lines are shown as they come
            if line.startswith("[worker"):
                print(line.rstrip(), flush=True)
            else:
                tail = (tail + [line])[-200:]
            if time.monotonic() > deadline:
                proc.kill()
        rc = proc.wait()
    if rc != 0 or not os.path.exists(out_path):
        with open(log_path) as f:
            sys.stderr.write(f.read()[-4000:])
        sys.stderr.write("".join(tail)[-8000:])
        raise SystemExit(f"benchmark worker on {nproc} rank(s) failed (exit {rc})")
    with open(out_path) as f:
        return json.load(f)


def run_scale(mode: str, out: str, no_plot: bool = False, timeout: float = 1800) -> dict[str, Any]:
    """The group ``scale``: :mod:`bench.scale` in a process of its own, writing
    OUT/scale.{json,md,png}; its targets (T12-T14) and where it wrote them. The smoke run
    skips its real jobs (``tests/bench/test_scale_smoke.py`` runs them)."""
    path = os.path.join(out, "scale.json")
    cmd = module("scale", f"--{mode}", "--out", path)
    if mode == "smoke":
        cmd.append("--no-jobs")
    if no_plot:
        cmd.append("--no-plot")
    print(f"[bench] {mode}: scale ({' '.join(cmd[1:])})", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=child_env(PYTHONWARNINGS="ignore"))
    except subprocess.TimeoutExpired:
        return {"error": f"bench.scale timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not os.path.exists(path):
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        return {"error": f"bench.scale failed (exit {proc.returncode})"}
    for line in proc.stdout.splitlines():
        if line.startswith("[scale"):
            print(line, flush=True)
    with open(path) as f:
        res = json.load(f)
    return {"targets": res.get("targets", {}), "file": path, "duration_s": res.get("duration_s"),
            "rc_source": res.get("rc_source"), "unavailable": res.get("unavailable", {})}


def run_verl(mode: str, out: str, timeout: float = 2400) -> dict[str, Any]:
    """The group ``verl``: :mod:`bench.verl` in a process of its own (verl's own manager against
    roll-ckpt-verl's on verl's FSDP2 engine, T19), writing OUT/verl.{json,md}; what it found."""
    path = os.path.join(out, "verl.json")
    cmd = module("verl", "--smoke" if mode == "smoke" else "--quick", "--out", out)
    print(f"[bench] {mode}: verl ({' '.join(cmd[1:])})", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=child_env(PYTHONWARNINGS="ignore"))
    except subprocess.TimeoutExpired:
        return {"error": f"bench.verl timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not os.path.exists(path):
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        return {"error": f"bench.verl failed (exit {proc.returncode})"}
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- summarising


def summarise(group: dict[str, Any], name: str, case: dict[str, Any]) -> dict[str, Any]:
    reps = case["reps"]
    row: dict[str, Any] = {"group": group["name"], "ranks": group["world_size"], "case": name,
                           "title": case["title"], "kind": case["kind"], "reps": len(reps)}
    if case["kind"] == "limit":
        rates = [r["ranks"][0]["rate"] for r in reps]
        row.update(gbps=median(rates) / 1e9, method=reps[0]["ranks"][0].get("method", ""),
                   bytes=reps[0]["ranks"][0].get("nbytes", 0), raw_gbps=[x / 1e9 for x in rates])
        return row
    per_rep = []
    for r in reps:
        ranks = r["ranks"]
        blocked = max(x["blocked_s"] for x in ranks)
        durable = max(x["durable_s"] for x in ranks)
        frac = max(x["extra_rss"] / x["state_bytes"] if x["state_bytes"] else 0.0 for x in ranks)
        # The writer threads hash at the same time: their summed hashing seconds / threads is
        # what hashing can take of the save's wall time.
        hash_frac = max((x.get("hash_s") or 0.0) / (x.get("threads") or 1) / x["durable_s"] if x["durable_s"] else 0.0
                        for x in ranks)
        staged = [x["staged_s"] for x in ranks if x.get("staged_s") is not None]
        call = [x["call_s"] for x in ranks if x.get("call_s") is not None]
        written = [x["written_s"] for x in ranks if x.get("written_s") is not None]
        read = [x["read_bytes"] for x in ranks if x.get("read_bytes") is not None]
        per_rep.append({
            "blocked_s": blocked, "durable_s": durable, "bytes": r["bytes"],
            "gbps": r["bytes"] / durable / 1e9 if durable else None,
            "extra_rss": max(x["extra_rss"] for x in ranks), "extra_rss_frac": frac,
            "copied": sum(x.get("copied") or 0 for x in ranks), "hash_frac": hash_frac,
            "staged_s": max(staged) if staged else None,
            "call_s": max(call) if call else None, "written_s": max(written) if written else None,
            "policies": ranks[0].get("policies"),
            # bytes fetched from storage (all ranks) per byte of the checkpoint: 1.0 = one pass
            "read_per_byte": sum(read) / r["bytes"] if read and r["bytes"] else None,
        })
    for key in ("blocked_s", "durable_s", "bytes", "gbps", "extra_rss", "extra_rss_frac", "copied", "hash_frac",
                "staged_s", "call_s", "written_s", "read_per_byte"):
        row[key] = median([p[key] for p in per_rep])
    row["state_bytes"] = sum(x["state_bytes"] for x in reps[0]["ranks"])
    row["tensors"] = group.get("tensors")
    if case.get("kept"):  # host memory kept between saves (max over ranks; child processes' USS included)
        row["kept"] = max(k["rss"] + k["children"] for k in case["kept"])
        row["kept_children"] = max(k["children"] for k in case["kept"])
        row["kept_frac"] = max((k["rss"] + k["children"]) / x["state_bytes"] if x["state_bytes"] else 0.0
                               for k, x in zip(case["kept"], reps[0]["ranks"]))
    row["policies"] = per_rep[0]["policies"]
    row["raw"] = per_rep
    return row


def _lost(x: dict[str, Any]) -> float:
    """The window with the save minus K times the median step of the window without it: a
    step slowed by something else in the window without the save (another job on the
    cores) does not count against the save, as it would in a difference of the two sums
    (reported as ``lost_sum_s``)."""
    steps = x["without"].get("step_times")
    if not steps:
        return x["with"]["wall_s"] - x["without"]["wall_s"]
    return x["with"]["wall_s"] - len(steps) * median(steps)


def summarise_loop(group: dict[str, Any]) -> dict[str, Any]:
    """T6: per method, the medians of (window with the save) - (window without), max over ranks."""
    out: dict[str, Any] = {"tensors": group["tensors"], "state_bytes": group["state_bytes"], "k": group["k"],
                           "step_s": group["step_s"], "threads": group["threads"], "ranks": group["world_size"],
                           "methods": {}, "unavailable": group.get("unavailable") or {}}
    for meth, reps in group["methods"].items():
        per = []
        for ranks in reps:
            per.append({
                "lost_s": max(_lost(x) for x in ranks),
                "lost_sum_s": max(x["with"]["wall_s"] - x["without"]["wall_s"] for x in ranks),
                "cpu_s": max(x["with"]["cpu_s"] - x["without"]["cpu_s"] for x in ranks),
                "blocked_s": max(x["with"]["blocked_s"] for x in ranks),
                "durable_s": max(x["with"]["durable_s"] for x in ranks),
                "without_s": max(x["without"]["wall_s"] for x in ranks),
                # the save ended after the K steps: the window then includes waiting for it
                "tail_s": max(max(0.0, x["with"]["wall_s"] - x["with"]["steps_s"]) for x in ranks),
                "window_s": max(x["with"]["wall_s"] for x in ranks),
            })
        row = {k: median([p[k] for p in per]) for k in per[0]}
        row.update(title=group["titles"].get(meth, meth), reps=len(per), raw=per)
        out["methods"][meth] = row
    # T6: CPU seconds of the whole save path per GB, each save alone (max over ranks, medians)
    for meth, reps in (group.get("save_cpu") or {}).items():
        per_gb = [max(x["cpu_s_per_gb"] for x in ranks if x.get("cpu_s_per_gb") is not None) for ranks in reps]
        if meth in out["methods"]:
            out["methods"][meth].update(
                cpu_s_per_gb=median(per_gb), raw_cpu_s_per_gb=per_gb,
                save_cpu_s=median([max(x["cpu_s"] for x in ranks) for ranks in reps]),
                save_wall_s=median([max(x["wall_s"] for x in ranks) for ranks in reps]))
    return out


def summarise_transformer(group: dict[str, Any]) -> dict[str, Any]:
    """T10/T11: the loop's summary (lost, blocked, durable, CPU per method) and each save's
    time per tensor."""
    out = summarise_loop(group)
    out["model"] = group["model"]
    for row in out["methods"].values():
        row["us_per_tensor"] = row["durable_s"] / group["tensors"] * 1e6
    return out


def summarise_many(group: dict[str, Any]) -> dict[str, Any]:
    """T7: per point of the sweep and method, median blocked / durable seconds (max over ranks)."""
    points = []
    for pt in group["points"]:
        ms: dict[str, Any] = {}
        for meth, reps in pt["methods"].items():
            per = [{"blocked_s": max(x["blocked_s"] for x in ranks), "durable_s": max(x["durable_s"] for x in ranks),
                    "get_state_dict_s": max((x.get("get_state_dict_s") or 0.0) for x in ranks) or None}
                   for ranks in reps]
            ms[meth] = {k: median([p[k] for p in per]) for k in per[0]}
            ms[meth]["raw_blocked_s"] = [p["blocked_s"] for p in per]
        points.append({"tensors": pt["tensors"], "state_bytes": pt["state_bytes"], "methods": ms})
    return {"ranks": group["world_size"], "titles": group["titles"], "points": points}


def hash_cost(nbytes: int = 64 << 20) -> dict[str, Any]:
    """Seconds of the hashing of roll-ckpt's writer (whole-file + per-8-MiB-piece xxh3-128,
    :func:`bench.common.writer_digest`) on 64 MiB (the keys keep their ``file_hasher`` names)."""
    import numpy as np
    import xxhash

    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    best: dict[str, float] = {}
    for _ in range(3):
        t0 = time.perf_counter()
        writer_digest(memoryview(data))
        t1 = time.perf_counter()
        xxhash.xxh3_128(memoryview(data)).hexdigest()
        t2 = time.perf_counter()
        best["file_hasher_s"] = min(best.get("file_hasher_s", 1e9), t1 - t0)
        best["xxh3_s"] = min(best.get("xxh3_s", 1e9), t2 - t1)
    return {"bytes": nbytes, **best, "file_hasher_gbps": nbytes / best["file_hasher_s"] / 1e9,
            "xxh3_gbps": nbytes / best["xxh3_s"] / 1e9}


def cgroup_memory() -> tuple[bool, str]:
    """Can this process make a memory-limited cgroup v2 (for a load larger than the page cache)?"""
    root = "/sys/fs/cgroup"
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = {ln.split()[4]: ln.split(" - ")[1].split()[0] for ln in f}
    except OSError as e:
        return False, f"cannot read /proc/self/mountinfo ({e})"
    if mounts.get(root) != "cgroup2":
        v2 = [p for p, t in mounts.items() if t == "cgroup2"]
        where = f"cgroup v2 only at {v2[0]}" if v2 else "no cgroup v2 mounted"
        ctl = ""
        if v2:
            try:
                with open(os.path.join(v2[0], "cgroup.controllers")) as f:
                    ctl = f.read().split()
            except OSError:
                ctl = []
            ctl = f" with controllers {ctl or 'none'}"
        return False, (f"{root} is not cgroup v2 ({mounts.get(root, 'not mounted')}; {where}{ctl}): no memory "
                       "controller to limit the page cache, and a state larger than free RAM does not fit")
    try:
        with open(os.path.join(root, "cgroup.controllers")) as f:
            if "memory" not in f.read().split():
                return False, "cgroup v2 has no memory controller"
    except OSError as e:
        return False, f"cgroup v2 not readable ({e})"
    if not os.access(root, os.W_OK):
        return False, "cgroup v2 is mounted read-only for this user"
    return False, "cgroup v2 memory controller present, but the case is not implemented yet"


def find(rows: list[dict[str, Any]], group: str, case: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["group"] == group and r["case"] == case), None)


def find_case(rows: list[dict[str, Any]], case: str, groups: tuple[str, ...] = ("target", "small")) -> dict[str, Any] | None:
    """The case in the first of ``groups`` that has it (the smoke run has only "target")."""
    for g in groups:
        r = find(rows, g, case)
        if r is not None:
            return r
    return None


def targets(rows: list[dict[str, Any]], limits: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    g = "target"
    extra = extra or {}
    zc, da = find(rows, g, "rc_async_zc_all"), find(rows, g, "dcp_async")
    rs, ds = find(rows, g, "rc_save"), find(rows, g, "dcp_save")
    rl, dl = find(rows, g, "rc_load"), find(rows, g, "dcp_load")
    rls = find(rows, g, "rc_load_stream")
    out: dict[str, Any] = {}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def entry(value: float | None, limit: float, le: bool, what: str, **more: Any) -> dict[str, Any]:
        ok = value is not None and (value <= limit if le else value >= limit)
        return {"value": value, "limit": limit, "pass": bool(ok), "op": "<=" if le else ">=", "what": what, **more}

    out["T1"] = entry(ratio(zc and zc["blocked_s"], da and da["blocked_s"]), 0.10, True,
                      "blocking time: zero-copy async save (model + AdamW in the store) / dcp.async_save default staging",
                      ours_s=zc and zc["blocked_s"], dcp_s=da and da["blocked_s"],
                      state_mib=zc and zc["state_bytes"] / MB)
    out["T2"] = entry(zc and zc["extra_rss_frac"], 0.05, True,
                      "extra peak RSS during that save / the rank's checkpointed bytes (max over ranks)",
                      dcp_async_default=da and da["extra_rss_frac"])
    disk = max(filter(None, [limits.get("disk_write_gbps"), limits.get("disk_write2_gbps")]), default=None)
    v_disk = ratio(rs and rs["gbps"], disk)
    v_dcp = ratio(rs and rs["gbps"], ds and ds["gbps"])
    t3 = entry(v_disk, 0.8, False, "durable write GB/s of roll-ckpt sync save / best fdatasync write GB/s "
               "(1 or 2 files at once, through the page cache); and / dcp.save default",
               ours_gbps=rs and rs["gbps"], disk_gbps=disk, dcp_gbps=ds and ds["gbps"],
               vs_direct=ratio(rs and rs["gbps"], limits.get("disk_write_direct_gbps")),
               vs_dcp={"value": v_dcp, "limit": 1.0, "pass": v_dcp is not None and v_dcp >= 1.0})
    t3["pass"] = t3["pass"] and t3["vs_dcp"]["pass"]
    out["T3"] = t3
    # T4: the resume's share of the disk's uncached read bandwidth for as many readers as ranks
    # (limit_read: 1 file; limit_read2: 2 files at once)
    readers = (rl or {}).get("ranks") or 2
    read = limits.get("disk_read_gbps") if readers == 1 else limits.get("disk_read2_gbps") or limits.get("disk_read_gbps")
    out["T4"] = entry(ratio(rl and rl["gbps"], read), 0.9, False,
                      f"load GB/s of roll-ckpt resume (default: every file verified before any byte is used) / the "
                      f"disk's uncached read GB/s with {readers} reader(s) at once (cold cache)",
                      ours_gbps=rl and rl["gbps"], dcp_gbps=dl and dl["gbps"], disk_read_gbps=read, readers=readers,
                      vs_dcp=ratio(rl and rl["gbps"], dl and dl["gbps"]),
                      dcp_vs_disk_read=ratio(dl and dl["gbps"], read),
                      vs_disk_read=ratio(rl and rl["gbps"], read),
                      stream={"value": ratio(rls and rls["gbps"], read), "gbps": rls and rls["gbps"],
                              "vs_dcp": ratio(rls and rls["gbps"], dl and dl["gbps"]),
                              "what": "rc_load_stream (verify_before_load: false, one pass) / the disk's read GB/s"},
                      read_per_byte={"rc_load": rl and rl.get("read_per_byte"),
                                     "rc_load_stream": rls and rls.get("read_per_byte"),
                                     "dcp_load": dl and dl.get("read_per_byte")})
    out["T5"] = entry(rs and rs["hash_frac"], 0.25, True,
                      "seconds spent hashing (xxh3-128, while writing; summed over the writer threads / their number) / "
                      "seconds of the sync save (max over ranks)")

    # T6: CPU seconds the whole save path spends per GB (this process's threads and its
    # children, each save alone until durable), roll-ckpt / dcp.async_save (thread mode)
    lp = (extra.get("loop") or {}).get("methods", {})

    def lost(m: str) -> float | None:
        return (lp.get(m) or {}).get("lost_s")

    def cpu(m: str) -> float | None:
        return (lp.get(m) or {}).get("cpu_s_per_gb")

    dcp_cpu = cpu("dcp_thread")
    out["T6"] = entry(ratio(cpu("rc_zc"), dcp_cpu), 0.5, True,
                      "CPU seconds per GB of the whole save path (calling thread, writer threads, child processes: "
                      "DCP's process-mode checkpointer counted), an async save alone until durable: roll-ckpt "
                      "zero-copy / dcp.async_save thread mode",
                      cpu_s_per_gb={m: cpu(m) for m in lp}, regular=ratio(cpu("rc_regular"), dcp_cpu),
                      process_mode=ratio(cpu("dcp_process"), dcp_cpu), zc_nice0=ratio(cpu("rc_zc_nice0"), dcp_cpu),
                      runs=min((len((lp.get(m) or {}).get("raw_cpu_s_per_gb") or []) for m in ("rc_zc", "dcp_thread")),
                               default=0),
                      lost_s={m: lost(m) for m in lp},
                      loop_lost={"value": ratio(lost("rc_zc"), lost("dcp_thread") if (lost("dcp_thread") or 0) > 0
                                                else None),
                                 "what": "the former T6: loop time lost per async save, zero-copy / dcp thread mode "
                                         "(reported, not the target)"})

    # T7: many tensors, at the first point of the sweep with >= 2,000 tensors (else the largest)
    pts = (extra.get("many") or {}).get("points", [])
    pt = next((p for p in pts if p["tensors"] >= 2000), pts[-1] if pts else None)
    ms = pt["methods"] if pt else {}

    def blk(m: str) -> float | None:
        return (ms.get(m) or {}).get("blocked_s")

    zc7, reg7, dcp7, pc7 = blk("rc_async_zc_all"), blk("rc_async"), blk("dcp_async"), blk("dcp_async_plancache")

    def raw(m: str) -> list[float]:
        return list((ms.get(m) or {}).get("raw_blocked_s") or [])

    def per_run(a: str, b: str) -> float | None:
        """The median over runs of each run's own ratio (runs paired by repetition)."""
        xs, ys = raw(a), raw(b)
        pairs = [x / y for x, y in zip(xs, ys) if x is not None and y]
        return median(pairs) if pairs else ratio(blk(a), blk(b))

    runs7 = min(len(raw("rc_async_zc_all")), len(raw("dcp_async")))
    t7 = entry(per_run("rc_async_zc_all", "dcp_async"), 0.05, True,
               "many tensors: blocked time of zero-copy / get_state_dict + dcp.async_save default, the median of "
               "at least 3 runs' ratios (and zero-copy's median <= 25 ms, regular staging <= 0.5x)",
               tensors=pt and pt["tensors"], zc_ms=zc7 and zc7 * 1e3, regular=per_run("rc_async", "dcp_async"),
               vs_plan_caching={"zc": ratio(zc7, pc7), "regular": ratio(reg7, pc7)},
               dcp_ms=dcp7 and dcp7 * 1e3, runs=runs7,
               raw={m: raw(m) for m in ("rc_async_zc_all", "rc_async", "dcp_async")})
    t7["pass"] = bool(t7["pass"] and runs7 >= 3 and zc7 is not None and zc7 <= 0.025 and t7["regular"] is not None
                      and t7["regular"] <= 0.5)
    out["T7"] = t7

    # T8: host-memory budget
    b25 = find_case(rows, "rc_budget_0.25")
    t8 = entry(b25 and b25["extra_rss_frac"], 0.3, True,
               "regular staging with max_staging_bytes = 0.25x the rank's state: extra peak RSS / state "
               "(cold staging buffers; the save must complete)",
               blocked_s={c: (find_case(rows, c) or {}).get("blocked_s") for c in (
                   "rc_budget_0.1", "rc_budget_0.25", "rc_budget_0.5", "rc_budget_none")},
               extra_rss_frac={c: (find_case(rows, c) or {}).get("extra_rss_frac") for c in (
                   "rc_budget_0.1", "rc_budget_0.25", "rc_budget_0.5", "rc_budget_none")})
    t8["pass"] = bool(t8["pass"] and b25 and b25["durable_s"] and b25["bytes"])
    out["T8"] = t8

    # T9: local_dedup against dcp.async_save on the same HSDP state
    dd, dh = find_case(rows, "rc_dedup", ("small", "target")), find_case(rows, "dcp_async_hsdp", ("small", "target"))
    dc = find_case(rows, "rc_dedup_cold", ("small", "target"))
    t9 = entry(ratio(dd and dd["blocked_s"], dh and dh["blocked_s"]), 0.2, True,
               "local_dedup (HSDP, 2 ranks): blocked / dcp.async_save default on the same state "
               "(and extra peak RSS <= 1.1x the rank's state)",
               ours_s=dd and dd["blocked_s"], dcp_s=dh and dh["blocked_s"],
               extra_rss_frac=dd and dd["extra_rss_frac"], dcp_extra_rss_frac=dh and dh["extra_rss_frac"],
               cold={"blocked_s": dc and dc["blocked_s"], "extra_rss_frac": dc and dc["extra_rss_frac"],
                     "what": "rc_dedup_cold: the reused staging buffers dropped before the save"})
    t9["pass"] = bool(t9["pass"] and dd and dd["extra_rss_frac"] is not None and dd["extra_rss_frac"] <= 1.1)
    out["T9"] = t9

    # T10/T11: the user's shape (a Hugging Face Llama on FSDP2, thousands of tensors per rank)
    tr = (extra.get("transformer") or {}).get("methods", {})

    def tr_(m: str, k: str) -> float | None:
        return (tr.get(m) or {}).get(k)

    out["T10"] = entry(ratio(tr_("rc_sync", "durable_s"), tr_("dcp_save", "durable_s")), 0.5, True,
                       "transformer-shaped rank (Hugging Face Llama, FSDP2): sync save time (per tensor) of roll-ckpt / "
                       "get_state_dict + dcp.save",
                       us_per_tensor={m: tr_(m, "us_per_tensor") for m in tr},
                       tensors=(extra.get("transformer") or {}).get("tensors"))
    tr_dcp = tr_("dcp_thread", "lost_s")
    tr_denom = tr_dcp if tr_dcp is not None and tr_dcp > 0 else None
    out["T11"] = entry(ratio(tr_("rc_zc", "lost_s"), tr_denom), 0.6, True,
                       "transformer-shaped rank: loop time lost per async save, roll-ckpt zero-copy / "
                       "dcp.async_save thread mode (and regular staging <= 1.0x)",
                       lost_s={m: tr_(m, "lost_s") for m in tr}, regular=ratio(tr_("rc_regular", "lost_s"), tr_denom))
    out["T11"]["pass"] = bool(out["T11"]["pass"] and out["T11"]["regular"] is not None
                              and out["T11"]["regular"] <= 1.0)

    # T26 (issue 38 item 4): T11's window against torch-checkpointing's design, whose call returns
    # at once and whose loop waits at `with manager.lock(): optimizer.step()` until the state is staged
    tc_lost = tr_("tc_async", "lost_s")
    # (<= 0.5: issue 38 item 3's bound on the default staging, buffers freed between saves, against the
    # peer's effective stall: the loop time its save costs)
    t26 = entry(ratio(tr_("rc_regular", "lost_s"), tc_lost if (tc_lost or 0) > 0 else None), 0.5, True,
                "transformer-shaped rank (T11's window, the step before the save included): loop time lost per "
                "async save, roll-ckpt regular staging (default: buffers freed between saves, made ready the step "
                "before) / torch-checkpointing async (its optimizer.step() under its staging lock)",
                lost_s={m: tr_(m, "lost_s") for m in ("rc_regular", "rc_zc", "tc_async")},
                zero_copy=ratio(tr_("rc_zc", "lost_s"), tc_lost if (tc_lost or 0) > 0 else None),
                loop=ratio(lost("rc_regular"), lost("tc_async") if (lost("tc_async") or 0) > 0 else None))
    if tc_lost is None:
        t26["not_run"] = ((extra.get("transformer") or {}).get("unavailable") or {}).get("tc_async") or \
            "the transformer group did not run"
    out["T26"] = t26


    # T12-T14: from bench.scale (the group "scale": simulated N ranks, real gloo jobs)
    sc = (extra.get("scale") or {}).get("targets") or {}
    missing = {"T12": (T12_LIMIT, "coordinator CPU per unchanged save at 1,024 simulated ranks, roll-ckpt / DCP plan "
                             "caching; and per-rank bytes sent <= 1 KiB plus its files' checksums"),
               "T13": (T13_LIMIT, "bytes read for .metadata on a resume of 1,024 simulated ranks / its size"),
               "T14": (OPS_LIMIT, "storage operations per rank per save, the same for every N and number "
                                        "of checkpoints kept")}
    for k, (limit, what) in missing.items():
        t = sc.get(k)
        out[k] = dict(t) if t else entry(None, limit, True, f"{what} (not run: the group scale)")

    # T18: from bench.torchtitan (the group "torchtitan", opt-in: it needs torchtitan)
    tt = (extra.get("torchtitan") or {}).get("target")
    if tt:
        out["T18"] = dict(tt)

    # T19: verl's FSDP2 engine, verl's manager against roll-ckpt-verl async (the group verl, run on demand)
    vr = extra.get("verl")
    if vr is not None and not vr.get("unavailable"):
        out["T19"] = entry(vr.get("ratio_blocked"), 0.2, True,
                           "verl's FSDP2 engine (2 ranks): blocked time of roll-ckpt-verl with async saves / verl's own "
                           "FSDPCheckpointManager", ours_s=(vr.get("roll_ckpt") or {}).get("blocked_s"),
                           verl_s=(vr.get("verl") or {}).get("blocked_s"), durable_ratio=vr.get("ratio_durable"),
                           error=vr.get("error"))

    # T20-T25: against the peer libraries (bench/peers.py), on every state and number of ranks
    # both ran on; the worst ratio of them decides. Never absolute times: ratios of the same run.
    peer_why = (extra.get("peers") or {}).get("unavailable") or {}
    for key, (ours, peer, field, limit, what, open_) in PEER_TARGETS.items():
        per = []
        for g in PEER_GROUPS:
            a, b = find(rows, g, ours), find(rows, g, peer)
            if a and b and a.get(field) is not None and b.get(field):
                per.append({"group": g, "ranks": a["ranks"], "state_mib": a["state_bytes"] / MB,
                            "tensors": a.get("tensors"), "ours_s": a[field], "peer_s": b[field],
                            "ratio": a[field] / b[field], **({"peer_call_s": b["call_s"]} if b.get("call_s") else {})})
        worst = max(per, key=lambda x: x["ratio"]) if per else None
        t = entry(worst and worst["ratio"], limit, True, what, ours=ours, peer=peer, field=field, per_state=per,
                  worst=worst and {k: worst[k] for k in ("group", "ranks", "state_mib", "tensors")})
        if not per:
            t["not_run"] = (peer_why.get(peer) or peer_why.get(ours)
                            or "its cases did not run (the groups target, tensors)")
        if open_:
            t["open"] = open_
        out[key] = t

    # T27 (issue 38 item 3): host memory regular staging keeps between saves by default, against
    # the state; beside it the trade-off: blocked with the buffers kept, and for a save nobody announced.
    # The target state decides (its staging buffers are what a large model keeps); the many-tensors
    # states are shown: there the manager's own bookkeeping (per-tensor plans, its process group,
    # the allocator's per-thread arenas: ~15 KiB per tensor at 2 ranks, with the buffers kept or not)
    # outweighs a state of 11 MiB per rank
    per = []
    for g in ["target", "target-1", "tensors", "tensors-1"]:
        a = find(rows, g, "rc_async")
        if a and a.get("kept_frac") is not None:
            keep, cold = find(rows, g, "rc_async_keep") or {}, find(rows, g, "rc_async_cold") or {}
            per.append({"group": g, "ranks": a["ranks"], "state_mib": a["state_bytes"] / MB, "tensors": a.get("tensors"),
                        "kept_frac": a["kept_frac"],
                        "blocked_s": a.get("blocked_s"), "keep_kept_frac": keep.get("kept_frac"),
                        "keep_blocked_s": keep.get("blocked_s"), "cold_blocked_s": cold.get("blocked_s")})
    decides = [x for x in per if x["group"] in ("target", "target-1")]
    worst = max(decides, key=lambda x: x["kept_frac"]) if decides else None
    out["T27"] = entry(worst and worst["kept_frac"], 0.5, True,
                       "host memory kept between saves by default (regular staging, strategy_config."
                       "keep_staging_buffers: false) / the rank's state, the target state (528 MiB; the many-tensors "
                       "state shown, not decisive: bookkeeping, not buffers), worst rank count",
                       per_state=per, worst=worst and {k: worst[k] for k in ("group", "ranks", "state_mib")})

    # import roll_ckpt in a fresh interpreter: its time, and neither numpy nor torch.distributed
    out["import"] = importcost.target(extra.get("import"))
    return out


PEER_TARGETS: dict[str, tuple[str, str, str, float, str, str | None]] = {
    "T20": ("rc_async", "tc_async", "blocked_s", 1.0,
            "blocked time, roll-ckpt async regular staging / torch-checkpointing async counted until its staging "
            "lock is free (the next optimizer.step() may run; its call alone returns sooner), worst state and rank "
            "count", None),
    "T21": ("rc_async", "bcp_async", "blocked_s", 1.0,
            "blocked time, roll-ckpt async regular staging / ByteCheckpoint fast_saving, worst state and rank count",
            None),
    "T22": ("rc_async", "tc_async", "durable_s", 1.0,
            "async save until durable, roll-ckpt / torch-checkpointing (its write future, then an fsync of its "
            "files: it never fsyncs), worst state and rank count", None),
    "T23": ("rc_async", "bcp_async", "durable_s", 1.0,
            "async save until durable, roll-ckpt / ByteCheckpoint fast_saving (it fsyncs its files), worst state "
            "and rank count", None),
    "T24": ("rc_load", "tc_load", "durable_s", 1.0,
            "resume time (cold page cache), roll-ckpt (verify, then load) / torch-checkpointing load + "
            "set_state_dict, worst state and rank count", None),
    "T25": ("rc_load", "bcp_load", "durable_s", 1.0,
            "resume time (cold page cache), roll-ckpt (verify, then load) / ByteCheckpoint load, worst state and "
            "rank count", None),
}
"""Target -> (roll-ckpt's case, the peer's case, the figure compared, limit (ratio <=), what, open)."""


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick", help="(default) ~4-5 min on 2 cores, 4 repetitions")
    size.add_argument("--full", action="store_const", dest="mode", const="full", help="larger states (2.2 GB), 6 repetitions, the sweep up to 10,000 tensors")
    size.add_argument("--smoke", action="store_const", dest="mode", const="smoke", help="a few MB, 1 repetition")
    p.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--scratch", default=None, help="where checkpoints are written (default: next to --out)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--ranks", default=None, help="world sizes to run (default 2,1)")
    p.add_argument("--groups", default=None,
                   help="groups to run (default small,target,tensors,many,loop,transformer,scale, and moe with --full; "
                        "small, target, tensors: state groups, tensors the many-tensors state the peers "
                        "are compared on too; moe: the resumes of a 30,000-tensor state, with the peers'; many: T7's sweep; loop: T6's save CPU and "
                        "training loop; transformer: T10/T11, a Hugging Face Llama on FSDP2; scale: T12-T14, "
                        "bench.scale's simulated ranks and real jobs; not run by default: torchtitan, T18, "
                        "torchtitan's checkpoint manager against roll-ckpt's, bench.torchtitan, in an interpreter "
                        "with torchtitan -- this one or the torchtitan leg's; verl, T19, verl's FSDP2 engine with "
                        "verl's manager and with roll-ckpt-verl's, where verl is installed (the verl leg))")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)  # the workers run from the repository root
    if args.scratch:
        args.scratch = os.path.abspath(args.scratch)
    mode = args.mode or "quick"
    cfg = MODES[mode]
    if args.groups is None:
        args.groups = "small,target,tensors,many,loop,transformer,scale" + (",moe" if "moe" in cfg else "")
    reps = args.reps or cfg["reps"]
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
    os.makedirs(args.out, exist_ok=True)
    scratch_parent = args.scratch or args.out
    os.makedirs(scratch_parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".scratch-", dir=scratch_parent)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    limits: dict[str, Any] = {}
    invariants: list[str] = []
    unavailable: dict[str, str] = {}
    peers_unavailable: dict[str, str] = {}
    extra: dict[str, Any] = {"hash": hash_cost(), "import": importcost.measure(), "skipped": [],
                             "peers": {**peers.describe(), "unavailable": peers_unavailable}}
    if mode == "full":
        ok, why = cgroup_memory()
        if not ok:
            extra["skipped"].append({"case": "load_over_page_cache", "reason": why})
    try:
        ranks = [int(x) for x in (args.ranks or cfg.get("ranks", "2,1")).split(",") if x]
        if args.device == "cuda":
            import torch

            ranks = [min(r, torch.cuda.device_count()) for r in ranks]
            ranks = sorted(set(ranks), reverse=True)
        # Without a warm-up round the first repetition pays for first calls (thread pools,
        # DCP's caches, staging buffers); the median of 4 repetitions discards it.
        warm = cfg.get("warmup", True)
        for nproc in ranks:
            # The small group runs first and warms every code path (thread pools, DCP's caches,
            # process groups); the target group then needs no warm-up round of its own.
            wanted = set(args.groups.split(","))
            w, d = cfg["small"]
            groups = []
            if cfg.get("one_group"):
                wanted = set()
                w, d = cfg["target"]
                cases = list(dict.fromkeys(TARGET_CASES + ALL_CASES + BUDGET_CASES + LIMITS))
                groups.append({"name": "target", "width": w, "depth": d, "reps": reps, "warmup": False,
                               "cases": cases})
                groups.append({"name": "tensors", "tensors": cfg["tensors"], "reps": reps, "warmup": False,
                               "cases": COMPARE_CASES})
                groups.append({"name": "many", "kind": "many", **cfg["many"]})
                groups.append({"name": "loop", "kind": "loop", **cfg["loop"]})
                groups.append({"name": "transformer", "kind": "transformer", **cfg["transformer"]})
            if "small" in wanted:
                groups.append({"name": "small", "width": w, "depth": d, "reps": reps, "warmup": warm,
                               "cases": ALL_CASES})
            if "target" in wanted:
                # the whole target group on the most ranks; roll-ckpt, DCP and the peers on the
                # same state on fewer
                w, d = cfg["target"]
                groups.append({"name": "target", "width": w, "depth": d, "reps": reps,
                               "warmup": warm and "small" not in wanted,
                               "cases": TARGET_CASES + BUDGET_CASES + LIMITS if nproc == max(ranks) else COMPARE_CASES})
            if "tensors" in wanted:
                groups.append({"name": "tensors", "tensors": cfg["tensors"], "reps": reps, "warmup": warm,
                               "cases": COMPARE_CASES})
            if "moe" in wanted:
                groups.append({"name": "moe", "tensors": cfg.get("moe", 30000), "reps": min(reps, 3),
                               "warmup": False, "cases": LOAD_CASES})
            # T6 and T7 are 1-rank measurements; T10/T11 run on the most ranks
            more = {"reps": args.reps} if args.reps else {}
            if nproc == max(ranks) and "transformer" in wanted:
                groups.append({"name": "transformer", "kind": "transformer", **cfg["transformer"], **more})
            for kind in ("many", "loop"):
                if nproc == min(ranks) and kind in wanted:
                    groups.append({"name": kind, "kind": kind, **cfg[kind], **more})
            if not groups:
                continue
            spec = {"device": args.device, "scratch": os.path.join(scratch, f"r{nproc}"), "groups": groups}
            print(f"[bench] {mode}: {nproc} rank(s), groups {[g['name'] for g in groups]}, {reps} rep(s)", flush=True)
            res = run_worker(nproc, spec, scratch, timeout=1800)
            for group in res["groups"]:
                for case, why in (group.get("unavailable") or {}).items():
                    # a peer not installed is not a torch that lacks an option
                    (peers_unavailable if case in PEER_CASES else unavailable)[case] = why
                if group.get("kind") == "loop":
                    extra["loop"] = summarise_loop(group)
                    continue
                if group.get("kind") == "many":
                    extra["many"] = summarise_many(group)
                    continue
                if group.get("kind") == "transformer":
                    extra["transformer"] = summarise_transformer(group)
                    continue
                invariants += group.get("invariants", [])
                for name, case in group["cases"].items():
                    row = summarise(group, name, case)
                    if group["world_size"] == 1:
                        row["group"] = f"{group['name']}-1"
                    rows.append(row)
        if "scale" in set(args.groups.split(",")):
            extra["scale"] = run_scale(mode, args.out, no_plot=args.no_plot)
            unavailable.update({f"scale:{m}": why for m, why in (extra["scale"].get("unavailable") or {}).items()})
        if "torchtitan" in set(args.groups.split(",")):  # opt-in: it needs torchtitan (the torchtitan leg)
            from . import torchtitan as tt_group

            print("[bench] torchtitan: torchtitan's CheckpointManager against roll-ckpt's (bench.torchtitan)", flush=True)
            extra["torchtitan"] = tt_group.run("smoke" if mode == "smoke" else "quick", args.out)
            unavailable.update(extra["torchtitan"].get("unavailable") or {})
        if "verl" in set(args.groups.split(",")):
            extra["verl"] = run_verl(mode, args.out)
            if extra["verl"].get("unavailable"):
                unavailable["verl"] = extra["verl"]["unavailable"]
        for key, case in (("disk_write_gbps", "limit_write"), ("disk_write2_gbps", "limit_write2"),
                          ("disk_write_direct_gbps", "limit_write_direct"),
                          ("disk_read_gbps", "limit_read"), ("disk_read2_gbps", "limit_read2"),
                          ("memcpy_gbps", "limit_memcpy"),
                          ("memcpy_fresh_gbps", "limit_memcpy_fresh")):
            r = find(rows, "target", case)
            if r is not None:
                limits[key] = r["gbps"]
                limits[key.replace("_gbps", "_method")] = r.get("method")
                limits["bytes"] = r.get("bytes")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tg = targets(rows, limits, extra)
    result = {
        "schema": 1, "mode": mode, "reps": reps, "device": args.device,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(time.perf_counter() - t0, 1),
        "machine": machine(scratch_parent, args.device), "limits": limits,
        "cases": [r for r in rows if r["kind"] != "limit"], "targets": tg,
        "invariants": sorted(set(invariants)), **extra,
        "unavailable": unavailable,  # case -> why this torch cannot run it (an older release)
        "all_pass": all(t["pass"] for t in tg.values()) and not invariants,
    }
    from .report import markdown, plot, plot_tensors

    with open(os.path.join(args.out, "latest.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(args.out, "latest.md"), "w") as f:
        f.write(md)
    if not args.no_plot and result["cases"]:  # (only the loop/many/scale groups: no state cases to plot)
        plot(result, os.path.join(args.out, "latest.png"))
        if result.get("many"):
            plot_tensors(result, os.path.join(args.out, "tensors.png"))
    print(md)
    for k, t in tg.items():
        v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        print(f"{k}: {'PASS' if t['pass'] else 'FAIL'}  {v} {t['op']} {t['limit']}  ({t['what']})")
    for problem in result["invariants"]:
        print(f"INVARIANT BROKEN: {problem}")
    print(f"[bench] {result['duration_s']} s; wrote {args.out}/latest.{{json,md,png}}"
          + (" and tensors.png" if result.get("many") and not args.no_plot else ""))
    return 1 if args.check and not result["all_pass"] else 0


if __name__ == "__main__":
    sys.exit(main())
